#include "bench/op_profile.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/record_function.h>

#if STRATA_BENCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace strata::bench {

#if STRATA_BENCH_CUDA
namespace {

struct Span {
  std::string name;
  std::shared_ptr<at::cuda::CUDAEvent> start, end;
};

std::mutex g_mutex;
std::vector<Span>* g_spans = nullptr;

struct Context : at::ObserverContext {
  std::shared_ptr<at::cuda::CUDAEvent> start;
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  auto ctx = std::make_unique<Context>();
  ctx->start = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  ctx->start->record();
  return ctx;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  auto* ctx = static_cast<Context*>(raw);
  auto end = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  end->record();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_spans) g_spans->push_back({fn.name(), ctx->start, end});
}

}  // namespace

struct OpProfile::State {
  std::vector<Span> spans;
  at::CallbackHandle handle = 0;
};

OpProfile::OpProfile() : state_(std::make_unique<State>()) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_spans = &state_->spans;
  }
  state_->handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_start, &on_end)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

void OpProfile::reattach() {
  if (state_->handle) at::removeCallback(state_->handle);
  state_->handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_start, &on_end)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

OpProfile::~OpProfile() {
  if (state_->handle) at::removeCallback(state_->handle);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_spans == &state_->spans) g_spans = nullptr;
}

double OpProfile::print(int top, int steps, double wall_ms) {
  at::removeCallback(state_->handle);
  state_->handle = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_spans = nullptr;
  }
  std::map<std::string, std::pair<double, int64_t>> by_name;
  std::vector<std::pair<double, double>> intervals;  // ms after the first op's start
  for (const auto& s : state_->spans) {
    s.end->synchronize();
    auto& entry = by_name[s.name];
    entry.first += s.start->elapsed_time(*s.end);
    entry.second += 1;
    const auto& origin = *state_->spans.front().start;
    intervals.emplace_back(origin.elapsed_time(*s.start), origin.elapsed_time(*s.end));
  }
  // The union of the intervals: the time some recorded op was running.
  std::sort(intervals.begin(), intervals.end());
  double busy = 0, lo = 0, hi = -1;
  for (const auto& [a, b] : intervals) {
    if (a > hi) {
      if (hi > lo) busy += hi - lo;
      lo = a;
      hi = b;
    } else {
      hi = std::max(hi, b);
    }
  }
  if (hi > lo) busy += hi - lo;
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::printf("op profile (GPU ms per step, inclusive; calls per step):\n");
  for (int i = 0; i < top && i < static_cast<int>(rows.size()); ++i)
    std::printf("  %9.3f ms %7.1f  %s\n", rows[i].second.first / steps,
                double(rows[i].second.second) / steps, rows[i].first.c_str());
  if (wall_ms <= 0) return -1;
  const double idle = std::max(0.0, 1.0 - busy / wall_ms);
  std::printf("GPU busy %.1f of %.1f ms per step: idle share %.3f\n", busy / steps, wall_ms / steps,
              idle);
  return idle;
}

#else

struct OpProfile::State {};
OpProfile::OpProfile() = default;
OpProfile::~OpProfile() = default;
void OpProfile::reattach() {}
double OpProfile::print(int, int, double) {
  std::printf("op profile: GPU builds only\n");
  return -1;
}

#endif

}  // namespace strata::bench
