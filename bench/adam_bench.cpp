#include "bench/adam_bench.h"
#include "bench/bench_device.h"

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/optim/adam.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int64_t numel = 368'000'000;  // dense-350M's parameters (examples/gpt.h), padded
  int64_t steps = 20;
  std::string device;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--numel") a.numel = std::stoll(value);
    else if (flag == "--steps") a.steps = std::stoll(value);
    else if (flag == "--device") a.device = value;
    else throw Error("strata-bench adam: unknown option " + flag +
                     " (known: --numel N --steps N --device cuda|cpu)");
  }
  return a;
}

// Milliseconds per call of fn, after two warm-up calls.
double time_ms(const torch::Device& device, int64_t steps, const std::function<void()>& fn) {
  fn();
  fn();
  synchronize(device);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < steps; ++i) fn();
  synchronize(device);
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / steps;
}

}  // namespace

int run_adam(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const torch::Device device = bench_device(args.device);
  torch::NoGradGuard no_grad;
  const int64_t n = args.numel;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const auto options = optim::AdamOptions(1e-4).weight_decay(0.1);
  const double scale = 1.0 / 1024;  // an unscale factor, as under fp16
  nlohmann::json rows = nlohmann::json::array();
  auto report = [&](const std::string& name, double ms, double bytes_per_element) {
    rows.push_back({{"name", name}, {"numel", n}, {"ms", ms},
                    {"GB_s", bytes_per_element * double(n) / (ms * 1e-3) / 1e9}});
    std::printf("%s\n", rows.back().dump().c_str());
    std::fflush(stdout);
  };

  // The 16-bit gradient and model copy, the fp32 master (its moments live in the optimizer).
  auto grad16 = torch::randn({n}, f32).to(torch::kBFloat16);
  auto model16 = torch::empty({n}, f32.dtype(torch::kBFloat16));
  {
    auto master = torch::randn({n}, f32);
    optim::Adam adam({master}, options);
    // Reads master, m, v, grad16; writes master, m, v, model16: 4*3 + 2 + 4*3 + 2 bytes.
    const double fused = time_ms(device, args.steps, [&] { adam.step_flat(grad16, scale, model16); });
    report("strata fused flat Adam (bf16 grad in, bf16 copy out)", fused, 28);
    // What the partitioned optimizer did before the fused step: an fp32 copy of the gradient,
    // unscale, the per-tensor reference step, the copy into the 16-bit model.
    const double unfused = time_ms(device, args.steps, [&] {
      auto g = grad16.to(torch::kFloat);
      g.mul_(scale);
      master.mutable_grad() = g;
      adam.step();
      model16.copy_(master);
    });
    report("strata unfused (fp32 grad copy + per-tensor Adam ops + copy-out)", unfused, 28);
    rows.push_back({{"fused_speedup_vs_unfused", unfused / fused}});
    std::printf("%s\n", rows.back().dump().c_str());
  }
  {
    // LibTorch's own AdamW over an fp32 parameter with an fp32 gradient (what a plain fp32 or
    // autocast program steps): reads p, g, m, v; writes p, m, v.
    auto p = torch::randn({n}, f32);
    p.mutable_grad() = grad16.to(torch::kFloat);
#if STRATA_TORCH_AT_LEAST(2, 2)
    if (device.is_cuda()) {
      auto m = torch::zeros({n}, f32), v = torch::zeros({n}, f32);
      auto step = torch::zeros({}, f32);
      std::vector<at::Tensor> ps{p}, gs{p.grad()}, ms{m}, vs{v}, steps{step};
      const double torch_fused = time_ms(device, args.steps, [&] {
        step.add_(1);
        at::_fused_adamw_(ps, gs, ms, vs, {}, steps, 1e-4, 0.9, 0.999, 0.1, 1e-8,
                          /*amsgrad=*/false, /*maximize=*/false);
      });
      report("torch fused AdamW (at::_fused_adamw_, fp32 params and grads)", torch_fused, 28);
    }
#endif
    torch::optim::AdamW adamw({p}, torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
    const double torch_plain = time_ms(device, args.steps, [&] { adamw.step(); });
    report("torch::optim::AdamW (per-tensor ops, fp32)", torch_plain, 28);
  }
  return 0;
}

}  // namespace strata::bench
