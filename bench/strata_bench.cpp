// strata-bench gpt: the benchmark models of ../shared/bench/README.md (the example GPT, wrapped by
// the engine from a JSON config) trained on random tokens; prints tokens/s, model TFLOP/s, MFU
// against a matrix product measured in the same run, and peak GPU memory, as one JSON line in
// the PyTorch peer's format (bench/run_dense.sh prints both side by side). For an fp32 config on
// one rank it also times a plain LibTorch loop over the same model and batch (torch::optim::AdamW
// with the engine's hyper-parameters, clip_grad_norm_) and prints Strata's ratio to it: the
// runtime's own cost. For a stage-3 config on one rank it also times the same config at stage 0
// in the same process (rounds alternating) and prints stage 3's ratio to it and the mechanism's
// cost per dispatched op (the op callback, gathers and releases).
//   strata-bench gpt --config FILE [--model dense-350M] [--steps 20] [--warmup 3] [--seq T]
//                    [--tiled-mlp none|auto|N]   (the blocks' feed-forward over sequence tiles)
//                    [--device cuda|cpu] [--profile STEPS]   (bench/op_profile.h)
//                    [--census STEPS]   (bench/op_census.h: ops, bytes, on any device)
//                    [--moe-kernel grouped|batched]   (the GPU's grouped path on a CPU, e.g.)
//   strata-bench adam [--numel N] [--steps N] [--device cuda|cpu]   (bench/adam_bench.h)
//   strata-bench cpu-adam [--numel N] [--runs R]                    (bench/cpu_adam_bench.cpp)
//   strata-bench nvme --dir PATH [--size-gib 4] [--block-size 1M] [--queue-depth 32] [--pairs 7]
//                                                                   (bench/nvme_bench.cpp)
//   strata-bench moe-dispatch [--experts 64] [--tokens 16384] ...   (bench/moe_bench.cpp)
//   strata-bench a2a [--sizes-mib 16,64,256,1024] (under strata-run) (bench/moe_bench.cpp)
//   strata-bench moe-ops [--experts 64] [--k 6] ...  (bench/moe_bench.cpp, bench/op_census.h)
//   strata-bench hf --hf-model DIR --config FILE [--B 4] [--T 2048] ...   (bench/hf_bench.cpp)
//   strata-bench --version
// MoE models (moe-8x, tiny-moe) get Strata's MoE layer (examples/gpt_moe.h) from the config's
// moe block; their line adds the fraction of routes dropped over capacity.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#if STRATA_BENCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "bench/adam_bench.h"
#include "bench/bench_device.h"
#include "bench/op_census.h"
#include "bench/op_profile.h"
#include "examples/gpt.h"
#include "examples/gpt_moe.h"
#include "runtime/engine.h"
#include "runtime/optim/adam.h"
#include "strata/version.h"
#include "runtime/error.h"

namespace strata::bench {
int run_nvme(int argc, char** argv);  // bench/nvme_bench.cpp: the io_uring store against fio
int run_moe_dispatch(int argc, char** argv);  // bench/moe_bench.cpp: MoE dispatch memory
int run_a2a(int argc, char** argv);           // bench/moe_bench.cpp: all_to_all bandwidth
int run_moe_ops(int argc, char** argv);       // bench/moe_bench.cpp: one MoE layer's op census
int run_hf(int argc, char** argv);  // bench/hf_bench.cpp: a published architecture, as the peer
}  // namespace strata::bench

namespace {

using strata::bench::matmul_peak;
using strata::bench::peak_memory_gib;
using strata::bench::reset_peak_memory;
using strata::bench::synchronize;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string config, model = "dense-350M", device;
  int64_t steps = 20, warmup = 3;
  int64_t profile = 0;  // > 0: after timing, that many steps under the op profile
  int64_t census = 0;   // > 0: after timing, that many steps counted op by op (any device)
  std::string moe_kernel;  // --moe-kernel grouped|batched: the experts' kernel, not the device's
  std::string checkpointing;  // --activation-checkpointing: GPTConfig::checkpointing
  int64_t seq = 0;            // --seq: the model's sequence length instead of its own
  // --tiled-mlp none|auto|N: GPTConfig::mlp_tiles (-1, 0, N); unset: the config's
  // activation_checkpointing.mlp_tiles, else untiled.
  std::optional<int64_t> tiled_mlp;
  bool host_init = false;     // --host-init 1: the model built in host memory (InitOptions::device)
};

Args parse(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) != "gpt")
    throw strata::Error("usage: strata-bench gpt --config FILE [--model NAME] [--steps N] "
                        "[--warmup N] [--device cuda|cpu] [--activation-checkpointing every|every:K|selective] "
                        "[--seq T] [--tiled-mlp none|auto|N] [--host-init 1] [--profile STEPS] [--census STEPS] [--moe-kernel grouped|batched]\n       strata-bench adam [--numel N] "
                        "[--steps N] [--device cuda|cpu]");
  Args a;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--config") a.config = value;
    else if (flag == "--model") a.model = value;
    else if (flag == "--steps") a.steps = std::stoll(value);
    else if (flag == "--warmup") a.warmup = std::stoll(value);
    else if (flag == "--device") a.device = value;
    else if (flag == "--profile") a.profile = std::stoll(value);
    else if (flag == "--census") a.census = std::stoll(value);
    else if (flag == "--moe-kernel") a.moe_kernel = value;
    else if (flag == "--activation-checkpointing") a.checkpointing = value;
    else if (flag == "--seq") a.seq = std::stoll(value);
    else if (flag == "--tiled-mlp") a.tiled_mlp = value == "none" ? -1 : value == "auto" ? 0 : std::stoll(value);
    else if (flag == "--host-init") a.host_init = value == "1";
    else throw strata::Error("strata-bench: unknown option " + flag);
  }
  if (a.config.empty()) throw strata::Error("strata-bench: --config FILE is required");
  return a;
}


// The same micro-steps as the engine runs, written as a user would without Strata.
struct PlainLoop {
  PlainLoop(const strata::examples::GPTConfig& cfg, const torch::Device& device,
            const strata::optim::AdamOptions& adam, double clipping, int64_t gas)
      : clipping(clipping), gas(gas) {
    torch::manual_seed(0);  // the engine's model was built from the same seed
    model = strata::examples::GPT(cfg);
    model->to(device);
    opt = std::make_unique<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(adam.lr())
                                 .betas(adam.betas())
                                 .eps(adam.eps())
                                 .weight_decay(adam.weight_decay()));
  }
  void step(const torch::Tensor& tokens, const torch::Tensor& targets) {
    for (int64_t m = 0; m < gas; ++m) {
      auto loss = model->forward(tokens, targets);
      (gas > 1 ? loss / double(gas) : loss).backward();
    }
    if (clipping > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), clipping);
    opt->step();
    opt->zero_grad();
  }
  strata::examples::GPT model{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  double clipping;
  int64_t gas;
};

// Seconds per call of `step`, over n calls.
template <class Step>
double seconds_per_step(Step&& step, int64_t n, const torch::Device& device) {
  synchronize(device);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < n; ++i) step();
  synchronize(device);
  return std::chrono::duration<double>(Clock::now() - t0).count() / n;
}

// Stage 3 on one rank against stage 0 of the same config, model and batch in this process: what
// gathering on use and releasing after it costs where no communication hides it.
template <class Stage3Step>
void compare_with_stage0(const Args& args, strata::Engine& stage3, Stage3Step& step3, double tok,
                         const torch::Device& device) {
  using namespace strata::examples;
  std::ifstream in(args.config);
  auto config = nlohmann::json::parse(in, nullptr, true, /*ignore_comments=*/true);
  config["zero_optimization"]["stage"] = 0;
  const auto cfg = GPTConfig::by_name(args.model);
  strata::InitOptions init;
  init.group = stage3.data_parallel_group();
  auto resolved = strata::load_engine_config(config, init);
  torch::manual_seed(0);
  GPT model = make_gpt(cfg, resolved.moe, 0, init.group);  // with MoE layers when the config has
  model->to(device);
  // The stage-0 engine's ops must not pay for stage 3's callback (the experts' coordinator's too).
  struct Coordinators {
    std::vector<strata::zero::ParamCoordinator*> all;
    void pause() { for (auto* c : all) c->pause(); }
    void resume() { for (auto* c : all) c->resume(); }
    int64_t ops_seen() const { return all.front()->ops_seen(); }  // each sees every op
    int64_t gathers() const {
      int64_t n = 0;
      for (auto* c : all) n += c->gathers();
      return n;
    }
  } coordinators{{stage3.stage3_coordinator()}};
  if (auto* experts = stage3.stage3_expert_coordinator()) coordinators.all.push_back(experts);
  auto* coordinator = &coordinators;
  coordinator->pause();
  auto engine0 = std::make_shared<strata::ModelEngine<GPT>>(model, std::move(resolved), std::move(init));
  const auto tokens = torch::randint(0, cfg.vocab, {engine0->train_micro_batch_size_per_gpu(), cfg.seq_len},
                                     torch::TensorOptions().dtype(torch::kLong).device(device));
  auto step0 = [&] {
    for (int64_t m = 0; m < engine0->gradient_accumulation_steps(); ++m) {
      engine0->backward(engine0->forward(tokens, tokens));
      engine0->step();
    }
  };
  seconds_per_step(step0, args.warmup, device);
  coordinator->resume();
  std::vector<double> ratios, s0, s3;
  int64_t ops = 0, gathers = 0;
  for (int round = 0; round < 3; ++round) {
    coordinator->pause();
    s0.push_back(seconds_per_step(step0, args.steps, device));
    coordinator->resume();
    const int64_t ops_before = coordinator->ops_seen(), gathers_before = coordinator->gathers();
    s3.push_back(seconds_per_step(step3, args.steps, device));
    ops = (coordinator->ops_seen() - ops_before) / args.steps;
    gathers = (coordinator->gathers() - gathers_before) / args.steps;
    ratios.push_back(s3.back() / s0.back());
  }
  std::sort(ratios.begin(), ratios.end());
  std::sort(s0.begin(), s0.end());
  std::sort(s3.begin(), s3.end());
  nlohmann::json b = {{"name", "strata " + args.model + " stage 0 (same run, same config)"},
                      {"step_ms", s0[1] * 1e3},
                      {"tok_s", tok / s0[1]},
                      {"stage3_step_ms", s3[1] * 1e3},
                      {"stage3_over_stage0", ratios[1]},
                      {"rounds", ratios},
                      {"ops_per_step", ops},
                      {"gathers_per_step", gathers},
                      {"mechanism_us_per_op", (s3[1] - s0[1]) / double(std::max<int64_t>(ops, 1)) * 1e6},
                      {"live_param_bytes_peak", stage3.live_param_bytes_peak()},
                      {"stage0_param_bytes", engine0->live_param_bytes_peak()}};
  std::printf("%s\n", b.dump().c_str());
}

int run(const Args& args) {
  using namespace strata::examples;
  auto cfg = GPTConfig::by_name(args.model);
  cfg.checkpointing = args.checkpointing;
  if (args.seq > 0) cfg.seq_len = args.seq;
  const torch::Device device = strata::bench::bench_device(args.device);
  const double peak = matmul_peak(device);

  strata::InitOptions init;
  auto config = strata::load_engine_config(args.config, init);
  cfg.mlp_tiles = args.tiled_mlp.value_or(config.activation_checkpointing.mlp_tiles.value_or(-1));
  torch::manual_seed(0);
  GPT model = make_gpt(cfg, config.moe, 0, init.group);
  // --host-init: the engine moves the host-built model to the device (a unit at a time at stage 3).
  if (args.host_init)
    init.device = device;
  else
    model->to(device);
  auto engine =
      std::make_shared<strata::ModelEngine<GPT>>(model, std::move(config), std::move(init));
  const auto moe_layers = strata::moe::moe_layers(*model);
  if (!args.moe_kernel.empty()) {
    if (args.moe_kernel != "grouped" && args.moe_kernel != "batched")
      throw strata::Error("strata-bench: --moe-kernel is grouped or batched, not " + args.moe_kernel);
    for (auto* layer : moe_layers)
      layer->experts->set_kernel(args.moe_kernel == "grouped" ? strata::moe::ExpertKernel::Grouped
                                                              : strata::moe::ExpertKernel::Batched);
  }
  const int64_t batch = engine->train_micro_batch_size_per_gpu(), seq = cfg.seq_len;
  const auto tokens = torch::randint(0, cfg.vocab, {batch, seq},
                                     torch::TensorOptions().dtype(torch::kLong).device(device));
  const auto targets = torch::randint(0, cfg.vocab, {batch, seq},
                                      torch::TensorOptions().dtype(torch::kLong).device(device));
  auto step = [&] {
    torch::Tensor loss;
    for (int64_t m = 0; m < engine->gradient_accumulation_steps(); ++m) {
      loss = engine->forward(tokens, targets);
      engine->backward(loss);
      engine->step();
    }
    return loss;
  };
  const auto w0 = Clock::now();
  for (int64_t i = 0; i < args.warmup; ++i) step();
  synchronize(device);
  const double warm = std::chrono::duration<double>(Clock::now() - w0).count();
  reset_peak_memory(device);
  // Stage 3's units, dense and experts' (none below stage 3).
  std::vector<const strata::zero::ParamUnits*> unit_sets;
  for (const auto* u : {engine->stage3_units(), engine->stage3_expert_units()})
    if (u) unit_sets.push_back(u);
  // offload_param: shard bytes brought to the device for gathers.
  auto h2d_bytes = [&] {
    int64_t b = 0;
    for (const auto* u : unit_sets) b += u->host_to_device_bytes();
    return b;
  };
  const int64_t h2d0 = h2d_bytes();
  // Each trainable unit's gathers (offload_param: one host-to-device copy of its shard each), to
  // say which parameters travel how often a step.
  auto unit_gathers = [&] {
    std::vector<int64_t> g;
    for (const auto* u : unit_sets)
      for (size_t i = 0; i < u->size(); ++i) g.push_back(u->unit(i).gathers);
    return g;
  };
  const auto gathers0 = unit_gathers();
  const auto nvme0 = engine->nvme_traffic();
  const auto t0 = Clock::now();
  torch::Tensor loss;
  std::vector<torch::Tensor> losses;  // read after the timed steps: no sync among them
  for (int64_t i = 0; i < args.steps; ++i) losses.push_back((loss = step()).detach());
  synchronize(device);
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count() / args.steps;
  // The timed steps' traffic (the profile's and the memory phases' steps come after).
  const int64_t h2d1 = h2d_bytes();
  const auto gathers1 = unit_gathers();
  const auto nvme = engine->nvme_traffic();

  // The peer's arithmetic: 6 x active parameters x tokens + causal attention counted half.
  const double tok = double(batch * seq * engine->gradient_accumulation_steps());
  const int64_t k = cfg.experts > 0 ? cfg.top_k : 1;
  const double V = cfg.vocab, d = cfg.d_model, L = cfg.layers, f = cfg.ffn;
  const double shared = double(cfg.shared_experts) * f;  // moe-ds's always-on experts, as the peer
  const double active = V * d * 2 + L * (4 * d * d + 2 * d * f * k + 2 * d * shared);
  const double flops = 6 * active * tok + 12 * L * d * seq * tok / 2;
  const double tflops = flops / dt / 1e12;
  // The precision in the name: a torch_autocast run and a bf16 model cast are different rows.
  const auto& pc = engine->config();
  const std::string precision = pc.torch_autocast.enabled ? "autocast"
                                : pc.bf16.enabled         ? "bf16"
                                : pc.fp16.enabled         ? "fp16"
                                                          : "fp32";
  const std::string ac =
      (args.checkpointing.empty() || args.checkpointing == "none"
           ? std::string()
           : " ckpt " + args.checkpointing +
                 (pc.activation_checkpointing.cpu_checkpointing ? " cpu" : "")) +
      (cfg.mlp_tiles < 0 ? std::string()
                         : cfg.mlp_tiles == 0 ? std::string(" tiled") : fmt::format(" tiled{}", cfg.mlp_tiles));
  nlohmann::json r = {{"name", "strata " + args.model + ac + " " + precision + " stage " +
                                   std::to_string(pc.zero_optimization.stage) + " x" +
                                   std::to_string(engine->data_parallel_size()) + " (per GPU)"},
                      {"B", batch}, {"T", seq}, {"step_ms", dt * 1e3},
                      {"tok_s", tok / dt}, {"tflops", tflops}, {"mfu", tflops / peak},
                      {"peak_tflops", peak}, {"mem_GiB", peak_memory_gib(device)},
                      // The long-context figure: the peak over the micro-batch's tokens.
                      {"mem_bytes_per_token",
                       peak_memory_gib(device) * double(1 << 30) / double(batch * seq)},
                      {"reserved_GiB", peak_memory_gib(device, /*reserved=*/true)},
                      {"warm_s", warm}, {"loss", loss.item<double>()}};
  std::vector<double> loss_values;
  for (const auto& l : losses) loss_values.push_back(l.item<double>());
  r["losses"] = loss_values;
  if (args.profile > 0 && engine->data_parallel_rank() == 0) {
    synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    strata::bench::OpProfile profile;
    for (int64_t i = 0; i < args.profile; ++i) {
      step();
      profile.reattach();  // after the callback the step's weight arrival installed
    }
    synchronize(device);
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double idle = profile.print(40, static_cast<int>(args.profile), wall_ms);
    if (idle >= 0) r["gpu_idle_share"] = idle;
  } else if (args.profile > 0) {
    for (int64_t i = 0; i < args.profile; ++i) step();
  }
  if (args.census > 0) {
    // Phase by phase (forward, backward, the engine's step), each over the census steps.
    const bool counts = engine->data_parallel_rank() == 0;
    const char* names[] = {"forward", "backward", "step"};
    for (int phase = 0; phase < 3; ++phase) {
      strata::bench::OpCensus census;
      census.stop();  // counting only inside its phase
      for (int64_t i = 0; i < args.census; ++i)
        for (int64_t m = 0; m < engine->gradient_accumulation_steps(); ++m)
          for (int p = 0; p < 3; ++p) {
            synchronize(device);
            if (p == phase && counts) census.resume();
            if (p == 0) loss = engine->forward(tokens, targets);
            if (p == 1) engine->backward(loss);
            if (p == 2) engine->step();
            synchronize(device);
            census.stop();
          }
      if (counts) {
        std::printf("=== census of the %s\n", names[phase]);
        census.print(30, static_cast<int>(args.census));
      }
    }
  }
  if (!moe_layers.empty()) {
    int64_t dropped = 0;
    for (auto* layer : moe_layers) dropped += layer->last().dropped_count();
    r["moe_dropped_route_fraction"] =
        double(dropped) / double(moe_layers.size() * batch * seq * cfg.top_k);
    r["ep_size"] = moe_layers.front()->options().ep_size;
  }
#if STRATA_BENCH_CUDA
  if (device.is_cuda() && engine->gradient_accumulation_steps() == 1) {
    // Where the peak lies: one more step, the caching allocator's peak in each phase and what
    // stays allocated at its end, beside the engine's own count of model states.
    const int index = device.index() < 0 ? 0 : device.index();
    auto allocated_now = [&] {
      return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current /
             double(1 << 30);
    };
    nlohmann::json phases;
    auto phase = [&](const char* name, auto&& body) {
      synchronize(device);
      reset_peak_memory(device);
      body();
      synchronize(device);
      phases[name] = {{"peak_GiB", peak_memory_gib(device)}, {"end_GiB", allocated_now()}};
    };
    torch::Tensor phase_loss;
    phase("forward", [&] { phase_loss = engine->forward(tokens, targets); });
    phase("backward", [&] { engine->backward(phase_loss); phase_loss = torch::Tensor(); });
    phase("step", [&] { engine->step(); });
    const auto states = engine->model_state_bytes();
    phases["model_states_GiB"] = {{"params", states.params / double(1 << 30)},
                                  {"grads", states.grads / double(1 << 30)},
                                  {"master", states.master / double(1 << 30)},
                                  {"optimizer", states.optimizer / double(1 << 30)}};
    r["memory_phases"] = phases;
  }
#endif
  if (const int64_t h2d = h2d1 - h2d0; h2d > 0) {
    // Against the parameters' own bytes: a unit comes over for the forward and again for each
    // backward that reads its weights.
    int64_t param_bytes = 0;
    for (const auto* u : unit_sets)
      param_bytes += u->partition().numel() * u->partition().element_size();
    const double per_step = double(h2d) / double(args.steps);
    r["param_offload"] = {{"h2d_GB_per_step", per_step / 1e9},
                          {"param_GB", double(param_bytes) / 1e9},
                          {"h2d_GB_s", per_step / dt / 1e9}};
    // The trainable units' bytes by how many times a step each came over (its gathers over the
    // timed steps), and the units that came fewer than twice (no backward reads their weights).
    std::map<std::string, double> by_travels;
    std::vector<std::string> fewer;
    size_t k = 0;
    for (const auto* u : unit_sets)
      for (size_t i = 0; i < u->size(); ++i, ++k) {
        const auto& unit = u->unit(i);
        if (!unit.trainable) continue;
        const double travels = double(gathers1[k] - gathers0[k]) / double(args.steps);
        by_travels[fmt::format("{:g}", travels)] +=
            double(unit.chunk * u->partition().element_size()) / 1e9;
        if (travels < 2) fewer.push_back(unit.name);
      }
    r["param_offload"]["param_GB_by_travels_per_step"] = by_travels;
    r["param_offload"]["units_travelling_less_than_twice"] = fewer;
  }
  if (nvme.read_bytes + nvme.written_bytes > 0) {
    // NVMe offload: this rank's disk traffic per step, and the time the step waited for it.
    const double n = double(args.steps);
    const double read = double(nvme.read_bytes - nvme0.read_bytes) / n;
    const double written = double(nvme.written_bytes - nvme0.written_bytes) / n;
    r["nvme_io"] = {{"read_GB_per_step", read / 1e9},
                    {"written_GB_per_step", written / 1e9},
                    {"GB_s", (read + written) / dt / 1e9},
                    {"read_wait_s_per_step", (nvme.read_wait_s - nvme0.read_wait_s) / n},
                    {"write_wait_s_per_step", (nvme.write_wait_s + nvme.wait_all_s -
                                               nvme0.write_wait_s - nvme0.wait_all_s) / n}};
  }
  if (engine->expert_window_bytes() > 0) {  // streamed experts: the last step's peak
    const auto& p = engine->stage3_expert_units()->partition();
    r["expert_window"] = {{"peak_GiB", double(engine->expert_bytes_peak()) / (1 << 30)},
                          {"window_GiB", double(engine->expert_window_bytes()) / (1 << 30)},
                          {"expert_param_GiB", double(p.numel() * p.element_size()) / (1 << 30)}};
  }
  if (const auto t = engine->last_offload_times()) {
    r["offload_ms"] = {{"wait", t->wait_ms}, {"norm", t->norm_ms}, {"cpu_step", t->step_ms},
                       {"forward_waits", t->forward_waits}, {"speculated", t->speculated},
                       {"redone", t->redone}};
    if (t->zenflow_updates > 0)
      // ZenFlow: the last window's CPU update and its wait for the sum's copy; the training
      // thread's waits for updates and the updates run, since the start (warm-up included).
      r["zenflow_ms"] = {{"cpu_update", t->zenflow_cpu_ms}, {"copy_wait", t->zenflow_copy_wait_ms},
                         {"stall_total", t->zenflow_stall_ms}, {"updates", t->zenflow_updates}};
  }
  r["grad_norm"] = engine->last_grad_norm();
  if (const auto* swapper = engine->optimizer_swapper()) {
    // The step's pass read and wrote the master and both moments once: 24 bytes per element.
    const auto& t = swapper->last_times();
    const double pass_ms = t.read_wait_ms + t.compute_ms + t.write_wait_ms;
    const double bytes = 2.0 * 3 * 4 * static_cast<double>(swapper->numel());
    r["nvme_swap"] = {{"read_wait_ms", t.read_wait_ms}, {"compute_ms", t.compute_ms},
                      {"write_wait_ms", t.write_wait_ms}, {"bytes_per_step", bytes},
                      {"GB_s", bytes / (pass_ms * 1e6)}};
  }
  if (engine->data_parallel_rank() == 0) {
    std::printf("%s\n", r.dump().c_str());
    std::fflush(stdout);  // a later run cut short by a time limit must not take this line with it
  }

  // The baseline: fp32 on one rank with Strata's AdamW, where a plain loop computes the same.
  const auto& c = engine->config();
  const auto* adam = dynamic_cast<const strata::optim::AdamOptions*>(
      &engine->optimizer().param_groups().at(0).options());
  if (engine->data_parallel_size() == 1 && !c.bf16.enabled && !c.fp16.enabled &&
      !c.torch_autocast.enabled && adam &&
      adam->adam_w_mode() && c.zero_optimization.stage == 0) {
    // Rounds that alternate the two loops, so that drift of the machine hits both alike; the
    // ratio is the median of the rounds' ratios.
    PlainLoop plain(cfg, device, *adam, c.gradient_clipping.value,
                    engine->gradient_accumulation_steps());
    auto plain_step = [&] { plain.step(tokens, targets); };
    seconds_per_step(plain_step, args.warmup, device);
    std::vector<double> ratios, plain_s;
    for (int round = 0; round < 3; ++round) {
      plain_s.push_back(seconds_per_step(plain_step, args.steps, device));
      ratios.push_back(plain_s.back() / seconds_per_step(step, args.steps, device));
    }
    std::sort(ratios.begin(), ratios.end());
    std::sort(plain_s.begin(), plain_s.end());
    nlohmann::json b = {{"name", "libtorch loop " + args.model + " AdamW"},
                        {"B", batch}, {"T", seq}, {"step_ms", plain_s[1] * 1e3},
                        {"tok_s", tok / plain_s[1]}, {"strata_over_plain", ratios[1]},
                        {"rounds", ratios}};
    std::printf("%s\n", b.dump().c_str());
  }
  // The stage-3 mechanism's cost beside stage 0 (not under offload, whose host step would be
  // counted as the mechanism's).
  if (engine->data_parallel_size() == 1 && c.zero_optimization.stage == 3 &&
      !engine->last_offload_times())
    compare_with_stage0(args, *engine, step, tok, device);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--version") {
    std::puts(strata::version_line());
    return 0;
  }
  try {
    if (argc >= 2 && std::string(argv[1]) == "adam") return strata::bench::run_adam(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "cpu-adam") return strata::bench::run_cpu_adam(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "nvme") return strata::bench::run_nvme(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "moe-dispatch")
      return strata::bench::run_moe_dispatch(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "a2a") return strata::bench::run_a2a(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "moe-ops") return strata::bench::run_moe_ops(argc, argv);
    if (argc >= 2 && std::string(argv[1]) == "hf") return strata::bench::run_hf(argc, argv);
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-bench: error: %s\n", e.what());
    return 1;
  }
}
