// Monitors and profilers (monitor/config.py, profiling/config.py, comm/config.py,
// utils/config.py). TensorBoard and CSV are Strata's own monitors (runtime/monitor/monitor.h,
// make_monitors), so their keys are implemented; the rest only observe in DeepSpeed, so enabling
// them here is accepted with a warning.
#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

Block make_file_monitor(const char* name) {
  BlockBuilder<MonitorConfig> b(name);
  // Support::Implemented: written by runtime/monitor
  b.add(&MonitorConfig::enabled, "enabled").describe("Write the training metrics with this monitor");
  b.add(&MonitorConfig::output_path, "output_path")
      .describe("Folder the logs are written under; unset: under the training script's launch folder");
  b.add(&MonitorConfig::job_name, "job_name")
      .describe("Name of the job: a folder of that name inside output_path holds its logs");
  return b.build();
}

Block make_wandb() {
  BlockBuilder<MonitorConfig> b("wandb");
  b.add(&MonitorConfig::enabled, "enabled")
      .ignored("Strata does not log to Weights & Biases")
      .describe("Log to Weights & Biases");
  b.add(&MonitorConfig::group, "group")
      .describe("W&B group name, to group runs together");
  b.add(&MonitorConfig::team, "team")
      .describe("W&B team (entity) name");
  b.add(&MonitorConfig::project, "project")
      .describe("W&B project name");
  return b.build();
}

Block make_comet() {
  BlockBuilder<CometConfig> b("comet");
  b.add(&CometConfig::enabled, "enabled")
      .ignored("Strata does not log to Comet")
      .describe("Log to Comet (needs the comet_ml package)");
  b.add(&CometConfig::samples_log_interval, "samples_log_interval")
      .positive()
      .describe("Submit metrics to Comet every this many samples");
  b.add(&CometConfig::project, "project")
      .describe("Comet project name");
  b.add(&CometConfig::workspace, "workspace")
      .describe("Comet workspace name");
  b.add(&CometConfig::api_key, "api_key")
      .describe("Comet API key (better set through COMET_API_KEY than in the config)");
  b.add(&CometConfig::experiment_name, "experiment_name")
      .describe("Name of the Comet experiment");
  b.add(&CometConfig::experiment_key, "experiment_key")
      .describe("Key of the Comet experiment to log to (32-50 alphanumeric characters)");
  b.add(&CometConfig::online, "online")
      .describe("Log to the Comet server (true) or to a local offline experiment (false)");
  b.add(&CometConfig::mode, "mode")
      .describe("How the experiment starts: get (continue experiment_key), create (always new) or get_or_create");
  return b.build();
}

Block make_flops_profiler() {
  BlockBuilder<FlopsProfilerConfig> b("flops_profiler");
  b.add(&FlopsProfilerConfig::enabled, "enabled")
      .ignored("Strata has no FLOPs profiler")
      .describe("Run the FLOPs profiler (also turns wall_clock_breakdown on)");
  b.add(&FlopsProfilerConfig::recompute_fwd_factor, "recompute_fwd_factor")
      .min(0)
      .describe("Share of the forward pass recomputed in backward by activation checkpointing (0: none, 1: all)");
  b.add(&FlopsProfilerConfig::profile_step, "profile_step")
      .describe("Training step at which the profile is taken (after warm-up steps)");
  b.add(&FlopsProfilerConfig::module_depth, "module_depth")
      .describe("Module depth at which aggregated results are printed; -1: every depth");
  b.add(&FlopsProfilerConfig::top_modules, "top_modules")
      .describe("Number of top modules listed in the aggregated profile");
  b.add(&FlopsProfilerConfig::detailed, "detailed")
      .describe("Print the detailed per-module profile");
  b.add(&FlopsProfilerConfig::output_file, "output_file")
      .describe("File the profile is written to; unset: standard output");
  return b.build();
}

Block make_comms_logger() {
  BlockBuilder<CommsLoggerConfig> b("comms_logger");
  b.add(&CommsLoggerConfig::enabled, "enabled")
      .ignored("Strata does not log communication calls")
      .describe("Log communication operations (timing each, synchronizing them)");
  b.add(&CommsLoggerConfig::verbose, "verbose")
      .describe("Print every communication operation as it happens");
  b.add(&CommsLoggerConfig::prof_all, "prof_all")
      .describe("Profile all communication operations");
  b.add(&CommsLoggerConfig::debug, "debug")
      .describe("Append the calling function's name to each operation's log name");
  b.add(&CommsLoggerConfig::prof_ops, "prof_ops")
      .describe("Only these communication operations are profiled (when prof_all is false)");
  return b.build();
}

Block make_throughput_timer() {
  BlockBuilder<ThroughputTimerConfig> b("timers.throughput");
  // Strata's progress line shows throughput
  b.add(&ThroughputTimerConfig::enabled, "enabled")
      .describe("Measure throughput (samples per second) with the engine's throughput timer");
  b.add(&ThroughputTimerConfig::synchronized, "synchronized")
      .describe("Synchronize the device when timing: exact times at some cost in speed");
  return b.build();
}

const Block& throughput_timer_block() {
  static const Block b = make_throughput_timer();
  return b;
}

Block make_timers() {
  BlockBuilder<TimersConfig> b("timers");
  b.block(&TimersConfig::throughput, "throughput", throughput_timer_block())
      .describe("The throughput timer's settings");
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
