// strata-bench moe-dispatch: the memory of one MoE layer's forward + backward (64 experts, top-2,
// 16k tokens by default) at several token counts, beside what DeepSpeed's dense dispatch would
// hold: its combine weights [S, E, C] (fp32) and dispatch mask [S, E, C] (bool), 5 S E C bytes,
// which grows as S^2 (C grows with S). Strata's permutation dispatch grows as S k d. Memory is
// the GPU allocator's peak above what existed before the call (on the CPU only the time).
//   strata-bench moe-dispatch [--experts 64] [--tokens 16384] [--hidden 1024] [--ffn 1024]
//                             [--k 2] [--device cuda|cpu]
// strata-bench a2a: the bandwidth of the equal-split all_to_all that MoE dispatch uses, through
// Strata's process group (NCCL on GPUs), at nccl_bw.py's sizes and its bus-bandwidth formula, so
// the two print side by side. Run it under strata-run on every rank.
//   strata-run --num_gpus 2 -- strata-bench a2a [--sizes-mib 16,64,256,1024] [--iters 20]
// strata-bench moe-ops: one MoE layer's forward + backward (by default moe-ds's: 64 experts of
// FFN 512, top-6, sigmoid + bias, 2 shared experts, dropless, 8 x 2048 tokens of width 1024),
// counted op by op (bench/op_census.h): the kernels and bytes of everything that is not a matrix
// product, beside the products'. On the CPU the grouped kernel's loop stands in for _grouped_mm,
// so the dispatch around it is the GPU's.
//   strata-bench moe-ops [--experts 64] [--k 6] [--hidden 1024] [--ffn 512] [--shared 2]
//                        [--tokens 16384] [--seq 2048] [--reps 1] [--top 30] [--device cpu|cuda]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#if STRATA_BENCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "bench/bench_device.h"
#include "bench/op_census.h"
#include "comm/process_group.h"
#include "moe/gate.h"
#include "moe/layer.h"
#include "runtime/error.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

int64_t flag_value(int argc, char** argv, const std::string& name, int64_t fallback) {
  for (int i = 2; i + 1 < argc; ++i)
    if (argv[i] == name) return std::stoll(argv[i + 1]);
  return fallback;
}

std::string flag_text(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 2; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

// The device allocator's peak and current bytes (GPU); the CPU allocator keeps no such count, so
// on the CPU the memory is not measured (-1).
int64_t peak_bytes(const torch::Device& device) {
#if STRATA_BENCH_CUDA
  if (device.is_cuda())
    return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak;
#endif
  return -1;
}

int64_t current_bytes(const torch::Device& device) {
#if STRATA_BENCH_CUDA
  if (device.is_cuda())
    return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
#endif
  return 0;
}

void reset_peak(const torch::Device& device) {
#if STRATA_BENCH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}

}  // namespace

int run_moe_dispatch(int argc, char** argv) {
  const int64_t E = flag_value(argc, argv, "--experts", 64);
  const int64_t max_tokens = flag_value(argc, argv, "--tokens", 16384);
  const int64_t d = flag_value(argc, argv, "--hidden", 1024);
  const int64_t f = flag_value(argc, argv, "--ffn", 1024);
  const int64_t k = flag_value(argc, argv, "--k", 2);
  const auto device = bench_device(flag_text(argc, argv, "--device", ""));
  const auto dtype = device.is_cuda() ? torch::kBFloat16 : torch::kFloat;
  moe::MoEOptions o(d, f, E);
  o.k = k;
  o.capacity_factor = 1.0;
  o.min_capacity = 4;
  moe::MoE layer(o);
  layer->to(device, dtype);
  // Token counts up to --tokens, smallest first (on the CPU the peak only grows).
  std::vector<int64_t> counts;
  for (int64_t s = max_tokens / 4; s <= max_tokens; s *= 2) counts.push_back(s);
  for (const int64_t S : counts) {
    auto x = torch::randn({S, d}, torch::TensorOptions().device(device).dtype(dtype))
                 .requires_grad_(true);
    synchronize(device);
    reset_peak(device);
    const int64_t before = current_bytes(device);
    const auto t0 = Clock::now();
    auto y = layer->forward(x);
    (y.to(torch::kFloat).square().mean() + layer->loss()).backward();
    synchronize(device);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    const int64_t peak = device.is_cuda() ? peak_bytes(device) - before : -1;
    const int64_t C = moe::gate_capacity(S, E, o.capacity_factor * k, o.min_capacity);
    const double dense_mask = 5.0 * double(S) * double(E) * double(C);
    const double per_route_row = double(peak) / double(S * k * d * c10::elementSize(dtype));
    nlohmann::json r = {{"name", "moe dispatch memory"},
                        {"device", device.str()},
                        {"experts", E},
                        {"tokens", S},
                        {"k", k},
                        {"hidden", d},
                        {"ffn", f},
                        {"capacity", C},
                        {"dense_mask_bytes_deepspeed", dense_mask},
                        {"ms", ms}};
    if (peak >= 0) {
      r["peak_bytes_forward_backward"] = peak;
      r["peak_over_tokens_k_d_elements"] = per_route_row;
      r["peak_over_dense_mask"] = double(peak) / dense_mask;
    }
    std::printf("%s\n", r.dump().c_str());
    x.mutable_grad() = torch::Tensor();
  }
  return 0;
}

int run_moe_ops(int argc, char** argv) {
  const int64_t E = flag_value(argc, argv, "--experts", 64);
  const int64_t k = flag_value(argc, argv, "--k", 6);
  const int64_t d = flag_value(argc, argv, "--hidden", 1024);
  const int64_t f = flag_value(argc, argv, "--ffn", 512);
  const int64_t shared = flag_value(argc, argv, "--shared", 2);
  const int64_t S = flag_value(argc, argv, "--tokens", 16384);
  const int64_t T = flag_value(argc, argv, "--seq", 2048);
  const int64_t reps = flag_value(argc, argv, "--reps", 1);
  const int64_t top = flag_value(argc, argv, "--top", 30);
  const auto device = bench_device(flag_text(argc, argv, "--device", ""));
  const auto dtype = device.is_cuda() ? torch::kBFloat16 : torch::kFloat;
  if (S % T != 0) throw Error(fmt::format("moe-ops: --tokens {} is not a multiple of --seq {}", S, T));
  moe::MoEOptions o(d, f, E);
  o.k = k;
  o.score_func = moe::ScoreFunc::Sigmoid;
  o.bias_update_speed = 1e-3;
  o.n_shared_experts = shared;
  o.drop_tokens = false;
  o.aux_loss_coef = 0.0;
  o.expert_bias = false;
  moe::MoE layer(o);
  layer->to(device, dtype);
  layer->experts->set_kernel(moe::ExpertKernel::Grouped);  // the GPU's path, on any device
  const auto x = torch::randn({S / T, T, d}, torch::TensorOptions().device(device).dtype(dtype))
                     .requires_grad_(true);
  auto step = [&] {
    // Gradients start unset, as after the engine's step: backward writes them, adds nothing.
    for (auto& p : layer->parameters()) p.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    auto y = layer->forward(x);
    (y.to(torch::kFloat).square().mean() + layer->loss()).backward();
  };
  step();  // warm-up: first-call allocations and lazy initialisation are not counted
  synchronize(device);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < reps; ++i) step();
  synchronize(device);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / reps;
  OpCensus census;
  step();
  synchronize(device);
  census.stop();
  const auto mem = census.memory_total(), prod = census.products_total();
  nlohmann::json r = {{"name", "moe layer ops (forward + backward)"}, {"device", device.str()},
                      {"experts", E}, {"k", k}, {"hidden", d}, {"ffn", f}, {"shared", shared},
                      {"tokens", S}, {"ms", ms},
                      {"memory_ops_calls", mem.calls}, {"memory_ops_MB", mem.bytes / 1e6},
                      {"host_syncs", census.memory_ops().count("aten::_local_scalar_dense")
                                         ? census.memory_ops().at("aten::_local_scalar_dense").calls
                                         : 0},
                      {"product_calls", prod.calls}, {"product_MB", prod.bytes / 1e6}};
  std::printf("%s\n", r.dump().c_str());
  census.print(static_cast<int>(top), 1);
  return 0;
}

int run_a2a(int argc, char** argv) {
  auto world = comm::init_process_group();
  const auto device = bench_device(flag_text(argc, argv, "--device", ""));
  const int64_t iters = flag_value(argc, argv, "--iters", 20);
  std::vector<int64_t> sizes;
  std::stringstream list(flag_text(argc, argv, "--sizes-mib", "16,64,256,1024"));
  for (std::string item; std::getline(list, item, ',');) sizes.push_back(std::stoll(item));
  const int n = world->size();
  for (const int64_t mib : sizes) {
    const int64_t numel = mib * (1 << 20) / 2;  // bf16, as nccl_bw.py
    auto x = torch::randn({numel}, torch::TensorOptions().device(device).dtype(torch::kBFloat16));
    auto y = torch::empty_like(x);
    for (int i = 0; i < 5; ++i) world->all_to_all_single(y, x);
    synchronize(device);
    world->barrier();
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < iters; ++i) world->all_to_all_single(y, x);
    synchronize(device);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count() / double(iters);
    const double algbw = double(numel * 2) / dt / 1e9;
    const double busbw = algbw * (n - 1) / n;
    if (world->rank() == 0) {
      nlohmann::json r = {{"name", "strata all_to_all"}, {"ranks", n},     {"mib", mib},
                          {"us", dt * 1e6},              {"algbw_GBs", algbw}, {"busbw_GBs", busbw}};
      std::printf("%s\n", r.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace strata::bench
