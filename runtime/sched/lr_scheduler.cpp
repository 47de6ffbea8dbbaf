// DeepSpeed's LR schedules (deepspeed/runtime/lr_schedules.py), including its later fixes:
// WarmupCosineLR zeroes every group before the start (DeepSpeed #7969) and floors the cosine
// span at 1 (#8142); WarmupLR without warmup_max_lr warms each group to its own lr (#8171).
#include "runtime/sched/lr_scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "runtime/error.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/json_params.h"

namespace strata {
namespace {

constexpr const char* kWhere = "scheduler.params";
constexpr double kPi = 3.14159265358979323846;

// DeepSpeed's resume argument; absent means a fresh start.
int64_t resume_iteration(const json& p) {
  return params::has(p, "last_batch_iteration") ? params::get_int(p, "last_batch_iteration", kWhere)
                                                : -1;
}

// Returns whether warmup_type is "linear"; "log" is the other known value.
std::optional<bool> parse_warmup_type(const std::string& type) {
  if (type == "log") return false;
  if (type == "linear") return true;
  return std::nullopt;
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
  min_lrs_ = params::get_per_group(p, "warmup_min_lr", kWhere, groups);
  const std::vector<double> max_lrs =
      params::has(p, "warmup_max_lr") ? params::get_per_group(p, "warmup_max_lr", kWhere, groups)
                                      : group_lrs(optimizer);
  for (size_t i = 0; i < groups; ++i) delta_lrs_.push_back(max_lrs[i] - min_lrs_[i]);

  const int64_t requested = params::get_int(p, "warmup_num_steps", kWhere);
  warmup_num_steps_ = std::max<int64_t>(2, requested);
  inverse_log_warmup_ = 1.0 / std::log(static_cast<double>(warmup_num_steps_));
  const std::string type = params::get_string(p, "warmup_type", kWhere);
  const auto linear = parse_warmup_type(type);
  if (!linear)
    warn(fmt::format("{}: unknown warmup_type \"{}\"; using \"log\" (as DeepSpeed does)", name,
                     type));
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
    : WarmupLR(optimizer, p, "WarmupDecayLR", params::get_int(p, "total_num_steps", kWhere)) {}

// ---- WarmupCosineLR ---------------------------------------------------------------------------

WarmupCosineLR::WarmupCosineLR(torch::optim::Optimizer& optimizer, const json& p)
    : LRScheduler(optimizer), org_lrs_(group_lrs(optimizer)) {
  total_num_steps_ = params::get_int(p, "total_num_steps", kWhere);
  const int64_t requested = params::get_int(p, "warmup_num_steps", kWhere);
  warmup_num_steps_ = std::max<int64_t>(2, requested);
  warmup_min_ratio_ = params::get_double(p, "warmup_min_ratio", kWhere);
  cos_min_ratio_ = params::get_double(p, "cos_min_ratio", kWhere);
  inverse_log_warmup_ = 1.0 / std::log(static_cast<double>(warmup_num_steps_));
  const std::string type = params::get_string(p, "warmup_type", kWhere);
  const auto linear = parse_warmup_type(type);
  if (!linear)
    throw Error(fmt::format("{}.warmup_type is \"{}\"; WarmupCosineLR knows \"log\" and \"linear\"",
                            kWhere, type));
  linear_ = *linear;
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
  const double cosine = (1 + std::cos(kPi * real_last_step / real_total_steps)) / 2;
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
  const double first = params::get_double(p, "cycle_first_step_size", kWhere);
  const double second = params::has(p, "cycle_second_step_size")
                            ? params::get_double(p, "cycle_second_step_size", kWhere)
                            : first;
  if (first <= 0 || second < 0)
    throw Error(
        fmt::format("{}: cycle_first_step_size must be > 0 and cycle_second_step_size "
                    ">= 0, got {} and {}",
                    kWhere, first, second));
  total_size_ = first + second;
  step_ratio_ = first / total_size_;
  // DeepSpeed stores the stair counts and never reads them: say so rather than pretend.
  for (const char* key : {"cycle_first_stair_count", "cycle_second_stair_count"})
    if (params::has(p, key) && params::get_int(p, key, kWhere) > 0)
      warn(
          fmt::format("OneCycle: {} has no effect; the cycle is continuous, as in DeepSpeed's "
                      "lr_schedules.py",
                      key));

  decay_step_size_ = params::get_double(p, "decay_step_size", kWhere);
  if (decay_step_size_ < 0)
    throw Error(fmt::format("{}.decay_step_size must be >= 0, got {}", kWhere, decay_step_size_));
  min_lr_ = params::get_double(p, "cycle_min_lr", kWhere);
  max_lr_ = params::get_double(p, "cycle_max_lr", kWhere);
  decay_lr_rate_ = params::get_double(p, "decay_lr_rate", kWhere);
  skip_lr_decay_ = decay_step_size_ == 0 || decay_lr_rate_ == 0;

  cycle_momentum_ = params::get_bool(p, "cycle_momentum", kWhere);
  skip_mom_decay_ = true;
  if (cycle_momentum_ && !has_betas(optimizer.defaults())) {
    warn(
        "OneCycle: cycle_momentum is disabled because the optimizer has no betas (DeepSpeed "
        "cycles only Adam-type beta1, not SGD momentum)");
    cycle_momentum_ = false;
  }
  if (cycle_momentum_) {
    min_mom_ = params::get_double(p, "cycle_min_mom", kWhere);
    max_mom_ = params::get_double(p, "cycle_max_mom", kWhere);
    decay_mom_rate_ = params::get_double(p, "decay_mom_rate", kWhere);
    skip_mom_decay_ = decay_step_size_ == 0 || decay_mom_rate_ == 0;
  }
  start(resume_iteration(p));
}

double OneCycle::scale_factor() const {
  const double batch_iteration = static_cast<double>(last_batch_iteration_ + 1);
  const double cycle = std::floor(1 + batch_iteration / total_size_);
  const double x = 1.0 + batch_iteration / total_size_ - cycle;
  return x <= step_ratio_ ? x / step_ratio_ : (x - 1) / (step_ratio_ - 1);
}

std::vector<double> OneCycle::get_lr() const {
  double lr = min_lr_;
  if (static_cast<double>(last_batch_iteration_) < total_size_) {
    lr = min_lr_ + (max_lr_ - min_lr_) * scale_factor();
  } else if (!skip_lr_decay_) {
    const double decay_iteration = static_cast<double>(last_batch_iteration_) - total_size_ + 1;
    lr = min_lr_ / (1 + decay_lr_rate_ * decay_iteration / decay_step_size_);
  }
  return std::vector<double>(group_count(), lr);
}

std::vector<double> OneCycle::get_mom() const {
  if (!cycle_momentum_) return {};
  double mom = max_mom_;
  if (last_batch_iteration_ < 0) {
    mom = min_mom_;  // what DeepSpeed's constructor writes (not the formula's value at -1)
  } else if (static_cast<double>(last_batch_iteration_) < total_size_) {
    mom = max_mom_ - (max_mom_ - min_mom_) * scale_factor();
  } else if (!skip_mom_decay_) {
    const double decay_iteration = static_cast<double>(last_batch_iteration_) - total_size_ + 1;
    mom = max_mom_ * (1 + decay_mom_rate_ * decay_iteration / decay_step_size_);
  }
  return std::vector<double>(group_count(), mom);
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
  min_lrs_ = params::get_per_group(p, "lr_range_test_min_lr", kWhere, group_count());
  step_size_ = params::get_double(p, "lr_range_test_step_size", kWhere);
  if (step_size_ <= 0)
    throw Error(fmt::format("{}.lr_range_test_step_size must be > 0, got {}", kWhere, step_size_));
  step_rate_ = params::get_double(p, "lr_range_test_step_rate", kWhere);
  staircase_ = params::get_bool(p, "lr_range_test_staircase", kWhere);
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
