#include "runtime/checkpointing/settings.h"

#include <unistd.h>

#include <mutex>

#include <fmt/format.h>

#include "runtime/checkpointing/saved_inputs.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace strata::checkpointing {
namespace {

std::mutex g_mutex;
Settings g_settings;
const void* g_owner = nullptr;
std::vector<ProfileEntry> g_profile;
int64_t g_micro_step = 0;

}  // namespace

void configure(const void* owner, const Settings& s) {
  // contiguous_memory_optimization without number_checkpoints is refused at the first checkpoint
  // (saved_inputs.cpp), not here: a config that carries the block for a program that does not
  // checkpoint (DeepSpeed asserts it only in deepspeed.checkpointing.configure) still trains.
  if (!s.nvme_path.empty() && s.cpu_checkpointing)
    throw Error(fmt::format(
        "{}: activation_checkpointing sets both cpu_checkpointing and nvme_path; the "
        "checkpointed inputs go to one place: keep one of them",
        s.source));
  std::lock_guard<std::mutex> lock(g_mutex);
  release_stores();  // a previous configuration's buffers and swap folder
  g_settings = s;
  g_owner = owner;
  g_profile.clear();
  g_micro_step = 0;
}

void configure(const void* owner, const Config& config, int rank) {
  const auto& ac = config.activation_checkpointing;
  Settings s;
  s.cpu_checkpointing = ac.cpu_checkpointing;
  s.contiguous = ac.contiguous_memory_optimization;
  s.number_checkpoints = ac.number_checkpoints.value_or(0);
  s.synchronize = ac.synchronize_checkpoint_boundary;
  s.profile = ac.profile;
  s.nvme_path = ac.nvme_path;
  s.mlp_tiles = ac.mlp_tiles.value_or(-1);
  s.nvme.block_size = config.aio.block_size;
  s.nvme.queue_depth = static_cast<int>(config.aio.queue_depth);
  s.nvme.intra_op_parallelism = static_cast<int>(config.aio.intra_op_parallelism);
  s.nvme.single_submit = config.aio.single_submit;
  s.nvme.overlap_events = config.aio.overlap_events;
  s.source = config.source;
  s.rank = rank;
  // partition_activations: the schema warns (ignored: no model parallelism).
  if (s.contiguous && !s.nvme_path.empty())
    log::info("[strata] warning: {}: activation_checkpointing.contiguous_memory_optimization has "
              "no effect with nvme_path (the checkpoints live in swap files)",
              config.source);
  configure(owner, s);
}

void release(const void* owner) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (owner != g_owner) return;
  release_stores();
  g_settings = Settings{};
  g_owner = nullptr;
  g_profile.clear();
}

Settings settings() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_settings;
}

size_t profile_forward(const std::string& name, double ms, int64_t input_bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_profile.push_back({name, ms, -1.0, input_bytes});
  return g_profile.size() - 1;
}

void profile_recompute(size_t index, double ms) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (index < g_profile.size()) g_profile[index].recompute_ms = ms;
}

BackwardProfile end_backward() {
  std::vector<ProfileEntry> entries;
  bool profile;
  int64_t step;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    entries.swap(g_profile);
    profile = g_settings.profile;
    step = ++g_micro_step;
  }
  BackwardProfile out;
  if (!profile || entries.empty()) return out;
  double forward = 0, recompute = 0;
  int64_t bytes = 0;
  for (const auto& e : entries) {
    forward += e.forward_ms;
    recompute += std::max(0.0, e.recompute_ms);
    bytes += e.input_bytes;
  }
  out.checkpoints = int64_t(entries.size());
  out.forward_ms = forward;
  out.recompute_ms = recompute;
  out.input_bytes = bytes;
  auto& lines = out.lines;
  lines.push_back(fmt::format(
      "[strata] activation checkpointing, micro-step {}: {} checkpoints, forward {:.3f} ms, "
      "recomputation {:.3f} ms, {} bytes of checkpointed inputs",
      step, entries.size(), forward, recompute, bytes));
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    lines.push_back(fmt::format(
        "[strata]   checkpoint {} ({}): forward {:.3f} ms, recomputation {}, inputs {} bytes", i,
        e.name, e.forward_ms,
        e.recompute_ms < 0 ? std::string("none") : fmt::format("{:.3f} ms", e.recompute_ms),
        e.input_bytes));
  }
  for (const auto& l : lines) log::line(l);
  return out;
}

}  // namespace strata::checkpointing
