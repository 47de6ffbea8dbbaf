// Monitors and profilers (monitor/config.py, profiling/config.py, comm/config.py,
// utils/config.py). TensorBoard and CSV are Strata's own monitors (runtime/monitor/monitor.h,
// make_monitors), so their keys are implemented; the rest only observe in DeepSpeed, so enabling
// them here is accepted with a warning.
#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

Block make_file_monitor(const char* name) {
  BlockBuilder<MonitorConfig> b(name);
  b.add(&MonitorConfig::enabled, "enabled");  // Support::Implemented: written by runtime/monitor
  b.add(&MonitorConfig::output_path, "output_path");
  b.add(&MonitorConfig::job_name, "job_name");
  return b.build();
}

Block make_wandb() {
  BlockBuilder<MonitorConfig> b("wandb");
  b.add(&MonitorConfig::enabled, "enabled").ignored("Strata does not log to Weights & Biases");
  b.add(&MonitorConfig::group, "group");
  b.add(&MonitorConfig::team, "team");
  b.add(&MonitorConfig::project, "project");
  return b.build();
}

Block make_comet() {
  BlockBuilder<CometConfig> b("comet");
  b.add(&CometConfig::enabled, "enabled").ignored("Strata does not log to Comet");
  b.add(&CometConfig::samples_log_interval, "samples_log_interval").positive();
  b.add(&CometConfig::project, "project");
  b.add(&CometConfig::workspace, "workspace");
  b.add(&CometConfig::api_key, "api_key");
  b.add(&CometConfig::experiment_name, "experiment_name");
  b.add(&CometConfig::experiment_key, "experiment_key");
  b.add(&CometConfig::online, "online");
  b.add(&CometConfig::mode, "mode");
  return b.build();
}

Block make_flops_profiler() {
  BlockBuilder<FlopsProfilerConfig> b("flops_profiler");
  b.add(&FlopsProfilerConfig::enabled, "enabled").ignored("Strata has no FLOPs profiler");
  b.add(&FlopsProfilerConfig::recompute_fwd_factor, "recompute_fwd_factor").min(0);
  b.add(&FlopsProfilerConfig::profile_step, "profile_step");
  b.add(&FlopsProfilerConfig::module_depth, "module_depth");
  b.add(&FlopsProfilerConfig::top_modules, "top_modules");
  b.add(&FlopsProfilerConfig::detailed, "detailed");
  b.add(&FlopsProfilerConfig::output_file, "output_file");
  return b.build();
}

Block make_comms_logger() {
  BlockBuilder<CommsLoggerConfig> b("comms_logger");
  b.add(&CommsLoggerConfig::enabled, "enabled").ignored("Strata does not log communication calls");
  b.add(&CommsLoggerConfig::verbose, "verbose");
  b.add(&CommsLoggerConfig::prof_all, "prof_all");
  b.add(&CommsLoggerConfig::debug, "debug");
  b.add(&CommsLoggerConfig::prof_ops, "prof_ops");
  return b.build();
}

Block make_throughput_timer() {
  BlockBuilder<ThroughputTimerConfig> b("timers.throughput");
  b.add(&ThroughputTimerConfig::enabled, "enabled");  // Strata's progress line shows throughput
  b.add(&ThroughputTimerConfig::synchronized, "synchronized");
  return b.build();
}

const Block& throughput_timer_block() {
  static const Block b = make_throughput_timer();
  return b;
}

Block make_timers() {
  BlockBuilder<TimersConfig> b("timers");
  b.block(&TimersConfig::throughput, "throughput", throughput_timer_block());
  return b.build();
}

}  // namespace

const Block& tensorboard_block() {
  static const Block b = make_file_monitor("tensorboard");
  return b;
}
const Block& csv_monitor_block() {
  static const Block b = make_file_monitor("csv_monitor");
  return b;
}
const Block& wandb_block() {
  static const Block b = make_wandb();
  return b;
}
const Block& comet_block() {
  static const Block b = make_comet();
  return b;
}
const Block& flops_profiler_block() {
  static const Block b = make_flops_profiler();
  return b;
}
const Block& comms_logger_block() {
  static const Block b = make_comms_logger();
  return b;
}
const Block& timers_block() {
  static const Block b = make_timers();
  return b;
}

}  // namespace strata::schema
