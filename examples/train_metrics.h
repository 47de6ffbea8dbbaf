// train_gpt's metrics row (--metrics-jsonl): what the engine reports about the step it just took
// (the optimizer's scalars, the state's bytes, offload and ZenFlow, the streamed experts and their
// gradient buckets), and the process's resident set.
#pragma once

#include <cstdint>
#include <utility>

#include <nlohmann/json.hpp>
#include <strata/strata.h>

namespace strata::examples {

// The process's resident set now and at its peak (VmRSS, VmHWM of /proc/self/status), in bytes:
// what the kernel counts, not a tally of Strata's buffers.
std::pair<int64_t, int64_t> host_rss();

// Adds the engine's figures for the last step to `row`.
void add_engine_metrics(nlohmann::json& row, Engine& engine);

}  // namespace strata::examples
