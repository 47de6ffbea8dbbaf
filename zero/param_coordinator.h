// ZeRO-3's gather-on-use for a model that has no hooks (ARCHITECTURE.md, "ZeRO-3 without
// hooks"): one global RecordFunction callback sees the inputs of every dispatched op, forward
// and backward; an input whose storage is a released unit's (param_units.h) is all-gathered
// before the op runs, and the units the op does not touch are released (a unit's ops run
// together, so the switch to another unit is its last use for now). A unit used again later (a
// tied embedding and output head, a block run twice) is gathered again: once per use. Nothing
// depends on the order of use, so steps that take another branch, eval and generation loops
// work as they are.
//
// Gathers are collectives, so every rank must run the same ops; they may only happen while the
// engine runs the model (forward and backward scopes) or inside a gathered-parameters scope.
// An op that touches a released parameter elsewhere (user code printing a weight between
// steps) must not start a collective that the other ranks never join: the bytes are filled
// with NaN and the error is raised by the next engine call. (RecordFunction swallows exceptions
// thrown by callbacks, so every error here is kept and raised by rethrow_if_failed().)
//
// Prefetch: the order in which units come into use (a "use" starts when an op touches a unit the
// previous unit-touching op did not) is recorded over a micro-step; the next micro-steps follow
// that trace and launch the gathers of the next units ahead (stage3_prefetch_bucket_size
// elements in flight, or one unit larger than that, bounded by stage3_max_live_parameters), and
// keep a unit whose next use comes within stage3_max_reuse_distance elements. The forward's end
// is a turn (end_forward()): the units not kept for reuse are released there and the forward's
// prefetch stops short of it, so nothing gathered for backward waits through the loss; with
// stage3_max_reuse_distance 0 every parameter travels once each way per micro-step. A micro-step that
// leaves the trace (a branch taken the same way on every rank) falls back to gather-on-use, says
// so once, and is recorded as the new trace; what it had gathered ahead is released at once.
//
// Every use is recorded: check_same_gathers() compares, across the ranks, the sequence of units
// used since the last check, and names the first unit on which the ranks differ (ranks that take
// different branches could otherwise all-gather different units of equal size and mix their
// weights silently).
//
// Per op, the work is the op's inputs plus the gathered units (never every unit or the whole
// trace): ParamUnits keeps the list of gathered units, the elements in flight ahead are counted
// as they change, and a unit's next use is found through an index of the trace built once per
// recorded trace.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "zero/param_units.h"

namespace at {
class RecordFunction;
}

namespace strata::zero {

struct CoordinatorOptions {
  int64_t prefetch_numel = 0;  // elements gathered ahead, at most, or one larger unit (0: none)
  int64_t max_live_numel = INT64_MAX;  // gathered elements (persistent ones aside), at most
  int64_t max_reuse_distance = 0;      // keep a unit used again within this many elements
};

class ParamCoordinator {
 public:
  enum class Phase { kIdle, kForward, kBackward, kGathered };

  ParamCoordinator(std::shared_ptr<ParamUnits> units, comm::GroupPtr group,
                   CoordinatorOptions options = {});
  ~ParamCoordinator();
  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;

  // While a Scope lives, gathers are allowed (forward, backward, a user's gathered scope).
  class Scope {
   public:
    Scope(ParamCoordinator* c, Phase phase);
    ~Scope();
    Scope(Scope&& o) noexcept : c_(o.c_), previous_(o.previous_) { o.c_ = nullptr; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Scope& operator=(Scope&&) = delete;

   private:
    ParamCoordinator* c_;
    Phase previous_;
  };
  Scope enter(Phase phase) { return Scope(this, phase); }

  // Gathers `units` (all units when empty) now and keeps them until unpin() (a collective: every
  // rank calls it). DeepSpeed's GatheredParameters, FSDP's summon_full_params.
  void pin(const std::vector<size_t>& units);
  void unpin();
  // Releases every gathered unit that is not pinned or persistent.
  void release_all();
  // After the engine's forward: the turn to backward. Every unit not kept for reuse within
  // stage3_max_reuse_distance is released (the model's last units too, as DeepSpeed releases a
  // module's parameters after its forward), and the forward's prefetch never reaches past this
  // point of the trace, so the loss and its backward run with no unit gathered for backward
  // yet; backward gathers its first units on use and prefetches from there.
  void end_forward();
  // After each micro-step's backward: the trace is followed again from its start (or replaced
  // by this micro-step's uses when they left it).
  void end_micro_step();
  // The first error a callback met (a failed gather, a touch outside the engine), once.
  void rethrow_if_failed();
  // Collective: throws strata::Error on every rank if the ranks gathered different units since
  // the last call, naming the first difference. Clears the record.
  void check_same_gathers();

  // Bytes of gathered parameters: now, and the most at any moment since reset_peak().
  int64_t live_bytes() const { return units_->gathered_bytes(); }
  int64_t live_bytes_peak() const { return units_->gathered_bytes_peak(); }
  void reset_peak() { units_->reset_gathered_peak(); }
  int64_t gathers() const { return gathers_; }  // since creation
  // Micro-steps whose uses left the recorded trace (their gathers were not prefetched).
  int64_t trace_departures() const { return left_trace_; }
  int64_t prefetches() const { return prefetches_; }  // of them, launched ahead of use
  const std::vector<int32_t>& trace() const { return trace_; }
  // Ops that went through the callback, and of them the ones that touched a unit.
  int64_t ops_seen() const { return ops_seen_; }
  int64_t ops_on_units() const { return ops_on_units_; }
  ParamUnits& units() { return *units_; }
  // Turns the op callback off and on again (benchmarks time other code in the same process
  // without it; nothing may touch a released unit while it is off).
  void pause();
  void resume();

  // The callback's entries (public for the registration in the .cpp): an op starts (returns
  // the units it holds until it ends), an op that held units ends.
  std::vector<size_t> on_op(const at::RecordFunction& fn);
  void on_op_end(const std::vector<size_t>& held);

 private:
  void fail(const std::string& message, size_t unit);
  std::vector<size_t> hold(std::vector<size_t> touched);
  // u comes into use: follow() records it and follows the trace, bring() gathers it (or waits
  // for its prefetch), after the units no longer in use are released.
  void follow(size_t u);
  void bring(size_t u, const char* op);
  bool kept_for_reuse(size_t u) const;  // O(log uses) through the trace's index
  void set_prefetched(size_t u, bool ahead);
  void index_trace();  // trace_uses_ and trace_prefix_ from trace_
  void finish_prefetch(size_t u);
  void release_unit(size_t u);
  // Releases the gathered units that are not pinned, held by a running op, in `in_use` or kept
  // for reuse.
  void release_idle(const std::vector<size_t>& in_use);
  void prefetch();

  std::shared_ptr<ParamUnits> units_;
  comm::GroupPtr group_;
  std::mutex mutex_;
  Phase phase_ = Phase::kIdle;
  std::vector<bool> pinned_;
  std::vector<int> held_;  // per unit: ops running now that read it
  std::atomic<bool> paused_{false};
  CoordinatorOptions options_;
  std::vector<int32_t> record_;  // uses since the last check_same_gathers()
  std::vector<int32_t> micro_;   // uses in this micro-step
  std::vector<int32_t> trace_;   // the uses of the micro-step that recorded it
  size_t micro_turn_ = SIZE_MAX;  // uses of this micro-step before its (last) forward ended
  size_t trace_turn_ = SIZE_MAX;  // the same for trace_: the forward's prefetch stops there
  size_t pos_ = 0;               // the next use the trace expects
  bool on_trace_ = false;
  std::vector<size_t> current_;  // the units of the last op that touched any
  std::vector<comm::WorkPtr> inflight_;  // per unit: a prefetch not yet waited for
  std::vector<bool> prefetched_;         // gathered ahead and not used yet
  int64_t ahead_numel_ = 0;              // their elements
  std::vector<std::vector<size_t>> trace_uses_;  // per unit: its places in trace_, ascending
  std::vector<int64_t> trace_prefix_;            // elements of trace_[0, k)
  int64_t prefetches_ = 0;
  std::optional<std::string> error_;
  int64_t gathers_ = 0, left_trace_ = 0;
  std::atomic<int64_t> ops_seen_{0}, ops_on_units_{0};
};

}  // namespace strata::zero
