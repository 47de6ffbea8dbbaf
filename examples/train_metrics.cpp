// train_gpt's metrics row: the engine's figures (train_metrics.h).
#include "examples/train_metrics.h"

#include <cmath>
#include <fstream>
#include <string>

namespace strata::examples {

std::pair<int64_t, int64_t> host_rss() {
  std::ifstream in("/proc/self/status");
  std::string line;
  int64_t rss = 0, peak = 0;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::stoll(line.substr(6)) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) peak = std::stoll(line.substr(6)) * 1024;
  }
  return {rss, peak};
}

void add_engine_metrics(nlohmann::json& row, Engine& engine) {
  if (!std::isnan(engine.last_grad_norm())) row["grad_norm"] = engine.last_grad_norm();
  row["loss_scale"] = engine.loss_scale();
  row["skipped"] = engine.last_step_skipped();
  row["skipped_steps"] = engine.skipped_steps();  // in all, since step 1
  const auto states = engine.model_state_bytes();
  row["model_state_bytes"] = states.total();
  row["model_state_host_bytes"] = states.host;  // of those, in host memory
  if (states.nvme > 0) row["model_state_nvme_bytes"] = states.nvme;  // beside: swap files
  row["host_peak_rss_bytes"] = host_rss().second;  // this process's (rank 0's) peak so far
  const auto t = engine.last_offload_times();
  if (t && t->speculated > 0) {
    // super_offload: steps begun during backward, and those redone or dropped after it.
    row["speculated_steps"] = t->speculated;
    row["redone_steps"] = t->redone;
  }
  if (t && t->zenflow_device_elements > 0) {
    // ZenFlow: what the device steps every step, and how stale the CPU's part is.
    row["zenflow_columns"] = t->zenflow_columns;
    row["zenflow_device_elements"] = t->zenflow_device_elements;
    row["zenflow_stale_steps"] = t->zenflow_stale_steps;
    if (t->zenflow_updates > 0) {  // the last CPU update's time; the waits for them, in all
      row["zenflow_cpu_update_ms"] = t->zenflow_cpu_ms;
      row["zenflow_stall_ms_total"] = t->zenflow_stall_ms;
    }
  }
  row["live_param_bytes_peak"] = engine.live_param_bytes_peak();
  if (engine.expert_window_bytes() > 0) {  // streamed experts (moe.expert_unit_size)
    row["expert_bytes_peak"] = engine.expert_bytes_peak();
    row["expert_window_bytes"] = engine.expert_window_bytes();
  }
  if (const auto* r = engine.expert_gradient_reducer()) {
    // The experts' gradient buckets: the most bytes held at once so far against the bound they
    // keep to, and the reduce-scatters the last backward launched before it was done.
    row["expert_reducer_peak_bytes"] = r->peak_bucket_numel() * r->element_size();
    if (r->max_live_numel() > 0)
      row["expert_reducer_bound_bytes"] = r->max_live_numel() * r->element_size();
    row["expert_reductions_during_backward"] = r->launched_during_backward();
    row["expert_reducer_buckets"] = r->bucket_count();
  }
}

}  // namespace strata::examples
