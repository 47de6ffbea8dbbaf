// Qwen3-MoE and Mixtral (models/causal_lm.h with moe/) against Hugging Face transformers as the
// oracle: tests/models/fixtures/{qwen3_moe, qwen3_moe_nonorm, mixtral}, written by
// scripts/hf_fixtures.py (transformers 5.25's own classes, fp32, CPU; experts saved per expert).
// The weights come in through the Hugging Face import (models::hf_import_options: per-expert
// files into the stacked SwiGLU experts); gradients and parameters go back to the files' names
// through the export's map (models::hf_export_options), so both directions are checked too.
//
// One process, the load-balancing loss off (config.json's output_router_logits false) and on
// (transformers' load_balancing_loss_func over every layer's router, times router_aux_loss_coef):
// logits and loss within 1e-5 relative, every gradient within 1e-5 relative; the parameters after
// 3 AdamW steps through the engine within 0.25 x lr x steps at ZeRO stages 0 and 3. Two ranks
// (this binary re-run through strata-run), each on one row of the batch, ep_size 1 and 2 at stages
// 0 and 3, the balance loss off and on: its statistics summed over both ranks' tokens
// (CausalLM::set_balance_group), as the one process of the oracle sees them, so the same bound.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "../sanitized.h"
#include "models/causal_lm.h"
#include "moe/balance.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/checkpoint/import_weights.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/engine.h"
#include "tests/models/oracle_util.h"
#include "tests/runtime/engine/launch_workers.h"

// A namespace of its own: this file shares test_models_oracle (one link) with test_hf_oracle.cpp,
// and a unity build compiles them as one translation unit.
namespace moe_oracle {
namespace {

namespace models = strata::models;
namespace ckpt = strata::checkpoint;

constexpr double kLr = 1e-3;
constexpr int kSteps = 3;
const std::vector<std::string> kFamilies = {"qwen3_moe", "qwen3_moe_nonorm", "mixtral"};

using strata::test::hf_oracle::counted;
using strata::test::hf_oracle::fixture_dir;
using strata::test::hf_oracle::relative;

models::DecoderConfig config_of(const std::string& family, bool aux) {
  auto c = models::read_hf_config(fixture_dir(family));
  c.output_router_logits = aux;
  c.loss_chunk_rows = 13;
  return c;
}

models::CausalLM build(const std::string& family, const models::DecoderConfig& config,
                       const models::MoEPlacement& placement = std::nullopt) {
  models::CausalLM model(config, placement);
  ckpt::import_weights(*model, ckpt::HfWeights(fixture_dir(family)),
                       models::hf_import_options(*model));
  return model;
}

// The model's tensors (values or gradients) under the files' names: stacked experts split per
// expert by the export's map (all experts: ep_size 1 here, or gathered).
std::map<std::string, torch::Tensor> file_view(const models::DecoderConfig& config,
                                               const std::map<std::string, torch::Tensor>& model) {
  const auto map = models::hf_export_options(config);
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : model) {
    const auto it = std::find_if(map.fused.begin(), map.fused.end(),
                                 [&](const ckpt::FusedWeight& f) { return f.target == name; });
    if (it == map.fused.end()) {
      out[name] = t;
      continue;
    }
    const auto parts = it->split(t);
    for (size_t k = 0; k < parts.size(); ++k) out[it->sources[k]] = parts[k];
  }
  return out;
}

struct Oracle {
  ckpt::SafetensorsFile file;
  explicit Oracle(const std::string& family)
      : file(ckpt::load_safetensors(fixture_dir(family) + "/oracle.safetensors")) {}
  const torch::Tensor& at(const std::string& name) const { return file.at(name); }
};

TEST(HfMoeOracle, LogitsLossAndGradientsWithTheBalanceLossOffAndOn) {
  // One test over the families, not one per family: each CTest case is a process start,
  // seconds under the sanitizer.
  for (const auto& family : kFamilies) {
    SCOPED_TRACE(family);
    const Oracle oracle(family);
    const auto& ids = oracle.at("input_ids");
    const auto& labels = oracle.at("labels");
    for (const int variant : {0, 1, 2}) {  // balance loss off, on, on with tiled experts
      const bool aux = variant > 0;
      auto config = config_of(family, aux);
      if (variant == 2) config.mlp_tiles = 3;
      auto model = build(family, config);
      const std::string p = aux ? "aux." : "";
      double logits_error = 0;
      {
        torch::NoGradGuard no_grad;
        logits_error = relative(model->logits(ids), oracle.at("logits"));
        EXPECT_LE(logits_error, 1e-5);
      }
      const auto loss = model->forward(ids, labels);
      const double loss_error = relative(loss, oracle.at(p + "loss"));
      EXPECT_LE(loss_error, 1e-5) << "aux " << aux;
      if (aux) EXPECT_LE(relative(model->aux_loss(), oracle.at("aux.aux_loss")), 1e-5);
      loss.backward();
      std::map<std::string, torch::Tensor> grads;
      for (const auto& q : model->named_parameters()) {
        ASSERT_TRUE(q.value().grad().defined()) << q.key();
        grads[q.key()] = q.value().grad();
      }
      double worst = 0;
      size_t compared = 0;
      for (const auto& [name, g] : file_view(config, grads)) {
        const double e = relative(g, oracle.at(p + "grad." + name));
        worst = std::max(worst, e);
        EXPECT_LE(e, 1e-5) << name << " aux " << aux;
        ++compared;
      }
      EXPECT_EQ(compared, ckpt::HfWeights(fixture_dir(family)).names().size());
      std::printf("%s balance loss %s%s: relative error logits %.2e, loss %.2e, worst gradient %.2e\n",
                  family.c_str(), aux ? "on" : "off", variant == 2 ? ", tiled experts" : "",
                  logits_error, loss_error, worst);
    }
  }
}

// The faults a re-implementation is likely to make, seeded one at a time: each must move what the
// oracle checks past its 1e-5 tolerance (scripts/hf_fixtures.py --check-faults prints transformers'
// side of the same figures).
TEST(HfMoeOracle, SeededFaultsAreCaught) {
  // One test over the families, not one per family: each CTest case is a process start,
  // seconds under the sanitizer.
  for (const auto& family : kFamilies) {
    SCOPED_TRACE(family);
    const Oracle oracle(family);
    const auto& ids = oracle.at("input_ids");
    torch::NoGradGuard no_grad;
    // Renormalising where the family does not, or not where it does.
    {
      auto config = config_of(family, false);
      config.norm_topk_prob = !config.norm_topk_prob;
      const double e = relative(build(family, config)->logits(ids), oracle.at("logits"));
      std::printf("%s: renormalisation flipped moves the logits by %.2e\n", family.c_str(), e);
      EXPECT_GT(e, 1e-5);
    }
    // SwiGLU's gate and up exchanged (silu(up) * gate).
    {
      const auto config = config_of(family, false);
      models::CausalLM model(config);
      auto options = models::hf_import_options(*model);
      for (auto& f : options.fused)
        if (f.target.size() > 2 && f.target.compare(f.target.size() - 2, 2, "w1") == 0)
          for (size_t k = 0; k + 1 < f.sources.size(); k += 2) std::swap(f.sources[k], f.sources[k + 1]);
      ckpt::import_weights(*model, ckpt::HfWeights(fixture_dir(family)), options);
      const double e = relative(model->logits(ids), oracle.at("logits"));
      std::printf("%s: gate and up exchanged moves the logits by %.2e\n", family.c_str(), e);
      EXPECT_GT(e, 1e-5);
    }
    // The balance loss as the mean of per-layer losses instead of over every layer's rows.
    auto model = build(family, config_of(family, true));
    model->logits(ids);
    const auto& layers = model->moe_layers();
    EXPECT_LE(relative(model->aux_loss(), oracle.at("aux.aux_loss")), 1e-5);
    if (layers.size() > 1) {
      auto mean = torch::zeros({});
      for (auto* layer : layers) mean = mean + strata::moe::hf_load_balancing_loss({layer});
      mean = mean / double(layers.size());
      const double e = relative(mean, oracle.at("aux.aux_loss"));
      std::printf("%s: the balance loss averaged per layer moves it by %.2e\n", family.c_str(), e);
      EXPECT_GT(e, 1e-5);
    }
  }
}

// `world` ranks (each on its rows of the batch), ZeRO `stage`, experts over `ep_size` ranks: the
// parameters after 3 AdamW steps against Hugging Face's; returns the worst distance. `tiles`:
// DecoderConfig::mlp_tiles (the experts over tiles of their rows).
double train_and_compare(const std::string& family, bool aux, int stage, int ep_size, int rank,
                         int world, int64_t tiles = -1) {
  const Oracle oracle(family);
  const auto& ids = oracle.at("input_ids");
  const auto& labels = oracle.at("labels");
  const int64_t batch = ids.size(0), micro = batch / world;
  strata::json json = {
      {"train_batch_size", batch},
      {"steps_per_print", 1000},
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", kLr}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.01}}}}},
      {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
  if (ep_size > 1) json["moe"] = {{"ep_size", ep_size}, {"drop_tokens", false}};
  strata::InitOptions init;
  auto cfg = strata::load_engine_config(json, init);
  auto config = config_of(family, aux);
  config.mlp_tiles = tiles;
  models::MoEPlacement placement;
  if (ep_size > 1)
    placement = strata::moe::MoEOptions::from_config(cfg.moe, config.hidden_size,
                                                     config.moe_intermediate_size, 0, 0, init.group);
  auto model = build(family, config, placement);
  model->set_balance_group(init.group);  // the balance loss over both ranks' tokens
  auto engine = std::make_shared<strata::ModelEngine<models::CausalLM>>(model, std::move(cfg),
                                                                        std::move(init));
  const double per_rank = double(counted(labels)) / double(world);
  const std::string what = family + (tiles >= 0 ? " tiled" : "") +
                           (aux ? " balance loss on" : " balance loss off") + " stage " +
                           std::to_string(stage) + " ep_size " + std::to_string(ep_size) +
                           " rank " + std::to_string(rank) + "/" + std::to_string(world);
  const std::string p = aux ? "aux." : "";
  for (int step = 0; step < kSteps; ++step) {
    auto loss = engine->forward(ids.narrow(0, rank * micro, micro),
                                labels.narrow(0, rank * micro, micro), per_rank);
    if (world == 1) {
      const double want = oracle.at(p + "loss_step" + std::to_string(step)).item<double>();
      EXPECT_NEAR(loss.item<double>(), want, 1e-5 * want) << what << " step " << step;
    }
    engine->backward(loss);
    engine->step();
  }
  // Every expert's weights: gathered over the expert-parallel group when it is split.
  std::map<std::string, torch::Tensor> params;
  {
    auto scope = engine->gathered_parameters();
    for (const auto& q : model->named_parameters()) params[q.key()] = q.value().detach().clone();
  }
  if (ep_size > 1) {
    const auto& group = engine->expert_groups()->expert_parallel;
    for (auto& [name, t] : params)
      if (name.find(".experts.") != std::string::npos) {
        auto all = torch::empty({int64_t(group->size()) * t.size(0), t.size(1), t.size(2)}, t.options());
        group->all_gather(all, t.contiguous());
        t = all;
      }
  }
  double worst_all = 0;
  const double bound = 0.25 * kLr * kSteps;
  for (const auto& [name, t] : file_view(config, params)) {
    const double worst = (t.to(torch::kDouble) - oracle.at(p + "adamw3." + name).to(torch::kDouble))
                             .abs().max().item<double>();
    worst_all = std::max(worst_all, worst);
    EXPECT_LE(worst, bound) << what << ": " << name;
  }
  std::printf("%s: after %d AdamW steps the worst parameter is %.2e from Hugging Face's (bound %.1e)\n",
              what.c_str(), kSteps, worst_all, bound);
  return worst_all;
}

TEST(HfMoeOracle, ThreeAdamWStepsAtStages0And3) {
  // One test over the families, not one per family: each CTest case is a process start,
  // seconds under the sanitizer.
  for (const auto& family : kFamilies) {
    SCOPED_TRACE(family);
    for (const bool aux : {false, true})
      for (const int stage : {0, 3})
        if (!strata::test::kSanitized || (aux && stage == 3))  // CI's time under the sanitizer
          train_and_compare(family, aux, stage, 1, 0, 1);
    train_and_compare(family, true, 3, 1, 0, 1, /*tiles=*/3);  // experts over tiles of their rows
  }
}


// ---- two ranks ----------------------------------------------------------------------------------

bool is_worker() { return strata::test_support::is_worker("STRATA_HF_MOE_ORACLE_WORKER"); }

TEST(HfMoeOracleWorker, TwoRanksAtEpSizes1And2) {
  if (!is_worker()) GTEST_SKIP() << "run by HfMoeOracleTwoRanks";
  const int rank = strata::test_support::env_int("RANK"), world = strata::test_support::env_int("WORLD_SIZE");
  for (const auto& family : kFamilies)
    for (const bool aux : {false, true})
      for (const int stage : {0, 3})
        for (const int ep : {1, 2})
          // Under the sanitizer (CI's time) the case that meets the most: balance loss, stage 3,
          // experts split.
          if (!strata::test::kSanitized || (aux && stage == 3 && ep == 2))
            train_and_compare(family, aux, stage, ep, rank, world);
  // Tiled experts with the exchange between them: the tiles run on what each rank received.
  for (const auto& family : kFamilies) train_and_compare(family, true, 3, 2, rank, world, /*tiles=*/2);
}

TEST(HfMoeOracleTwoRanks, EveryFamilyAtStages0And3AndEpSizes1And2) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers("STRATA_HF_MOE_ORACLE_WORKER", 2,
                                                 "HfMoeOracleWorker.*", &output),
            0)
      << output;
  std::printf("%s", output.c_str());
}

}  // namespace
}  // namespace moe_oracle
