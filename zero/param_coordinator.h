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
// Every gather is recorded: check_same_gathers() compares, across the ranks, the sequence of
// units gathered since the last check, and names the first unit on which the ranks differ
// (ranks that take different branches could otherwise all-gather different units of equal size
// and mix their weights silently).
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

class ParamCoordinator {
 public:
  enum class Phase { kIdle, kForward, kBackward, kGathered };

  ParamCoordinator(std::shared_ptr<ParamUnits> units, comm::GroupPtr group);
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
  // The first error a callback met (a failed gather, a touch outside the engine), once.
  void rethrow_if_failed();
  // Collective: throws strata::Error on every rank if the ranks gathered different units since
  // the last call, naming the first difference. Clears the record.
  void check_same_gathers();

  // Bytes of gathered parameters: now, and the most since reset_peak().
  int64_t live_bytes() const { return units_->gathered_bytes(); }
  int64_t live_bytes_peak() const { return peak_bytes_; }
  void reset_peak() { peak_bytes_ = units_->gathered_bytes(); }
  int64_t gathers() const { return gathers_; }  // since creation
  // Ops that went through the callback, and of them the ones that touched a unit.
  int64_t ops_seen() const { return ops_seen_; }
  int64_t ops_on_units() const { return ops_on_units_; }
  ParamUnits& units() { return *units_; }
  // Turns the op callback off and on again (benchmarks time other code in the same process
  // without it; nothing may touch a released unit while it is off).
  void pause();
  void resume();

  // The callback's entry (public for the registration in the .cpp).
  void on_op(const at::RecordFunction& fn);

 private:
  void fail(const std::string& message, size_t unit);

  std::shared_ptr<ParamUnits> units_;
  comm::GroupPtr group_;
  std::mutex mutex_;
  Phase phase_ = Phase::kIdle;
  std::vector<bool> pinned_;
  std::vector<int32_t> record_;  // units gathered since the last check_same_gathers()
  std::optional<std::string> error_;
  int64_t peak_bytes_ = 0, gathers_ = 0;
  std::atomic<int64_t> ops_seen_{0}, ops_on_units_{0};
  uint64_t callback_ = 0;
};

}  // namespace strata::zero
