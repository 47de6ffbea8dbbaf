// The speculative offloaded step's check (offload_optimizer.super_offload), shared by the CPU
// test (test_engine_precision.cpp) and the GPU one (test_engine_gpu_speculative.cpp): a model of
// elementwise products and sums only (kernels without atomics on both devices, and with Half
// kernels on the CPU), parameters of uneven sizes over several buckets and tiles, trained 6 steps
// with gradient accumulation 2, an overflow (fp16) or a huge loss at step 3's second micro-step,
// and after every step the fp32 master, both Adam moments and the model's weights.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "runtime/optim/state_io.h"

namespace speculative_run {

struct UnevenNetImpl : torch::nn::Module {
  UnevenNetImpl() {
    for (int64_t n : {3001, 9000, 17, 24000, 5000, 12345}) {
      ws.push_back(register_parameter("w" + std::to_string(ws.size()), torch::randn({n}) * 0.1));
      cs.push_back(torch::randn({1}).item<double>());
    }
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    const auto dtype = ws.front().scalar_type();
    const auto a = x.narrow(1, 0, 1).to(dtype), b = x.narrow(1, 1, 1).to(dtype);
    torch::Tensor out;
    for (size_t k = 0; k < ws.size(); ++k) {
      const auto term = ((a * ws[k] + b * ws[k] * ws[k]).sum(1, true) * cs[k]).to(torch::kFloat);
      out = out.defined() ? out + term : term;
    }
    return torch::mse_loss(out, y);
  }
  std::vector<torch::Tensor> ws;
  std::vector<double> cs;
};
TORCH_MODULE(UnevenNet);

struct Run {
  std::vector<std::vector<torch::Tensor>> states;  // per step: master, moments, model weights
  std::vector<double> norms;
  int64_t skipped = 0, speculated = 0, redone = 0;
};

// clip 0: no clipping. precision: fp16 (the step-3 overflow skips the step), bf16 or fp32.
inline Run train(const torch::Device& device, int64_t stage, const std::string& precision,
                 double clip, bool speculative, const strata::InitOptions& options = {}) {
  torch::manual_seed(3);
  UnevenNet model;
  model->to(device);
  nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", 16},
      {"gradient_accumulation_steps", 2},
      {"steps_per_print", 1000000},
      {"gradient_clipping", clip},
      {"zero_optimization",
       {{"stage", stage},
        {"reduce_bucket_size", 20000},
        {"sub_group_size", 7000},
        {"stage3_param_persistence_threshold", 0},
        {"offload_optimizer", {{"device", "cpu"}, {"super_offload", speculative}}}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  if (precision == "fp16")
    config["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}, {"hysteresis", 1}};
  else if (precision == "bf16")
    config["bf16"] = {{"enabled", true}};
  auto engine = strata::initialize(model, config, options);
  Run run;
  for (int64_t step = 0; step < 6; ++step) {
    for (int64_t micro = 0; micro < 2; ++micro) {
      const auto x = torch::randn({16, 2}).to(device), y = torch::randn({16, 1}).to(device);
      auto loss = engine->forward(x, y);
      if (step == 2 && micro == 1)
        loss = loss * (precision == "fp16" ? std::numeric_limits<float>::infinity() : 1e3);
      engine->backward(loss);
      engine->step();
    }
    run.norms.push_back(engine->last_grad_norm());
    auto& optimizer = engine->optimizer();  // waits for a step still running
    std::vector<torch::Tensor> state;
    for (const auto& p : optimizer.param_groups()[0].params()) {
      state.push_back(p.detach().cpu().clone());
      // No state yet (every step so far skipped) reads as Adam's zero moments.
      const auto s = strata::optim::export_param_state(optimizer, p);
      if (s && !s->tensors.empty()) {
        for (const auto& [name, t] : s->tensors) state.push_back(t.detach().cpu().clone());
      } else {
        state.push_back(torch::zeros_like(p).cpu());
        state.push_back(torch::zeros_like(p).cpu());
      }
    }
    for (const auto& p : model->parameters())
      if (p.numel() > 0) state.push_back(p.detach().cpu().clone());
    run.states.push_back(std::move(state));
  }
  run.skipped = engine->skipped_steps();
  if (const auto t = engine->last_offload_times()) run.speculated = t->speculated, run.redone = t->redone;
  return run;
}

// A clipping threshold some steps' norms pass and others do not (their median), then the
// synchronous and the speculative run with it: every step's state bit for bit.
inline void expect_speculation_exact(const torch::Device& device, int64_t stage,
                                     const std::string& precision,
                                     const strata::InitOptions& options = {}) {
  const std::string what = precision + " stage " + std::to_string(stage);
  auto norms = train(device, stage, precision, 0.0, false, options).norms;
  std::vector<double> finite;
  for (double n : norms)
    if (std::isfinite(n)) finite.push_back(n);
  ASSERT_FALSE(finite.empty()) << what;
  std::sort(finite.begin(), finite.end());
  const double clip = finite[finite.size() / 2];
  const auto sync = train(device, stage, precision, clip, false, options);
  const auto spec = train(device, stage, precision, clip, true, options);
  if (precision == "fp16") {
    EXPECT_EQ(sync.skipped, 1) << what;
    EXPECT_EQ(spec.skipped, 1) << what;
  }
  EXPECT_EQ(spec.speculated, 6) << what;
  EXPECT_GT(spec.redone, precision == "fp16" ? 1 : 0) << what << ": nothing clipped";
  EXPECT_LT(spec.redone, 6) << what << ": every speculation redone";
  ASSERT_EQ(sync.states.size(), spec.states.size());
  for (size_t s = 0; s < sync.states.size(); ++s) {
    ASSERT_EQ(sync.states[s].size(), spec.states[s].size()) << what;
    for (size_t i = 0; i < sync.states[s].size(); ++i)
      EXPECT_TRUE(torch::equal(sync.states[s][i], spec.states[s][i]))
          << what << ", step " << s + 1 << ", tensor " << i << ": "
          << [&] {
               const auto a = sync.states[s][i].reshape({-1}), b = spec.states[s][i].reshape({-1});
               if (a.sizes() != b.sizes()) return std::string("different sizes");
               const auto where = a.ne(b).nonzero().reshape({-1});
               if (where.numel() == 0) return std::string("NaN");
               const int64_t k = where[0].item<int64_t>();
               return std::to_string(where.numel()) + " elements differ, the first at " +
                      std::to_string(k) + " of " + std::to_string(a.numel()) + ": " +
                      std::to_string(a[k].item<double>()) + " vs " + std::to_string(b[k].item<double>());
             }();
  }
}

}  // namespace speculative_run
