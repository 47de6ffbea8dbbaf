// The scheduler registry and its built-in entries (DeepSpeed's five schedules).
#include "runtime/sched/registry.h"

#include <fmt/format.h>

#include <memory>
#include <string>
#include <utility>

#include "runtime/optim/name_registry.h"

namespace strata {
namespace {

template <class Scheduler>
std::unique_ptr<LRScheduler> make(torch::optim::Optimizer& optimizer, const json& params) {
  return std::make_unique<Scheduler>(optimizer, params);
}

detail::NameRegistry<SchedulerFactory>& scheduler_registry() {
  static detail::NameRegistry<SchedulerFactory> table("scheduler",
                                                      {{"WarmupLR", make<WarmupLR>},
                                                       {"WarmupDecayLR", make<WarmupDecayLR>},
                                                       {"WarmupCosineLR", make<WarmupCosineLR>},
                                                       {"OneCycle", make<OneCycle>},
                                                       {"LRRangeTest", make<LRRangeTest>}});
  return table;
}

}  // namespace

void register_scheduler(const std::string& name, SchedulerFactory factory) {
  scheduler_registry().add(name, std::move(factory));
}

std::unique_ptr<LRScheduler> make_scheduler(const SchedulerConfig& config,
                                            torch::optim::Optimizer& optimizer) {
  auto scheduler = scheduler_registry().get(config.type)(optimizer, config.params);
  if (!scheduler)
    throw Error(fmt::format("the factory for scheduler \"{}\" returned no scheduler", config.type));
  return scheduler;
}

std::vector<std::string> scheduler_names() { return scheduler_registry().names(); }

}  // namespace strata
