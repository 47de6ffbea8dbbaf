#include "models/hf_config.h"

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "runtime/config/json_reader.h"
#include "runtime/config/schema.h"
#include "runtime/error.h"

namespace strata::models {
namespace {

using json = nlohmann::json;

// Keys that describe the file, the tokenizer or inference, never the training math.
const std::set<std::string> kInert = {
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "max_position_embeddings",
    "pretraining_tp",  // Meta's tensor-parallel degree of pretraining; transformers ignores it
    "return_dict", "output_attentions", "output_hidden_states", "_attn_implementation_autoset"};

// What each family's config.json may hold besides kInert.
const std::set<std::string> kLlamaKeys = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias",
    "attention_dropout", "mlp_bias", "initializer_range"};
const std::set<std::string> kQwen3Extra = {"use_sliding_window", "sliding_window",
                                           "max_window_layers", "layer_types"};
// The mixtures of experts. Qwen3-MoE writes its expert count as num_experts (transformers 4) or
// num_local_experts (transformers 5's attribute map); Mixtral's experts' width is its
// intermediate_size.
const std::set<std::string> kQwen3MoeExtra = {
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
    "output_router_logits"};
const std::set<std::string> kMixtralExtra = {
    "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
    "router_jitter_noise", "sliding_window"};

struct Reader {
  const json& j;
  std::string source;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(fmt::format("{}: \"{}\": {}", source, key, what));
  }
  bool has(const std::string& key) const { return j.contains(key) && !j.at(key).is_null(); }
  int64_t positive(const std::string& key) const {
    if (!has(key)) fail(key, "missing: a positive integer is needed");
    const auto& v = j.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < 1)
      fail(key, fmt::format("is {}: need a positive integer", v.dump()));
    return v.get<int64_t>();
  }
  double number(const json& v, const std::string& key) const {
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      fail(key, fmt::format("is {}: need a number", v.dump()));
    return v.get<double>();
  }
  double number_or(const std::string& key, double fallback) const {
    return has(key) ? number(j.at(key), key) : fallback;
  }
  bool flag_or(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j.at(key).is_boolean()) fail(key, fmt::format("is {}: need true or false", j.at(key).dump()));
    return j.at(key).get<bool>();
  }
};

// rope_scaling (transformers 4) or rope_parameters (transformers 5): its type and llama3's keys.
void read_rope(const Reader& r, const std::string& key, DecoderConfig& c) {
  const json& rope = r.j.at(key);
  if (!rope.is_object()) r.fail(key, fmt::format("is {}: need an object or null", rope.dump()));
  const bool v5 = key == "rope_parameters";
  std::string type = "default";
  for (const char* name : {"rope_type", "type"})
    if (rope.contains(name)) {
      if (!rope.at(name).is_string()) r.fail(key + "." + name, "need a string");
      type = rope.at(name).get<std::string>();
    }
  std::set<std::string> allowed = {"rope_type", "type"};
  if (v5) allowed.insert("rope_theta");
  if (type == "llama3") {
    allowed.insert({"factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings"});
    c.rope_llama3 = true;
    for (const char* name : {"factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings"})
      if (!rope.contains(name)) r.fail(key + "." + name, "missing: rope_type llama3 needs it");
    c.llama3.factor = r.number(rope.at("factor"), key + ".factor");
    c.llama3.low_freq_factor = r.number(rope.at("low_freq_factor"), key + ".low_freq_factor");
    c.llama3.high_freq_factor = r.number(rope.at("high_freq_factor"), key + ".high_freq_factor");
    const auto& original = rope.at("original_max_position_embeddings");
    if (!original.is_number_integer() || original.get<int64_t>() < 1)
      r.fail(key + ".original_max_position_embeddings", "need a positive integer");
    c.llama3.original_max_position_embeddings = original.get<int64_t>();
    if (c.llama3.factor <= 0 || c.llama3.low_freq_factor <= 0 ||
        c.llama3.high_freq_factor <= c.llama3.low_freq_factor)
      r.fail(key, "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0");
  } else if (type != "default") {
    r.fail(key, fmt::format("rope_type \"{}\" is not supported (supported: default, llama3)", type));
  }
  if (v5) {
    if (!rope.contains("rope_theta")) r.fail(key + ".rope_theta", "missing");
    c.rope_theta = r.number(rope.at("rope_theta"), key + ".rope_theta");
  }
  for (const auto& [name, value] : rope.items())
    if (!allowed.count(name))
      r.fail(key + "." + name, fmt::format("is not a key of rope_type \"{}\"", type));
}

void read_moe(const Reader& r, DecoderConfig& c) {
  const bool qwen = c.family == Family::kQwen3Moe;
  const char* experts_key = qwen && r.has("num_experts") ? "num_experts" : "num_local_experts";
  if (qwen && r.has("num_experts") && r.has("num_local_experts") &&
      r.j.at("num_experts") != r.j.at("num_local_experts"))
    r.fail("num_local_experts", "differs from num_experts: give one");
  c.num_experts = r.positive(experts_key);
  c.num_experts_per_tok = r.positive("num_experts_per_tok");
  c.moe_intermediate_size = qwen ? r.positive("moe_intermediate_size") : c.intermediate_size;
  c.norm_topk_prob = qwen ? r.flag_or("norm_topk_prob", false) : true;  // Qwen3MoeConfig's default
  c.decoder_sparse_step = qwen && r.has("decoder_sparse_step") ? r.positive("decoder_sparse_step") : 1;
  if (qwen && r.has("mlp_only_layers")) {
    const auto& layers = r.j.at("mlp_only_layers");
    if (!layers.is_array()) r.fail("mlp_only_layers", "need an array of layer indices");
    for (const auto& l : layers) {
      if (!l.is_number_integer()) r.fail("mlp_only_layers", fmt::format("holds {}", l.dump()));
      c.mlp_only_layers.push_back(l.get<int64_t>());
    }
  }
  c.router_aux_loss_coef = r.number_or("router_aux_loss_coef", qwen ? 0.001 : 0.001);
  c.output_router_logits = r.flag_or("output_router_logits", false);
  if (r.number_or("router_jitter_noise", 0.0) != 0.0)
    r.fail("router_jitter_noise", "is not 0: the router's jitter is not built");
  if (!qwen && r.has("sliding_window"))
    r.fail("sliding_window", "is set: sliding-window attention is not built");
}

}  // namespace

const char* family_name(Family family) {
  switch (family) {
    case Family::kQwen3: return "qwen3";
    case Family::kQwen3Moe: return "qwen3_moe";
    case Family::kMixtral: return "mixtral";
    default: return "llama";
  }
}

bool DecoderConfig::is_moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  for (auto l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

void DecoderConfig::validate(const std::string& source) const {
  auto fail = [&](const std::string& key, const std::string& what) {
    throw Error(fmt::format("{}: \"{}\": {}", source, key, what));
  };
  for (const auto& [key, value] :
       std::vector<std::pair<const char*, int64_t>>{{"vocab_size", vocab_size},
                                                    {"hidden_size", hidden_size},
                                                    {"intermediate_size", intermediate_size},
                                                    {"num_hidden_layers", num_hidden_layers},
                                                    {"num_attention_heads", num_attention_heads},
                                                    {"num_key_value_heads", num_key_value_heads},
                                                    {"head_dim", head_dim}})
    if (value < 1) fail(key, fmt::format("is {}: need a positive integer", value));
  if (mlp_tiles < -1)
    fail("mlp_tiles (Strata's)", fmt::format("is {}: -1 (untiled), 0 (derived) or a count", mlp_tiles));
  if (num_attention_heads % num_key_value_heads != 0)
    fail("num_key_value_heads", fmt::format("{} does not divide num_attention_heads {}",
                                            num_key_value_heads, num_attention_heads));
  if (head_dim % 2 != 0) fail("head_dim", fmt::format("is {}: RoPE needs an even head_dim", head_dim));
  if (!(rms_norm_eps > 0)) fail("rms_norm_eps", "need a positive number");
  if (!(rope_theta > 0)) fail("rope_theta", "need a positive number");
  if (!(initializer_range >= 0)) fail("initializer_range", "need a number >= 0");
  if (loss_chunk_rows < 1) fail("loss_chunk_rows", "need a positive integer");
  if (num_experts > 0) {
    if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts)
      fail("num_experts_per_tok", fmt::format("is {}: need 1 to num_experts ({})",
                                              num_experts_per_tok, num_experts));
    if (moe_intermediate_size < 1) fail("moe_intermediate_size", "need a positive integer");
    if (decoder_sparse_step < 1) fail("decoder_sparse_step", "need a positive integer");
    if (!(router_aux_loss_coef >= 0)) fail("router_aux_loss_coef", "need a number >= 0");
    for (auto l : mlp_only_layers)
      if (l < 0 || l >= num_hidden_layers)
        fail("mlp_only_layers", fmt::format("names layer {} of {}", l, num_hidden_layers));
  }
}

DecoderConfig parse_hf_config(const json& j, const std::string& source) {
  if (!j.is_object()) throw Error(fmt::format("{}: a config.json is a JSON object", source));
  const Reader r{j, source};
  if (!j.contains("model_type") || !j.at("model_type").is_string())
    r.fail("model_type", "missing: need \"llama\" or \"qwen3\"");
  const auto type = j.at("model_type").get<std::string>();
  DecoderConfig c;
  std::set<std::string> known = kLlamaKeys;
  if (type == "llama") {
    c.family = Family::kLlama;
  } else if (type == "qwen3") {
    c.family = Family::kQwen3;
    c.qk_norm = true;
    known.insert(kQwen3Extra.begin(), kQwen3Extra.end());
    known.erase("mlp_bias");
  } else if (type == "qwen3_moe") {
    c.family = Family::kQwen3Moe;
    c.qk_norm = true;
    known.insert(kQwen3Extra.begin(), kQwen3Extra.end());
    known.insert(kQwen3MoeExtra.begin(), kQwen3MoeExtra.end());
    known.erase("mlp_bias");
  } else if (type == "mixtral") {
    c.family = Family::kMixtral;
    known.insert(kMixtralExtra.begin(), kMixtralExtra.end());
    known.erase("mlp_bias");
  } else {
    r.fail("model_type", fmt::format("\"{}\" is not supported (supported: llama, qwen3, "
                                     "qwen3_moe, mixtral)", type));
  }
  std::vector<std::string> candidates(known.begin(), known.end());
  candidates.insert(candidates.end(), kInert.begin(), kInert.end());
  for (const auto& [key, value] : j.items()) {
    if (known.count(key) || kInert.count(key)) continue;
    const auto near = schema::closest(key, candidates);
    r.fail(key, fmt::format("is not a key of a {} config.json{}; remove it if it does not change "
                            "the model", type, near.empty() ? "" : " (did you mean \"" + near + "\"?)"));
  }

  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  c.intermediate_size = r.positive("intermediate_size");
  c.num_hidden_layers = r.positive("num_hidden_layers");
  c.num_attention_heads = r.positive("num_attention_heads");
  c.num_key_value_heads = r.has("num_key_value_heads") ? r.positive("num_key_value_heads")
                                                       : c.num_attention_heads;
  if (r.has("head_dim")) {
    c.head_dim = r.positive("head_dim");
  } else if (c.family == Family::kQwen3 || c.family == Family::kQwen3Moe) {
    c.head_dim = 128;  // Qwen3Config's default
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      r.fail("head_dim", fmt::format("missing, and hidden_size {} is not a multiple of "
                                     "num_attention_heads {}", c.hidden_size, c.num_attention_heads));
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = r.has("max_position_embeddings")
                                  ? r.positive("max_position_embeddings") : 0;
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.rope_theta = r.number_or("rope_theta", 10000.0);
  if (r.has("rope_scaling")) read_rope(r, "rope_scaling", c);
  if (r.has("rope_parameters")) {
    if (r.has("rope_scaling") || r.has("rope_theta"))
      r.fail("rope_parameters", "given beside rope_scaling / rope_theta: keep one spelling");
    read_rope(r, "rope_parameters", c);
  }
  c.tie_word_embeddings = r.flag_or("tie_word_embeddings", false);
  c.attention_bias = r.flag_or("attention_bias", false);
  c.mlp_bias = r.flag_or("mlp_bias", false);
  c.initializer_range = r.number_or("initializer_range", 0.02);
  if (r.has("hidden_act")) {
    const auto& act = j.at("hidden_act");
    if (!act.is_string() || act.get<std::string>() != "silu")
      r.fail("hidden_act", fmt::format("is {}: only \"silu\" (SwiGLU) is built", act.dump()));
  }
  if (r.number_or("attention_dropout", 0.0) != 0.0)
    r.fail("attention_dropout", "is not 0: attention dropout is not built (fine-tuning sets 0)");
  if (r.flag_or("use_sliding_window", false))
    r.fail("use_sliding_window", "is true: sliding-window attention is not built");
  if (r.has("layer_types")) {
    const auto& types = j.at("layer_types");
    if (!types.is_array()) r.fail("layer_types", "need an array");
    for (size_t i = 0; i < types.size(); ++i)
      if (types[i] != "full_attention")
        r.fail(fmt::format("layer_types[{}]", i),
               fmt::format("is {}: only full_attention is built", types[i].dump()));
    if (int64_t(types.size()) != c.num_hidden_layers)
      r.fail("layer_types", fmt::format("has {} entries for {} layers", types.size(),
                                        c.num_hidden_layers));
  }
  if (c.family == Family::kQwen3Moe || c.family == Family::kMixtral) read_moe(r, c);
  c.validate(source);
  return c;
}

DecoderConfig read_hf_config(const std::string& path) {
  std::string file = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) file = path + "/config.json";
  // Not a FIFO or a device: opening one would wait for a writer.
  if (::stat(file.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw Error(fmt::format("{}: not a regular file: give the model's config.json", file));
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open the model's config.json", file));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_hf_config(read_json_strict(text.str(), file).value, file);
}

}  // namespace strata::models
