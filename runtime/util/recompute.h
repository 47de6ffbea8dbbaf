// What a layer needs to know about activation checkpointing (runtime/checkpointing/checkpoint.h)
// to be recomputed exactly: the regions it runs in. A checkpointed function runs twice, once in
// the real forward (without keeping its activations) and once more in backward; a layer whose
// forward has effects beyond its output (a counter that advances, statistics it keeps, a loss
// it hands the model through a member) uses these three calls so that the second run replays
// the first instead of repeating its effects:
//
//   - remember(compute): in the real forward, compute() and note the value; in the
//     recomputation, the value noted at the same position, compute() not called. The MoE layer
//     keys its gate noise with it (moe/layer.cpp): its call counter advances once per real
//     forward and the recomputed gate draws the same noise, so it routes the same tokens.
//   - recomputing(): true while a recomputation runs (the layer then leaves its statistics,
//     e.g. the expert loads of the real forward, as they are).
//   - side_output(t, set): a differentiable tensor the function hands out other than through
//     its return value (the MoE layer's l_aux, read later by the model's loss). Inside a
//     checkpointed region it becomes an extra output of the region, and `set` receives the
//     region's output (connected to autograd) to keep instead of `t`, which was computed without
//     a graph; the recomputation registers the recomputed `t` at the same position, so its
//     gradient flows. Outside any region it does nothing (`t` is already what the layer keeps).
//
// Regions nest (a checkpointed block inside a checkpointed stack): a value a recomputing region
// replays is noted by the recording regions inside it. A region belongs to the thread that runs
// it. Header-only (the checkpoint mechanism in runtime/ owns the regions; layers below it, such
// as moe/, only call these functions), and the one piece of runtime/util/ that uses torch.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "runtime/error.h"

namespace strata::recompute {

enum class Mode { kRecord, kReplay };

struct SideOutput {
  torch::Tensor tensor;
  std::function<void(const torch::Tensor&)> set;
};

struct Region {
  Mode mode = Mode::kRecord;
  const char* name = "checkpointed function";
  std::vector<uint64_t> tape;  // remember()'s values, in call order
  size_t cursor = 0;           // replay: the next value to give back
  std::vector<SideOutput> side_outputs;
  Region* parent = nullptr;
};

inline thread_local Region* g_current = nullptr;

// Enters `region` on this thread for the scope's life (the checkpoint mechanism's business).
class RegionScope {
 public:
  explicit RegionScope(Region& region) : region_(region) {
    region_.parent = g_current;
    g_current = &region_;
  }
  ~RegionScope() { g_current = region_.parent; }
  RegionScope(const RegionScope&) = delete;
  RegionScope& operator=(const RegionScope&) = delete;

 private:
  Region& region_;
};

inline Region* current_region() { return g_current; }

inline bool recomputing() {
  for (const Region* r = g_current; r; r = r->parent)
    if (r->mode == Mode::kReplay) return true;
  return false;
}

template <class Compute>
uint64_t remember(Compute&& compute) {
  Region* r = g_current;
  std::vector<Region*> recording;
  for (; r && r->mode == Mode::kRecord; r = r->parent) recording.push_back(r);
  uint64_t value;
  if (r) {
    if (r->cursor >= r->tape.size())
      throw Error(fmt::format(
          "activation checkpointing: the recomputation of {} asked for value {} of its tape, "
          "but the real forward noted only {}: the function took another path the second time "
          "(a branch on data that changed, or on grad mode). Make the checkpointed function "
          "depend only on its inputs",
          r->name, r->cursor + 1, r->tape.size()));
    value = r->tape[r->cursor++];
  } else {
    value = std::forward<Compute>(compute)();
  }
  for (Region* x : recording) x->tape.push_back(value);
  return value;
}

inline void side_output(const torch::Tensor& t, std::function<void(const torch::Tensor&)> set) {
  if (g_current && t.defined()) g_current->side_outputs.push_back({t, std::move(set)});
}

}  // namespace strata::recompute
