// Helpers for the scenarios (scenarios.cpp, scenarios_calls.cpp): each rank's inputs are a known
// function of its rank, and every result is checked against a float64 value computed locally.
// STRATA_COMM_DEVICE=cuda puts the tensors on this rank's GPU (NCCL).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/env.h"
#include "runtime/error.h"

namespace strata::test {

using Clock = std::chrono::steady_clock;

inline bool on_cuda() {
  const char* d = std::getenv("STRATA_COMM_DEVICE");
  return d && std::string(d) == "cuda";
}

inline torch::Device device() {
  if (!on_cuda()) return torch::kCPU;
  return torch::Device(torch::kCUDA, comm::read_rank_env().local_rank);
}

inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Rank r's i-th input value: small integers, so sums stay exact in every dtype (uint8 too).
inline double val(int r, int64_t i) { return double((r * 7 + i * 3) % 11 + 1); }

inline torch::Tensor values(int r, int64_t n) {
  auto t = torch::empty({n}, torch::kDouble);
  auto a = t.accessor<double, 1>();
  for (int64_t i = 0; i < n; ++i) a[i] = val(r, i);
  return t;
}

inline torch::Tensor on_device(const torch::Tensor& t64, torch::ScalarType dt) {
  return t64.to(dt).to(device()).contiguous();
}

// Compares in logical element order, whatever the layout of `got`.
inline void expect_close(const torch::Tensor& got, const torch::Tensor& want,
                         const std::string& what) {
  check(got.numel() == want.numel(), what + ": numel " + std::to_string(got.numel()) + " vs " +
                                         std::to_string(want.numel()));
  auto g = got.cpu().to(torch::kDouble).reshape({-1});
  // The expectation goes through the result's dtype too (rounding of averages).
  auto w = want.to(got.scalar_type()).to(torch::kDouble).reshape({-1});
  const double tol = (got.scalar_type() == torch::kHalf || got.scalar_type() == torch::kBFloat16)
                         ? 2e-2
                         : 1e-6;
  auto diff = (g - w).abs() - tol * w.abs();
  if (g.numel() > 0 && diff.max().item<double>() > 1e-12) {
    std::ostringstream os;
    os << what << ": got " << g.slice(0, 0, 8) << " want " << w.slice(0, 0, 8);
    throw std::runtime_error("check failed: " + os.str());
  }
}

// Runs f, which must throw a strata::Error containing every needle; prints it as a MESSAGE.
template <class F>
std::string expect_error(F&& f, std::vector<std::string> needles, const std::string& what) {
  try {
    f();
  } catch (const strata::Error& e) {
    const std::string m = e.what();
    for (auto& n : needles)
      check(m.find(n) != std::string::npos,
            what + ": error lacks '" + n + "'. The error: " + m);
    std::cout << "MESSAGE: " << m << std::endl;
    return m;
  }
  throw std::runtime_error("check failed: " + what + ": no strata::Error was thrown");
}

}  // namespace strata::test
