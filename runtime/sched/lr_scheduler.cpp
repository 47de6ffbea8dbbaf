// DeepSpeed's LR schedules (deepspeed/runtime/lr_schedules.py), including its later fixes:
// WarmupCosineLR zeroes every group before the start (DeepSpeed #7969), floors the cosine span
// at 1 and clamps its progress at 1 (#8142) and falls back to "log" for an unknown warmup_type
// (#8151); WarmupLR without warmup_max_lr warms each group to its own lr (#8171); OneCycle's
// stair counts make stairs (#8179) and its bounds take per-group lists (#8201). Expressions
// keep DeepSpeed's order of operations, so that floor() at a stair falls the same way.
#include "runtime/sched/lr_scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "runtime/error.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/json_params.h"

namespace strata {
namespace {

constexpr const char* kSched = "scheduler.params";
constexpr double kPi = 3.14159265358979323846;

// DeepSpeed's resume argument; absent means a fresh start.
int64_t resume_iteration(const json& p) {
  return params::has(p, "last_batch_iteration") ? params::get_int(p, "last_batch_iteration", kSched)
                                                : -1;
}

// Returns whether warmup_type is "linear"; "log" is the other known value.
std::optional<bool> parse_warmup_type(const std::string& type) {
  if (type == "log") return false;
  if (type == "linear") return true;
  return std::nullopt;
}

std::string unknown_warmup_type(const char* name, const std::string& type) {
  return fmt::format("{}: {}.warmup_type = \"{}\" is not \"log\" or \"linear\"; using \"log\", as "
                     "DeepSpeed does",
                     name, kSched, type);
}

// Python's float %: the result takes the divisor's sign.
double python_mod(double a, double b) {
  const double r = std::fmod(a, b);
  return r != 0 && (r < 0) != (b < 0) ? r + b : r;
}

std::vector<double> group_lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (const auto& group : optimizer.param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
}

// DeepSpeed cycles momentum only where the optimizer has "betas": the Adam family.
template <class Options>
bool try_set_betas(torch::optim::OptimizerOptions& options, double beta1, double beta2) {
  auto* typed = dynamic_cast<Options*>(&options);
  if (typed != nullptr) typed->betas(std::make_tuple(beta1, beta2));
  return typed != nullptr;
}

bool set_betas(torch::optim::OptimizerOptions& options, double beta1, double beta2) {
  return try_set_betas<optim::AdamOptions>(options, beta1, beta2) ||
         try_set_betas<torch::optim::AdamOptions>(options, beta1, beta2) ||
         try_set_betas<torch::optim::AdamWOptions>(options, beta1, beta2);
}

bool has_betas(const torch::optim::OptimizerOptions& options) {
  return dynamic_cast<const optim::AdamOptions*>(&options) != nullptr ||
         dynamic_cast<const torch::optim::AdamOptions*>(&options) != nullptr ||
         dynamic_cast<const torch::optim::AdamWOptions*>(&options) != nullptr;
}

}  // namespace

// ---- LRScheduler ------------------------------------------------------------------------------

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer) : optimizer_(&optimizer) {}

void LRScheduler::step() { step(last_batch_iteration_ + 1); }

void LRScheduler::step(int64_t batch_iteration) {
  last_batch_iteration_ = batch_iteration;
  apply();
}

void LRScheduler::apply() {
  const std::vector<double> lrs = get_lr();
  auto& groups = optimizer_->param_groups();
  for (size_t i = 0; i < std::min(groups.size(), lrs.size()); ++i)
    groups[i].options().set_lr(lrs[i]);
  last_lr_ = group_lrs(*optimizer_);
}

void LRScheduler::start(int64_t last_batch_iteration) {
  last_batch_iteration_ = last_batch_iteration;
  if (last_batch_iteration == -1) apply();
}

json LRScheduler::state_dict() const { return {{"last_batch_iteration", last_batch_iteration_}}; }

void LRScheduler::load_state_dict(const json& state) {
  last_batch_iteration_ = params::get_int(state, "last_batch_iteration", "scheduler state");
  apply();
}

// ---- WarmupLR / WarmupDecayLR -----------------------------------------------------------------

WarmupLR::WarmupLR(torch::optim::Optimizer& optimizer, const json& params)
    : WarmupLR(optimizer, params, "WarmupLR", std::nullopt) {}

WarmupLR::WarmupLR(torch::optim::Optimizer& optimizer, const json& p, const char* name,
                   std::optional<int64_t> total_num_steps)
    : LRScheduler(optimizer), total_num_steps_(total_num_steps) {
  const size_t groups = group_count();
  min_lrs_ = params::get_per_group(p, "warmup_min_lr", kSched, groups);
  const std::vector<double> max_lrs =
      params::has(p, "warmup_max_lr") ? params::get_per_group(p, "warmup_max_lr", kSched, groups)
                                      : group_lrs(optimizer);
  for (size_t i = 0; i < groups; ++i) delta_lrs_.push_back(max_lrs[i] - min_lrs_[i]);

  const int64_t requested = params::get_int(p, "warmup_num_steps", kSched);
  warmup_num_steps_ = std::max<int64_t>(2, requested);
  inverse_log_warmup_ = 1.0 / std::log(static_cast<double>(warmup_num_steps_));
  const std::string type = params::get_string(p, "warmup_type", kSched);
  const auto linear = parse_warmup_type(type);
  if (!linear) warn(unknown_warmup_type(name, type));
  linear_ = linear.value_or(false);
  if (total_num_steps_ && *total_num_steps_ < warmup_num_steps_)
    warn(fmt::format("{}: total_num_steps {} is less than warmup_num_steps {}", name,
                     *total_num_steps_, requested));
  start(resume_iteration(p));
}

double WarmupLR::gamma() const {
  const int64_t i = last_batch_iteration_;
  if (i < warmup_num_steps_)
    return linear_ ? static_cast<double>(i) / static_cast<double>(warmup_num_steps_)
                   : inverse_log_warmup_ * std::log(static_cast<double>(i + 1));
  if (!total_num_steps_) return 1.0;
  return std::max(0.0,
                  static_cast<double>(*total_num_steps_ - i) /
                      std::max(1.0, static_cast<double>(*total_num_steps_ - warmup_num_steps_)));
}

std::vector<double> WarmupLR::get_lr() const {
  if (last_batch_iteration_ < 0) return min_lrs_;
  const double g = gamma();
  std::vector<double> lrs;
  for (size_t i = 0; i < min_lrs_.size(); ++i) lrs.push_back(min_lrs_[i] + delta_lrs_[i] * g);
  return lrs;
}

WarmupDecayLR::WarmupDecayLR(torch::optim::Optimizer& optimizer, const json& p)
    : WarmupLR(optimizer, p, "WarmupDecayLR", params::get_int(p, "total_num_steps", kSched)) {}

// ---- WarmupCosineLR ---------------------------------------------------------------------------

WarmupCosineLR::WarmupCosineLR(torch::optim::Optimizer& optimizer, const json& p)
    : LRScheduler(optimizer), org_lrs_(group_lrs(optimizer)) {
  total_num_steps_ = params::get_int(p, "total_num_steps", kSched);
  const int64_t requested = params::get_int(p, "warmup_num_steps", kSched);
  warmup_num_steps_ = std::max<int64_t>(2, requested);
  warmup_min_ratio_ = params::get_double(p, "warmup_min_ratio", kSched);
  cos_min_ratio_ = params::get_double(p, "cos_min_ratio", kSched);
  inverse_log_warmup_ = 1.0 / std::log(static_cast<double>(warmup_num_steps_));
  const std::string type = params::get_string(p, "warmup_type", kSched);
  const auto linear = parse_warmup_type(type);
  if (!linear) warn(unknown_warmup_type("WarmupCosineLR", type));
  linear_ = linear.value_or(false);
  if (total_num_steps_ < warmup_num_steps_)
    warn(fmt::format("WarmupCosineLR: total_num_steps {} is less than warmup_num_steps {}",
                     total_num_steps_, requested));
  start(resume_iteration(p));
}

double WarmupCosineLR::get_lr_ratio() const {
  const int64_t i = last_batch_iteration_;
  if (i < 0) return 0.0;
  if (i < warmup_num_steps_) {
    const double ratio = linear_ ? static_cast<double>(i) / static_cast<double>(warmup_num_steps_)
                                 : inverse_log_warmup_ * std::log(static_cast<double>(i + 1));
    return warmup_min_ratio_ + ratio * (1.0 - warmup_min_ratio_);
  }
  const double real_last_step = static_cast<double>(i - warmup_num_steps_ + 1);
  const double real_total_steps =
      static_cast<double>(std::max<int64_t>(1, total_num_steps_ - warmup_num_steps_));
  const double progress = std::min(1.0, real_last_step / real_total_steps);  // #8142
  const double cosine = (1 + std::cos(kPi * progress)) / 2;
  return std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * cosine);
}

std::vector<double> WarmupCosineLR::get_lr() const {
  if (last_batch_iteration_ < 0) return std::vector<double>(org_lrs_.size(), 0.0);
  const double ratio = get_lr_ratio();
  std::vector<double> lrs;
  for (double lr : org_lrs_) lrs.push_back(lr * ratio);
  return lrs;
}

// ---- OneCycle ---------------------------------------------------------------------------------

OneCycle::OneCycle(torch::optim::Optimizer& optimizer, const json& p) : LRScheduler(optimizer) {
  first_step_size_ = params::get_double(p, "cycle_first_step_size", kSched);
  second_step_size_ = params::has(p, "cycle_second_step_size")
                          ? params::get_double(p, "cycle_second_step_size", kSched)
                          : first_step_size_;
  if (first_step_size_ <= 0 || second_step_size_ < 0)
    throw Error(
        fmt::format("{}: cycle_first_step_size must be > 0 and cycle_second_step_size "
                    ">= 0, got {} and {}",
                    kSched, first_step_size_, second_step_size_));
  total_size_ = first_step_size_ + second_step_size_;
  step_ratio_ = first_step_size_ / total_size_;
  first_stair_count_ = params::has(p, "cycle_first_stair_count")
                           ? params::get_int(p, "cycle_first_stair_count", kSched)
                           : 0;
  second_stair_count_ = params::has(p, "cycle_second_stair_count")
                            ? params::get_int(p, "cycle_second_stair_count", kSched)
                            : first_stair_count_;

  decay_step_size_ = params::get_double(p, "decay_step_size", kSched);
  if (decay_step_size_ < 0)
    throw Error(fmt::format("{}.decay_step_size must be >= 0, got {}", kSched, decay_step_size_));
  // Both bounds are read before anything is written (DeepSpeed #8201: all or nothing).
  min_lrs_ = params::get_per_group(p, "cycle_min_lr", kSched, group_count());
  max_lrs_ = params::get_per_group(p, "cycle_max_lr", kSched, group_count());
  decay_lr_rate_ = params::get_double(p, "decay_lr_rate", kSched);
  skip_lr_decay_ = decay_step_size_ == 0 || decay_lr_rate_ == 0;

  cycle_momentum_ = params::get_bool(p, "cycle_momentum", kSched);
  skip_mom_decay_ = true;
  if (cycle_momentum_ && !has_betas(optimizer.defaults())) {
    warn(
        "OneCycle: cycle_momentum is disabled because the optimizer has no betas (DeepSpeed "
        "cycles only Adam-type beta1, not SGD momentum)");
    cycle_momentum_ = false;
  }
  if (cycle_momentum_) {  // as in DeepSpeed, the momentum lists are read only when used
    min_moms_ = params::get_per_group(p, "cycle_min_mom", kSched, group_count());
    max_moms_ = params::get_per_group(p, "cycle_max_mom", kSched, group_count());
    decay_mom_rate_ = params::get_double(p, "decay_mom_rate", kSched);
    skip_mom_decay_ = decay_step_size_ == 0 || decay_mom_rate_ == 0;
  }
  start(resume_iteration(p));
}

double OneCycle::scale_factor() const {
  const double batch_iteration = static_cast<double>(last_batch_iteration_ + 1);
  const double cycle = std::floor(1 + batch_iteration / total_size_);
  const double x = 1.0 + batch_iteration / total_size_ - cycle;
  const bool rising = x <= step_ratio_;
  const double scale = rising ? x / step_ratio_ : (x - 1) / (step_ratio_ - 1);
  const int64_t stairs = rising ? first_stair_count_ : second_stair_count_;
  if (stairs <= 0) return scale;
  // DeepSpeed #8179 counts stairs from the batch offset, not from scale: the float scale at a
  // half's end can land 1e-16 under a whole stair. As there, x picks the stair count and the
  // offset picks the half the position is counted in.
  const double n = static_cast<double>(stairs);
  const double offset = python_mod(batch_iteration, total_size_);
  const double position = offset <= first_step_size_
                              ? offset * n / first_step_size_
                              : (total_size_ - offset) * n / second_step_size_;
  return std::floor(position) / n;
}

double OneCycle::decay_iteration() const {
  return static_cast<double>(last_batch_iteration_) - total_size_ + 1;
}

std::vector<double> OneCycle::get_lr() const {
  std::vector<double> lrs;
  if (static_cast<double>(last_batch_iteration_) < total_size_) {
    const double scale = scale_factor();
    for (size_t g = 0; g < min_lrs_.size(); ++g)
      lrs.push_back(min_lrs_[g] + (max_lrs_[g] - min_lrs_[g]) * scale);
    return lrs;
  }
  if (skip_lr_decay_) return min_lrs_;
  const double factor = 1 + decay_lr_rate_ * (decay_iteration() / decay_step_size_);
  for (double lr : min_lrs_) lrs.push_back(lr / factor);
  return lrs;
}

std::vector<double> OneCycle::get_mom() const {
  if (!cycle_momentum_) return {};
  if (last_batch_iteration_ < 0) return min_moms_;  // what DeepSpeed's constructor writes
  std::vector<double> moms;
  if (static_cast<double>(last_batch_iteration_) < total_size_) {
    const double scale = scale_factor();
    for (size_t g = 0; g < max_moms_.size(); ++g)
      moms.push_back(max_moms_[g] - (max_moms_[g] - min_moms_[g]) * scale);
    return moms;
  }
  if (skip_mom_decay_) return max_moms_;
  const double factor = 1 + decay_mom_rate_ * (decay_iteration() / decay_step_size_);
  for (double mom : max_moms_) moms.push_back(mom * factor);
  return moms;
}

void OneCycle::apply() {
  LRScheduler::apply();
  const std::vector<double> moms = get_mom();
  auto& groups = optimizer().param_groups();
  for (size_t i = 0; i < std::min(groups.size(), moms.size()); ++i)
    set_betas(groups[i].options(), moms[i], /*DeepSpeed's fixed beta2=*/0.99);
}

// ---- LRRangeTest ------------------------------------------------------------------------------

LRRangeTest::LRRangeTest(torch::optim::Optimizer& optimizer, const json& p)
    : LRScheduler(optimizer) {
  min_lrs_ = params::get_per_group(p, "lr_range_test_min_lr", kSched, group_count());
  step_size_ = params::get_double(p, "lr_range_test_step_size", kSched);
  if (step_size_ <= 0)
    throw Error(fmt::format("{}.lr_range_test_step_size must be > 0, got {}", kSched, step_size_));
  step_rate_ = params::get_double(p, "lr_range_test_step_rate", kSched);
  staircase_ = params::get_bool(p, "lr_range_test_staircase", kSched);
  start(resume_iteration(p));
}

std::vector<double> LRRangeTest::get_lr() const {
  double interval = static_cast<double>(last_batch_iteration_ + 1) / step_size_;
  if (staircase_) interval = std::floor(interval);
  const double increase = 1 + step_rate_ * interval;
  std::vector<double> lrs;
  for (double lr : min_lrs_) lrs.push_back(lr * increase);
  return lrs;
}

}  // namespace strata
