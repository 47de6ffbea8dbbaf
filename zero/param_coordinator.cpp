#include "zero/param_coordinator.h"

#include <algorithm>

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>

#include "runtime/error.h"
#include "runtime/log.h"

namespace strata::zero {
namespace {

// RecordFunction callbacks are plain function pointers: one callback serves every live
// coordinator, listed here. It is installed with the first and removed with the last. Every op
// reads the list: it reads an immutable snapshot, replaced (under the mutex) when the list
// changes, instead of copying the list under a global lock.
using Registry = std::vector<ParamCoordinator*>;
std::mutex g_registry_mutex;
Registry& registry() {
  static Registry coordinators;
  return coordinators;
}
std::shared_ptr<const Registry> g_snapshot = std::make_shared<const Registry>();
void publish_registry() { std::atomic_store(&g_snapshot, std::make_shared<const Registry>(registry())); }
at::CallbackHandle g_callback = 0;
size_t g_paused = 0;  // coordinators that asked for the callback to be off

// The units an op holds while it runs: ops run inside ops (addmm copies its bias into the
// output before it multiplies), and a unit the outer op reads must outlive the inner ones.
struct Holds : at::ObserverContext {
  std::vector<std::pair<ParamCoordinator*, std::vector<size_t>>> held;
};

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  const auto live = std::atomic_load(&g_snapshot);
  std::unique_ptr<Holds> holds;
  for (auto* c : *live) {
    auto held = c->on_op(fn);
    if (held.empty()) continue;
    if (!holds) holds = std::make_unique<Holds>();
    holds->held.emplace_back(c, std::move(held));
  }
  return holds;
}

void release_holds(const at::RecordFunction&, at::ObserverContext* context) {
  if (auto* holds = static_cast<Holds*>(context))
    for (auto& [c, units] : holds->held) c->on_op_end(units);
}

// The units an op reads. Persistent ones are always whole: reading them is no move to another
// unit (a block's own LayerNorm between its matrices must not release the block).
void add_units_of(const at::Tensor& t, const ParamUnits& units, std::vector<size_t>& out) {
  if (!t.defined() || !t.has_storage()) return;
  const int64_t u = units.unit_of(t.storage().unsafeGetStorageImpl());
  if (u >= 0 && !units.unit(size_t(u)).persistent &&
      std::find(out.begin(), out.end(), size_t(u)) == out.end())
    out.push_back(size_t(u));
}

// FNV-1a over the gathered units' ids, sizes and layouts (which parameters, at which offsets: a
// unit of the same id and size laid out differently on two ranks would mix their weights).
uint64_t fingerprint(const std::vector<int32_t>& record, const ParamUnits& units) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (int32_t u : record) {
    mix(uint64_t(u));
    mix(uint64_t(units.unit(size_t(u)).numel));
    mix(units.unit(size_t(u)).layout_digest);
  }
  return h >> 1;  // fits a non-negative int64
}

}  // namespace

ParamCoordinator::ParamCoordinator(std::shared_ptr<ParamUnits> units, comm::GroupPtr group,
                                   CoordinatorOptions options)
    : units_(std::move(units)),
      group_(group && group->size() > 1 ? std::move(group) : nullptr),
      pinned_(units_->size(), false),
      options_(options),
      inflight_(units_->size()),
      prefetched_(units_->size(), false) {
  units_->reset_gathered_peak();
  held_.assign(units_->size(), 0);
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  registry().push_back(this);
  publish_registry();
  if (registry().size() == 1)
    g_callback = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_op_start, &release_holds)
            .needsInputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

ParamCoordinator::~ParamCoordinator() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto& r = registry();
  r.erase(std::remove(r.begin(), r.end(), this), r.end());
  publish_registry();
  if (paused_) --g_paused;
  if (r.empty()) {
    at::removeCallback(g_callback);
    g_callback = 0;
  }
}

void ParamCoordinator::pause() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (paused_) return;
  paused_ = true;
  if (++g_paused == registry().size()) at::disableCallback(g_callback);
}

void ParamCoordinator::resume() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (!paused_) return;
  paused_ = false;
  if (g_paused-- == registry().size()) at::reenableCallback(g_callback);
}

void ParamCoordinator::on_op_end(const std::vector<size_t>& held) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t u : held) --held_[u];
}

ParamCoordinator::Scope::Scope(ParamCoordinator* c, Phase phase) : c_(c) {
  std::lock_guard<std::mutex> lock(c_->mutex_);
  previous_ = c_->phase_;
  c_->phase_ = phase;
}

ParamCoordinator::Scope::~Scope() {
  if (!c_) return;
  std::lock_guard<std::mutex> lock(c_->mutex_);
  c_->phase_ = previous_;
}

std::vector<size_t> ParamCoordinator::on_op(const at::RecordFunction& fn) {
  ops_seen_.fetch_add(1, std::memory_order_relaxed);
  if (paused_) return {};
  std::vector<size_t> touched;
  for (const auto& input : fn.inputs()) {
    if (input.isTensor()) {
      add_units_of(input.toTensor(), *units_, touched);
    } else if (input.isTensorList()) {
      for (const at::Tensor& t : input.toTensorList().vec()) add_units_of(t, *units_, touched);
    }
  }
  if (touched.empty()) return touched;
  std::lock_guard<std::mutex> lock(mutex_);
  ops_on_units_.fetch_add(1, std::memory_order_relaxed);
  if (phase_ == Phase::kIdle && group_) {
    // No collective the other ranks never join: poison the bytes and report.
    for (size_t u : touched)
      if (!units_->unit(u).gathered)
        fail(fmt::format("'{}' (ZeRO-3 unit '{}') was read by {} outside the engine's forward "
                         "and backward; its parameters are partitioned across the ranks, and "
                         "gathering them takes every rank. Read parameters inside "
                         "engine->forward(), or in a gathered-parameters scope "
                         "(engine->gathered_parameters()) entered on every rank",
                         units_->unit(u).names.front(), units_->unit(u).name, fn.name()),
             u);
    return hold(touched);
  }
  if (phase_ == Phase::kGathered || (phase_ == Phase::kIdle && !group_)) {
    // The program's own reads of gathered weights (or, alone, of any): not the model's run, so
    // neither a use to trace nor a reason to release anything.
    for (size_t u : touched) {
      finish_prefetch(u);
      if (units_->unit(u).gathered) continue;
      try {
        units_->gather(u);
      } catch (const std::exception& e) {
        fail(fmt::format("ZeRO-3 could not gather unit '{}' for {}: {}", units_->unit(u).name,
                         fn.name(), e.what()),
             u);
      }
    }
    return hold(touched);
  }
  std::vector<size_t> fresh;  // units this op brings into use
  for (size_t u : touched)
    if (std::find(current_.begin(), current_.end(), u) == current_.end()) {
      follow(u);
      fresh.push_back(u);
    }
  // The units this op does not read, and no op still running holds: their use is over for now.
  // Released before the new units are gathered, so that the gathered bytes never hold both.
  release_idle(touched);
  for (size_t u : fresh) bring(u, fn.name());
  current_ = touched;
  if (on_trace_) prefetch();
  return hold(touched);
}

std::vector<size_t> ParamCoordinator::hold(std::vector<size_t> touched) {
  for (size_t u : touched) ++held_[u];
  return touched;
}

void ParamCoordinator::bring(size_t u, const char* op) {
  if (inflight_[u]) {
    finish_prefetch(u);
  } else if (!units_->unit(u).gathered) {
    try {
      units_->gather(u);
      ++gathers_;
    } catch (const std::exception& e) {
      fail(fmt::format("ZeRO-3 could not gather unit '{}' ({} elements) for {}: {}",
                       units_->unit(u).name, units_->unit(u).numel, op, e.what()),
           u);
    }
  }
}

void ParamCoordinator::follow(size_t u) {
  set_prefetched(u, false);
  record_.push_back(int32_t(u));
  micro_.push_back(int32_t(u));
  if (!on_trace_) return;
  if (pos_ < trace_.size() && trace_[pos_] == int32_t(u)) {
    ++pos_;
    return;
  }
  on_trace_ = false;
  // What was gathered ahead along the trace waits for uses that may not come (a streamed expert
  // unit no token reaches in this micro-step): no longer kept, so that release_idle frees it
  // before u is gathered, and the gathered units stay within the live bound.
  for (size_t v = 0; v < prefetched_.size(); ++v)
    if (prefetched_[v]) set_prefetched(v, false);
  // Said once: a model whose order changes every micro-step (streamed experts that no token
  // reaches in some) would say it every time.
  if (left_trace_++ > 0) return;
  log::info("[strata] ZeRO-3: use {} of this micro-step is unit '{}' where the recorded order has "
            "{}; gathering on use from here, and recording the new order (said once; "
            "trace_departures() counts them)",
            micro_.size(), units_->unit(u).name,
            pos_ < trace_.size() ? "'" + units_->unit(size_t(trace_[pos_])).name + "'"
                                 : std::string("nothing more"));
}

bool ParamCoordinator::kept_for_reuse(size_t u) const {
  if (prefetched_[u]) return true;  // gathered ahead of its use
  if (!on_trace_ || options_.max_reuse_distance <= 0) return false;
  // Its next use at or after pos_, and the elements used before it from pos_ on.
  const auto& at = trace_uses_[u];
  const auto next = std::lower_bound(at.begin(), at.end(), pos_);
  return next != at.end() &&
         trace_prefix_[*next] - trace_prefix_[pos_] <= options_.max_reuse_distance;
}

void ParamCoordinator::set_prefetched(size_t u, bool ahead) {
  if (prefetched_[u] == ahead) return;
  prefetched_[u] = ahead;
  ahead_numel_ += ahead ? units_->unit(u).numel : -units_->unit(u).numel;
}

void ParamCoordinator::index_trace() {
  trace_uses_.assign(units_->size(), {});
  trace_prefix_.assign(trace_.size() + 1, 0);
  for (size_t k = 0; k < trace_.size(); ++k) {
    trace_uses_[size_t(trace_[k])].push_back(k);
    trace_prefix_[k + 1] = trace_prefix_[k] + units_->unit(size_t(trace_[k])).numel;
  }
}

void ParamCoordinator::finish_prefetch(size_t u) {
  if (!inflight_[u]) return;
  auto work = std::move(inflight_[u]);
  at::DisableRecordFunctionGuard no_callbacks;
  try {
    work->wait();
  } catch (const std::exception& e) {
    fail(fmt::format("ZeRO-3 could not gather unit '{}' ({} elements) ahead of its use: {}",
                     units_->unit(u).name, units_->unit(u).numel, e.what()),
         u);
  }
}

void ParamCoordinator::release_idle(const std::vector<size_t>& in_use) {
  // A copy of the live list, which release_unit changes.
  const std::vector<size_t> live = units_->live_units();
  for (size_t v : live)
    if (!pinned_[v] && held_[v] == 0 && std::find(in_use.begin(), in_use.end(), v) == in_use.end() &&
        !kept_for_reuse(v))
      release_unit(v);
}

void ParamCoordinator::release_unit(size_t u) {
  finish_prefetch(u);  // its bytes may still be being written
  set_prefetched(u, false);
  units_->release(u);
}

void ParamCoordinator::prefetch() {
  if (options_.prefetch_numel <= 0) return;
  int64_t ahead = ahead_numel_, live = units_->live_numel();
  // Not across the turn: backward's first units would sit through the loss, the step's peak.
  const size_t end = phase_ == Phase::kForward ? std::min(trace_turn_, trace_.size()) : trace_.size();
  for (size_t k = pos_; k < end; ++k) {
    const size_t v = size_t(trace_[k]);
    const auto& unit = units_->unit(v);
    if (unit.gathered) continue;
    // As DeepSpeed: the bucket bounds what joins gathers already in flight, so a unit larger
    // than the bucket (an MoE layer's experts) is still fetched ahead when nothing else is.
    if ((ahead > 0 && ahead + unit.numel > options_.prefetch_numel) ||
        live + unit.numel > options_.max_live_numel)
      break;
    try {
      inflight_[v] = units_->gather_async(v);
    } catch (const std::exception& e) {
      fail(fmt::format("ZeRO-3 could not launch the gather of unit '{}': {}", unit.name, e.what()), v);
      return;
    }
    set_prefetched(v, true);
    ++gathers_;
    ++prefetches_;
    ahead += unit.numel;
    live += unit.numel;
  }
}

void ParamCoordinator::end_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  micro_turn_ = micro_.size();
  release_idle({});
  // Backward's first use is a use of its own, kept or not, so that every micro-step records the
  // same uses.
  current_.clear();
}

void ParamCoordinator::end_micro_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!on_trace_ || pos_ != trace_.size()) {
    trace_ = micro_;
    trace_turn_ = micro_turn_;
    index_trace();
  }
  micro_turn_ = SIZE_MAX;
  micro_.clear();
  pos_ = 0;
  on_trace_ = !trace_.empty() && options_.prefetch_numel + options_.max_reuse_distance > 0;
  current_.clear();
}

void ParamCoordinator::fail(const std::string& message, size_t unit) {
  // The op runs anyway (callbacks cannot stop it): give it bytes, NaN, so nothing reads freed
  // memory and nothing looks like a trained weight.
  units_->poison(unit);
  if (!error_) error_ = message;
  fmt::print(stderr, "[strata] error: {}\n", message);
}

void ParamCoordinator::pin(const std::vector<size_t>& units) {
  std::vector<size_t> which = units;
  if (which.empty())
    for (size_t u = 0; u < units_->size(); ++u) which.push_back(u);
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t u : which) {
    if (u >= units_->size()) throw Error(fmt::format("ZeRO-3: no unit {}", u));
    finish_prefetch(u);
    if (!units_->unit(u).gathered) {
      units_->gather(u);
      ++gathers_;
    }
    pinned_[u] = true;
  }
}

void ParamCoordinator::unpin() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::fill(pinned_.begin(), pinned_.end(), false);
}

void ParamCoordinator::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t u = 0; u < units_->size(); ++u)
    if (!pinned_[u]) release_unit(u);
  current_.clear();
}

void ParamCoordinator::rethrow_if_failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) return;
  std::string message = std::move(*error_);
  error_.reset();
  throw Error(message);
}

void ParamCoordinator::check_same_gathers() {
  std::vector<int32_t> record;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    record.swap(record_);
  }
  if (!group_) return;
  const int64_t h = int64_t(fingerprint(record, *units_)), n = int64_t(record.size());
  auto summary = torch::tensor({h, -h, n, -n}, torch::kLong);
  group_->all_reduce(summary, comm::ReduceOp::Max);
  const auto* s = summary.data_ptr<int64_t>();
  if (s[0] == -s[1] && s[2] == -s[3]) return;
  // Someone differs: every rank's record (unit ids, then their layout digests), padded with -1,
  // finds the first difference.
  const int64_t longest = s[2], world = group_->size(), row = 2 * longest;
  auto mine = torch::full({row}, int64_t(-1), torch::kLong);
  for (int64_t i = 0; i < n; ++i) {
    mine[i] = record[size_t(i)];
    mine[longest + i] = int64_t(units_->unit(size_t(record[size_t(i)])).layout_digest >> 1);
  }
  auto all = torch::empty({world * row}, torch::kLong);
  group_->all_gather(all, mine);
  const auto* a = all.data_ptr<int64_t>();
  int64_t at = 0;
  bool ids_agree = true;
  for (; at < longest; ++at) {
    bool ids = true, layouts = true;
    for (int64_t r = 1; r < world; ++r) {
      ids = ids && a[r * row + at] == a[at];
      layouts = layouts && a[r * row + longest + at] == a[longest + at];
    }
    ids_agree = ids;
    if (!ids || !layouts) break;
  }
  if (at < longest && ids_agree) {
    const auto& unit = units_->unit(size_t(a[at]));
    throw Error(fmt::format(
        "ZeRO-3: unit '{}' ({} elements) holds different parameters on the ranks (gather {} of "
        "the step; its parameter names, sizes or offsets differ): the ranks partitioned the "
        "model differently and would mix their weights. Build the same model, with the same "
        "parameter names and the same stage3_* thresholds, on every rank",
        unit.name, unit.numel, at + 1));
  }
  std::string who;
  for (int64_t r = 0; r < world; ++r) {
    const int64_t u = at < longest ? a[r * row + at] : -1;
    who += fmt::format("{}rank {}: {}", r ? "; " : "", r,
                       u < 0 ? std::string("nothing more")
                             : fmt::format("'{}' ({} elements)", units_->unit(size_t(u)).name,
                                           units_->unit(size_t(u)).numel));
  }
  throw Error(fmt::format(
      "ZeRO-3: the ranks gathered different parameters in this step (gather {} of the step: {}). "
      "Every rank must run the same modules in the same order; a branch decided differently "
      "on the ranks (by rank, by local data) mixes their weights. Decide such branches the same "
      "on every rank (e.g. by step number)",
      at + 1, who));
}

}  // namespace strata::zero
