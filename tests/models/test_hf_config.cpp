// Hugging Face config.json files read by models/hf_config.h: the fixtures' (transformers 5:
// rope_parameters, dtype), and files with the keys and values of published models' config.json
// in transformers 4's spelling (rope_theta + rope_scaling, torch_dtype), typed here from their
// model cards' files; then each refusal: unknown keys (named, with the nearest known one),
// features that are not built, shapes that cannot work, duplicate keys, a FIFO.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "models/causal_lm.h"
#include "models/hf_config.h"
#include "models/rope.h"
#include "runtime/error.h"

namespace {

namespace models = strata::models;
using nlohmann::json;

const json kLlama31_8B = json::parse(R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})");

const json kLlama32_1B = json::parse(R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})");

const json kQwen3_06B = json::parse(R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");

TEST(HfConfig, PublishedLlamaAndQwen3ConfigsInTransformers4Spelling) {
  const auto a = models::parse_hf_config(kLlama31_8B, "Llama-3.1-8B");
  EXPECT_EQ(a.family, models::Family::kLlama);
  EXPECT_EQ(a.head_dim, 128);  // hidden / heads
  EXPECT_EQ(a.num_key_value_heads, 8);
  EXPECT_TRUE(a.rope_llama3);
  EXPECT_EQ(a.llama3.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(a.rope_theta, 500000.0);
  EXPECT_FALSE(a.tie_word_embeddings);
  const auto b = models::parse_hf_config(kLlama32_1B, "Llama-3.2-1B");
  EXPECT_TRUE(b.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(b.llama3.factor, 32.0);
  const auto q = models::parse_hf_config(kQwen3_06B, "Qwen3-0.6B");
  EXPECT_EQ(q.family, models::Family::kQwen3);
  EXPECT_TRUE(q.qk_norm);
  EXPECT_EQ(q.head_dim, 128);  // not hidden / heads = 64
  EXPECT_FALSE(q.rope_llama3);
  EXPECT_DOUBLE_EQ(q.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(q.rms_norm_eps, 1e-6);
}

TEST(HfConfig, TheFixturesInTransformers5Spelling) {
  const auto dir = std::string(STRATA_SOURCE_DIR) + "/tests/models/fixtures/";
  const auto l = models::read_hf_config(dir + "llama3");  // a folder: its config.json
  EXPECT_TRUE(l.rope_llama3);
  EXPECT_DOUBLE_EQ(l.rope_theta, 500000.0);
  EXPECT_EQ(l.llama3.original_max_position_embeddings, 64);
  EXPECT_EQ(l.num_key_value_heads, 2);
  EXPECT_TRUE(models::read_hf_config(dir + "llama3_tied/config.json").tie_word_embeddings);
  const auto q = models::read_hf_config(dir + "qwen3");
  EXPECT_EQ(q.head_dim, 32);
  EXPECT_TRUE(q.qk_norm);
}

// The message of parse_hf_config's error for `config`, "" when it passes.
std::string refusal(const json& config) {
  try {
    models::parse_hf_config(config, "config.json");
  } catch (const strata::Error& e) {
    return e.what();
  }
  return "";
}

json with(json base, const std::string& key, const json& value) {
  base[key] = value;
  return base;
}

TEST(HfConfig, UnknownKeysAreNamedWithTheNearestKnownOne) {
  const auto m = refusal(with(kLlama31_8B, "num_key_value_head", 8));
  EXPECT_NE(m.find("\"num_key_value_head\""), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean \"num_key_value_heads\""), std::string::npos) << m;
  // A Qwen3 key in a Llama file, a Llama key in a Qwen3 file.
  EXPECT_NE(refusal(with(kLlama31_8B, "use_sliding_window", false)).find("use_sliding_window"),
            std::string::npos);
  EXPECT_NE(refusal(with(kQwen3_06B, "mlp_bias", false)).find("mlp_bias"), std::string::npos);
  EXPECT_NE(refusal(with(kLlama31_8B, "model_type", "qwen3_moe")).find("qwen3_moe"),
            std::string::npos);
}

TEST(HfConfig, WhatIsNotBuiltIsRefusedByKeyAndValue) {
  const struct {
    json config;
    const char* says;
  } cases[] = {
      {with(kLlama31_8B, "rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}), "yarn"},
      {with(kLlama31_8B, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}}), "linear"},
      {with(kQwen3_06B, "use_sliding_window", true), "sliding-window"},
      {with(kLlama31_8B, "hidden_act", "gelu"), "\"gelu\""},
      {with(kLlama31_8B, "attention_dropout", 0.1), "attention_dropout"},
      {with(kQwen3_06B, "layer_types", json::array({"sliding_attention"})), "layer_types[0]"},
      {with(kLlama31_8B, "num_key_value_heads", 5), "does not divide"},
      {with(kLlama31_8B, "hidden_size", 0), "hidden_size"},
      {with(kLlama31_8B, "vocab_size", "big"), "vocab_size"},
      {with(kLlama32_1B, "head_dim", 63), "even head_dim"},
      {with(kLlama31_8B, "rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "default"}}),
       "keep one spelling"},
      {with(kLlama31_8B, "rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}),
       "low_freq_factor"},
      {with(kLlama31_8B, "rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0},
                                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                                          {"original_max_position_embeddings", 8192},
                                          {"beta_fast", 32}}),
       "rope_scaling.beta_fast"},
  };
  for (const auto& c : cases) {
    const auto m = refusal(c.config);
    EXPECT_NE(m.find(c.says), std::string::npos) << "wanted \"" << c.says << "\" in: " << m;
    EXPECT_NE(m.find("config.json"), std::string::npos) << m;
  }
}

TEST(HfConfig, FilesThatCannotBeReadAreNamed) {
  char dir_template[] = "/tmp/strata-hf-config-XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  {
    std::ofstream(dir + "/dup.json") << R"({"model_type": "llama", "vocab_size": 4, "vocab_size": 5})";
  }
  try {
    models::read_hf_config(dir + "/dup.json");
    ADD_FAILURE() << "a duplicate key was accepted";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size"), std::string::npos) << e.what();
  }
  EXPECT_THROW(models::read_hf_config(dir + "/missing.json"), strata::Error);
  EXPECT_THROW(models::read_hf_config(dir), strata::Error);  // a folder without config.json
  ASSERT_EQ(::mkfifo((dir + "/fifo.json").c_str(), 0600), 0);
  EXPECT_THROW(models::read_hf_config(dir + "/fifo.json"), strata::Error);  // not waited on
  ::unlink((dir + "/fifo.json").c_str());
  ::unlink((dir + "/dup.json").c_str());
  ::rmdir(dir.c_str());
}

// The model's parameter names are Hugging Face's (a small Qwen3 of the published keys).
TEST(HfConfig, ParameterNamesAreHuggingFacesStateDictNames) {
  auto small = kQwen3_06B;
  small["hidden_size"] = 32;
  small["intermediate_size"] = 64;
  small["num_hidden_layers"] = 1;
  small["num_attention_heads"] = 4;
  small["num_key_value_heads"] = 2;
  small["head_dim"] = 16;
  small["vocab_size"] = 40;
  models::CausalLM model(models::parse_hf_config(small, "small"));
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  const std::vector<std::string> want = {
      "model.embed_tokens.weight",
      "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.k_proj.weight",
      "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.self_attn.q_norm.weight",
      "model.layers.0.self_attn.k_norm.weight",
      "model.layers.0.mlp.gate_proj.weight",
      "model.layers.0.mlp.up_proj.weight",
      "model.layers.0.mlp.down_proj.weight",
      "model.layers.0.input_layernorm.weight",
      "model.layers.0.post_attention_layernorm.weight",
      "model.norm.weight"};  // tied: no lm_head.weight
  EXPECT_EQ(names, want);
  EXPECT_EQ(model->named_parameters()["model.layers.0.self_attn.q_proj.weight"].sizes(),
            torch::IntArrayRef({64, 32}));
}

// The layering (ARCHITECTURE.md): models/ use the runtime's public APIs only (activation
// checkpointing and tiling, Ulysses' attention exchange, the fused loss, the MoE layer and its
// balance loss, the Hugging Face import and export maps, the base headers), and nothing of the
// runtime includes them.
TEST(ModelsLayer, UsesThePublicApisOnlyAndNothingBelowIncludesIt) {
  namespace fs = std::filesystem;
  const fs::path root = STRATA_SOURCE_DIR;
  const std::regex include("^\\s*#include \"([^\"]+)\"");
  const std::regex allowed_in_models(
      "models/.*|runtime/checkpointing/checkpoint\\.h|runtime/util/tiled\\.h|runtime/nn/.*|"
      "runtime/sequence/ulysses\\.h|"
      "runtime/(error|compat|log)\\.h|"
      "runtime/config/(json_reader|schema)\\.h|moe/(layer|balance)\\.h|"
      "runtime/checkpoint/(import_weights|hf_export|hf_folder)\\.h");
  int files = 0;
  for (const char* layer : {"models", "runtime", "zero", "moe", "offload", "comm"}) {
    for (const auto& entry : fs::recursive_directory_iterator(root / layer)) {
      const auto ext = entry.path().extension();
      if (ext != ".h" && ext != ".cpp" && ext != ".cu") continue;
      ++files;
      std::ifstream in(entry.path());
      int line_no = 0;
      for (std::string line; std::getline(in, line);) {
        ++line_no;
        std::smatch m;
        if (!std::regex_search(line, m, include)) continue;
        const std::string target = m[1];
        const std::string where = entry.path().string() + ":" + std::to_string(line_no);
        if (std::string(layer) == "models")
          EXPECT_TRUE(std::regex_match(target, allowed_in_models)) << where << ": " << target;
        else
          EXPECT_NE(target.rfind("models/", 0), 0u) << where << ": " << target;
      }
    }
  }
  EXPECT_GT(files, 100);
}

}  // namespace
