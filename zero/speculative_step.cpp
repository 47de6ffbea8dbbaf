#include "zero/speculative_step.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"
#include "zero/host_copy.h"

namespace strata::zero {
namespace {

// `a` takes `b`'s bytes and `b` takes `a`'s; every holder of either tensor sees the change (the
// inner optimizer's parameter and state are these very tensors).
void swap_storage(torch::Tensor& a, torch::Tensor& b) {
  const auto storage = a.storage();
  const int64_t offset = a.storage_offset();
  const auto sizes = a.sizes().vec(), strides = a.strides().vec();
  a.set_(b.storage(), b.storage_offset(), b.sizes(), b.strides());
  b.set_(storage, offset, sizes, strides);
}

}  // namespace

SpeculativeStep::SpeculativeStep(std::vector<Item> items) : items_(std::move(items)) {
  by_part_.resize(items_.size());
  for (size_t k = 0; k < items_.size(); ++k) by_part_[k] = k;
  std::sort(by_part_.begin(), by_part_.end(),
            [&](size_t a, size_t b) { return items_[a].part < items_[b].part; });
  for (size_t k : by_part_) starts_.push_back(items_[k].part);
  state_.assign(items_.size(), State::kWaiting);
  landed_.resize(items_.size());
}

SpeculativeStep::~SpeculativeStep() {
  try {
    cancel();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[strata] error: the speculative optimizer step failed at exit: %s\n",
                 e.what());
  }
}

int64_t SpeculativeStep::shadow_bytes() const {
  return shadow_master_.defined() ? 3 * shadow_master_.numel() * 4 : 0;
}

void SpeculativeStep::begin(const Arrays& arrays, const optim::AdamScalars& assumed, int threads,
                            std::function<void()> out_free) {
  // A committed step is the state now: it is finished, never cut short.
  if (committed()) finish();
  else cancel();
  const int64_t n = arrays.master.numel();
  for (const auto* t : {&arrays.master, &arrays.exp_avg, &arrays.exp_avg_sq})
    if (!t->is_cpu() || t->scalar_type() != torch::kFloat || !t->is_contiguous() || t->numel() != n)
      throw Error("SpeculativeStep: the master and moments must be contiguous fp32 host tensors "
                  "of one size");
  int64_t covered = 0;
  for (const auto& item : items_) covered += item.n;
  if (covered > n || arrays.grad.numel() != n || arrays.out.numel() != n)
    throw Error(fmt::format("SpeculativeStep: items cover {} elements, the partition has {}",
                            covered, n));
  if (!shadow_master_.defined() || shadow_master_.numel() != n) {
    // Copies, not empty arrays: elements no item covers (a bucket's padding past its end, the
    // share kept on the device) are never written by the step, and after a commit they are the
    // state's: padding stays zero; the device share's host copy is refreshed before it is read.
    shadow_master_ = arrays.master.clone();
    shadow_exp_avg_ = arrays.exp_avg.clone();
    shadow_exp_avg_sq_ = arrays.exp_avg_sq.clone();
  }
  arrays_ = arrays;
  assumed_ = assumed;
  out_free_ = std::move(out_free);
  threads_ = std::max(1, threads);
  std::fill(state_.begin(), state_.end(), State::kWaiting);
  std::fill(landed_.begin(), landed_.end(), std::function<void()>());
  arrived_ = added_ = stepped_ = 0;
  cancel_ = false;
  failure_ = nullptr;
  step_ms_ = 0;
  committed_ = false;
  running_ = true;
  worker_ = std::thread([this] { run(); });
}

void SpeculativeStep::arrive(int64_t part, int64_t n, std::function<void()> landed) {
  if (!pending()) return;
  auto it = std::lower_bound(starts_.begin(), starts_.end(), part);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (; it != starts_.end() && *it < part + n; ++it) {
      const size_t k = by_part_[size_t(it - starts_.begin())];
      if (items_[k].part + items_[k].n > part + n)
        throw Error(fmt::format("SpeculativeStep: a gradient piece [{}, {}) ends inside item [{}, {})",
                                part, part + n, items_[k].part, items_[k].part + items_[k].n));
      if (state_[k] != State::kWaiting) continue;  // a second delivery of the same piece
      state_[k] = State::kArrived;
      landed_[k] = landed;
      ++arrived_;
    }
  }
  cv_.notify_all();
}

void SpeculativeStep::run() {
  torch::NoGradGuard no_grad;
  // (No at::set_num_threads here: it sets the process's count, not this thread's.)
  // Raw pointers taken now: commit() swaps the tensors' storages while the worker goes on.
  float* in_p = arrays_.master.data_ptr<float>();
  float* in_m = arrays_.exp_avg.data_ptr<float>();
  float* in_v = arrays_.exp_avg_sq.data_ptr<float>();
  float* to_p = shadow_master_.data_ptr<float>();
  float* to_m = shadow_exp_avg_.data_ptr<float>();
  float* to_v = shadow_exp_avg_sq_.data_ptr<float>();
  const auto* g = static_cast<const char*>(arrays_.grad.data_ptr());
  auto* out = static_cast<char*>(arrays_.out.data_ptr());
  const int64_t g_size = arrays_.grad.element_size(), out_size = arrays_.out.element_size();
  const auto g_type = host_float(arrays_.grad), out_type = host_float(arrays_.out);
  const int64_t total = int64_t(items_.size());
  try {
    for (;;) {
      size_t k = 0;
      bool add = false;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        auto find = [&](State s) {
          for (size_t i = 0; i < state_.size(); ++i)
            if (state_[i] == s) return i;
          return state_.size();
        };
        cv_.wait(lock, [&] {
          return cancel_ || stepped_ == total || find(State::kArrived) < state_.size() ||
                 find(State::kAdded) < state_.size();
        });
        if (cancel_ || stepped_ == total) return;
        // Landing and adding first (cheap, and the gradient's norm waits for them), then the
        // first arrived item in the preferred order.
        k = find(State::kArrived);
        add = k < state_.size();
        if (!add) k = find(State::kAdded);
        state_[k] = add ? State::kArrived : State::kStepping;
      }
      const auto& item = items_[k];
      if (add) {
        if (landed_[k]) landed_[k]();
        if (arrays_.arriving.defined())
          arrays_.grad.narrow(0, item.part, item.n).add_(arrays_.arriving.narrow(0, item.part, item.n));
      } else {
        if (out_free_) {  // last step's copies out of `out` are done before it is rewritten
          out_free_();
          out_free_ = nullptr;
        }
        const auto t0 = std::chrono::steady_clock::now();
        const int64_t o = item.part;
        offload::cpu_adam_step_to({in_p + o, in_m + o, in_v + o}, {to_p + o, to_m + o, to_v + o},
                                  g + o * g_size, g_type, out + o * out_size, out_type, item.n,
                                  assumed_, threads_);
        step_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        state_[k] = add ? State::kAdded : State::kStepped;
        ++(add ? added_ : stepped_);
      }
      cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = std::current_exception();
    cancel_ = true;
  }
  cv_.notify_all();
}

void SpeculativeStep::wait_gradient() {
  if (!pending()) throw Error("SpeculativeStep::wait_gradient: no speculative step in flight");
  std::unique_lock<std::mutex> lock(mutex_);
  if (arrived_ < int64_t(items_.size())) {
    for (size_t k = 0; k < items_.size(); ++k)
      if (state_[k] == State::kWaiting)
        throw Error(fmt::format("SpeculativeStep: the gradient of partition elements [{}, {}) never "
                                "arrived before the step",
                                items_[k].part, items_[k].part + items_[k].n));
  }
  cv_.wait(lock, [&] { return added_ == int64_t(items_.size()) || failure_; });
  if (failure_) std::rethrow_exception(failure_);
}

void SpeculativeStep::commit() {
  if (!pending()) throw Error("SpeculativeStep::commit: no speculative step in flight");
  swap_storage(arrays_.master, shadow_master_);
  swap_storage(arrays_.exp_avg, shadow_exp_avg_);
  swap_storage(arrays_.exp_avg_sq, shadow_exp_avg_sq_);
  committed_ = true;
}

void SpeculativeStep::wait_item(size_t k) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return state_.at(k) == State::kStepped || failure_ || cancel_; });
  if (failure_) std::rethrow_exception(failure_);
  if (state_[k] != State::kStepped)
    throw Error("SpeculativeStep::wait_item: the step was dropped before this item was stepped");
}

void SpeculativeStep::join() {
  if (worker_.joinable()) worker_.join();
  running_ = false;
  if (failure_) {
    auto failure = failure_;
    failure_ = nullptr;
    std::rethrow_exception(failure);
  }
}

void SpeculativeStep::finish() {
  if (!running_) return;
  if (!committed_) {
    cancel();
    return;
  }
  join();
}

void SpeculativeStep::cancel() {
  if (!running_) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancel_ = true;
  }
  cv_.notify_all();
  join();
}

}  // namespace strata::zero
