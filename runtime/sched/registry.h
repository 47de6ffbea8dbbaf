// The LR scheduler registry: the config's `scheduler.type` names an entry, case-insensitively.
// Built in, as DeepSpeed spells them: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
// LRRangeTest. A program adds its own before building the engine with register_scheduler() and
// lists the name in LoadOptions::extra_schedulers so the config accepts it.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/sched/lr_scheduler.h"

namespace strata {

// params is the config's `scheduler.params` (built-in types: every key filled, "auto"s
// resolved; registered types: as written). The scheduler keeps a reference to the optimizer.
using SchedulerFactory = std::function<std::unique_ptr<LRScheduler>(
    torch::optim::Optimizer& optimizer, const json& params)>;

// Throws strata::Error if the name (compared case-insensitively) is taken or the factory empty.
void register_scheduler(const std::string& name, SchedulerFactory factory);

// Builds config.type over the optimizer (writing its initial lr, as DeepSpeed's constructors
// do). Unknown type: strata::Error listing the registered names.
std::unique_ptr<LRScheduler> make_scheduler(const SchedulerConfig& config,
                                            torch::optim::Optimizer& optimizer);

// Registered names, spelled as registered, sorted case-insensitively.
std::vector<std::string> scheduler_names();

}  // namespace strata
