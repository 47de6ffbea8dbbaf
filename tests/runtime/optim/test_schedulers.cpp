// The LR schedules against DeepSpeed's current formulas (ds_lr_schedules.h, written again there
// from deepspeed/runtime/lr_schedules.py) at every iteration from -1 to well past the end, plus
// a few values worked by hand; the scheduler registry; scheduler state round trips.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/optim/adam.h"
#include "runtime/sched/registry.h"
#include "tests/runtime/optim/ds_lr_schedules.h"

namespace {

using strata::json;
using ds::kPi;

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

double beta1_of(const torch::optim::Optimizer& o, size_t group = 0) {
  return std::get<0>(
      static_cast<const strata::optim::AdamOptions&>(o.param_groups()[group].options()).betas());
}

double beta2_of(const torch::optim::Optimizer& o) {
  return std::get<1>(
      static_cast<const strata::optim::AdamOptions&>(o.param_groups()[0].options()).betas());
}

// Within 1e-9 relative of DeepSpeed's value (absolute near 0).
double tolerance(double expected) { return std::max(1e-9 * std::abs(expected), 1e-15); }

void expect_lr(const torch::optim::Optimizer& o, double expected, int64_t i, size_t group = 0) {
  EXPECT_NEAR(lr_of(o, group), expected, tolerance(expected))
      << "last_batch_iteration " << i << ", group " << group;
}

std::vector<double> per_group(double v) { return {v}; }
std::vector<double> per_group(std::vector<double> v) { return v; }

// Steps the scheduler from its start through `last`, checking every group's lr against
// `reference(i)` (one value, or one per group) at construction (i = -1) and after every step.
template <class Reference>
void walk(strata::LRScheduler& s, const torch::optim::Optimizer& o, int64_t last,
          Reference reference) {
  ASSERT_EQ(s.last_batch_iteration(), -1);
  for (int64_t i = -1; i <= last; ++i) {
    if (i >= 0) s.step();
    ASSERT_EQ(s.last_batch_iteration(), i);
    const std::vector<double> expected = per_group(reference(i));
    ASSERT_EQ(expected.size(), o.param_groups().size());
    for (size_t g = 0; g < expected.size(); ++g) expect_lr(o, expected[g], i, g);
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
    walk(s, *opt, 30, [&](int64_t i) { return ds::warmup_lr(i, 0.01, 0.1, 10, linear); });
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
  expect_lr(*opt, ds::warmup_lr(4, 0.0, 0.1, 10, false), 4, 0);
  expect_lr(*opt, ds::warmup_lr(4, 0.01, 0.3, 10, false), 4, 1);
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
    walk(s, *opt, 90, [&](int64_t i) { return ds::warmup_lr(i, 0.01, 0.1, 10, linear, 30); });
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

json cosine_params(const char* type, int64_t total = 30, int64_t warmup = 10) {
  return {{"total_num_steps", total},
          {"warmup_min_ratio", 0.1},
          {"warmup_num_steps", warmup},
          {"cos_min_ratio", 0.01},
          {"warmup_type", type}};
}

// Past total_num_steps the ratio stays at cos_min_ratio (DeepSpeed #8142), also when the decay
// window is one step, empty or negative; warmup_num_steps 1 reads as 2.
TEST(WarmupCosineLR, MatchesDeepSpeedForBothWarmupTypesToWellPastTheEnd) {
  const std::vector<double> lrs = {0.2, 0.05};
  for (bool linear : {false, true}) {
    for (auto [total, warmup] : std::vector<std::pair<int64_t, int64_t>>{
             {30, 10}, {11, 10}, {10, 10}, {4, 10}, {25, 1}, {1000, 100}}) {
      SCOPED_TRACE(fmt::format("{}, total {}, warmup {}", linear ? "linear" : "log", total,
                               warmup));
      auto opt = make_adam(lrs);
      strata::WarmupCosineLR s(*opt, cosine_params(linear ? "linear" : "log", total, warmup));
      walk(s, *opt, 3 * std::max(total, warmup) + 20, [&](int64_t i) {
        const double r = ds::cosine_ratio(i, 0.1, 0.01, warmup, total, linear);
        return std::vector<double>{lrs[0] * r, lrs[1] * r};
      });
    }
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
  for (int64_t i : {30, 39, 49, 1000}) {  // it stays there (unclamped, 49 was back at the top)
    s.step(i);
    expect_lr(*opt, 0.2 * 0.01, i, 0);
    expect_lr(*opt, 0.4 * 0.01, i, 1);
  }
}

// DeepSpeed #8151: an unknown warmup_type warns and warms up by "log".
TEST(WarmupCosineLR, UnknownWarmupTypeWarnsAndUsesLog) {
  auto a = make_adam();
  auto b = make_adam();
  strata::WarmupCosineLR unknown(*a, cosine_params("exp"));
  strata::WarmupCosineLR log(*b, cosine_params("log"));
  ASSERT_EQ(unknown.warnings().size(), 1u);
  EXPECT_NE(unknown.warnings()[0].find("warmup_type = \"exp\""), std::string::npos)
      << unknown.warnings()[0];
  EXPECT_TRUE(log.warnings().empty());
  for (int i = 0; i < 40; ++i) {
    unknown.step();
    log.step();
    EXPECT_EQ(lr_of(*a), lr_of(*b)) << "iteration " << i;
  }
}

// ---- OneCycle ---------------------------------------------------------------------------------

// Every group's lr and beta1 against DeepSpeed's, from -1 to well past the cycle's end.
void walk_one_cycle(const ds::OneCycle& p, int64_t past_the_end = 40) {
  auto opt = make_adam(std::vector<double>(p.min_lrs.size(), 0.5));
  strata::OneCycle s(*opt, p.to_json());
  ASSERT_TRUE(s.cycle_momentum());
  EXPECT_TRUE(s.warnings().empty());
  walk(s, *opt, static_cast<int64_t>(p.first + p.second) + past_the_end, [&](int64_t i) {
    const std::vector<double> mom = p.mom(i);
    for (size_t g = 0; g < mom.size(); ++g) {
      EXPECT_NEAR(beta1_of(*opt, g), mom[g], tolerance(mom[g]))
          << "iteration " << i << ", group " << g;
      EXPECT_DOUBLE_EQ(beta2_of(*opt), 0.99);  // DeepSpeed's fixed beta2
    }
    return p.lr(i);
  });
}

TEST(OneCycle, LrAndMomentumMatchDeepSpeedInEveryPhase) { walk_one_cycle(ds::OneCycle()); }

TEST(OneCycle, HandWorkedValues) {
  const ds::OneCycle p;  // up over 10, down over 5, then decay every 4
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
  ds::OneCycle p;
  p.decay_step_size = 0;
  walk_one_cycle(p, 25);
}

// DeepSpeed #8179: stair counts 0 (continuous), 1 and several, each half its own or the first's,
// in cycles whose halves the stairs divide and do not; two groups with their own bounds (#8201).
TEST(OneCycle, StairsMatchDeepSpeedForEveryCountAndShape) {
  struct Stairs {
    int64_t first;
    std::optional<int64_t> second;
  };
  const std::vector<Stairs> counts = {{0, std::nullopt}, {1, std::nullopt}, {1, 0}, {0, 1},
                                      {4, std::nullopt}, {3, 2},            {2, 5}, {10, 5},
                                      {7, 3},            {0, 6}};
  const std::vector<std::pair<double, double>> shapes = {{10, 5}, {8, 8},    {7, 3},
                                                         {3, 7},  {1000, 333}, {5, 0}};
  for (auto [first, second] : shapes) {
    for (const Stairs& stairs : counts) {
      ds::OneCycle p;
      p.min_lrs = {0.01, 0.002};
      p.max_lrs = {0.1, 0.03};
      p.min_moms = {0.85, 0.8};
      p.max_moms = {0.95, 0.9};
      p.first = first;
      p.second = second;
      p.first_stairs = stairs.first;
      p.second_stairs = stairs.second;
      SCOPED_TRACE(fmt::format("halves {} and {}, stairs {} and {}", first, second, stairs.first,
                               stairs.second ? std::to_string(*stairs.second) : "null"));
      walk_one_cycle(p);
    }
  }
}

// DeepSpeed #8166 allows cycle_second_step_size 0: a cycle with no way down. Its step_ratio is 1,
// so every iteration of the cycle goes up (and a stair position is counted over the first half,
// never divided by the 0); the cycle's last iteration, b = total_size, wraps to x = 0, so
// cycle_max_lr is never written and that iteration gives cycle_min_lr before the decay phase.
TEST(OneCycle, ZeroSecondHalfMatchesDeepSpeed) {
  for (int64_t stairs : {0, 1, 2, 3, 10, -1}) {
    for (double decay_step_size : {4.0, 0.0}) {
      ds::OneCycle p;
      p.first = 10;
      p.second = 0;
      p.first_stairs = stairs;
      p.decay_step_size = decay_step_size;
      SCOPED_TRACE(fmt::format("stairs {}, decay_step_size {}", stairs, decay_step_size));
      walk_one_cycle(p);
    }
  }
  // Two groups, a first half the stairs do not divide, the second count (unused) its own.
  ds::OneCycle groups;
  groups.min_lrs = {0.01, 0.002};
  groups.max_lrs = {0.1, 0.03};
  groups.min_moms = {0.85, 0.8};
  groups.max_moms = {0.95, 0.9};
  groups.first = 7;
  groups.second = 0;
  groups.first_stairs = 3;
  groups.second_stairs = 5;
  walk_one_cycle(groups);

  // By hand, min 0.01 and max 0.1 up over 10, then decay every 4 at rate 0.5.
  ds::OneCycle p;
  p.first = 10;
  p.second = 0;
  auto opt = make_adam();
  strata::OneCycle s(*opt, p.to_json());
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);
  s.step(0);  // 1 / 10 of the way up
  EXPECT_NEAR(lr_of(*opt), 0.019, 1e-15);
  s.step(8);  // 9 / 10: the highest lr of the cycle
  EXPECT_NEAR(lr_of(*opt), 0.091, 1e-15);
  EXPECT_NEAR(beta1_of(*opt), 0.86, 1e-15);
  s.step(9);  // b = 10 = total_size: x wraps to 0
  EXPECT_NEAR(lr_of(*opt), 0.01, 1e-15);
  EXPECT_NEAR(beta1_of(*opt), 0.95, 1e-15);
  s.step(10);  // decay, one step in
  EXPECT_NEAR(lr_of(*opt), 0.01 / 1.125, 1e-15);
  EXPECT_NEAR(beta1_of(*opt), 0.95 * 1.025, 1e-15);
  // Two stairs over the 10: flat at 0.01 for b 0..4, at 0.055 for b 5..9, 0.01 again at b = 10.
  p.first_stairs = 2;
  auto opt2 = make_adam();
  strata::OneCycle st(*opt2, p.to_json());
  const std::vector<double> lrs = {0.01, 0.01, 0.01, 0.01, 0.055, 0.055, 0.055, 0.055, 0.055, 0.01};
  for (size_t k = 0; k < lrs.size(); ++k) {
    st.step();
    EXPECT_NEAR(lr_of(*opt2), lrs[k], 1e-15) << "iteration " << k;
  }
}

// DeepSpeed makes stairs only `if stair_count > 0`: a negative count (-1 is the default of its
// command line) is a continuous half, on either side, the same numbers as a count of 0.
TEST(OneCycle, NegativeStairCountsAreContinuous) {
  struct Stairs {
    int64_t first;
    std::optional<int64_t> second;
  };
  const std::vector<Stairs> counts = {{-1, std::nullopt}, {-1, -1}, {-7, std::nullopt},
                                      {-1, 0},            {0, -1},  {-1, 3},
                                      {4, -1},            {-2, -5}};
  for (auto [first, second] : std::vector<std::pair<double, double>>{{10, 5}, {7, 3}, {6, 0}}) {
    for (const Stairs& stairs : counts) {
      ds::OneCycle p;
      p.first = first;
      p.second = second;
      p.first_stairs = stairs.first;
      p.second_stairs = stairs.second;
      SCOPED_TRACE(fmt::format("halves {} and {}, stairs {} and {}", first, second, stairs.first,
                               stairs.second ? std::to_string(*stairs.second) : "null"));
      walk_one_cycle(p);

      // Against Strata itself: each negative count gives what 0 gives on its half.
      ds::OneCycle zeroed = p;
      zeroed.first_stairs = std::max<int64_t>(0, p.first_stairs);
      if (p.second_stairs) zeroed.second_stairs = std::max<int64_t>(0, *p.second_stairs);
      else zeroed.second_stairs = zeroed.first_stairs;
      auto opt_a = make_adam();
      auto opt_b = make_adam();
      strata::OneCycle a(*opt_a, p.to_json());
      strata::OneCycle b(*opt_b, zeroed.to_json());
      for (int64_t i = 0; i < static_cast<int64_t>(first + second) + 5; ++i) {
        a.step();
        b.step();
        EXPECT_EQ(lr_of(*opt_a), lr_of(*opt_b)) << "iteration " << i;
        EXPECT_EQ(beta1_of(*opt_a), beta1_of(*opt_b)) << "iteration " << i;
      }
    }
  }
}

// Both through the config, as DeepSpeed would take them from its JSON: the schema passes them on
// (tests/runtime/config checks the printout) and the scheduler it makes gives DeepSpeed's numbers.
TEST(OneCycle, ZeroSecondHalfAndNegativeStairsFromAConfig) {
  const strata::Config c = strata::parse_config_text(R"({"train_batch_size": 8,
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": [0.01, 0.002],
        "cycle_max_lr": [0.1, 0.03], "cycle_first_step_size": 10, "cycle_second_step_size": 0,
        "cycle_first_stair_count": -1, "decay_step_size": 4, "decay_lr_rate": 0.5,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}}})",
                                                     "test.json");
  ds::OneCycle p;
  p.min_lrs = {0.01, 0.002};
  p.max_lrs = {0.1, 0.03};
  p.min_moms = {0.85, 0.85};
  p.max_moms = {0.95, 0.95};
  p.first = 10;
  p.second = 0;
  p.first_stairs = -1;
  auto opt = make_adam({0.5, 0.5});
  auto s = strata::make_scheduler(c.scheduler, *opt);
  ASSERT_NE(dynamic_cast<strata::OneCycle*>(s.get()), nullptr);
  walk(*s, *opt, 40, [&](int64_t i) {
    const std::vector<double> mom = p.mom(i);
    for (size_t g = 0; g < mom.size(); ++g)
      EXPECT_NEAR(beta1_of(*opt, g), mom[g], tolerance(mom[g])) << "iteration " << i;
    return p.lr(i);
  });
}

// The example of DeepSpeed #8179 (min 0.001, max 0.01, halves of 8), and the way down.
TEST(OneCycle, StairsHoldLrAndMomentumFlat) {
  ds::OneCycle p;
  p.min_lrs = {0.001};
  p.max_lrs = {0.01};
  p.first = p.second = 8;
  const std::vector<std::pair<int64_t, std::vector<double>>> by_count = {
      {0, {0.002125, 0.00325, 0.004375, 0.0055, 0.006625, 0.00775, 0.008875, 0.01}},
      {2, {0.001, 0.001, 0.001, 0.0055, 0.0055, 0.0055, 0.0055, 0.01,  // up
           0.0055, 0.0055, 0.0055, 0.0055, 0.001, 0.001, 0.001, 0.001}},  // down
      {4, {0.001, 0.00325, 0.00325, 0.0055, 0.0055, 0.00775, 0.00775, 0.01}},
      {8, {0.002125, 0.00325, 0.004375, 0.0055, 0.006625, 0.00775, 0.008875, 0.01}}};
  for (const auto& [count, lrs] : by_count) {
    p.first_stairs = count;
    auto opt = make_adam();
    strata::OneCycle s(*opt, p.to_json());
    for (size_t k = 0; k < lrs.size(); ++k) {
      s.step();
      EXPECT_NEAR(lr_of(*opt), lrs[k], 1e-15) << "stairs " << count << ", iteration " << k;
      // beta1 moves with the lr: max_mom at min_lr, min_mom at max_lr
      EXPECT_NEAR(beta1_of(*opt), 0.95 - 0.1 * (lrs[k] - 0.001) / 0.009, 1e-12);
    }
  }
}

// DeepSpeed #8201: the four bounds take one value per param group; a list of another length is
// an error before the optimizer is touched.
TEST(OneCycle, PerGroupBounds) {
  ds::OneCycle p;
  p.min_lrs = {0.01, 0.002};
  p.max_lrs = {0.1, 0.03};
  p.min_moms = {0.85, 0.8};
  p.max_moms = {0.95, 0.9};
  auto opt = make_adam({0.5, 0.5});
  strata::OneCycle s(*opt, p.to_json());
  for (size_t g : {0, 1}) {
    expect_lr(*opt, p.min_lrs[g], -1, g);
    EXPECT_DOUBLE_EQ(beta1_of(*opt, g), p.min_moms[g]);
  }
  s.step(9);  // the peak
  for (size_t g : {0, 1}) {
    expect_lr(*opt, p.max_lrs[g], 9, g);
    EXPECT_NEAR(beta1_of(*opt, g), p.min_moms[g], 1e-15);
  }
  for (const char* key : {"cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"}) {
    json bad = p.to_json();
    bad[key] = {0.1, 0.2, 0.3};
    auto fresh = make_adam({0.5, 0.5});
    EXPECT_THROW(strata::OneCycle(*fresh, bad), strata::Error) << key;
    EXPECT_EQ(lr_of(*fresh, 0), 0.5) << key;
  }
  // As in DeepSpeed, momentum bounds are not read where momentum does not cycle.
  json sgd_params = p.to_json();
  sgd_params["cycle_min_lr"] = 0.01;
  sgd_params["cycle_max_lr"] = 0.1;
  torch::optim::SGD sgd({torch::zeros({2}, torch::requires_grad())}, torch::optim::SGDOptions(0.1));
  EXPECT_NO_THROW(strata::OneCycle(sgd, sgd_params));
}

TEST(OneCycle, CyclesTorchAdamBetas) {
  const ds::OneCycle p;
  torch::optim::Adam opt({torch::zeros({2}, torch::requires_grad())},
                         torch::optim::AdamOptions(0.1).betas(std::make_tuple(0.9, 0.999)));
  strata::OneCycle s(opt, p.to_json());
  auto beta = [&] {
    return static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options()).betas();
  };
  EXPECT_DOUBLE_EQ(std::get<0>(beta()), 0.85);
  s.step(4);
  EXPECT_NEAR(std::get<0>(beta()), 0.9, 1e-15);
  EXPECT_DOUBLE_EQ(std::get<1>(beta()), 0.99);
}

// As in DeepSpeed, an optimizer without betas (SGD) gets lr cycling only, and a warning.
TEST(OneCycle, SgdMomentumIsNotCycled) {
  const ds::OneCycle p;
  torch::optim::SGD opt({torch::zeros({2}, torch::requires_grad())},
                        torch::optim::SGDOptions(0.1).momentum(0.9));
  strata::OneCycle s(opt, p.to_json());
  EXPECT_FALSE(s.cycle_momentum());
  EXPECT_EQ(s.warnings().size(), 1u);
  EXPECT_TRUE(s.get_mom().empty());
  walk(s, opt, 20, [&](int64_t i) { return p.lr(i); });
  EXPECT_DOUBLE_EQ(
      static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).momentum(), 0.9);
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
    walk(s, *opt, 20, [&](int64_t i) { return ds::range_test_lr(i, 0.001, 4, 2.0, staircase); });
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
  round_trip<strata::OneCycle>(ds::OneCycle().to_json(), 9, 20);
  ds::OneCycle stairs;
  stairs.first_stairs = 3;
  round_trip<strata::OneCycle>(stairs.to_json(), 6, 20);
  round_trip<strata::LRRangeTest>({{"lr_range_test_min_lr", 0.001},
                                   {"lr_range_test_step_size", 4},
                                   {"lr_range_test_step_rate", 2.0},
                                   {"lr_range_test_staircase", true}},
                                  5, 10);
}

// A run resumed past total_num_steps gets DeepSpeed's clamped lr (#8142), not a rising cosine.
TEST(SchedulerState, CosineResumedPastTheEndStaysAtItsFloor) {
  auto opt = make_adam({0.2});
  strata::WarmupCosineLR s(*opt, cosine_params("linear"));
  s.load_state_dict({{"last_batch_iteration", 45}});
  expect_lr(*opt, 0.2 * 0.01, 45);
  s.step();
  expect_lr(*opt, 0.2 * 0.01, 46);
}

TEST(SchedulerState, ResumeIterationLeavesOptimizerAlone) {
  auto opt = make_adam({0.2});
  json p = warmup_params("linear");
  p["last_batch_iteration"] = 4;
  strata::WarmupLR s(*opt, p);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.2);  // DeepSpeed writes nothing when resuming
  s.step();
  expect_lr(*opt, ds::warmup_lr(5, 0.01, 0.1, 10, true), 5);
}

// ---- registry ---------------------------------------------------------------------------------

strata::SchedulerConfig scheduler_config(const std::string& type, json params) {
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
  auto s = strata::make_scheduler(scheduler_config("warmupdecaylr", warmup_params("log", 30)), *opt);
  ASSERT_NE(dynamic_cast<strata::WarmupDecayLR*>(s.get()), nullptr);
  EXPECT_DOUBLE_EQ(lr_of(*opt), 0.01);
  auto c = strata::make_scheduler(scheduler_config("WarmupCosineLR", cosine_params("linear")), *opt);
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
  auto s = strata::make_scheduler(scheduler_config("TESTHALVINGLR", {{"base", 0.8}}), *opt);
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
    strata::make_scheduler(scheduler_config("CosineLR", cosine_params("log")), *opt);
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
    strata::make_scheduler(scheduler_config("WarmupLR", p), *opt);
    FAIL() << "no error for a missing param";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("scheduler.params.warmup_num_steps"), std::string::npos)
        << e.what();
  }
}

}  // namespace
