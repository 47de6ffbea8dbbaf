// zero_optimization.zenflow (docs/zenflow.md) on the CPU, fp32: where every element is stepped
// every step (topk_ratio 1, or update_interval 1) it is the exact offloaded step; warm-up steps are
// plain steps; past them the unselected columns lag by the window and training still converges;
// what Strata does not run is refused by name.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "runtime/error.h"

namespace {

using strata::json;

// 2-D weights of several columns, biases (1-D: always on the device), a 3-D parameter (its
// trailing dimensions are one column axis).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(12, 24));
    fc2 = register_module("fc2", torch::nn::Linear(24, 6));
    mix = register_parameter("mix", torch::randn({3, 6, 6}) * 0.3);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = fc2(torch::tanh(fc1(x)));
    h = h + torch::einsum("bj,ijk->bk", {h, mix}).mean() * 0.1;
    return torch::mse_loss(h, y);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor mix;
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor x, y;
};
Batch batch(int64_t i, int64_t n) {
  torch::manual_seed(100 + i);
  auto x = torch::randn({n, 12});
  return {x, torch::sin(x.narrow(1, 0, 6) * 2)};
}

json config_for(int64_t stage, int64_t gas, const json& zenflow) {
  json c = {{"train_micro_batch_size_per_gpu", 8 / gas},
            {"gradient_accumulation_steps", gas},
            {"steps_per_print", 1000000},
            {"gradient_clipping", 0.5},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-2}, {"weight_decay", 0.01}}}}},
            {"zero_optimization",
             {{"stage", stage}, {"sub_group_size", 50}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  if (!zenflow.is_null()) c["zero_optimization"]["zenflow"] = zenflow;
  return c;
}

struct Run {
  std::vector<std::vector<torch::Tensor>> params;  // after each step
  std::vector<float> losses;
  strata::zero::OffloadTimes last;
};

Run train(int64_t stage, int64_t gas, const json& zenflow, int64_t steps,
          torch::Device device = torch::kCPU) {
  torch::manual_seed(3);
  Net net;
  net->to(device);
  auto engine = strata::initialize(net, config_for(stage, gas, zenflow));
  Run r;
  for (int64_t s = 0; s < steps; ++s) {
    auto d = batch(s, 8);
    d.x = d.x.to(device), d.y = d.y.to(device);
    float loss = 0;
    for (int64_t m = 0; m < gas; ++m) {
      auto l = engine->forward(d.x.narrow(0, m * 8 / gas, 8 / gas), d.y.narrow(0, m * 8 / gas, 8 / gas));
      loss += l.item<float>() / float(gas);
      engine->backward(l);
      engine->step();
    }
    r.losses.push_back(loss);
    std::vector<torch::Tensor> now;
    for (const auto& p : net->parameters()) now.push_back(p.detach().cpu().clone());
    r.params.push_back(now);
  }
  if (const auto t = engine->last_offload_times()) r.last = *t;
  return r;
}

double max_rel(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>());
  return worst;
}

json block(double ratio, int64_t update, int64_t select, int64_t warm_up = 0, bool overlap = false) {
  return {{"topk_ratio", ratio}, {"select_strategy", "step"}, {"select_interval", select},
          {"update_interval", update}, {"full_warm_up_rounds", warm_up}, {"overlap_step", overlap}};
}

TEST(ZenFlow, EveryElementSteppedEveryStepIsTheExactStep) {
  for (const int64_t stage : {1, 2}) {
    for (const int64_t gas : {1, 2}) {
      const auto exact = train(stage, gas, json(), 8);
      // All columns on the device (the CPU's window update is overwritten for all of them), and
      // a third of them with a CPU update every step (reselected every 3 steps).
      for (const auto& zf : {block(1.0, 3, 3), block(0.34, 1, 3), block(0.5, 1, 1, 2)}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + ", gas " + std::to_string(gas) + ", " + zf.dump());
        const auto got = train(stage, gas, zf, 8);
        for (size_t s = 0; s < exact.params.size(); ++s)
          EXPECT_LE(max_rel(got.params[s], exact.params[s]), 1e-6) << "after step " << s + 1;
      }
    }
  }
}

TEST(ZenFlow, WarmUpIsPlainThenTheUnselectedColumnsLagAndTrainingConverges) {
  const auto exact = train(2, 1, json(), 24);
  const auto got = train(2, 1, block(0.25, 4, 8, 2), 24);
  for (size_t s = 0; s < 2; ++s) EXPECT_LE(max_rel(got.params[s], exact.params[s]), 1e-6) << s;
  EXPECT_GT(max_rel(got.params[2], exact.params[2]), 1e-4) << "step 3 updates a quarter of the columns";
  // Fresh batches each step: the mean of the last 8 losses, against the exact step's.
  auto tail_mean = [](const std::vector<float>& l) {
    double sum = 0;
    for (size_t i = l.size() - 8; i < l.size(); ++i) sum += l[i];
    return sum / 8;
  };
  std::printf("last 8 steps' mean loss: exact %.4f, zenflow %.4f (first %.4f)\n",
              tail_mean(exact.losses), tail_mean(got.losses), got.losses.front());
  EXPECT_LT(tail_mean(got.losses), 0.8 * got.losses.front());
  EXPECT_LT(tail_mean(got.losses), 1.25 * tail_mean(exact.losses));
  // fc1 24 x 12: 3 of 12 columns; fc2 6 x 24: 6 of 24; mix 3 x 36: 9 of 36; the biases whole.
  EXPECT_EQ(got.last.zenflow_columns, 3 + 6 + 9);
  EXPECT_EQ(got.last.zenflow_device_elements, 24 * 3 + 6 * 6 + 3 * 9 + 24 + 6);
  // 24 steps, 2 of warm-up: 22 in windows of 4 (and reselections every 8 flush early: 4, 2 | ...).
  EXPECT_GE(got.last.zenflow_stale_steps, 0);
  EXPECT_LT(got.last.zenflow_stale_steps, 4);
}

// Trains `save_at` steps, saves, resumes in a fresh engine built from other initial weights and
// trains to `steps`: the parameters then, against the straight run's (stages 1 and 2).
void expect_resume_continues(const json& zf, int64_t save_at, int64_t steps, const std::string& name) {
  for (const int64_t stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto straight = train(stage, 1, zf, steps);
    const auto dir = testing::TempDir() + name + "_" + std::to_string(stage) + "_" +
                     std::to_string(::getpid());
    auto run = [&](int64_t seed, int64_t from, int64_t to, bool load) {
      torch::manual_seed(seed);
      Net net;
      auto engine = strata::initialize(net, config_for(stage, 1, zf));
      if (load) engine->load_checkpoint(dir);
      for (int64_t s = from; s < to; ++s) {
        const auto d = batch(s, 8);
        engine->backward(engine->forward(d.x, d.y));
        engine->step();
      }
      if (!load) engine->save_checkpoint(dir);
      std::vector<torch::Tensor> now;
      for (const auto& p : net->parameters()) now.push_back(p.detach().clone());
      return now;
    };
    run(3, 0, save_at, false);
    // Other initial weights (seed 99): all of them come from the checkpoint.
    EXPECT_LE(max_rel(run(99, save_at, steps, true), straight.params.back()), 1e-6);
    std::filesystem::remove_all(dir);
  }
}

// A checkpoint in the middle of a window (the unselected columns' gradients summed, not yet
// applied) resumes as the straight run continues: the selection, the window and the selected
// elements' device state come back. 1 warm-up step, a window of 3, one step into the next.
TEST(ZenFlow, ResumeInTheMiddleOfAWindowContinuesTheStraightRun) {
  expect_resume_continues(block(0.3, 3, 6, 1), 5, 12, "zenflow_resume");
}

// overlap_step: the CPU update of a window runs beside the next window and its weights are
// installed at that window's end. The first window is the synchronous run's; its update reaches
// the unselected columns one window later: after 2U steps they hold exactly what the
// synchronous run's hold after U (both CPU updates read the same window), and before that the
// initial weights. The metrics count the pending window in the staleness. On a GPU the new
// weights cross on the copy stream, staged in the spare sum buffer (the GPU test runs this too).
void expect_overlap_installs_one_window_late(torch::Device device) {
  const int64_t U = 3;
  json once = block(0.25, U, 0);
  once["select_strategy"] = "auto";
  once.erase("select_interval");
  json overlapped = once;
  overlapped["overlap_step"] = true;
  for (const int64_t stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto sync = train(stage, 1, once, 2 * U, device);
    const auto over = train(stage, 1, overlapped, 2 * U + 1, device);
    for (int64_t s = 0; s + 1 < U; ++s)
      EXPECT_LE(max_rel(over.params[size_t(s)], sync.params[size_t(s)]), 1e-6) << "step " << s + 1;
    torch::manual_seed(3);
    Net net;
    std::vector<torch::Tensor> initial;
    for (const auto& p : net->parameters()) initial.push_back(p.detach().clone());
    int64_t updated = 0, elements = 0;
    for (size_t i = 0; i < initial.size(); ++i) {
      // The unselected elements: those the synchronous run's first CPU update changed.
      const auto cpu = sync.params[U - 1][i].ne(over.params[U - 1][i]);
      updated += cpu.sum().item<int64_t>();
      elements += cpu.numel();
      if (!cpu.any().item<bool>()) continue;  // 1-D: all on the device
      for (const int64_t s : {U - 1, 2 * U - 2})
        EXPECT_TRUE(over.params[size_t(s)][i].masked_select(cpu).equal(initial[i].masked_select(cpu)))
            << "parameter " << i << " after step " << s + 1 << ": the update is installed early";
      const auto got = over.params[2 * U - 1][i].masked_select(cpu);
      const auto want = sync.params[U - 1][i].masked_select(cpu);
      EXPECT_LE((got - want).abs().max().item<double>(), 1e-6 * want.abs().max().item<double>())
          << "parameter " << i << " after step " << 2 * U;
    }
    EXPECT_GT(updated, elements / 2) << "most elements are the CPU's at topk_ratio 0.25";
    // After 2U + 1 steps: one step of this window, the last window's U pending.
    EXPECT_EQ(over.last.zenflow_stale_steps, 1 + U);
    // Two windows' updates started on the worker; the first was settled (waited for, timed) at
    // the second window's end; the second is not settled yet (reading the times does not wait).
    EXPECT_EQ(over.last.zenflow_updates, 1);
    EXPECT_GT(over.last.zenflow_cpu_ms, 0.0);
    EXPECT_GE(over.last.zenflow_copy_wait_ms, 0.0);
    EXPECT_GE(over.last.zenflow_stall_ms, 0.0);
    EXPECT_EQ(sync.last.zenflow_updates, 2) << "one synchronous update per window";
    EXPECT_GT(sync.last.zenflow_cpu_ms, 0.0);
  }
}

TEST(ZenFlow, OverlapStepInstallsEachWindowOneWindowLate) { expect_overlap_installs_one_window_late(torch::kCPU); }

// A checkpoint taken while an overlapped update is pending (applied to the master and moments,
// not yet to the model's weights) resumes as the straight overlapped run continues: 1 warm-up
// step, a window of 3 (pending), one step more.
TEST(ZenFlow, ResumeWithAnOverlappedUpdatePendingContinuesTheStraightRun) {
  expect_resume_continues(block(0.3, 3, 6, 1, /*overlap=*/true), 5, 12, "zenflow_overlap_resume");
}

// A checkpoint of an exact run resumed in ZenFlow mode starts it afresh: its warm-up steps are
// the exact run's next steps.
TEST(ZenFlow, ACheckpointWithoutZenFlowStartsItAfresh) {
  const auto exact = train(2, 1, json(), 6);
  const auto dir = testing::TempDir() + "zenflow_afresh_" + std::to_string(::getpid());
  {
    torch::manual_seed(3);
    Net net;
    auto engine = strata::initialize(net, config_for(2, 1, json()));
    for (int64_t s = 0; s < 3; ++s) {
      const auto d = batch(s, 8);
      engine->backward(engine->forward(d.x, d.y));
      engine->step();
    }
    engine->save_checkpoint(dir);
  }
  torch::manual_seed(3);
  Net net;
  auto engine = strata::initialize(net, config_for(2, 1, block(0.2, 2, 4, 2)));
  engine->load_checkpoint(dir);
  for (int64_t s = 3; s < 6; ++s) {
    const auto d = batch(s, 8);
    engine->backward(engine->forward(d.x, d.y));
    engine->step();
    std::vector<torch::Tensor> now;
    for (const auto& p : net->parameters()) now.push_back(p.detach().clone());
    if (s < 5)
      EXPECT_LE(max_rel(now, exact.params[size_t(s)]), 1e-6) << "warm-up step " << s + 1;
    else
      EXPECT_GT(max_rel(now, exact.params[size_t(s)]), 1e-4) << "ZenFlow's first selected step";
  }
  std::filesystem::remove_all(dir);
}

// On a GPU (skipped without one): the selected columns' Adam runs on the device, the rest on the
// CPU. Every element stepped every step is still the exact offloaded step (fp32; the device's
// Adam against the CPU's: 1e-5), and the overlapped mode trains with the same selection.
TEST(ZenFlow, OnTheGpuTheExactStepAndTheOverlappedModeTrain) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  const torch::Device cuda(torch::kCUDA);
  for (const int64_t stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto exact = train(stage, 1, json(), 8, cuda);
    for (const auto& zf : {block(1.0, 3, 3), block(0.34, 1, 3)}) {
      SCOPED_TRACE(zf.dump());
      const auto got = train(stage, 1, zf, 8, cuda);
      for (size_t s = 0; s < exact.params.size(); ++s)
        EXPECT_LE(max_rel(got.params[s], exact.params[s]), 1e-5) << "after step " << s + 1;
    }
  }
  const auto over = train(2, 1, block(0.25, 4, 8, 2, /*overlap=*/true), 24, cuda);
  double tail = 0;
  for (size_t i = over.losses.size() - 8; i < over.losses.size(); ++i) tail += over.losses[i] / 8;
  std::printf("GPU, overlap_step: loss %.4f -> %.4f (last 8 steps' mean)\n", over.losses.front(), tail);
  EXPECT_LT(tail, 0.8 * over.losses.front());
  EXPECT_EQ(over.last.zenflow_columns, 3 + 6 + 9);
  EXPECT_EQ(over.last.zenflow_device_elements, 24 * 3 + 6 * 6 + 3 * 9 + 24 + 6);
  // The overlapped update's weights staged on the device: installed one window late, exactly.
  // (Not against the same run on the CPU: that differed by up to 0.059 relative over 24 steps with
  // reselections every 8, session 38; the two devices' runs diverge, why was not traced.)
  expect_overlap_installs_one_window_late(cuda);
}

TEST(ZenFlow, WhatIsNotRunIsRefusedByName) {
  auto refused = [](json config, const std::string& why) {
    torch::manual_seed(3);
    Net net;
    try {
      strata::initialize(net, config);
      ADD_FAILURE() << "accepted: " << config.dump();
    } catch (const strata::Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  auto with = [](json zf, const std::string& key, json value) {
    zf[key] = std::move(value);
    return zf;
  };
  const auto ok = block(0.1, 2, 4);
  refused(config_for(2, 1, with(ok, "select_strategy", "auto")), "select_strategy");
  refused(config_for(2, 1, with(ok, "update_interval", "auto")), "update_interval");
  refused(config_for(2, 1, with(ok, "offload", true)), "offload");
  refused(config_for(2, 1, with(ok, "select_interval", 1)), "at least update_interval");
  refused(config_for(2, 1, with(ok, "update_interval", 0)), "positive integer");
  refused(config_for(2, 1, with(ok, "steps_per_epoch", 10)), "steps_per_epoch");
  auto stage3 = config_for(3, 1, ok);
  refused(stage3, "stage 1 or 2");
  auto on_device = config_for(2, 1, ok);
  on_device["zero_optimization"].erase("offload_optimizer");
  refused(on_device, "\"cpu\"");
  auto sgd = config_for(2, 1, ok);
  sgd["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 0.1}}}};
  refused(sgd, "Adam");
}

}  // namespace
