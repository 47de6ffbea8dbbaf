// The engine on CUDA tensors (label `gpu`). One GPU: fp32 at ZeRO stages 0-2 equals LibTorch's
// AdamW on the same GPU step for step; bf16 and fp16 train the example GPT and track fp32, with
// ZeRO's model-state bytes. Two GPUs (NCCL, ranks started by strata-run, one GPU each): train_gpt
// at bf16 ZeRO 1 and 2 gives the losses of stage 0, fp32 on 2 GPUs those of 1 GPU with the same
// global batch, an fp16 overflow on one rank skips the step on both (this binary re-run as the
// ranks), and a ZeRO-2 checkpoint of 2 GPUs resumes exactly on 2 and re-partitioned on 1.
//
// Every test skips (GTEST_SKIP, with the reason) when this LibTorch has no CUDA, the machine has
// fewer GPUs than the test needs, or (two GPUs) this build has no NCCL. Every process started is
// bounded by a timeout (and every collective in it by STRATA_TIMEOUT).
//
// STRATA_ENGINE_GPU_TESTS_ON_CPU=1 runs the same tests and assertions on the CPU (Gloo, and
// train_gpt --device cpu), skipping only what LibTorch's CPU kernels lack (fp16 matrix products):
// a way to check the suite itself on a machine without GPUs. Never set by the build or CI.
#include <c10/core/DeviceGuard.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "examples/data.h"
#include "examples/gpt.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "tests/runtime/checkpoint/scratch_dir.h"

extern char** environ;

namespace {

using strata::json;
using strata::test::ScratchDir;

// --- where the tests run ------------------------------------------------------------------------

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == value;
}

bool on_cpu_for_development() { return env_is("STRATA_ENGINE_GPU_TESTS_ON_CPU", "1"); }

int cuda_devices() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

// Why a test that needs `gpus` GPUs cannot run here; empty when it can.
std::string missing_gpus(int gpus) {
  if (on_cpu_for_development()) return "";
  if (!torch::cuda::is_available())
    return "no CUDA: this LibTorch was built without CUDA or sees no GPU";
  if (gpus > 1 && !strata::comm::nccl_available())
    return "this build of Strata has no NCCL (multi-GPU runs need it)";
  if (cuda_devices() < gpus)
    return "needs " + std::to_string(gpus) + " GPUs, this machine has " +
           std::to_string(cuda_devices());
  return "";
}

#define REQUIRE_GPUS(n)                                      \
  do {                                                       \
    const std::string why_not = missing_gpus(n);             \
    if (!why_not.empty()) GTEST_SKIP() << why_not;           \
  } while (0)

// The device of the in-process tests.
torch::Device test_device() {
  return on_cpu_for_development() ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, 0);
}

// LibTorch 1.13's CPU kernels have no fp16 matrix product (CUDA has).
bool fp16_matmul_here() { return !on_cpu_for_development(); }

std::string device_flag() { return on_cpu_for_development() ? "cpu" : "cuda"; }

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

double relative(double a, double reference) {
  return std::abs(a - reference) / std::max(std::abs(reference), 1e-12);
}

// --- processes ----------------------------------------------------------------------------------

struct Run {
  int exit_code = -1;  // 128 + signal when killed; -1 when it outlived its timeout
  std::string output;  // stdout and stderr
  double seconds = 0;
};

// Runs `command` through /bin/sh with `env` added, collecting its output. After `timeout_s` the
// whole process group gets SIGTERM (strata-run forwards it to the ranks, which also die with the
// launcher: PR_SET_PDEATHSIG), then SIGKILL 10 s later. Never waits longer than that.
Run run_command(const std::string& command, double timeout_s,
                const std::vector<std::pair<std::string, std::string>>& env = {}) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  Run run;
  // The child's environment and arguments are built here: after fork() in a threaded program
  // the child only calls async-signal-safe functions.
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    bool replaced = false;
    for (const auto& kv : env) replaced = replaced || entry.rfind(kv.first + "=", 0) == 0;
    if (!replaced) entries.push_back(entry);
  }
  for (const auto& [name, value] : env) entries.push_back(name + "=" + value);
  std::vector<char*> envp;
  for (auto& entry : entries) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::string shell = "/bin/sh", dash_c = "-c", script = command;
  char* argv[] = {shell.data(), dash_c.data(), script.data(), nullptr};

  int out[2];
  if (::pipe(out) != 0) return {-1, "pipe failed", 0};
  const pid_t pid = ::fork();
  if (pid < 0) return {-1, "fork failed", 0};
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::execve(argv[0], argv, envp.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so the kill below cannot miss the group
  ::close(out[1]);
  ::fcntl(out[0], F_SETFL, ::fcntl(out[0], F_GETFL) | O_NONBLOCK);

  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  bool timed_out = false, killed = false;
  double term_at = 0;
  for (;;) {
    pollfd p{out[0], POLLIN, 0};
    ::poll(&p, 1, 200);
    char buffer[8192];
    ssize_t n;
    bool eof = false;
    while ((n = ::read(out[0], buffer, sizeof buffer)) > 0) run.output.append(buffer, size_t(n));
    if (n == 0) eof = true;
    if (eof) break;
    if (!timed_out && elapsed() > timeout_s) {
      timed_out = true;
      term_at = elapsed();
      ::kill(-pid, SIGTERM);
    }
    if (timed_out && !killed && elapsed() > term_at + 10) {
      killed = true;
      ::kill(-pid, SIGKILL);
    }
    // Grandchildren that escaped the group could hold the pipe open: stop reading then.
    if (killed && elapsed() > term_at + 15) break;
  }
  ::close(out[0]);
  int status = 0;
  while (::waitpid(pid, &status, killed ? 0 : WNOHANG) == 0) {
    if (!timed_out && elapsed() > timeout_s) {
      timed_out = true;
      ::kill(-pid, SIGTERM);
      term_at = elapsed();
    }
    if (timed_out && !killed && elapsed() > term_at + 10) {
      killed = true;
      ::kill(-pid, SIGKILL);
    }
    ::usleep(50000);
  }
  run.seconds = elapsed();
  if (timed_out) {
    run.exit_code = -1;
    run.output += "\n[test] stopped after " + std::to_string(timeout_s) + " s: " + command + "\n";
  } else {
    run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  return run;
}

// The multi-GPU tests start train_gpt or this binary; each launch gets this long.
constexpr double kLaunchTimeout = 180;
// Every collective of the ranks: a rank that does not come fails the run with its name.
const std::vector<std::pair<std::string, std::string>> kRankEnv = {{"STRATA_TIMEOUT", "60"}};

std::string bin(const std::string& name) { return std::string(STRATA_BIN_DIR) + "/" + name; }

// train_gpt on `gpus` GPUs: through strata-run (one GPU per rank: it sets CUDA_VISIBLE_DEVICES
// for each) when several, directly when one.
Run train_gpt(int gpus, const std::string& config, const std::string& args,
              const std::string& model = "tiny") {
  std::string command;
  if (gpus > 1) command = bin("strata-run") + " --num_gpus " + std::to_string(gpus) + " -- ";
  command += bin("train_gpt") + " --device " + device_flag() + " --model " + model + " --config " +
             config + " " + args;
  return run_command(command, kLaunchTimeout, kRankEnv);
}

std::vector<json> read_jsonl(const std::string& path) {
  std::vector<json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

std::vector<double> column(const std::vector<json>& rows, const char* key) {
  std::vector<double> values;
  for (const auto& r : rows) values.push_back(r.at(key).get<double>());
  return values;
}

double mean(const std::vector<double>& v, size_t from, size_t to) {
  double sum = 0;
  for (size_t i = from; i < to; ++i) sum += v[i];
  return sum / double(to - from);
}

std::string write_config(const ScratchDir& dir, const std::string& name, const json& config) {
  const std::string path = dir.str() + "/" + name + ".json";
  std::ofstream(path) << config.dump(2);
  return path;
}

// train_gpt's config for the multi-GPU runs: a fixed global batch of 16 (8 per rank on 2 GPUs),
// AdamW with clipping and a warmup-cosine schedule.
json gpt_config(int stage, const std::string& precision, int64_t total_steps) {
  json c = {{"train_batch_size", 16},
            {"gradient_accumulation_steps", 1},
            {"steps_per_print", 1000},
            {"gradient_clipping", 1.0},
            {"zero_optimization", {{"stage", stage}}},
            {"optimizer",
             {{"type", "AdamW"},
              {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}}}}},
            {"scheduler",
             {{"type", "WarmupCosineLR"},
              {"params", {{"total_num_steps", total_steps}, {"warmup_num_steps", 3}}}}}};
  if (precision == "bf16") c["bf16"] = {{"enabled", true}};
  if (precision == "fp16") c["fp16"] = {{"enabled", true}};
  // Stage 3 with the tiny model's units really released (nothing persistent, no reuse).
  if (stage == 3)
    c["zero_optimization"] = {{"stage", 3},
                              {"stage3_param_persistence_threshold", 0},
                              {"stage3_prefetch_bucket_size", 50000},
                              {"stage3_max_reuse_distance", 0}};
  return c;
}

// --- a small model ------------------------------------------------------------------------------

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 4));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    // In the parameters' dtype (fp16 matrix products on the GPU); fp16 on the CPU (development
    // runs only) computes in fp32, which LibTorch's CPU kernels have.
    const auto dtype = fc1->weight.scalar_type();
    const auto compute = fc1->weight.is_cpu() && dtype == torch::kHalf ? torch::kFloat : dtype;
    auto layer = [&](torch::nn::Linear& l, const torch::Tensor& h) {
      return torch::nn::functional::linear(h, l->weight.to(compute), l->bias.to(compute));
    };
    auto h = torch::tanh(layer(fc1, x.to(compute)));
    h = torch::tanh(layer(fc2, h));
    return torch::mse_loss(layer(fc3, h).to(torch::kFloat), y);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

// Two models with the same initial parameters, on `device`.
std::pair<Mlp, Mlp> twin_mlps(torch::Device device) {
  torch::manual_seed(3);
  Mlp a, b;
  {
    torch::NoGradGuard no_grad;
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  }
  a->to(device);
  b->to(device);
  return {a, b};
}

struct Batch {
  torch::Tensor x, y;
};
// Made on the CPU from a seed (the same numbers whatever the device), then moved.
Batch mlp_batch(int64_t seed, int64_t n, torch::Device device) {
  torch::manual_seed(77 + seed);
  auto x = torch::randn({n, 16});
  auto y = (x.narrow(1, 0, 4) * x.narrow(1, 4, 4)).sin() + x.narrow(1, 8, 4).cos();
  return {x.to(device), y.to(device)};
}

// --- 1. fp32 on one GPU equals LibTorch's AdamW ------------------------------------------------

class EngineGpuFp32 : public testing::TestWithParam<std::tuple<int, int>> {};

// The engine (AdamW from the config, clipping at 0.5, `gas` micro-batches per step) against
// torch::optim::AdamW and clip_grad_norm_ on the whole batch, on the same GPU and data: the
// parameters agree after every one of 10 steps. Stage 0 trains the module's own CUDA tensors;
// stages 1-2 (one rank) go through the flat fp32 master buffer on the GPU.
TEST_P(EngineGpuFp32, MatchesLibTorchAdamWOnTheSameGpuStepForStep) {
  REQUIRE_GPUS(1);
  const auto [stage, gas] = GetParam();
  const auto device = test_device();
  auto [net, ref] = twin_mlps(device);
  const int64_t global = 32, micro = global / gas;
  const double max_norm = 0.5;
  const json config = {
      {"train_micro_batch_size_per_gpu", micro},
      {"gradient_accumulation_steps", gas},
      {"steps_per_print", 1000},
      {"gradient_clipping", max_norm},
      {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 2000}}},
      {"optimizer",
       {{"type", "AdamW"},
        {"params",
         {{"lr", 1e-2}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.1}}}}}};
  auto engine = strata::initialize(net, config);
  ASSERT_EQ(engine->data_parallel_size(), 1);
  torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(1e-2)
                                                 .betas(std::make_tuple(0.9, 0.999))
                                                 .eps(1e-8)
                                                 .weight_decay(0.1));
  int clipped = 0;
  for (int64_t step = 0; step < 10; ++step) {
    const auto d = mlp_batch(step, global, device);
    for (int64_t m = 0; m < gas; ++m) {
      engine->backward(engine->forward(d.x.narrow(0, m * micro, micro),
                                       d.y.narrow(0, m * micro, micro)));
      engine->step();
    }
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm);
    opt.step();
    clipped += norm > max_norm;
    EXPECT_NEAR(engine->last_grad_norm(), norm, 1e-5 * norm) << "step " << step;
    auto pn = net->parameters(), pr = ref->parameters();
    ASSERT_EQ(pn.size(), pr.size());
    for (size_t i = 0; i < pn.size(); ++i) {
      ASSERT_EQ(pn[i].device(), device) << "parameter " << i;
      const auto a = pn[i].detach().cpu(), b = pr[i].detach().cpu();
      ASSERT_TRUE(torch::allclose(a, b, 1e-5, 1e-6))
          << "stage " << stage << " gas " << gas << " step " << step << " parameter " << i
          << " differs by " << (a - b).abs().max().item<double>() << " (relative "
          << ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item<double>() << ", at |value| "
          << b.abs().flatten()[(a - b).abs().argmax()].item<double>() << ")";
    }
  }
  EXPECT_GT(clipped, 0) << "the clipping threshold never bit: the test would not check it";
  EXPECT_EQ(engine->global_steps(), 10);
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kFloat);
}

INSTANTIATE_TEST_SUITE_P(StageAndAccumulation, EngineGpuFp32,
                         testing::Combine(testing::Values(0, 1, 2, 3), testing::Values(1, 2)),
                         [](const testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return "Stage" + std::to_string(std::get<0>(info.param)) + "Gas" +
                                  std::to_string(std::get<1>(info.param));
                         });

// --- 2. bf16 and fp16 train the GPT on one GPU -------------------------------------------------

struct GptRun {
  std::vector<double> losses;
  strata::zero::ModelStateBytes bytes;
  int64_t numel = 0;
  int64_t skipped = 0;
  torch::ScalarType dtype = torch::kFloat;
  bool on_device = false;
};

// The example GPT ("tiny") trained by the engine for `steps` steps at `stage` on one device; with
// `save_dir`, a checkpoint after step `save_at`; with `resume`, from that checkpoint on.
GptRun train_tiny_gpt(const std::string& precision, torch::Device device, int64_t steps,
                      int stage = 0, const std::string& save_dir = "", int64_t save_at = -1,
                      const std::string& resume = "") {
  using namespace strata::examples;
  static const auto data = TokenData::synthetic(size_t{1} << 20);
  const auto model_config = GPTConfig::by_name("tiny");
  torch::manual_seed(1234);
  GPT model(model_config);
  model->to(device);
  json config = {{"train_micro_batch_size_per_gpu", 16},
                 {"gradient_accumulation_steps", 1},
                 {"steps_per_print", 1000},
                 {"gradient_clipping", 1.0},
                 {"optimizer",
                  {{"type", "AdamW"},
                   {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}}}}}};
  if (precision == "bf16") config["bf16"] = {{"enabled", true}};
  if (precision == "fp16") config["fp16"] = {{"enabled", true}, {"initial_scale_power", 12}};
  // Stage 3 with every unit released after use and one unit prefetched.
  config["zero_optimization"] = {{"stage", stage},
                                 {"stage3_param_persistence_threshold", 0},
                                 {"stage3_prefetch_bucket_size", 50000},
                                 {"stage3_max_reuse_distance", 0}};
  auto engine = strata::initialize(model, config);
  GptRun run;
  for (const auto& p : model->parameters()) run.numel += p.numel();
  const int64_t first = resume.empty() ? 0 : (engine->load_checkpoint(resume), engine->global_steps());
  for (int64_t step = first; step < steps; ++step) {
    const auto b = data.batch(7, step, 0, 16, model_config.seq_len);
    auto loss = engine->forward(b.tokens.to(device), b.targets.to(device));
    engine->backward(loss);
    engine->step();
    run.losses.push_back(loss.item<double>());
    if (step + 1 == save_at) engine->save_checkpoint(save_dir);
  }
  run.bytes = engine->model_state_bytes();
  run.skipped = engine->skipped_steps();
  run.dtype = model->parameters().front().scalar_type();
  run.on_device = true;
  for (const auto& p : model->parameters()) run.on_device = run.on_device && p.device() == device;
  return run;
}

// bf16 and fp16 (stage 0, fp32 master weights, fp16 with dynamic loss scaling) on the GPU: the
// loss falls, every step stays within 5% of the fp32 run's, and the model states take ZeRO's
// 16 bytes per parameter at stage 0 (2 + 2 for the 16-bit parameters and gradients, 4 + 8 for
// the fp32 master and Adam's moments; over the flat buffer, padded to a multiple of 64).
TEST(EngineGpu, Bf16AndFp16TrainTheGptAndTrackFp32) {
  REQUIRE_GPUS(1);
  const auto device = test_device();
  const int64_t steps = 30;
  const auto fp32 = train_tiny_gpt("fp32", device, steps);
  ASSERT_EQ(fp32.losses.size(), size_t(steps));
  EXPECT_TRUE(fp32.on_device);
  EXPECT_GT(mean(fp32.losses, 0, 3), 5.0);  // ~ln 256 before training
  EXPECT_LT(mean(fp32.losses, steps - 5, steps), mean(fp32.losses, 0, 5) - 1.0);
  // fp32 at stage 0 trains the module's own tensors: 4 + 4 + 8 bytes per parameter, no padding.
  EXPECT_EQ(fp32.bytes.total(), 16 * fp32.numel);
  EXPECT_EQ(fp32.bytes.optimizer, 8 * fp32.numel);
  EXPECT_EQ(fp32.bytes.host, 0);  // nothing offloaded: every state on the device

  std::vector<std::string> precisions = {"bf16"};
  if (fp16_matmul_here()) precisions.push_back("fp16");
  for (const auto& precision : precisions) {
    SCOPED_TRACE(precision);
    const auto run = train_tiny_gpt(precision, device, steps);
    ASSERT_EQ(run.losses.size(), size_t(steps));
    EXPECT_TRUE(run.on_device);
    EXPECT_EQ(run.dtype, precision == "bf16" ? torch::kBFloat16 : torch::kHalf);
    double worst = 0;
    for (int64_t i = 0; i < steps; ++i) {
      ASSERT_TRUE(std::isfinite(run.losses[i])) << "step " << i + 1;
      worst = std::max(worst, relative(run.losses[i], fp32.losses[i]));
    }
    std::cout << "[ INFO     ] " << precision << ": loss " << mean(run.losses, 0, 5) << " -> "
              << mean(run.losses, steps - 5, steps) << " (fp32 " << mean(fp32.losses, 0, 5)
              << " -> " << mean(fp32.losses, steps - 5, steps) << "), worst gap to fp32 " << worst
              << ", skipped " << run.skipped << "\n";
    EXPECT_LT(worst, 0.05) << precision << " drifted from fp32 by " << worst;
    EXPECT_LT(mean(run.losses, steps - 5, steps), mean(run.losses, 0, 5) - 1.0);
    EXPECT_LE(run.skipped, precision == "fp16" ? 2 : 0);
    const auto& b = run.bytes;
    EXPECT_GE(b.params, 2 * run.numel);
    EXPECT_LT(b.params, 2 * (run.numel + 64));
    EXPECT_EQ(b.grads, b.params);
    EXPECT_EQ(b.master, 2 * b.params);
    EXPECT_EQ(b.optimizer, 4 * b.params);
    EXPECT_EQ(b.total(), 8 * b.params);  // 16 bytes per (padded) parameter
  }
}

// ZeRO-3 on one GPU (units released after use, gathered again on the device's allocator, one
// prefetched): the losses of stage 0 in fp32, bf16 and fp16 (with its loss scaler and skipped
// steps), and a bf16 checkpoint that resumes exactly.
TEST(EngineGpu, Stage3TrainsTheGptLikeStage0AndResumesExactly) {
  REQUIRE_GPUS(1);
  const auto device = test_device();
  std::vector<std::string> precisions = {"fp32", "bf16"};
  if (fp16_matmul_here()) precisions.push_back("fp16");
  for (const auto& precision : precisions) {
    SCOPED_TRACE(precision);
    const auto s0 = train_tiny_gpt(precision, device, 12, 0);
    const auto s3 = train_tiny_gpt(precision, device, 12, 3);
    ASSERT_EQ(s3.losses.size(), s0.losses.size());
    EXPECT_TRUE(s3.on_device);
    for (size_t i = 0; i < s0.losses.size(); ++i)
      EXPECT_LE(relative(s3.losses[i], s0.losses[i]), precision == "fp32" ? 1e-5 : 1e-3)
          << "step " << i + 1 << ": " << s3.losses[i] << " vs " << s0.losses[i];
    EXPECT_EQ(s3.skipped, s0.skipped);
  }
  const std::string dir = testing::TempDir() + "/stage3_gpu_ckpt_" + std::to_string(getpid());
  const auto whole = train_tiny_gpt("bf16", device, 12, 3, dir, 6);
  const auto resumed = train_tiny_gpt("bf16", device, 12, 3, "", -1, dir);
  ASSERT_EQ(resumed.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[6 + i]) << "step " << i + 7;
}

// --- 3. two GPUs: ZeRO stages and data parallelism through train_gpt -------------------------

// bf16 on 2 GPUs at ZeRO stages 0, 1 and 2: the same elementwise math on the same global batch,
// so stages 1 and 2 give stage 0's loss at every step (to 1e-3, relative); the loss falls, no
// step is skipped, and the model states shrink as ZeRO's formulas say (per rank, Psi
// parameters, N = 2: 16 Psi at stage 0, 4 Psi + 12 Psi / N at stage 1, 2 Psi + 14 Psi / N at 2).
TEST(EngineGpu, TwoGpusBf16ZeroStages1To3GiveTheLossesOfStage0) {
  REQUIRE_GPUS(2);
  ScratchDir dir;
  const int64_t steps = 20;
  std::vector<std::vector<json>> runs;
  for (int stage : {0, 1, 2, 3}) {
    const std::string name = "bf16_zero" + std::to_string(stage);
    const auto config = write_config(dir, name, gpt_config(stage, "bf16", steps));
    const std::string metrics = dir.str() + "/" + name + ".jsonl";
    const auto r = train_gpt(2, config,
                             "--steps " + std::to_string(steps) + " --seed 5 --metrics-jsonl " +
                                 metrics);
    ASSERT_EQ(r.exit_code, 0) << "stage " << stage << "\n" << r.output;
    EXPECT_NE(r.output.find("x 2 ranks"), std::string::npos) << r.output;
    runs.push_back(read_jsonl(metrics));
    ASSERT_EQ(runs.back().size(), size_t(steps)) << "stage " << stage;
  }
  const auto z0 = column(runs[0], "loss");
  for (int stage : {1, 2, 3}) {
    const auto zs = column(runs[stage], "loss");
    double worst = 0;
    for (int64_t i = 0; i < steps; ++i) {
      worst = std::max(worst, relative(zs[i], z0[i]));
      EXPECT_LE(relative(zs[i], z0[i]), 1e-3)
          << "stage " << stage << " step " << i + 1 << ": " << zs[i] << " vs " << z0[i];
    }
    std::cout << "[ INFO     ] stage " << stage << ": worst gap to stage 0 " << worst << "\n";
  }
  std::cout << "[ INFO     ] stage 0: loss " << mean(z0, 0, 5) << " -> "
            << mean(z0, steps - 5, steps) << "\n";
  EXPECT_LT(mean(z0, steps - 5, steps), mean(z0, 0, 5) - 0.5);
  for (const auto& run : runs)
    for (const auto& row : run) {
      EXPECT_FALSE(row.at("skipped").get<bool>()) << "step " << row.at("step");
      EXPECT_TRUE(std::isfinite(row.at("loss").get<double>()));
    }
  const double b0 = runs[0].back().at("model_state_bytes").get<double>();
  const double b1 = runs[1].back().at("model_state_bytes").get<double>();
  const double b2 = runs[2].back().at("model_state_bytes").get<double>();
  EXPECT_NEAR(b1 / b0, 10.0 / 16.0, 0.01) << b1 << " vs " << b0;
  EXPECT_NEAR(b2 / b0, 9.0 / 16.0, 0.01) << b2 << " vs " << b0;
  const double b3 = runs[3].back().at("model_state_bytes").get<double>();
  EXPECT_NEAR(b3 / b0, 8.0 / 16.0, 0.02) << b3 << " vs " << b0;  // ZeRO-3: 16 Psi / N
}

// ZeRO-Offload on GPUs: with offload_optimizer "cpu" (page-locked buffers, gradients copied to
// the host per bucket, the CPU Adam in tiles of 20k elements, weights copied back per tile)
// train_gpt gives the losses of the same run without offload, at stages 1-3 on 1 and 2 GPUs (on
// one GPU at stages 1-2 each step overlaps the next forward, zero/weight_arrival.h):
// fp32 to 1e-5, bf16 to 1e-3 (the CPU and CUDA Adams round alike; sums differ in order).
TEST(EngineGpu, OptimizerOffloadGivesTheLossesWithout) {
  REQUIRE_GPUS(1);
  ScratchDir dir;
  const int64_t steps = 10;
  for (int gpus : {1, 2}) {
    if (gpus == 2 && !missing_gpus(2).empty()) continue;
    for (const std::string precision : {"fp32", "bf16"})
      for (int stage : {1, 2, 3}) {
        std::vector<double> losses[2];
        for (bool offload : {false, true}) {
          auto c = gpt_config(stage, precision, steps);
          c["zero_optimization"]["sub_group_size"] = 20000;
          if (offload) c["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
          const std::string name = precision + "_s" + std::to_string(stage) + "_" +
                                   std::to_string(gpus) + (offload ? "_off" : "");
          const std::string metrics = dir.str() + "/" + name + ".jsonl";
          const auto r = train_gpt(gpus, write_config(dir, name, c),
                                   "--steps " + std::to_string(steps) + " --seed 5 --metrics-jsonl " + metrics);
          ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
          EXPECT_EQ(r.output.find("optimizer offload: fp32 master") != std::string::npos, offload)
              << r.output;
          losses[offload] = column(read_jsonl(metrics), "loss");
          ASSERT_EQ(losses[offload].size(), size_t(steps)) << name;
        }
        for (int64_t i = 0; i < steps; ++i)
          EXPECT_LE(relative(losses[1][i], losses[0][i]), precision == "fp32" ? 1e-5 : 1e-3)
              << precision << " stage " << stage << ", " << gpus << " GPU(s), step " << i + 1;
      }
  }
}

// Parameter offload alone at stage 3 (DeepSpeed allows it): the 16-bit shards in page-locked
// host memory or an NVMe swap file (the scratch folder; buffered where O_DIRECT is refused),
// copied to the GPU for each gather; the fp32 master and AdamW's moments stay on the GPU, and each
// step stores the master, cast, back to the shards' tier. The losses of the same run without
// offload on 1 and 2 GPUs: fp32 to 1e-6, bf16 to 1e-3.
TEST(EngineGpu, ParameterOffloadWithTheOptimizerOnTheGpuGivesTheLossesWithout) {
  REQUIRE_GPUS(1);
  ScratchDir dir;
  const int64_t steps = 8;
  for (int gpus : {1, 2}) {
    if (gpus == 2 && !missing_gpus(2).empty()) continue;
    for (const std::string precision : {"fp32", "bf16"}) {
      std::map<std::string, std::vector<double>> losses;
      for (const std::string params : {"none", "cpu", "nvme"}) {
        auto c = gpt_config(3, precision, steps);
        if (params != "none") c["zero_optimization"]["offload_param"] = {{"device", params}};
        if (params == "nvme") c["zero_optimization"]["offload_param"]["nvme_path"] = dir.str();
        const std::string name = precision + "_" + params + "_" + std::to_string(gpus);
        const std::string metrics = dir.str() + "/" + name + ".jsonl";
        const auto r = train_gpt(gpus, write_config(dir, name, c),
                                 "--steps " + std::to_string(steps) + " --seed 5 --metrics-jsonl " + metrics);
        ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
        if (params != "none")
          EXPECT_NE(r.output.find("the fp32 master and the optimizer state stay on the cuda"),
                    std::string::npos) << r.output;
        losses[params] = column(read_jsonl(metrics), "loss");
        ASSERT_EQ(losses[params].size(), size_t(steps)) << name;
      }
      for (const std::string params : {"cpu", "nvme"})
        for (int64_t i = 0; i < steps; ++i)
          EXPECT_LE(relative(losses[params][i], losses["none"][i]), precision == "fp32" ? 1e-6 : 1e-3)
              << precision << ", parameters " << params << ", " << gpus << " GPU(s), step " << i + 1;
    }
  }
}

// MoE on GPUs (tiny-moe: Strata's MoE layer, 4 experts, top-2, tokens dropped): bf16 at ZeRO
// stage 2 trains on one GPU; fp32 at ep_size 2 on 2 GPUs gives the losses of ep_size 1 on one GPU
// with the same gate calls (gradient accumulation 2), to 1e-4 (sums in another order).
TEST(EngineGpu, MoEExpertParallelGivesTheLossesOfOneGpu) {
  REQUIRE_GPUS(1);
  ScratchDir dir;
  const int64_t steps = 12;
  auto moe = [&](int ep, const std::string& precision) {
    auto c = gpt_config(2, precision, steps);
    c.erase("gradient_accumulation_steps");
    c["train_micro_batch_size_per_gpu"] = 8;
    c["moe"] = {{"num_experts", 4}, {"ep_size", ep}, {"top_k", 2}, {"capacity_factor", 1.0},
                {"drop_tokens", true}, {"aux_loss_coef", 0.01}};
    return c;
  };
  const std::string bf16 = dir.str() + "/bf16.jsonl";
  const auto rb = train_gpt(1, write_config(dir, "moe_bf16", moe(1, "bf16")),
                            "--steps " + std::to_string(steps) + " --metrics-jsonl " + bf16, "tiny-moe");
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  const auto rows = read_jsonl(bf16);
  ASSERT_EQ(rows.size(), size_t(steps));
  const auto losses = column(rows, "loss");
  EXPECT_LT(mean(losses, steps - 3, steps), mean(losses, 0, 3) - 0.3);
  int64_t dropped = 0;
  for (const auto& r : rows) dropped += r.at("dropped_tokens").get<int64_t>();
  EXPECT_GT(dropped, 0);
  if (!missing_gpus(2).empty()) return;
  const std::string one = dir.str() + "/ep1.jsonl", two = dir.str() + "/ep2.jsonl";
  const std::string args = "--steps " + std::to_string(steps) + " --seed 3 --metrics-jsonl ";
  const auto r1 = train_gpt(1, write_config(dir, "moe_ep1", moe(1, "fp32")), args + one, "tiny-moe");
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  const auto r2 = train_gpt(2, write_config(dir, "moe_ep2", moe(2, "fp32")), args + two, "tiny-moe");
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_NE(r2.output.find("ep_size 2"), std::string::npos) << r2.output;
  const auto a = column(read_jsonl(one), "loss"), b = column(read_jsonl(two), "loss");
  ASSERT_EQ(a.size(), size_t(steps));
  ASSERT_EQ(b.size(), size_t(steps));
  for (int64_t i = 0; i < steps; ++i)
    EXPECT_LE(relative(b[i], a[i]), 1e-4) << "step " << i + 1 << ": " << b[i] << " vs " << a[i];
}

// MoE at ZeRO stage 3 on GPUs (tiny-moe, fp32): the experts' own units gathered on use give the
// losses of stage 2 on one GPU (to 1e-5), and so do they with the parameters and optimizer state
// of experts and the rest in host memory; on 2 GPUs, ep_size 2 at stage 3 gives ep_size 1's
// losses (1e-4).
TEST(EngineGpu, MoEAtStageThreeGivesTheLossesOfStageTwo) {
  REQUIRE_GPUS(1);
  ScratchDir dir;
  const int64_t steps = 8;
  auto moe = [&](int ep, int stage) {
    auto c = gpt_config(stage, "fp32", steps);
    c.erase("gradient_accumulation_steps");
    c["train_micro_batch_size_per_gpu"] = 8;
    c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    c["moe"] = {{"num_experts", 4}, {"ep_size", ep}, {"top_k", 2}, {"capacity_factor", 1.0},
                {"drop_tokens", true}, {"aux_loss_coef", 0.01}};
    return c;
  };
  const std::string args = "--steps " + std::to_string(steps) + " --seed 3 --metrics-jsonl ";
  auto losses = [&](int gpus, const json& config, const std::string& name,
                    const std::string& extra = "") {
    const std::string jsonl = dir.str() + "/" + name + ".jsonl";
    const auto r =
        train_gpt(gpus, write_config(dir, name, config), extra + " " + args + jsonl, "tiny-moe");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const auto rows = r.exit_code == 0 ? column(read_jsonl(jsonl), "loss") : std::vector<double>{};
    EXPECT_EQ(rows.size(), size_t(steps)) << name;
    return rows;
  };
  const auto two = losses(1, moe(1, 2), "s2");
  auto offloaded = moe(1, 3);
  offloaded["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  auto params_only = moe(1, 3);  // the optimizer on the GPU
  params_only["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  offloaded["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  for (const auto& [name, config] : {std::pair{std::string("s3"), moe(1, 3)},
                                     std::pair{std::string("s3_offload"), offloaded},
                                     std::pair{std::string("s3_params_only"), params_only}}) {
    const auto three = losses(1, config, name);
    for (size_t i = 0; i < three.size() && i < two.size(); ++i)
      EXPECT_LE(relative(three[i], two[i]), 1e-5) << name << ", step " << i + 1;
  }
  // Streamed experts (one unit per expert), everything offloaded, the model built in host memory
  // and moved to the GPU by the engine a unit at a time (--host-init: InitOptions::device).
  auto streamed = offloaded;
  streamed["moe"]["expert_unit_size"] = 1;
  const auto from_host = losses(1, streamed, "s3_streamed_host_init", "--host-init");
  for (size_t i = 0; i < from_host.size() && i < two.size(); ++i)
    EXPECT_LE(relative(from_host[i], two[i]), 1e-5) << "streamed, host init, step " << i + 1;
  if (!missing_gpus(2).empty()) return;
  // One GPU accumulates 2 micro-batches of 8: the gate calls of 2 GPUs with 8 each.
  const auto b = losses(2, moe(2, 3), "ep2_s3");
  for (size_t i = 0; i < two.size() && i < b.size(); ++i)
    EXPECT_LE(relative(b[i], two[i]), 1e-4) << "step " << i + 1 << ": " << b[i] << " vs " << two[i];
}

// fp32 stage 0: 2 GPUs with 8 samples each give the losses of 1 GPU with all 16 (to 1e-4,
// relative: only the order of the gradient sums differs).
TEST(EngineGpu, TwoGpusFp32GiveTheLossesOfOneGpuWithTheSameGlobalBatch) {
  REQUIRE_GPUS(2);
  ScratchDir dir;
  const int64_t steps = 20;
  const auto config = write_config(dir, "fp32", gpt_config(0, "fp32", steps));
  const std::string one = dir.str() + "/one.jsonl", two = dir.str() + "/two.jsonl";
  const std::string args = "--steps " + std::to_string(steps) + " --seed 6 --metrics-jsonl ";
  const auto r1 = train_gpt(1, config, args + one);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  EXPECT_NE(r1.output.find("16 micro x 1 accumulation x 1 ranks"), std::string::npos)
      << r1.output;
  const auto r2 = train_gpt(2, config, args + two);
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_NE(r2.output.find("8 micro x 1 accumulation x 2 ranks"), std::string::npos)
      << r2.output;
  const auto a = column(read_jsonl(one), "loss"), b = column(read_jsonl(two), "loss");
  ASSERT_EQ(a.size(), size_t(steps));
  ASSERT_EQ(b.size(), size_t(steps));
  double worst = 0;
  for (int64_t i = 0; i < steps; ++i) {
    worst = std::max(worst, relative(b[i], a[i]));
    EXPECT_LE(relative(b[i], a[i]), 1e-4) << "step " << i + 1 << ": " << b[i] << " vs " << a[i];
  }
  std::cout << "[ INFO     ] loss " << mean(a, 0, 5) << " -> " << mean(a, steps - 5, steps)
            << "; worst gap of 2 GPUs to 1: " << worst << "\n";
  EXPECT_LT(mean(a, steps - 5, steps), mean(a, 0, 5) - 0.5);
}

// --- 4. fp16 overflow on one of two GPUs -------------------------------------------------------

bool is_worker() { return std::getenv("STRATA_ENGINE_GPU_WORKER") != nullptr; }

// The rank's GPU: strata-run leaves it only its own (cuda:0); with every GPU visible, the
// local rank's.
torch::Device worker_device() {
  if (on_cpu_for_development()) return torch::kCPU;
  const int local = std::max(0, env_int("LOCAL_RANK"));
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local % cuda_devices()));
}

// Runs as each of 2 ranks (EngineGpu.TwoGpusFp16OverflowOnOneRankIsSkippedOnBoth starts them).
// fp16 at ZeRO stages 0 to 3 on NCCL: at step 3 only the last rank's loss is inf; both ranks
// skip that step (parameters unchanged, scale halved with hysteresis 1) and take every other;
// at the end the ranks hold the same parameters.
TEST(EngineGpuWorker, Fp16OverflowOnOneRankIsSkippedOnEveryRank) {
  if (!is_worker())
    GTEST_SKIP() << "runs as a rank under strata-run (EngineGpu.TwoGpusFp16OverflowOnOneRank...)";
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
  ASSERT_EQ(world, 2);
  ASSERT_TRUE(on_cpu_for_development() || torch::cuda::is_available());
  const auto device = worker_device();
  std::optional<c10::DeviceGuard> on_device;  // the current device too
  if (device.is_cuda()) on_device.emplace(device);
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage) + ", rank " + std::to_string(rank));
    torch::manual_seed(3);
    Mlp net;
    net->to(device);
    const json config = {
        {"train_micro_batch_size_per_gpu", 8},
        {"steps_per_print", 1000},
        {"fp16", {{"enabled", true}, {"initial_scale_power", 8}, {"hysteresis", 1}}},
        {"zero_optimization", stage == 3 ? json{{"stage", 3}, {"stage3_param_persistence_threshold", 0}}
                                         : json{{"stage", stage}}},
        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}}};
    auto engine = strata::initialize(net, config);
    ASSERT_EQ(engine->data_parallel_size(), world);
    ASSERT_EQ(engine->data_parallel_rank(), rank);
    ASSERT_EQ(net->fc1->weight.scalar_type(), torch::kHalf);
    ASSERT_EQ(net->fc1->weight.device(), device);
    EXPECT_EQ(engine->loss_scale(), 256.0);
    for (int64_t step = 0; step < 5; ++step) {
      const auto d = mlp_batch(100 * step + rank, 8, device);
      auto loss = engine->forward(d.x, d.y);
      const bool overflow_step = step == 2;
      if (overflow_step && rank == world - 1)
        loss = loss * std::numeric_limits<float>::infinity();
      std::vector<torch::Tensor> before;
      {
        auto whole = engine->gathered_parameters();  // stage 3: every rank reads the weights
        for (const auto& p : net->parameters()) before.push_back(p.detach().cpu().clone());
      }
      const double scale_before = engine->loss_scale();
      engine->backward(loss);
      engine->step();
      EXPECT_EQ(engine->last_step_skipped(), overflow_step) << "step " << step + 1;
      bool unchanged = true;
      {
        auto whole = engine->gathered_parameters();
        const auto after = net->parameters();
        for (size_t i = 0; i < before.size(); ++i)
          unchanged = unchanged && torch::equal(after[i].detach().cpu(), before[i]);
      }
      EXPECT_EQ(unchanged, overflow_step) << "step " << step + 1;
      EXPECT_EQ(engine->loss_scale(), overflow_step ? scale_before / 2 : scale_before)
          << "step " << step + 1;
    }
    EXPECT_EQ(engine->skipped_steps(), 1);
    EXPECT_EQ(engine->global_steps(), 5);
    EXPECT_EQ(engine->loss_scale(), 128.0);
    // The same parameters on every rank: the elementwise max over ranks equals the min.
    auto& group = engine->data_parallel_group();
    ASSERT_TRUE(group != nullptr);
    auto whole = engine->gathered_parameters();
    for (const auto& p : net->parameters()) {
      auto hi = p.detach().to(torch::kFloat).contiguous().clone(), lo = hi.clone();
      group->all_reduce(hi, strata::comm::ReduceOp::Max);
      group->all_reduce(lo, strata::comm::ReduceOp::Min);
      EXPECT_TRUE(torch::equal(hi.cpu(), lo.cpu()));
    }
  }
}

TEST(EngineGpu, TwoGpusFp16OverflowOnOneRankIsSkippedOnBoth) {
  if (is_worker()) GTEST_SKIP() << "the driver does not run inside a rank";
  REQUIRE_GPUS(2);
  auto env = kRankEnv;
  env.emplace_back("STRATA_ENGINE_GPU_WORKER", "1");
  const auto r = run_command(bin("strata-run") + " --num_gpus 2 -- /proc/" +
                                 std::to_string(::getpid()) +
                                 "/exe --gtest_filter='EngineGpuWorker.*'",
                             kLaunchTimeout, env);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  size_t passed = 0;
  for (size_t at = 0; (at = r.output.find("[  PASSED  ] 1 test", at)) != std::string::npos; ++at)
    ++passed;
  EXPECT_EQ(passed, 2u) << "both ranks must run and pass the worker test\n" << r.output;
}

// --- 5. a ZeRO-2 bf16 checkpoint of 2 GPUs ------------------------------------------------------

// 20 steps straight on 2 GPUs; 10 steps saved (--save-dir), then resumed (--resume) for steps
// 11-20, on 2 GPUs and on 1 (the ZeRO-2 partitions re-partitioned for one rank).
//
// Same world: the resumed losses are expected to equal the straight run's bit for bit. Asserted
// exactly at step 11 (one forward pass of the restored bf16 weights: deterministic kernels) and
// to 1e-6 relative after it, since CUDA's attention backward (flash / memory-efficient SDPA) is
// not promised deterministic. The learning rate is host arithmetic: exact. One GPU: another
// micro-batch (16, not 8), so other rounding in bf16: 1e-3 relative.
TEST(EngineGpu, TwoGpusZero2Bf16CheckpointResumesExactlyAndOnOneGpu) {
  REQUIRE_GPUS(2);
  ScratchDir dir;
  const int64_t steps = 20;
  const auto config = write_config(dir, "zero2_bf16", gpt_config(2, "bf16", steps));
  const std::string ckpt = dir.str() + "/ckpt";
  const std::string common = "--steps " + std::to_string(steps) + " --seed 9 ";
  const std::string full = dir.str() + "/full.jsonl";
  auto r = train_gpt(2, config, common + "--metrics-jsonl " + full);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train_gpt(2, config, "--steps 10 --seed 9 --save-dir " + ckpt);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(std::filesystem::exists(ckpt + "/step10/manifest.json")) << r.output;

  const auto reference = read_jsonl(full);
  ASSERT_EQ(reference.size(), size_t(steps));
  for (int gpus : {2, 1}) {
    SCOPED_TRACE(std::to_string(gpus) + " GPU(s)");
    const std::string out = dir.str() + "/resumed" + std::to_string(gpus) + ".jsonl";
    r = train_gpt(gpus, config, common + "--resume " + ckpt + " --metrics-jsonl " + out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    const auto rows = read_jsonl(out);
    ASSERT_EQ(rows.size(), 10u);
    double worst = 0;
    for (size_t i = 0; i < rows.size(); ++i)
      worst = std::max(worst, relative(rows[i].at("loss").get<double>(),
                                       reference[10 + i].at("loss").get<double>()));
    std::cout << "[ INFO     ] resumed on " << gpus << " GPU(s): worst gap to the straight run "
              << worst << "\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& a = reference[10 + i];
      const auto& b = rows[i];
      ASSERT_EQ(b.at("step").get<int64_t>(), a.at("step").get<int64_t>());
      const double la = a.at("loss").get<double>(), lb = b.at("loss").get<double>();
      if (gpus == 2) {
        if (i == 0) {
          EXPECT_EQ(lb, la) << "step 11: the restored weights' loss";
        }
        EXPECT_LE(relative(lb, la), 1e-6) << "step " << i + 11 << ": " << lb << " vs " << la;
        EXPECT_EQ(b.at("lr").get<double>(), a.at("lr").get<double>()) << "step " << i + 11;
      } else {
        EXPECT_LE(relative(lb, la), 1e-3) << "step " << i + 11 << ": " << lb << " vs " << la;
        EXPECT_DOUBLE_EQ(b.at("lr").get<double>(), a.at("lr").get<double>());
      }
      EXPECT_FALSE(b.at("skipped").get<bool>());
    }
  }
}

// A model with parameters on the CPU and on a GPU is refused at initialize, naming one of each:
// its gradients would arrive on two autograd threads (one per device) into one reducer, and the
// flat buffer and the gradient norm assume one device.
TEST(EngineGpu, ParametersOnCpuAndGpuAreRefusedNamingBoth) {
  if (on_cpu_for_development()) GTEST_SKIP() << "needs a second device";
  REQUIRE_GPUS(1);
  struct SplitImpl : torch::nn::Module {
    SplitImpl() {
      near = register_module("near", torch::nn::Linear(4, 4));
      far = register_module("far", torch::nn::Linear(4, 1));
      near->to(torch::Device(torch::kCUDA, 0));
    }
    torch::Tensor forward(const torch::Tensor& x) { return far(near(x).cpu()).sum(); }
    torch::nn::Linear near{nullptr}, far{nullptr};
  };
  for (const auto& [stage, bf16] : {std::pair{0, false}, std::pair{2, true}}) {
    auto model = torch::nn::ModuleHolder<SplitImpl>(std::make_shared<SplitImpl>());
    json config = {{"train_micro_batch_size_per_gpu", 2},
                   {"zero_optimization", {{"stage", stage}}},
                   {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}}}}}};
    if (bf16) config["bf16"] = {{"enabled", true}};
    try {
      strata::initialize(model, config);
      ADD_FAILURE() << "stage " << stage << ": a model on a GPU and the CPU was accepted";
    } catch (const strata::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'near.weight' on cuda:0"), std::string::npos) << what;
      EXPECT_NE(what.find("on cpu"), std::string::npos) << what;
    }
  }
}

}  // namespace
