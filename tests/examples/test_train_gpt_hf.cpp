// train_gpt --hf-model / --hf-export (issue 56) on real processes, with the Hugging Face fixtures
// (tests/models/fixtures: folders transformers' save_pretrained wrote):
//  - round trip at ZeRO-3 on 2 ranks, the model built in shards (each rank reads only its shards):
//    10 steps, exported at the save; the exported folder's names, shapes and dtypes are the
//    fixture's, its config.json the fixture's, and importing it back gives the trained fp32
//    parameters (the checkpoint consolidated) bit for bit;
//  - the import in shards trains with the losses of the run that read every tensor whole, also
//    with offload_param on NVMe, and at stages 0 and 2 on one rank (the same losses within float
//    rounding across stages);
//  - a damaged folder ends the run with an error naming the file, before any step.
// transformers itself loading the export is scripts/hf_roundtrip.py (bench/results.md).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "../sanitized.h"
#include "models/causal_lm.h"
#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/checkpoint/import_weights.h"
#include "train_gpt_runs.h"

// A namespace of its own: this file shares test_examples (one link) with test_train_gpt.cpp, and a
// unity build compiles them as one translation unit.
namespace train_hf {

namespace {

using namespace train_gpt_runs;
namespace ckpt = strata::checkpoint;

std::string temp(const std::string& name) {
  return testing::TempDir() + "/train_hf_" + std::to_string(getpid()) + "_" + name;
}

std::string fixture(const std::string& family) { return hf_fixture(family); }

std::string token_file() { return fixture_tokens(temp("tokens.bin"), 12345u); }

struct Case {
  std::string family = "llama3";
  int stage = 3, ranks = 2;
  bool zero_init = false;
  std::string params = "none";  // offload_param device
  int steps = 10;
  std::string extra;
};

std::vector<nlohmann::json> train(const Case& c, const std::string& name, std::string* output = nullptr) {
  nlohmann::json config = {
      {"train_batch_size", 8},
      {"train_micro_batch_size_per_gpu", 2},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}}}}},
      {"zero_optimization", {{"stage", c.stage}}}};
  if (c.stage == 3) config["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  if (c.params != "none") {
    config["zero_optimization"]["offload_param"] = {{"device", c.params}};
    if (c.params == "nvme") {
      std::filesystem::create_directories(temp(name + "_swap"));
      config["zero_optimization"]["offload_param"]["nvme_path"] = temp(name + "_swap");
    }
  }
  const auto path = temp(name + ".json");
  std::ofstream(path) << config.dump();
  const auto metrics = temp(name + ".jsonl");
  const auto r = capture(std::string(STRATA_BIN_DIR) + "/strata-run --num_gpus " +
                         std::to_string(c.ranks) + " -- " + STRATA_BIN_DIR +
                         "/train_gpt --device cpu --hf-model " + fixture(c.family) + " --config " +
                         path + " --data tokens:" + token_file() + " --seq-len 32 --steps " +
                         std::to_string(c.steps) + (c.zero_init ? " --zero-init" : "") +
                         " --metrics-jsonl " + metrics + " " + c.extra);
  if (output) *output = r.output;
  EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
  return read_jsonl(metrics);
}

std::vector<double> losses(const std::vector<nlohmann::json>& rows) {
  std::vector<double> out;
  for (const auto& r : rows) out.push_back(r.at("loss").get<double>());
  return out;
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     size_t(a.numel()) * a.element_size()) == 0;
}

}  // namespace

TEST(TrainGptHf, RoundTripAtZero3OnTwoRanksBuiltInShards) {
  const std::vector<std::string> families =
      strata::test::kSanitized ? std::vector<std::string>{"llama3_tied"}
                               : std::vector<std::string>{"llama3", "llama3_tied", "qwen3"};
  for (const auto& family : families) {
    SCOPED_TRACE(family);
    Case c;
    c.family = family;
    c.zero_init = true;
    c.steps = strata::test::kSanitized ? 4 : 10;  // CI's time under the sanitizer
    const auto save = temp(family + "_ckpt"), out = temp(family + "_hf");
    std::string output;
    c.extra = "--save-dir " + save + " --hf-export " + out;
    const auto rows = train(c, family + "_roundtrip", &output);
    ASSERT_EQ(rows.size(), size_t(c.steps));
    EXPECT_NE(output.find("rank 1 imported"), std::string::npos) << output;
    EXPECT_NE(output.find(": its shards"), std::string::npos) << output;
    const auto tag = "step" + std::to_string(c.steps);
    const auto exported = out + "/" + tag;

    const ckpt::HfWeights theirs(fixture(family)), ours(exported);
    ASSERT_EQ(ours.names(), theirs.names());
    for (const auto& name : theirs.names()) {
      EXPECT_EQ(ours.find(name)->shape, theirs.find(name)->shape) << name;
      EXPECT_EQ(ours.find(name)->dtype, theirs.find(name)->dtype) << name;
    }
    EXPECT_EQ(ckpt::read_file(exported + "/config.json"), ckpt::read_file(fixture(family) + "/config.json"));
    EXPECT_TRUE(std::ifstream(exported + "/generation_config.json").good());
    EXPECT_FALSE(std::ifstream(exported + "/oracle.safetensors").good());  // weights stay behind

    // Imported back: the trained parameters, bit for bit, and not the fixture's.
    strata::models::CausalLM model(strata::models::read_hf_config(exported));
    ckpt::import_weights(*model, ours);
    const auto trained = ckpt::consolidate(save, tag);
    int compared = 0;
    for (const auto& p : model->named_parameters()) {
      for (const auto& [key, t] : trained)
        if (key == "param." + p.key()) {
          EXPECT_TRUE(same_bits(p.value(), t)) << p.key();
          ++compared;
        }
    }
    EXPECT_EQ(compared, int(model->named_parameters().size()));
    strata::models::CausalLM start(strata::models::read_hf_config(exported));
    ckpt::import_weights(*start, theirs);
    EXPECT_FALSE(same_bits(start->model->norm->weight, model->model->norm->weight));

    // strata-ckpt writes the same folder from the checkpoint (the source from its client state),
    // here in bf16 and in shards of at most 100 kB.
    const auto cli = temp(family + "_cli");
    const auto r = capture(std::string(STRATA_BIN_DIR) + "/strata-ckpt consolidate " + save +
                           " --hf-folder " + cli + " --dtype bf16 --max-shard-size 100KB");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const ckpt::HfWeights sharded(cli);
    EXPECT_GT(sharded.shard_count(), 1u);
    EXPECT_EQ(sharded.names(), theirs.names());
    EXPECT_EQ(sharded.find("model.norm.weight")->dtype, torch::kBFloat16);
    EXPECT_TRUE(std::ifstream(cli + "/config.json").good());
  }
}

TEST(TrainGptHf, ImportInShardsTrainsWithTheLossesOfTheWholeRead) {
  Case whole;
  whole.steps = strata::test::kSanitized ? 2 : 4;
  const auto reference = losses(train(whole, "whole"));
  ASSERT_EQ(reference.size(), size_t(whole.steps));
  Case shards = whole;
  shards.zero_init = true;
  if (!strata::test::kSanitized) EXPECT_EQ(losses(train(shards, "shards")), reference);
  Case nvme = shards;
  nvme.params = "nvme";
  EXPECT_EQ(losses(train(nvme, "nvme")), reference);
  if (strata::test::kSanitized) return;
  for (int stage : {0, 2}) {
    Case one = whole;
    one.stage = stage;
    one.ranks = 1;
    const auto got = losses(train(one, "stage" + std::to_string(stage)));
    ASSERT_EQ(got.size(), reference.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], reference[i], 1e-5 * reference[i]);
  }
}

TEST(TrainGptHf, ADamagedFolderEndsTheRunNamingTheFile) {
  const auto dir = temp("damaged");
  std::filesystem::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"})
    std::filesystem::copy_file(fixture("qwen3") + "/" + f, dir + "/" + f,
                               std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(dir + "/model.safetensors",
                               std::filesystem::file_size(dir + "/model.safetensors") - 100);
  const auto r = run("--hf-model " + dir + " --config " + std::string(STRATA_SOURCE_DIR) +
                     "/configs/gpt_tiny.json --data tokens:" + token_file() + " --steps 2");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("truncated"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << r.output;
}

}  // namespace train_hf
