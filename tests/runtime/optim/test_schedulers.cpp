// The LR schedules against DeepSpeed's formulas, written out again here in double straight from
// deepspeed/runtime/lr_schedules.py, plus a few values worked by hand; the scheduler registry;
// scheduler state round trips.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "runtime/error.h"
#include "runtime/optim/adam.h"
#include "runtime/sched/registry.h"

namespace {

using strata::json;
constexpr double kPi = 3.14159265358979323846;

// ---- DeepSpeed's formulas, by last_batch_iteration i ------------------------------------------

double ds_warmup_lr(int64_t i, double min_lr, double max_lr, int64_t warmup_num_steps, bool linear,
                    std::optional<int64_t> total_num_steps = std::nullopt) {
  const int64_t warmup = std::max<int64_t>(2, warmup_num_steps);
  if (i < 0) return min_lr;
  double gamma = 1.0;
  if (i < warmup)
    gamma =
        linear ? double(i) / double(warmup) : std::log(double(i + 1)) / std::log(double(warmup));
  else if (total_num_steps)
    gamma = std::max(
        0.0, double(*total_num_steps - i) / std::max(1.0, double(*total_num_steps - warmup)));
  return min_lr + (max_lr - min_lr) * gamma;
}

double ds_cosine_ratio(int64_t i, double warmup_min_ratio, double cos_min_ratio,
                       int64_t warmup_num_steps, int64_t total_num_steps, bool linear) {
  const int64_t warmup = std::max<int64_t>(2, warmup_num_steps);
  if (i < 0) return 0.0;
  if (i < warmup) {
    const double r =
        linear ? double(i) / double(warmup) : std::log(double(i + 1)) / std::log(double(warmup));
    return warmup_min_ratio + r * (1 - warmup_min_ratio);
  }
  const double last = double(i - warmup + 1);
  const double total = double(std::max<int64_t>(1, total_num_steps - warmup));
  return std::max(0.0,
                  cos_min_ratio + (1 - cos_min_ratio) * (1 + std::cos(kPi * last / total)) / 2);
}

struct OneCycleParams {
  double min_lr = 0.01, max_lr = 0.1, decay_lr_rate = 0.5;
  double first = 10, second = 5, decay_step_size = 4;
  double min_mom = 0.85, max_mom = 0.95, decay_mom_rate = 0.1;
  json to_json(bool cycle_momentum = true) const {
    return {{"cycle_min_lr", min_lr},
            {"cycle_max_lr", max_lr},
            {"decay_lr_rate", decay_lr_rate},
            {"cycle_first_step_size", first},
            {"cycle_second_step_size", second},
            {"cycle_first_stair_count", 0},
            {"cycle_second_stair_count", nullptr},
            {"decay_step_size", decay_step_size},
            {"cycle_momentum", cycle_momentum},
            {"cycle_min_mom", min_mom},
            {"cycle_max_mom", max_mom},
            {"decay_mom_rate", decay_mom_rate}};
  }
};

double ds_one_cycle_scale(int64_t i, const OneCycleParams& p) {
  const double total = p.first + p.second;
  const double ratio = p.first / total;
  const double bi = double(i + 1);
  const double cycle = std::floor(1 + bi / total);
  const double x = 1 + bi / total - cycle;
  return x <= ratio ? x / ratio : (x - 1) / (ratio - 1);
}

double ds_one_cycle_lr(int64_t i, const OneCycleParams& p) {
  if (double(i) < p.first + p.second)
    return p.min_lr + (p.max_lr - p.min_lr) * ds_one_cycle_scale(i, p);
  if (p.decay_step_size == 0 || p.decay_lr_rate == 0) return p.min_lr;
  const double d = double(i) - (p.first + p.second) + 1;
  return p.min_lr / (1 + p.decay_lr_rate * d / p.decay_step_size);
}

double ds_one_cycle_mom(int64_t i, const OneCycleParams& p) {
  if (i < 0) return p.min_mom;  // DeepSpeed's constructor writes cycle_min_mom
  if (double(i) < p.first + p.second)
    return p.max_mom - (p.max_mom - p.min_mom) * ds_one_cycle_scale(i, p);
  if (p.decay_step_size == 0 || p.decay_mom_rate == 0) return p.max_mom;
  const double d = double(i) - (p.first + p.second) + 1;
  return p.max_mom * (1 + p.decay_mom_rate * d / p.decay_step_size);
}

double ds_range_test_lr(int64_t i, double min_lr, double step_size, double step_rate,
                        bool staircase) {
  double interval = double(i + 1) / step_size;
  if (staircase) interval = std::floor(interval);
  return min_lr * (1 + step_rate * interval);
}

// ---- helpers ----------------------------------------------------------------------------------

// An optimizer over one tensor per group, groups at the given lrs.
std::unique_ptr<strata::optim::Adam> make_adam(std::vector<double> lrs = {0.2}) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (double lr : lrs)
    groups.emplace_back(std::vector<torch::Tensor>{torch::zeros({3}, torch::requires_grad())},
                        std::make_unique<strata::optim::AdamOptions>(lr));
  return std::make_unique<strata::optim::Adam>(std::move(groups),
                                               strata::optim::AdamOptions(lrs[0]));
}

double lr_of(const torch::optim::Optimizer& o, size_t group = 0) {
  return o.param_groups()[group].options().get_lr();
}

double beta1_of(const torch::optim::Optimizer& o) {
  return std::get<0>(
      static_cast<const strata::optim::AdamOptions&>(o.param_groups()[0].options()).betas());
}

double beta2_of(const torch::optim::Optimizer& o) {
  return std::get<1>(
      static_cast<const strata::optim::AdamOptions&>(o.param_groups()[0].options()).betas());
}

void expect_lr(const torch::optim::Optimizer& o, double expected, int64_t i, size_t group = 0) {
  EXPECT_NEAR(lr_of(o, group), expected, 1e-12 * std::max(1.0, std::abs(expected)))
      << "last_batch_iteration " << i << ", group " << group;
}

// Steps the scheduler from its start through `last`, checking the optimizer's lr against
// `reference(i)` at construction (i = -1) and after every step.
template <class Reference>
void walk(strata::LRScheduler& s, const torch::optim::Optimizer& o, int64_t last,
          Reference reference) {
  ASSERT_EQ(s.last_batch_iteration(), -1);
  expect_lr(o, reference(-1), -1);
  for (int64_t i = 0; i <= last; ++i) {
    s.step();
    ASSERT_EQ(s.last_batch_iteration(), i);
    expect_lr(o, reference(i), i);
    EXPECT_EQ(s.get_lr(), s.get_last_lr());
  }
}

json warmup_params(const char* type, std::optional<int64_t> total = std::nullopt) {
  json p = {{"warmup_min_lr", 0.01},
            {"warmup_max_lr", 0.1},
            {"warmup_num_steps", 10},
            {"warmup_type", type}};
  if (total) p["total_num_steps"] = *total;
  return p;
}

// ---- WarmupLR / WarmupDecayLR -----------------------------------------------------------------

TEST(WarmupLR, MatchesDeepSpeedForBothWarmupTypes) {
  for (bool linear : {false, true}) {
    SCOPED_TRACE(linear ? "linear" : "log");
    auto opt = make_adam();
    strata::WarmupLR s(*opt, warmup_params(linear ? "linear" : "log"));
    walk(s, *opt, 15, [&](int64_t i) { return ds_warmup_lr(i, 0.01, 0.1, 10, linear); });
  }
}

TEST(WarmupLR, HandWorkedValues) {
  auto opt = make_adam();
  strata::WarmupLR s(*opt, warmup_params("log"));
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);  // constructor: warmup_min_lr
  s.step(0);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);  // log(1) = 0
  s.step(4);
  EXPECT_NEAR(lr_of(*opt), 0.01 + 0.09 * 0.69897000433601886, 1e-15);  // log10(5)
  s.step(9);
  EXPECT_NEAR(lr_of(*opt), 0.1, 1e-15);  // end of warmup: log(10)/log(10)
  s.step(10);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.1);

  auto lin = make_adam();
  strata::WarmupLR l(*lin, warmup_params("linear"));
  l.step(4);
  EXPECT_NEAR(lr_of(*lin), 0.01 + 0.09 * 0.4, 1e-15);
  l.step(9);
  EXPECT_NEAR(lr_of(*lin), 0.01 + 0.09 * 0.9, 1e-15);  // linear never reaches max before step 10
  l.step(10);
  EXPECT_DOUBLE_EQ(lr_of(*lin), 0.1);
}

// DeepSpeed's order: optimizer.step() then scheduler.step(); the constructor's lr serves the
// first optimizer step and iteration 0's (the same, for a warmup) the second.
TEST(WarmupLR, LrSeenByEachOptimizerStep) {
  auto opt = make_adam();
  strata::WarmupLR s(*opt, {{"warmup_min_lr", 0.0},
                            {"warmup_max_lr", 0.1},
                            {"warmup_num_steps", 4},
                            {"warmup_type", "linear"}});
  std::vector<double> used;
  for (int k = 0; k < 7; ++k) {
    used.push_back(lr_of(*opt));  // what optimizer.step() would use now
    s.step();
  }
  const std::vector<double> expected = {0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.1};
  ASSERT_EQ(used.size(), expected.size());
  for (size_t k = 0; k < used.size(); ++k)
    EXPECT_NEAR(used[k], expected[k], 1e-15) << "step " << k + 1;
}

TEST(WarmupLR, MaxLrDefaultsToEachGroupsLr) {
  auto opt = make_adam({0.1, 0.2});
  strata::WarmupLR s(*opt, {{"warmup_min_lr", 0.0},
                            {"warmup_max_lr", nullptr},
                            {"warmup_num_steps", 3},
                            {"warmup_type", "linear"}});
  expect_lr(*opt, 0.0, -1, 0);
  expect_lr(*opt, 0.0, -1, 1);
  s.step(5);
  expect_lr(*opt, 0.1, 5, 0);
  expect_lr(*opt, 0.2, 5, 1);
}

TEST(WarmupLR, PerGroupListsAndUnknownWarmupType) {
  auto opt = make_adam({0.1, 0.2});
  strata::WarmupLR s(*opt, {{"warmup_min_lr", {0.0, 0.01}},
                            {"warmup_max_lr", {0.1, 0.3}},
                            {"warmup_num_steps", 10},
                            {"warmup_type", "cosine"}});
  ASSERT_EQ(s.warnings().size(), 1u);  // DeepSpeed warns and falls back to log
  s.step(4);
  expect_lr(*opt, ds_warmup_lr(4, 0.0, 0.1, 10, false), 4, 0);
  expect_lr(*opt, ds_warmup_lr(4, 0.01, 0.3, 10, false), 4, 1);
  EXPECT_THROW(strata::WarmupLR(*opt, {{"warmup_min_lr", {0.0}},
                                       {"warmup_max_lr", 0.1},
                                       {"warmup_num_steps", 10},
                                       {"warmup_type", "log"}}),
               strata::Error);
}

TEST(WarmupDecayLR, MatchesDeepSpeedForBothWarmupTypes) {
  for (bool linear : {false, true}) {
    SCOPED_TRACE(linear ? "linear" : "log");
    auto opt = make_adam();
    strata::WarmupDecayLR s(*opt, warmup_params(linear ? "linear" : "log", 30));
    walk(s, *opt, 40, [&](int64_t i) { return ds_warmup_lr(i, 0.01, 0.1, 10, linear, 30); });
  }
}

TEST(WarmupDecayLR, HandWorkedValues) {
  auto opt = make_adam();
  strata::WarmupDecayLR s(*opt, warmup_params("linear", 30));
  s.step(10);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.1);  // end of warmup: (30 - 10) / 20 = 1
  s.step(20);
  EXPECT_NEAR(lr_of(*opt), 0.055, 1e-15);  // halfway down
  s.step(30);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);  // warmup_min_lr + 0
  s.step(35);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);  // gamma clamps at 0
}

// ---- WarmupCosineLR ---------------------------------------------------------------------------

json cosine_params(const char* type) {
  return {{"total_num_steps", 30},
          {"warmup_min_ratio", 0.1},
          {"warmup_num_steps", 10},
          {"cos_min_ratio", 0.01},
          {"warmup_type", type}};
}

TEST(WarmupCosineLR, MatchesDeepSpeedForBothWarmupTypes) {
  for (bool linear : {false, true}) {
    SCOPED_TRACE(linear ? "linear" : "log");
    auto opt = make_adam({0.2});
    strata::WarmupCosineLR s(*opt, cosine_params(linear ? "linear" : "log"));
    walk(s, *opt, 40,
         [&](int64_t i) { return 0.2 * ds_cosine_ratio(i, 0.1, 0.01, 10, 30, linear); });
  }
}

TEST(WarmupCosineLR, HandWorkedValuesRelativeToEachGroupsLr) {
  auto opt = make_adam({0.2, 0.4});
  strata::WarmupCosineLR s(*opt, cosine_params("linear"));
  expect_lr(*opt, 0.0, -1, 0);  // every group starts at 0
  expect_lr(*opt, 0.0, -1, 1);
  s.step(0);
  expect_lr(*opt, 0.2 * 0.1, 0, 0);  // warmup_min_ratio
  expect_lr(*opt, 0.4 * 0.1, 0, 1);
  s.step(5);
  expect_lr(*opt, 0.2 * (0.1 + 0.5 * 0.9), 5, 0);
  s.step(9);
  expect_lr(*opt, 0.2 * (0.1 + 0.9 * 0.9), 9, 0);  // last warmup iteration
  s.step(10);
  expect_lr(*opt, 0.2 * (0.01 + 0.99 * (1 + std::cos(kPi / 20)) / 2), 10, 0);
  s.step(19);
  expect_lr(*opt, 0.2 * 0.505, 19, 0);  // cos(pi / 2) = 0
  expect_lr(*opt, 0.4 * 0.505, 19, 1);
  s.step(29);
  expect_lr(*opt, 0.2 * 0.01, 29, 0);  // cos(pi) = -1: cos_min_ratio
}

TEST(WarmupCosineLR, UnknownWarmupTypeIsAnError) {
  auto opt = make_adam();
  EXPECT_THROW(strata::WarmupCosineLR(*opt, cosine_params("exp")), strata::Error);
}

// ---- OneCycle ---------------------------------------------------------------------------------

TEST(OneCycle, LrAndMomentumMatchDeepSpeedInEveryPhase) {
  const OneCycleParams p;
  auto opt = make_adam();
  strata::OneCycle s(*opt, p.to_json());
  ASSERT_TRUE(s.cycle_momentum());
  EXPECT_TRUE(s.warnings().empty());
  EXPECT_DOUBLE_EQ(beta1_of(*opt), p.min_mom);  // constructor
  EXPECT_DOUBLE_EQ(beta2_of(*opt), 0.99);       // DeepSpeed's fixed beta2
  walk(s, *opt, 30, [&](int64_t i) {
    EXPECT_NEAR(beta1_of(*opt), ds_one_cycle_mom(i, p), 1e-12) << "iteration " << i;
    EXPECT_DOUBLE_EQ(beta2_of(*opt), 0.99);
    return ds_one_cycle_lr(i, p);
  });
}

TEST(OneCycle, HandWorkedValues) {
  const OneCycleParams p;  // up over 10, down over 5, then decay every 4
  auto opt = make_adam();
  strata::OneCycle s(*opt, p.to_json());
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);
  s.step(4);  // 5 / 15 of the cycle: halfway up
  EXPECT_NEAR(lr_of(*opt), 0.055, 1e-15);
  EXPECT_NEAR(beta1_of(*opt), 0.9, 1e-15);
  s.step(9);  // the peak
  EXPECT_NEAR(lr_of(*opt), 0.1, 1e-15);
  EXPECT_NEAR(beta1_of(*opt), 0.85, 1e-15);
  s.step(11);  // 2 of 5 steps down
  EXPECT_NEAR(lr_of(*opt), 0.01 + 0.09 * 0.6, 1e-15);
  s.step(14);  // end of the cycle
  EXPECT_NEAR(lr_of(*opt), 0.01, 1e-15);
  EXPECT_NEAR(beta1_of(*opt), 0.95, 1e-15);
  s.step(15);  // decay, one step in
  EXPECT_NEAR(lr_of(*opt), 0.01 / 1.125, 1e-15);
  EXPECT_NEAR(beta1_of(*opt), 0.95 * 1.025, 1e-15);  // DeepSpeed multiplies momentum
}

TEST(OneCycle, NoDecayWhenDecayStepSizeIsZero) {
  OneCycleParams p;
  p.decay_step_size = 0;
  auto opt = make_adam();
  strata::OneCycle s(*opt, p.to_json());
  walk(s, *opt, 25, [&](int64_t i) {
    EXPECT_NEAR(beta1_of(*opt), ds_one_cycle_mom(i, p), 1e-12) << "iteration " << i;
    return ds_one_cycle_lr(i, p);
  });
  EXPECT_DOUBLE_EQ(lr_of(*opt), p.min_lr);
  EXPECT_DOUBLE_EQ(beta1_of(*opt), p.max_mom);
}

TEST(OneCycle, CyclesTorchAdamBetas) {
  const OneCycleParams p;
  torch::optim::Adam opt({torch::zeros({2}, torch::requires_grad())},
                         torch::optim::AdamOptions(0.1).betas(std::make_tuple(0.9, 0.999)));
  strata::OneCycle s(opt, p.to_json());
  auto beta = [&] {
    return static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options()).betas();
  };
  EXPECT_DOUBLE_EQ(std::get<0>(beta()), p.min_mom);
  s.step(4);
  EXPECT_NEAR(std::get<0>(beta()), 0.9, 1e-15);
  EXPECT_DOUBLE_EQ(std::get<1>(beta()), 0.99);
}

// As in DeepSpeed, an optimizer without betas (SGD) gets lr cycling only, and a warning.
TEST(OneCycle, SgdMomentumIsNotCycled) {
  const OneCycleParams p;
  torch::optim::SGD opt({torch::zeros({2}, torch::requires_grad())},
                        torch::optim::SGDOptions(0.1).momentum(0.9));
  strata::OneCycle s(opt, p.to_json());
  EXPECT_FALSE(s.cycle_momentum());
  EXPECT_EQ(s.warnings().size(), 1u);
  EXPECT_TRUE(s.get_mom().empty());
  walk(s, opt, 20, [&](int64_t i) { return ds_one_cycle_lr(i, p); });
  EXPECT_DOUBLE_EQ(
      static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).momentum(), 0.9);
}

TEST(OneCycle, StairCountsHaveNoEffectAsInDeepSpeed) {
  const OneCycleParams p;
  json stairs = p.to_json();
  stairs["cycle_first_stair_count"] = 4;
  auto a = make_adam();
  auto b = make_adam();
  strata::OneCycle plain(*a, p.to_json());
  strata::OneCycle stepped(*b, stairs);
  EXPECT_EQ(stepped.warnings().size(), 1u);
  for (int i = 0; i < 20; ++i) {
    plain.step();
    stepped.step();
    EXPECT_DOUBLE_EQ(lr_of(*a), lr_of(*b));
  }
}

// ---- LRRangeTest ------------------------------------------------------------------------------

TEST(LRRangeTest, ContinuousAndStaircaseMatchDeepSpeed) {
  for (bool staircase : {false, true}) {
    SCOPED_TRACE(staircase ? "staircase" : "continuous");
    auto opt = make_adam();
    strata::LRRangeTest s(*opt, {{"lr_range_test_min_lr", 0.001},
                                 {"lr_range_test_step_size", 4},
                                 {"lr_range_test_step_rate", 2.0},
                                 {"lr_range_test_staircase", staircase}});
    walk(s, *opt, 20, [&](int64_t i) { return ds_range_test_lr(i, 0.001, 4, 2.0, staircase); });
  }
}

TEST(LRRangeTest, HandWorkedValues) {
  const json base = {{"lr_range_test_min_lr", 0.001},
                     {"lr_range_test_step_size", 4},
                     {"lr_range_test_step_rate", 2.0},
                     {"lr_range_test_staircase", true}};
  auto opt = make_adam();
  strata::LRRangeTest stairs(*opt, base);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.001);
  stairs.step(2);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.001);  // floor(3 / 4) = 0
  stairs.step(3);
  EXPECT_NEAR(lr_of(*opt), 0.003, 1e-15);  // floor(4 / 4) = 1
  json continuous = base;
  continuous["lr_range_test_staircase"] = false;
  strata::LRRangeTest smooth(*opt, continuous);
  smooth.step(2);
  EXPECT_NEAR(lr_of(*opt), 0.0025, 1e-15);  // 1 + 2 * 3 / 4
}

// ---- state ------------------------------------------------------------------------------------

template <class Scheduler>
void round_trip(const json& params, int64_t steps_before, int64_t steps_after) {
  auto opt_a = make_adam();
  Scheduler a(*opt_a, params);
  for (int64_t i = 0; i < steps_before; ++i) a.step();
  const json state = a.state_dict();
  EXPECT_EQ(state, json({{"last_batch_iteration", steps_before - 1}}));

  auto opt_b = make_adam();
  Scheduler b(*opt_b, params);
  b.load_state_dict(state);
  EXPECT_EQ(b.last_batch_iteration(), a.last_batch_iteration());
  EXPECT_DOUBLE_EQ(lr_of(*opt_b), lr_of(*opt_a));  // the next optimizer step's lr
  EXPECT_DOUBLE_EQ(beta1_of(*opt_b), beta1_of(*opt_a));
  for (int64_t i = 0; i < steps_after; ++i) {
    a.step();
    b.step();
    EXPECT_DOUBLE_EQ(lr_of(*opt_b), lr_of(*opt_a)) << "step " << i;
    EXPECT_DOUBLE_EQ(beta1_of(*opt_b), beta1_of(*opt_a)) << "step " << i;
  }
}

TEST(SchedulerState, RoundTripContinuesIdentically) {
  round_trip<strata::WarmupLR>(warmup_params("log"), 7, 10);
  round_trip<strata::WarmupDecayLR>(warmup_params("linear", 30), 12, 25);
  round_trip<strata::WarmupCosineLR>(cosine_params("log"), 7, 30);
  round_trip<strata::OneCycle>(OneCycleParams().to_json(), 9, 20);
  round_trip<strata::LRRangeTest>({{"lr_range_test_min_lr", 0.001},
                                   {"lr_range_test_step_size", 4},
                                   {"lr_range_test_step_rate", 2.0},
                                   {"lr_range_test_staircase", true}},
                                  5, 10);
}

TEST(SchedulerState, ResumeIterationLeavesOptimizerAlone) {
  auto opt = make_adam({0.2});
  json p = warmup_params("linear");
  p["last_batch_iteration"] = 4;
  strata::WarmupLR s(*opt, p);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.2);  // DeepSpeed writes nothing when resuming
  s.step();
  expect_lr(*opt, ds_warmup_lr(5, 0.01, 0.1, 10, true), 5);
}

// ---- registry ---------------------------------------------------------------------------------

strata::SchedulerConfig config(const std::string& type, json params) {
  strata::SchedulerConfig c;
  c.present = true;
  c.type = type;
  c.params = std::move(params);
  return c;
}

TEST(SchedulerRegistry, BuiltinsAreRegisteredAndCaseInsensitive) {
  const auto names = strata::scheduler_names();
  for (const char* name :
       {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;

  auto opt = make_adam();
  auto s = strata::make_scheduler(config("warmupdecaylr", warmup_params("log", 30)), *opt);
  ASSERT_NE(dynamic_cast<strata::WarmupDecayLR*>(s.get()), nullptr);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);
  auto c = strata::make_scheduler(config("WarmupCosineLR", cosine_params("linear")), *opt);
  EXPECT_NE(dynamic_cast<strata::WarmupCosineLR*>(c.get()), nullptr);
}

// A program's own schedule: halve the lr every step.
class HalvingLR : public strata::LRScheduler {
 public:
  HalvingLR(torch::optim::Optimizer& optimizer, double base) : LRScheduler(optimizer), base_(base) {
    start(-1);
  }
  std::vector<double> get_lr() const override {
    return std::vector<double>(group_count(),
                               base_ * std::pow(0.5, double(last_batch_iteration_ + 1)));
  }

 private:
  double base_;
};

TEST(SchedulerRegistry, RegisteredSchedulerIsMadeByName) {
  strata::register_scheduler("TestHalvingLR", [](torch::optim::Optimizer& o, const json& p) {
    return std::make_unique<HalvingLR>(o, p.at("base").get<double>());
  });
  auto opt = make_adam();
  auto s = strata::make_scheduler(config("TESTHALVINGLR", {{"base", 0.8}}), *opt);
  ASSERT_NE(dynamic_cast<HalvingLR*>(s.get()), nullptr);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.8);
  s->step();
  s->step();
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.2);
  EXPECT_THROW(strata::register_scheduler("testhalvinglr",
                                          [](torch::optim::Optimizer& o, const json&) {
                                            return std::make_unique<HalvingLR>(o, 1.0);
                                          }),
               strata::Error);
  EXPECT_THROW(strata::register_scheduler("warmuplr", nullptr), strata::Error);
}

TEST(SchedulerRegistry, UnknownTypeListsRegisteredNames) {
  auto opt = make_adam();
  try {
    strata::make_scheduler(config("CosineLR", cosine_params("log")), *opt);
    FAIL() << "no error for an unknown scheduler";
  } catch (const strata::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("\"CosineLR\""), std::string::npos) << what;
    for (const char* name :
         {"LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"})
      EXPECT_NE(what.find(name), std::string::npos) << name << " in: " << what;
  }
}

TEST(SchedulerRegistry, MissingParamNamesItsPath) {
  auto opt = make_adam();
  json p = warmup_params("log");
  p.erase("warmup_num_steps");
  try {
    strata::make_scheduler(config("WarmupLR", p), *opt);
    FAIL() << "no error for a missing param";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("scheduler.params.warmup_num_steps"), std::string::npos)
        << e.what();
  }
}

}  // namespace
