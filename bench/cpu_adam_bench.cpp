// strata-bench cpu-adam [--numel N] [--runs R] [--threads T] [--bf16] [--alone]: the host tier's
// CPU Adam (offload/cpu_adam.h) on N fp32 parameters (fp32 gradient, no copy-out: reads p, g, m, v
// and writes p, m, v, 28 bytes per parameter; --bf16: a bf16 gradient and a bf16 copy-out, as the
// offloaded step of a bf16 model reads and writes, also 28 bytes) against
// torch::optim::AdamW::step on the same sizes, with 1 and 2 threads (--threads T: T only), and a
// STREAM triad (a = b + s c) measured in the same binary as the memory-bandwidth bound. Runs
// alternate between the contenders; each figure is the median of R runs. The last line is one
// JSON object: the 2-thread speedup over LibTorch's AdamW and the fraction of the triad's
// bandwidth. --alone times Strata's step only (no LibTorch AdamW, no triad): the CPU Adam over an
// offloaded partition's size, beside the training step it belongs to (bench/results.md, issue 55).
#include "bench/adam_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Fn>
double seconds(Fn&& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// a = b + s * c over n floats on `threads` threads: 12 bytes moved per element.
void triad(float* a, const float* b, const float* c, int64_t n, int threads) {
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> workers;
  auto range = [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) a[i] = b[i] + 3.f * c[i];
  };
  for (int t = 1; t < threads; ++t)
    workers.emplace_back(range, std::min(n, t * per), std::min(n, (t + 1) * per));
  range(0, std::min(n, per));
  for (auto& w : workers) w.join();
}

}  // namespace

int run_cpu_adam(int argc, char** argv) {
  int64_t n = 100'000'000;
  int runs = 5;
  std::vector<int> thread_counts = {1, 2};
  bool bf16 = false, alone = false;
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--bf16") { bf16 = true; continue; }
    if (flag == "--alone") { alone = true; continue; }
    if (i + 1 >= argc)
      throw Error("strata-bench cpu-adam: " + flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--numel") n = std::stoll(value);
    else if (flag == "--runs") runs = std::stoi(value);
    else if (flag == "--threads") thread_counts = {std::stoi(value)};
    else throw Error("strata-bench cpu-adam: unknown option " + flag +
                     " (known: --numel N --runs R --threads T --bf16 --alone)");
  }
  if (thread_counts.front() < 1) throw Error("strata-bench cpu-adam: --threads must be >= 1");
  if (n < 1 || runs < 1) throw Error("strata-bench cpu-adam: --numel and --runs must be >= 1");
  torch::NoGradGuard no_grad;
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01;

  // Strata's tensors and LibTorch's: the same sizes and values, stepped independently.
  auto p = torch::randn({n}), g = torch::randn({n}), m = torch::zeros({n}), v = torch::zeros({n});
  const auto g_type = bf16 ? offload::Float::kBF16 : offload::Float::kF32;
  if (bf16) g = g.to(torch::kBFloat16);
  auto out = bf16 ? torch::empty({n}, torch::kBFloat16) : torch::Tensor();
  // LibTorch's side and the triad's arrays (3 x n/2 floats, as much memory as Adam's tiles),
  // unless timing Strata's step alone.
  auto tp = alone ? torch::zeros({1}) : p.clone();
  tp.mutable_grad() = alone ? torch::zeros({1}) : g.to(torch::kFloat, false, true);
  torch::optim::AdamW adamw({tp}, torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(wd));
  const int64_t tn = alone ? 1 : n / 2;
  auto ta = torch::zeros({tn}), tb = torch::randn({tn}), tc = torch::randn({tn});

  int64_t step = 0;
  auto strata_step = [&](int threads) {
    ++step;
    optim::AdamScalars s;
    s.lr = float(lr);
    s.beta1 = float(beta1), s.beta2 = float(beta2), s.eps = float(eps), s.weight_decay = float(wd);
    s.one_minus_beta1 = float(1.0 - beta1), s.one_minus_beta2 = float(1.0 - beta2);
    s.decay_factor = float(1.0 - lr * wd);
    s.step_size = float(lr / (1.0 - std::pow(beta1, double(step))));
    s.sqrt_c2 = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
    offload::cpu_adam_step(p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                           g.data_ptr(), g_type, out.defined() ? out.data_ptr() : nullptr,
                           g_type, n, s, threads);
  };

  nlohmann::json last;
  std::printf("{\"isa\": \"%s\", \"numel\": %lld, \"runs\": %d, \"dtype\": \"%s\"}\n",
              offload::cpu_adam_isa(), (long long)n, runs, bf16 ? "bf16" : "fp32");
  for (int threads : thread_counts) {
    at::set_num_threads(threads);
    strata_step(threads);  // warm: first touch of every page
    adamw.step();
    triad(ta.data_ptr<float>(), tb.data_ptr<float>(), tc.data_ptr<float>(), tn, threads);
    std::vector<double> strata_s, torch_s, triad_s;
    if (alone) {
      for (int r = 0; r < runs; ++r) strata_s.push_back(seconds([&] { strata_step(threads); }));
      const double s = median(strata_s);
      last = {{"threads", threads}, {"strata_ms", s * 1e3}, {"strata_GB_s", 28.0 * double(n) / s / 1e9}};
      std::printf("%s\n", last.dump().c_str());
      continue;
    }
    for (int r = 0; r < runs; ++r) {
      strata_s.push_back(seconds([&] { strata_step(threads); }));
      torch_s.push_back(seconds([&] { adamw.step(); }));
      triad_s.push_back(seconds([&] {
        triad(ta.data_ptr<float>(), tb.data_ptr<float>(), tc.data_ptr<float>(), tn, threads);
      }));
    }
    const double s = median(strata_s), t = median(torch_s), tr = median(triad_s);
    const double adam_gbs = 28.0 * double(n) / s / 1e9, triad_gbs = 12.0 * double(tn) / tr / 1e9;
    last = {{"threads", threads},
            {"strata_ms", s * 1e3},
            {"libtorch_adamw_ms", t * 1e3},
            {"speedup_vs_libtorch_adamw", t / s},
            {"strata_GB_s", adam_gbs},
            {"stream_triad_GB_s", triad_gbs},
            {"fraction_of_stream_triad", adam_gbs / triad_gbs}};
    std::printf("%s\n", last.dump().c_str());
    std::fflush(stdout);
  }
  if (alone) return 0;
  std::printf("%s\n", nlohmann::json{{"speedup_vs_libtorch_adamw", last["speedup_vs_libtorch_adamw"]},
                                     {"fraction_of_stream_triad", last["fraction_of_stream_triad"]}}
                          .dump()
                          .c_str());
  return 0;
}

}  // namespace strata::bench
