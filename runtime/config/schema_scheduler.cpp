// The scheduler block: DeepSpeed's schedules (runtime/lr_schedules.py) with their params checked
// and completed like the optimizer's; other types as registered by the program.
#include <fmt/format.h>

#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

// DeepSpeed's constructor arguments, one struct per schedule. Keys marked "or list" take one
// value per optimizer param group; last_batch_iteration (-1 = start) resumes a schedule. These
// are the current DeepSpeed's (runtime/sched/lr_scheduler.h names the PRs): OneCycle's bounds
// take lists (DeepSpeed #8201) and an unknown warmup_type warns and reads as "log" (#8151).
struct LRRangeTestParams {
  json lr_range_test_min_lr = 1e-3;  // or list
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
  int64_t last_batch_iteration = -1;
};

struct OneCycleParams {
  json cycle_min_lr = 0.0;  // required, or list
  json cycle_max_lr = 0.0;  // required, or list
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  std::optional<int64_t> cycle_second_step_size;  // unset = cycle_first_step_size; 0 allowed
  int64_t cycle_first_stair_count = 0;              // <= 0: continuous
  std::optional<int64_t> cycle_second_stair_count;  // unset = cycle_first_stair_count
  int64_t decay_step_size = 0;
  bool cycle_momentum = true;
  json cycle_min_mom = 0.8;  // or list
  json cycle_max_mom = 0.9;  // or list
  double decay_mom_rate = 0.0;
  int64_t last_batch_iteration = -1;
};

struct WarmupLRParams {
  Autoable<json> warmup_min_lr{0.0};  // or list
  Autoable<json> warmup_max_lr{};     // or list; null = each param group's own lr (DeepSpeed's None)
  Autoable<int64_t> warmup_num_steps{1000};
  std::string warmup_type = "log";
  int64_t last_batch_iteration = -1;
};

struct WarmupDecayLRParams {
  Autoable<int64_t> total_num_steps{0};  // required
  Autoable<json> warmup_min_lr{0.0};     // or list
  Autoable<json> warmup_max_lr{0.001};   // or list
  Autoable<int64_t> warmup_num_steps{1000};
  std::string warmup_type = "log";
  int64_t last_batch_iteration = -1;
};

struct WarmupCosineParams {
  Autoable<int64_t> total_num_steps{0};  // required
  double warmup_min_ratio = 0.0;
  Autoable<int64_t> warmup_num_steps{1000};
  double cos_min_ratio = 0.0001;
  std::string warmup_type = "log";
  int64_t last_batch_iteration = -1;
};

Block make_lr_range_test() {
  BlockBuilder<LRRangeTestParams> b("scheduler.params (LRRangeTest)");
  b.add(&LRRangeTestParams::lr_range_test_min_lr, "lr_range_test_min_lr")
      .as(Kind::FloatOrList).min(0)
      .describe("Learning rate the range test starts from (one per param group allowed)");
  b.add(&LRRangeTestParams::lr_range_test_step_size, "lr_range_test_step_size")
      .positive()
      .describe("Training steps between increases of the learning rate");
  b.add(&LRRangeTestParams::lr_range_test_step_rate, "lr_range_test_step_rate")
      .min(0)
      .describe("Rate at which the learning rate grows at each increase");
  b.add(&LRRangeTestParams::lr_range_test_staircase, "lr_range_test_staircase")
      .describe("Increase the learning rate in stairs instead of continuously");
  b.add(&LRRangeTestParams::last_batch_iteration, "last_batch_iteration")
      .min(-1)
      .describe("Index of the last batch when resuming; -1 starts the schedule from the beginning");
  return b.build();
}

Block make_one_cycle() {
  BlockBuilder<OneCycleParams> b("scheduler.params (OneCycle)");
  b.add(&OneCycleParams::cycle_min_lr, "cycle_min_lr")
      .as(Kind::FloatOrList).min(0).must_be_given()
      .describe("Lower learning-rate bound of the cycle, where it starts (one per param group allowed)");
  b.add(&OneCycleParams::cycle_max_lr, "cycle_max_lr")
      .as(Kind::FloatOrList).min(0).must_be_given()
      .describe("Upper learning-rate bound of the cycle (one per param group allowed)");
  b.add(&OneCycleParams::decay_lr_rate, "decay_lr_rate")
      .min(0)
      .describe("Learning-rate decay rate in the decay phase after the cycle");
  // As DeepSpeed checks them (#8166, each half on its own): cycle_first_step_size > 0 (the
  // scale divides by first / total), cycle_second_step_size >= 0; 0 is a cycle with no way down
  // (runtime/sched/lr_scheduler.h). DeepSpeed does not check the stair counts: a count <= 0 is a
  // continuous half (`if stair_count > 0`), and -1 is its command line's default for both.
  b.add(&OneCycleParams::cycle_first_step_size, "cycle_first_step_size")
      .positive()
      .describe("Steps in the increasing half of the cycle");
  b.add(&OneCycleParams::cycle_second_step_size, "cycle_second_step_size")
      .min(0)
      .describe("Steps in the decreasing half of the cycle; unset: cycle_first_step_size");
  b.add(&OneCycleParams::cycle_first_stair_count, "cycle_first_stair_count")
      .describe("Stairs in the first half of the cycle (lr and momentum change in steps); 0: continuous");
  b.add(&OneCycleParams::cycle_second_stair_count, "cycle_second_stair_count")
      .describe("Stairs in the second half of the cycle; unset: cycle_first_stair_count");
  b.add(&OneCycleParams::decay_step_size, "decay_step_size")
      .min(0)
      .describe("Interval (steps) at which decay is applied after the cycle; 0: no decay");
  b.add(&OneCycleParams::cycle_momentum, "cycle_momentum")
      .describe("Cycle momentum inversely to the learning rate between cycle_min_mom and cycle_max_mom");
  b.add(&OneCycleParams::cycle_min_mom, "cycle_min_mom")
      .as(Kind::FloatOrList).min(0)
      .describe("Lower momentum bound of the cycle (one per param group allowed)");
  b.add(&OneCycleParams::cycle_max_mom, "cycle_max_mom")
      .as(Kind::FloatOrList).min(0)
      .describe("Upper momentum bound of the cycle, where it starts (one per param group allowed)");
  b.add(&OneCycleParams::decay_mom_rate, "decay_mom_rate")
      .min(0)
      .describe("Momentum decay rate in the decay phase after the cycle");
  b.add(&OneCycleParams::last_batch_iteration, "last_batch_iteration")
      .min(-1)
      .describe("Index of the last batch when resuming; -1 starts the schedule from the beginning");
  Block block = b.build();
  block.finish = [](void* obj, Ctx&, const std::string&) {
    auto& p = *static_cast<OneCycleParams*>(obj);
    if (!p.cycle_second_step_size) p.cycle_second_step_size = p.cycle_first_step_size;
    if (!p.cycle_second_stair_count) p.cycle_second_stair_count = p.cycle_first_stair_count;
  };
  return block;
}

template <class T>
void warmup_keys(BlockBuilder<T>& b) {
  // 0 is what HF's Trainer passes by default (--warmup_steps 0); DeepSpeed takes max(2, n).
  b.add(&T::warmup_num_steps, "warmup_num_steps")
      .min(0)
      .describe("Steps over which the learning rate warms up (fewer than 2 count as 2, as in DeepSpeed)");
  b.add(&T::warmup_type, "warmup_type")
      .describe("Shape of the warm-up: log or linear");  // the value is checked by with_warmup_finish
  b.add(&T::last_batch_iteration, "last_batch_iteration")
      .min(-1)
      .describe("Index of the last batch when resuming; -1 starts the schedule from the beginning");
}

// DeepSpeed warns about an unknown warmup_type and warms up by "log" (WarmupCosineLR too since
// DeepSpeed #8151), so such a config loads here as well, read as "log" with that warning.
template <class T>
Block with_warmup_finish(Block block) {
  block.finish = [](void* obj, Ctx& ctx, const std::string& path) {
    std::string& type = static_cast<T*>(obj)->warmup_type;
    if (type == "log" || type == "linear") return;
    const std::string best = closest(type, {"log", "linear"});
    ctx.warn(join(path, "warmup_type"),
             fmt::format("{} = \"{}\" is not \"log\" or \"linear\"; read as \"log\", as DeepSpeed "
                         "reads it{}",
                         join(path, "warmup_type"), type,
                         best.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", best)));
    type = "log";
  };
  return block;
}

template <class T>
void warmup_lr_keys(BlockBuilder<T>& b) {
  b.add(&T::warmup_min_lr, "warmup_min_lr")
      .as(Kind::FloatOrList).min(0)
      .describe("Learning rate at the start of warm-up (one per param group allowed)");
  b.add(&T::warmup_max_lr, "warmup_max_lr")
      .as(Kind::FloatOrList).min(0).can_be_null()
      .describe("Learning rate reached at the end of warm-up (one per param group allowed)");
  warmup_keys(b);
}

Block make_warmup() {
  BlockBuilder<WarmupLRParams> b("scheduler.params (WarmupLR)");
  warmup_lr_keys(b);
  return with_warmup_finish<WarmupLRParams>(b.build());
}

Block make_warmup_decay() {
  BlockBuilder<WarmupDecayLRParams> b("scheduler.params (WarmupDecayLR)");
  warmup_lr_keys(b);
  b.add(&WarmupDecayLRParams::total_num_steps, "total_num_steps")
      .positive().must_be_given()
      .describe("Total training steps; after warm-up the learning rate decays linearly to 0 at this step");
  return with_warmup_finish<WarmupDecayLRParams>(b.build());
}

Block make_warmup_cosine() {
  BlockBuilder<WarmupCosineParams> b("scheduler.params (WarmupCosineLR)");
  b.add(&WarmupCosineParams::total_num_steps, "total_num_steps")
      .positive().must_be_given()
      .describe("Total training steps; after warm-up the learning rate follows a cosine to cos_min_ratio at this "
                "step");
  b.add(&WarmupCosineParams::warmup_min_ratio, "warmup_min_ratio")
      .range(0, 1)
      .describe("Learning rate at the start of warm-up, as a fraction of the optimizer's lr");
  b.add(&WarmupCosineParams::cos_min_ratio, "cos_min_ratio")
      .range(0, 1)
      .describe("Learning rate at the end of the cosine decay, as a fraction of the optimizer's lr");
  warmup_keys(b);
  return with_warmup_finish<WarmupCosineParams>(b.build());
}

struct BuiltIn {
  const char* name;
  std::function<json(const json& raw, const std::string& path, Ctx& ctx)> read;
};

template <class P>
json read_params(const Block& block, const json& raw, const std::string& path, Ctx& ctx) {
  P p;
  read_block(block, &p, raw, path, ctx);
  return print_block(block, &p, path, ctx.unresolved);
}

const Block& lr_range_test_block() { static const Block b = make_lr_range_test(); return b; }
const Block& one_cycle_block() { static const Block b = make_one_cycle(); return b; }
const Block& warmup_lr_block() { static const Block b = make_warmup(); return b; }
const Block& warmup_decay_block() { static const Block b = make_warmup_decay(); return b; }
const Block& warmup_cosine_block() { static const Block b = make_warmup_cosine(); return b; }

const std::vector<BuiltIn>& built_ins() {
  static const std::vector<BuiltIn> all = {
      {"LRRangeTest",
       [](const json& r, const std::string& p, Ctx& c) { return read_params<LRRangeTestParams>(lr_range_test_block(), r, p, c); }},
      {"OneCycle",
       [](const json& r, const std::string& p, Ctx& c) { return read_params<OneCycleParams>(one_cycle_block(), r, p, c); }},
      {"WarmupLR",
       [](const json& r, const std::string& p, Ctx& c) { return read_params<WarmupLRParams>(warmup_lr_block(), r, p, c); }},
      {"WarmupDecayLR",
       [](const json& r, const std::string& p, Ctx& c) { return read_params<WarmupDecayLRParams>(warmup_decay_block(), r, p, c); }},
      {"WarmupCosineLR",
       [](const json& r, const std::string& p, Ctx& c) { return read_params<WarmupCosineParams>(warmup_cosine_block(), r, p, c); }},
  };
  return all;
}

void finish_scheduler(void* obj, Ctx& ctx, const std::string& path) {
  auto& s = *static_cast<SchedulerConfig*>(obj);
  s.present = true;
  const std::string type_path = join(path, "type");
  if (!ctx.present.count(type_path) || ctx.has_error_at(type_path)) return;  // already reported
  if (s.type.empty()) {
    ctx.error(type_path, fmt::format("{} is empty; name one (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, ...)", type_path));
    return;
  }
  const std::string pp = join(path, "params");
  const json raw = s.params.is_null() ? json::object() : s.params;
  for (const BuiltIn& b : built_ins()) {
    if (iequals(s.type, b.name)) {
      s.type = b.name;
      s.params = b.read(raw, pp, ctx);
      return;
    }
  }
  for (const std::string& name : ctx.options.extra_schedulers) {
    if (iequals(s.type, name)) {
      s.params = raw;
      return;
    }
  }
  std::vector<std::string> known;
  for (const BuiltIn& b : built_ins()) known.push_back(b.name);
  known.insert(known.end(), ctx.options.extra_schedulers.begin(), ctx.options.extra_schedulers.end());
  const std::string best = closest(s.type, known);
  if (!best.empty()) {
    ctx.error(join(path, "type"),
              fmt::format("{}.type = \"{}\" is not a known scheduler; did you mean \"{}\"?", path, s.type, best));
  } else if (ctx.options.allow_unresolved_auto) {
    ctx.warn(join(path, "type"),
             fmt::format("{}.type = \"{}\" is not built in: the program must register it "
                         "(LoadOptions::extra_schedulers); its params are not checked here",
                         path, s.type));
    s.params = raw;
  } else {
    ctx.error(join(path, "type"),
              fmt::format("{}.type = \"{}\" is not a known scheduler: built in are {}; a program can "
                          "register its own (LoadOptions::extra_schedulers)",
                          path, s.type, fmt::join(known, ", ")));
  }
}

Block make_scheduler() {
  BlockBuilder<SchedulerConfig> b("scheduler");
  b.add(&SchedulerConfig::type, "type")
      .must_be_given().not_null()
      .describe("Schedule name: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR, ...");
  b.add(&SchedulerConfig::params, "params")
      .as(Kind::Object).can_be_null()
      .describe("Arguments passed to the schedule's constructor");
  Block block = b.build();
  block.finish = finish_scheduler;
  return block;
}

}  // namespace

const Block& scheduler_block() {
  static const Block b = make_scheduler();
  return b;
}

std::vector<const Block*> scheduler_params_blocks() {
  return {&lr_range_test_block(), &one_cycle_block(), &warmup_lr_block(), &warmup_decay_block(),
          &warmup_cosine_block()};
}

}  // namespace strata::schema
