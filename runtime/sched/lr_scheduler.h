// LR schedules, DeepSpeed's (deepspeed/runtime/lr_schedules.py) formula for formula and step for
// step, over any torch::optim::Optimizer.
//
// Step semantics (DeepSpeed's):
//   - last_batch_iteration starts at -1. The constructor then writes the schedule's value for
//     iteration -1 into the optimizer (WarmupLR / WarmupDecayLR: warmup_min_lr; WarmupCosineLR:
//     0; OneCycle: cycle_min_lr and beta1 = cycle_min_mom; LRRangeTest: lr_range_test_min_lr),
//     so the first optimizer step runs with that lr.
//   - The engine calls step() after each optimizer step that was applied (at a gradient
//     accumulation boundary; not after a step skipped for fp16 overflow). step() sets
//     last_batch_iteration += 1 and writes get_lr() for it. Optimizer step k (k >= 2) therefore
//     runs with the lr of iteration k - 2.
//   - state_dict() is {"last_batch_iteration": n}. load_state_dict() restores n and, unlike
//     DeepSpeed (whose optimizer checkpoint carries the lr), also writes the lr for n into the
//     optimizer: LibTorch's optimizer serialization does not restore lr, and the value is the one
//     a DeepSpeed optimizer checkpoint would hold.
//   - A config may pass "last_batch_iteration" (DeepSpeed's resume argument); when it is not -1
//     the constructor leaves the optimizer untouched, as DeepSpeed does.
//
// Each constructor takes the config's `scheduler.params` object (every DeepSpeed param present:
// the config layer fills the defaults for built-in types). Params DeepSpeed accepts as "float or
// list" (per param group) accept a JSON number or list here too.
//
// Where DeepSpeed versions differ, the current one is followed (checked against its master of
// 2026-08-22, edaa722, version 0.19.6 in development); the class comments name the PRs.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace strata {

using json = nlohmann::json;

class LRScheduler {
 public:
  explicit LRScheduler(torch::optim::Optimizer& optimizer);
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advance one batch and write its lr (and momentum, for OneCycle) into the optimizer.
  void step();
  // DeepSpeed's step(batch_iteration): jump to that iteration.
  void step(int64_t batch_iteration);

  // The lr of every param group at last_batch_iteration() (what step() writes).
  virtual std::vector<double> get_lr() const = 0;
  // The lrs last written into the optimizer.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_batch_iteration() const { return last_batch_iteration_; }

  virtual json state_dict() const;
  virtual void load_state_dict(const json& state);

  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  // What DeepSpeed would log as warnings (e.g. momentum cycling disabled); the engine logs them.
  const std::vector<std::string>& warnings() const { return warnings_; }

 protected:
  // Writes the schedule's values for last_batch_iteration into the optimizer.
  virtual void apply();
  // Constructors end with this: apply() unless resuming (DeepSpeed: only when it is -1).
  void start(int64_t last_batch_iteration);
  size_t group_count() const { return optimizer_->param_groups().size(); }
  void warn(std::string message) { warnings_.push_back(std::move(message)); }

  int64_t last_batch_iteration_ = -1;

 private:
  torch::optim::Optimizer* optimizer_;
  std::vector<double> last_lr_;
  std::vector<std::string> warnings_;
};

// Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps (at least 2), then hold.
//   gamma = log(i + 1) / log(warmup_num_steps)   (warmup_type "log")
//         = i / warmup_num_steps                  (warmup_type "linear")
//   lr    = min + (max - min) * gamma, and max once i >= warmup_num_steps.
// warmup_max_lr null or absent: each group's lr at construction. An unknown warmup_type falls
// back to "log" with a warning, as in DeepSpeed.
class WarmupLR : public LRScheduler {
 public:
  WarmupLR(torch::optim::Optimizer& optimizer, const json& params);
  std::vector<double> get_lr() const override;

 protected:
  WarmupLR(torch::optim::Optimizer& optimizer, const json& params, const char* where,
           std::optional<int64_t> total_num_steps);
  double gamma() const;

  std::vector<double> min_lrs_, delta_lrs_;
  int64_t warmup_num_steps_;
  bool linear_;
  double inverse_log_warmup_;
  std::optional<int64_t> total_num_steps_;  // set: WarmupDecayLR
};

// WarmupLR, then linear decay: gamma = max(0, (total - i) / max(1, total - warmup_num_steps)).
class WarmupDecayLR : public WarmupLR {
 public:
  WarmupDecayLR(torch::optim::Optimizer& optimizer, const json& params);
};

// Ratios of each group's lr at construction: warm up from warmup_min_ratio to 1 (log or linear
// as WarmupLR), then cosine down to cos_min_ratio at total_num_steps, where it stays:
//   t     = min(1, (i - warmup_num_steps + 1) / max(1, total_num_steps - warmup_num_steps))
//   ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * t)) / 2)
// Iteration -1 gives 0 for every group. This is DeepSpeed 0.19.3 and later: the min(1, .) clamp
// and the max(1, .) floor are DeepSpeed #8142 (before it the cosine rose again past
// total_num_steps, and total == warmup divided by zero); no option keeps the old rise, which
// was a bug. An unknown warmup_type warns and falls back to "log", as since DeepSpeed #8151
// (0.19.4; before it DeepSpeed failed on its first step).
class WarmupCosineLR : public LRScheduler {
 public:
  WarmupCosineLR(torch::optim::Optimizer& optimizer, const json& params);
  std::vector<double> get_lr() const override;
  double get_lr_ratio() const;

 private:
  std::vector<double> org_lrs_;
  int64_t total_num_steps_;
  int64_t warmup_num_steps_;
  double warmup_min_ratio_, cos_min_ratio_, inverse_log_warmup_;
  bool linear_;
};

// 1Cycle: lr from cycle_min_lr up to cycle_max_lr over cycle_first_step_size, back down over
// cycle_second_step_size (null: the first), then the decay phase. With b = i + 1 and
// x = b / total_size - floor(b / total_size), the half is x <= first / total_size:
//   scale = x / ratio going up, (x - 1) / (ratio - 1) going down   (ratio = first / total_size)
//   lr    = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
// cycle_first_step_size must be > 0 and cycle_second_step_size >= 0 (DeepSpeed #8166). A second
// half of 0 has no way down: ratio is 1, every iteration of the cycle is going up, and its last
// one (i = first - 1, b = total_size) wraps to x = 0, so cycle_max_lr is never reached and that
// iteration gives cycle_min_lr (beta1 cycle_max_mom) before the decay phase, as in DeepSpeed.
// A half with a stair count n > 0 (cycle_first_stair_count going up, cycle_second_stair_count,
// null: the first's, going down) holds lr and momentum flat in n stairs, counted from the
// integer offset c = b mod total_size so that floor() falls as in DeepSpeed at a stair boundary:
//   scale = floor(c * n / first) / n  if c <= first,  else floor((total_size - c) * n / second) / n
// A count <= 0 (DeepSpeed's command-line default is -1) keeps that half continuous.
// Decay phase (stairs do not apply), d = i - total_size + 1:
//   lr = cycle_min_lr / (1 + decay_lr_rate * (d / decay_step_size))
// (cycle_min_lr throughout when decay_step_size or decay_lr_rate is 0). With cycle_momentum and
// an Adam-type optimizer (strata::optim::Adam, torch Adam / AdamW: "betas" in DeepSpeed's
// check) beta1 cycles inversely, cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale, and in
// the decay phase is cycle_max_mom * (1 + decay_mom_rate * (d / decay_step_size)); DeepSpeed
// writes beta2 = 0.99 alongside. Optimizers without betas (SGD included) get no momentum cycling
// and a warning, as in DeepSpeed. cycle_min_lr, cycle_max_lr, cycle_min_mom and cycle_max_mom
// take one number or one per param group.
// Current DeepSpeed: the stairs are DeepSpeed #8179 (0.19.4; before it the counts were stored
// and unused), the per-group lists #8201 (master after 0.19.5). No option keeps the unused
// counts: a config that sets them asks for stairs.
class OneCycle : public LRScheduler {
 public:
  OneCycle(torch::optim::Optimizer& optimizer, const json& params);
  std::vector<double> get_lr() const override;
  // beta1 of every group at last_batch_iteration(); empty when momentum does not cycle.
  std::vector<double> get_mom() const;
  bool cycle_momentum() const { return cycle_momentum_; }

 protected:
  void apply() override;

 private:
  double scale_factor() const;
  double decay_iteration() const;

  double first_step_size_, second_step_size_, total_size_, step_ratio_, decay_step_size_;
  int64_t first_stair_count_, second_stair_count_;  // <= 0: continuous
  std::vector<double> min_lrs_, max_lrs_, min_moms_, max_moms_;
  double decay_lr_rate_, decay_mom_rate_ = 0;
  bool skip_lr_decay_, skip_mom_decay_, cycle_momentum_;
};

// lr = lr_range_test_min_lr * (1 + step_rate * x), x = (i + 1) / step_size, floored when
// lr_range_test_staircase.
class LRRangeTest : public LRScheduler {
 public:
  LRRangeTest(torch::optim::Optimizer& optimizer, const json& params);
  std::vector<double> get_lr() const override;

 private:
  std::vector<double> min_lrs_;
  double step_size_, step_rate_;
  bool staircase_;
};

}  // namespace strata
