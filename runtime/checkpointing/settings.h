// The activation_checkpointing block as the checkpoint mechanism reads it. The model calls
// strata::checkpointing::checkpoint() (checkpoint.h) without a handle on the engine, as a
// DeepSpeed model calls deepspeed.checkpointing.checkpoint after
// deepspeed.checkpointing.configure(): the engine configures these process-wide settings when it
// is built (configure), and puts the defaults back when it is destroyed (release). A program
// without an engine may call configure itself.
//
// What each key does here (docs/config.md says it for the user):
//   cpu_checkpointing                 checkpointed inputs leave the device for host memory
//                                     (page-locked when they come from a GPU) and come back
//                                     before their recomputation, fetched one checkpoint ahead
//   contiguous_memory_optimization    checkpointed inputs in one buffer preallocated for
//   number_checkpoints                number_checkpoints checkpoints (sized by the first one)
//   synchronize_checkpoint_boundary   CUDA: the device synchronised before and after each
//                                     checkpointed forward (nothing on a CPU)
//   profile                           each checkpointed function's forward and recomputation
//                                     times, logged after each backward
//   partition_activations             accepted with one warning (the schema's: no model
//                                     parallelism)
//   nvme_path (Strata's)              checkpointed inputs in swap files of the io_uring store
//                                     under this folder, written behind the forward and read
//                                     back one checkpoint ahead of the backward
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "offload/nvme_store.h"
#include "runtime/config/config.h"

namespace strata::checkpointing {

struct Settings {
  bool cpu_checkpointing = false;
  bool contiguous = false;
  int64_t number_checkpoints = 0;  // 0: not given
  bool synchronize = false;
  bool profile = false;
  std::string nvme_path;  // "": inputs stay in memory
  // mlp_tiles (Strata's): the tiles a model's feed-forward runs over (tiled.h): -1 untiled, 0
  // derived from the shapes, N. The model reads it; the engine warns after the first backward
  // when it is set and the model ran no tiled computation.
  int64_t mlp_tiles = -1;
  offload::NvmeOptions nvme;
  std::string source = "activation_checkpointing";  // for messages: the config file
  int rank = 0;
};

// Sets the process's settings from a config (strata::Error for a combination that cannot work,
// naming the key); `owner` is who may release them.
void configure(const void* owner, const Config& config, int rank);
void configure(const void* owner, const Settings& settings);
// Back to the defaults, if `owner` configured the settings in force; removes the NVMe folder.
void release(const void* owner);
Settings settings();

// One checkpointed function's times in this micro-step (profile only).
struct ProfileEntry {
  std::string name;
  double forward_ms = 0.0;
  double recompute_ms = -1.0;  // -1: not recomputed (yet)
  int64_t input_bytes = 0;
};
// profile: records the forward of a new entry, returns its index; then its recomputation.
size_t profile_forward(const std::string& name, double ms, int64_t input_bytes);
void profile_recompute(size_t index, double ms);
// After each backward (the engine calls it): logs the micro-step's entries when profiling, and
// clears them. Returns what it logged and the totals (the engine's monitors write them).
struct BackwardProfile {
  std::vector<std::string> lines;
  int64_t checkpoints = 0;
  double forward_ms = 0, recompute_ms = 0;
  int64_t input_bytes = 0;
};
BackwardProfile end_backward();

}  // namespace strata::checkpointing
