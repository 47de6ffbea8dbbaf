// Llama-3 and Qwen3 (models/) against Hugging Face transformers as the oracle: the fixtures under
// tests/models/fixtures/ were written by scripts/hf_fixtures.py (transformers' own
// LlamaForCausalLM / Qwen3ForCausalLM, fp32, CPU): each holds the config.json and weights
// save_pretrained wrote, one batch, and Hugging Face's logits, loss, every gradient and the
// parameters after 3 torch.optim.AdamW steps. No Python runs here.
//
// One process: logits and loss within 1e-5 relative (max |a - b| / max |b|), every gradient within
// 1e-5 relative, with and without activation checkpointing and a tiled MLP; the parameters after 3 AdamW steps
// through the engine within 0.25 x lr x steps per element at ZeRO stages 0 and 3 (the
// differential matrix's bound: Adam's sign on near-zero gradients), and with 2 micro-batches of
// gradient accumulation. Two ranks (this binary re-run through strata-run): the same steps with
// each rank on one row of the batch, stages 0 and 3, with and without checkpointing; Hugging
// Face's loss is a mean over the batch's counted tokens, so each rank divides its sum by them
// (the model's num_items_in_batch, as transformers' Trainer does across devices).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <string>

#include "models/causal_lm.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/engine.h"
#include "tests/models/oracle_util.h"
#include "tests/runtime/engine/launch_workers.h"

namespace {

namespace models = strata::models;
using strata::checkpoint::load_safetensors;
using strata::checkpoint::SafetensorsFile;

constexpr double kLr = 1e-3;
constexpr int kSteps = 3;

using strata::test::hf_oracle::counted;
using strata::test::hf_oracle::fixture_dir;
using strata::test::hf_oracle::relative;

struct Fixture {
  models::DecoderConfig config;
  SafetensorsFile weights, oracle;
};

Fixture load_fixture(const std::string& family) {
  const auto dir = fixture_dir(family);
  return {models::read_hf_config(dir), load_safetensors(dir + "/model.safetensors"),
          load_safetensors(dir + "/oracle.safetensors")};
}

// The model of the fixture, its weights loaded by Hugging Face's names (every one used, and no
// parameter left without one).
// "+tiled" after the policy: the dense layers' MLP over 3 tiles of the sequence
// (DecoderConfig::mlp_tiles).
models::CausalLM build(const Fixture& f, std::string checkpointing = "") {
  auto config = f.config;
  const std::string tiled = "+tiled";
  if (checkpointing.size() >= tiled.size() &&
      checkpointing.compare(checkpointing.size() - tiled.size(), tiled.size(), tiled) == 0) {
    config.mlp_tiles = 3;
    checkpointing.resize(checkpointing.size() - tiled.size());
  }
  config.checkpointing = checkpointing;
  config.loss_chunk_rows = 13;  // several chunks, the last one short
  models::CausalLM model(config);
  std::set<std::string> names;
  for (const auto& [name, tensor] : f.weights.tensors) names.insert(name);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    if (!names.erase(p.key())) {
      ADD_FAILURE() << p.key() << " is not in Hugging Face's model.safetensors";
      continue;
    }
    const auto& w = f.weights.at(p.key());
    EXPECT_EQ(p.value().sizes(), w.sizes()) << p.key();
    p.value().copy_(w);
  }
  EXPECT_TRUE(names.empty()) << *names.begin() << " of model.safetensors has no parameter";
  return model;
}

class HfOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(HfOracle, LogitsLossAndGradientsEqualHuggingFaces) {
  const auto f = load_fixture(GetParam());
  for (const std::string checkpointing : {"", "every", "+tiled", "every+tiled"}) {
    auto model = build(f, checkpointing);
    const auto& ids = f.oracle.at("input_ids");
    const auto& labels = f.oracle.at("labels");
    double logits_error = 0;
    {
      torch::NoGradGuard no_grad;
      logits_error = relative(model->logits(ids), f.oracle.at("logits"));
      EXPECT_LE(logits_error, 1e-5) << checkpointing;
    }
    const auto loss = model->forward(ids, labels);
    const double loss_error = relative(loss, f.oracle.at("loss"));
    EXPECT_LE(loss_error, 1e-5) << checkpointing;
    loss.backward();
    double worst_grad = 0;
    for (const auto& p : model->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      const double e = relative(p.value().grad(), f.oracle.at("grad." + p.key()));
      worst_grad = std::max(worst_grad, e);
      EXPECT_LE(e, 1e-5) << p.key() << " " << checkpointing;
    }
    std::printf("%s checkpointing '%s': relative error logits %.2e, loss %.2e, worst gradient %.2e\n",
                GetParam().c_str(), checkpointing.c_str(), logits_error, loss_error, worst_grad);
  }
}

// `world` ranks, each on rows [rank * rows, ...) of the batch in `gas` micro-batches; the
// parameters after 3 steps against Hugging Face's AdamW, the losses against its per-step losses.
void train_and_compare(const std::string& family, int stage, const std::string& checkpointing,
                       int gas, int rank, int world) {
  const auto f = load_fixture(family);
  auto model = build(f, checkpointing);
  const auto& ids = f.oracle.at("input_ids");
  const auto& labels = f.oracle.at("labels");
  const int64_t batch = ids.size(0), micro = batch / (world * gas);
  ASSERT_EQ(micro * world * gas, batch);
  strata::json config = {
      {"train_batch_size", batch},
      {"gradient_accumulation_steps", gas},
      {"steps_per_print", 1000},
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", kLr}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.01}}}}},
      {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
  auto engine = strata::initialize(model, config);
  // The engine averages over ranks and micro-batches: each micro-batch's sum over the batch's
  // counted tokens, times world x gas, makes the average Hugging Face's mean.
  const double per_micro = double(counted(labels)) / double(world * gas);
  const std::string what = family + " stage " + std::to_string(stage) + " checkpointing '" +
                           checkpointing + "' gas " + std::to_string(gas) + " rank " +
                           std::to_string(rank) + "/" + std::to_string(world);
  for (int step = 0; step < kSteps; ++step) {
    double loss_sum = 0;
    for (int m = 0; m < gas; ++m) {
      const int64_t first = (int64_t(rank) * gas + m) * micro;
      auto loss = engine->forward(ids.narrow(0, first, micro), labels.narrow(0, first, micro),
                                  per_micro);
      loss_sum += loss.item<double>();
      engine->backward(loss);
      engine->step();
    }
    if (world == 1) {
      const double want = f.oracle.at("loss_step" + std::to_string(step)).item<double>();
      EXPECT_NEAR(loss_sum / gas, want, 1e-5 * want) << what << " step " << step;
    }
  }
  const double bound = 0.25 * kLr * kSteps;
  auto check = [&] {
    double worst_all = 0;
    for (const auto& p : model->named_parameters()) {
      const auto want = f.oracle.at("adamw3." + p.key());
      const double worst = (p.value().detach().to(torch::kDouble) - want.to(torch::kDouble))
                               .abs().max().item<double>();
      worst_all = std::max(worst_all, worst);
      EXPECT_LE(worst, bound) << what << ": " << p.key();
    }
    std::printf("%s: after %d AdamW steps the worst parameter is %.2e from Hugging Face's (bound %.1e)\n",
                what.c_str(), kSteps, worst_all, bound);
  };
  if (stage == 3) {
    auto scope = engine->gathered_parameters();  // every unit's full values while it lives
    check();
  } else {
    check();
  }
}

TEST_P(HfOracle, ThreeAdamWStepsEqualHuggingFacesAtStages0And3) {
  for (const int stage : {0, 3})
    for (const std::string checkpointing : {"", "every"})
      train_and_compare(GetParam(), stage, checkpointing, /*gas=*/1, 0, 1);
  train_and_compare(GetParam(), 3, "every", /*gas=*/2, 0, 1);
  train_and_compare(GetParam(), 3, "every+tiled", /*gas=*/2, 0, 1);  // ALST's combination
}

INSTANTIATE_TEST_SUITE_P(Families, HfOracle, ::testing::Values("llama3", "llama3_tied", "qwen3"));

// ---- two ranks ----------------------------------------------------------------------------------

bool is_worker() { return strata::test_support::is_worker("STRATA_HF_ORACLE_WORKER"); }

TEST(HfOracleWorker, TwoRanksEqualHuggingFace) {
  if (!is_worker()) GTEST_SKIP() << "run by HfOracleTwoRanks";
  const int rank = strata::test_support::env_int("RANK"), world = strata::test_support::env_int("WORLD_SIZE");
  for (const std::string family : {"llama3", "llama3_tied", "qwen3"})
    for (const int stage : {0, 3})
      for (const std::string checkpointing : {"", "every"})
        train_and_compare(family, stage, checkpointing, 1, rank, world);
}

TEST(HfOracleTwoRanks, EveryFamilyAtStages0And3WithAndWithoutCheckpointing) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers("STRATA_HF_ORACLE_WORKER", 2,
                                                 "HfOracleWorker.*", &output),
            0)
      << output;
}

}  // namespace
