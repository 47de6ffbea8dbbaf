// Stage 0 over several real processes is data parallelism: the engine on N ranks, each on its
// slice of the global batch, must reach the parameters a single process reaches on the whole
// batch with LibTorch's own optimizer. The driver tests start N copies of this binary through
// strata-run; each copy runs the worker test, which computes that reference itself.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "runtime/engine.h"
#include "tests/runtime/engine/launch_workers.h"

namespace {

using strata::json;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::mse_loss(fc2(torch::tanh(fc1(x))), y);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

using strata::test_support::env_int;

struct Batch {
  torch::Tensor x, y;
};
Batch global_batch(int64_t step, int64_t n) {
  torch::manual_seed(500 + step);
  auto x = torch::randn({n, 8});
  return {x, (x * torch::arange(8).to(torch::kFloat)).sum(1, true).cos()};
}

// Trains the engine on this rank's slices and LibTorch's `reference` optimizer on the whole
// batch in this process; parameters must agree after every step.
void run_worker(const json& optimizer, double clipping,
                const std::function<std::unique_ptr<torch::optim::Optimizer>(Net&)>& reference,
                int64_t stage = 0) {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
  ASSERT_GE(world, 2);
  const int64_t global = 24, gas = 2, micro = global / (gas * world);

  torch::manual_seed(11);
  Net net, ref;
  {
    torch::NoGradGuard no_grad;
    auto pn = net->parameters(), pr = ref->parameters();
    for (size_t i = 0; i < pn.size(); ++i) {
      pr[i].copy_(pn[i]);
      pn[i].add_(0.01 * rank);  // the engine must start every rank from rank 0's values
    }
  }
  json config = {{"train_batch_size", global},
                 {"gradient_accumulation_steps", gas},
                 {"steps_per_print", 1000},
                 {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 100}}},
                 {"optimizer", optimizer}};
  if (clipping > 0) config["gradient_clipping"] = clipping;
  // No group passed: the engine meets the other ranks from the environment, once per process
  // (every worker test here initializes engines again in the same process).
  auto engine = strata::initialize(net, config);
  ASSERT_EQ(engine->data_parallel_size(), world);
  ASSERT_EQ(engine->data_parallel_rank(), rank);
  ASSERT_EQ(engine->train_micro_batch_size_per_gpu(), micro);
  auto opt = reference(ref);

  for (int64_t step = 0; step < 8; ++step) {
    const auto batch = global_batch(step, global);
    for (int64_t m = 0; m < gas; ++m) {
      const int64_t first = (m * world + rank) * micro;
      engine->backward(
          engine->forward(batch.x.narrow(0, first, micro), batch.y.narrow(0, first, micro)));
      engine->step();
    }
    opt->zero_grad();
    ref->forward(batch.x, batch.y).backward();
    if (clipping > 0) {
      const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), clipping);
      EXPECT_NEAR(engine->last_grad_norm(), norm, 1e-5 * norm) << "step " << step;
    }
    opt->step();
    auto pn = net->parameters(), pr = ref->parameters();
    for (size_t i = 0; i < pn.size(); ++i)
      ASSERT_TRUE(torch::allclose(pn[i], pr[i], 1e-5, 1e-6))
          << "stage " << stage << " rank " << rank << " step " << step << " parameter " << i
          << " differs by "
          << (pn[i] - pr[i]).abs().max().item<double>();
  }
}

bool is_worker() { return strata::test_support::is_worker("STRATA_DP_WORKER"); }

TEST(EngineDataParallelWorker, SgdMomentumMatchesTheFullBatch) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineDataParallel.*)";
  run_worker({{"type", "SGD"}, {"params", {{"lr", 0.05}, {"momentum", 0.9}}}}, 0.0,
             [](Net& ref) {
               return std::make_unique<torch::optim::SGD>(
                   ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
             });
}

TEST(EngineDataParallelWorker, AdamWWithClippingMatchesTheFullBatch) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineDataParallel.*)";
  run_worker({{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}, {"eps", 1e-6}}}},
             0.1, [](Net& ref) {
               return std::make_unique<torch::optim::AdamW>(
                   ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01).eps(1e-6));
             });
}

json adamw() {
  return {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}, {"eps", 1e-6}}}};
}
std::unique_ptr<torch::optim::Optimizer> torch_adamw(Net& ref) {
  return std::make_unique<torch::optim::AdamW>(
      ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01).eps(1e-6));
}

TEST(EngineDataParallelWorker, ZeroStage1MatchesTheFullBatch) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineDataParallel.*)";
  run_worker(adamw(), 0.1, torch_adamw, 1);
}

TEST(EngineDataParallelWorker, ZeroStage2MatchesTheFullBatch) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineDataParallel.*)";
  run_worker(adamw(), 0.1, torch_adamw, 2);
}

// ZeRO's memory per rank for 16-bit parameters with Adam: stage 1 keeps 2 + 2 bytes per
// parameter and 12/N for the fp32 master and Adam state; stage 2 also partitions the gradients
// (2/N). Counted over the padded flat buffer (numel rounded up to N x 64).
TEST(EngineDataParallelWorker, Bf16ModelStateBytesFollowZeroFormulas) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineDataParallel.*)";
  const int64_t world = env_int("WORLD_SIZE");
  for (int64_t stage : {1, 2}) {
    torch::manual_seed(1);
    Net net;
    int64_t numel = 0;
    for (const auto& p : net->parameters()) numel += p.numel();
    const int64_t quantum = world * 64, padded = (numel + quantum - 1) / quantum * quantum;
    json config = {{"train_micro_batch_size_per_gpu", 4},
                   {"steps_per_print", 1000},
                   {"bf16", {{"enabled", true}}},
                   {"zero_optimization", {{"stage", stage}}},
                   {"optimizer", adamw()}};
    auto engine = strata::initialize(net, config);
    const auto b = global_batch(0, 4);
    // LibTorch's CPU mse_loss has no bf16 kernel: the loss in fp32 from the bf16 output.
    const auto out = net->fc2(torch::tanh(net->fc1(b.x.to(torch::kBFloat16))));
    engine->backward((out.to(torch::kFloat) - b.y).pow(2).mean());
    engine->step();
    const auto bytes = engine->model_state_bytes();
    EXPECT_EQ(bytes.params, 2 * padded);
    EXPECT_EQ(bytes.grads, stage == 1 ? 2 * padded : 2 * padded / world);
    EXPECT_EQ(bytes.master, 4 * padded / world);
    EXPECT_EQ(bytes.optimizer, 8 * padded / world);
    EXPECT_EQ(bytes.total(), stage == 1 ? 4 * padded + 12 * padded / world
                                        : 2 * padded + 14 * padded / world);
  }
}

// Elementwise only: LibTorch's CPU kernels have no fp16 matrix product.
struct ScaleNetImpl : torch::nn::Module {
  ScaleNetImpl() { w = register_parameter("w", torch::ones({8})); }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return ((x.to(w.scalar_type()) * w).sum(1, true).to(torch::kFloat) - y).pow(2).mean();
  }
  torch::Tensor w;
};
TORCH_MODULE(ScaleNet);

// ScaleNet's ops have CPU Half kernels: the engine lets fp16 run on the CPU when told so.
strata::InitOptions cpu_fp16() {
  strata::InitOptions options;
  options.allow_fp16_on_cpu = true;
  return options;
}

// fp16 at stage 1: only the last rank's gradient overflows at step 2, and every rank skips the
// step (the flag is all-reduced) and halves its scale; the other steps proceed everywhere.
TEST(EngineDataParallelWorker, Fp16OverflowOnOneRankIsSkippedOnEveryRank) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineDataParallel.*)";
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
  ScaleNet net;
  json config = {{"train_micro_batch_size_per_gpu", 4},
                 {"steps_per_print", 1000},
                 {"fp16", {{"enabled", true}, {"initial_scale_power", 8}, {"hysteresis", 1}}},
                 {"zero_optimization", {{"stage", 1}}},
                 {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.01}}}}}};
  auto engine = strata::initialize(net, config, cpu_fp16());
  for (int64_t step = 0; step < 4; ++step) {
    const auto b = global_batch(step, 4);
    auto loss = engine->forward(b.x, b.y);
    if (step == 2 && rank == world - 1) loss = loss * std::numeric_limits<float>::infinity();
    const auto before = net->w.detach().clone();
    engine->backward(loss);
    engine->step();
    EXPECT_EQ(engine->last_step_skipped(), step == 2) << "rank " << rank << " step " << step;
    EXPECT_EQ(torch::equal(net->w.detach(), before), step == 2) << "rank " << rank;
  }
  EXPECT_EQ(engine->loss_scale(), 128.0);
  EXPECT_EQ(engine->skipped_steps(), 1);
}

class EngineDataParallel : public testing::TestWithParam<int> {};

TEST_P(EngineDataParallel, RanksReachTheSingleProcessParameters) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers("STRATA_DP_WORKER", GetParam(),
                                            "EngineDataParallelWorker.*", &output),
            0)
      << output;
  EXPECT_NE(output.find("[  PASSED  ] 6 tests"), std::string::npos) << output;
}

INSTANTIATE_TEST_SUITE_P(Ranks, EngineDataParallel, testing::Values(2, 3, 4));

}  // namespace
