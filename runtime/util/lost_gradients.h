// A recomputation differentiates with torch::autograd::grad with respect to the inputs and
// parameters it was given; a leaf that requires grad and is read by the function without being
// one of them would silently get no gradient. Activation checkpointing and tiled computation
// both walk the recomputed graph once and refuse such a leaf by name.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

namespace strata::recompute {

// Throws strata::Error when the graph behind `outputs` reaches a leaf that requires grad and is
// not in `targets`: "<what>: <name> reads a tensor of shape ... <hint>".
void check_leaves(const std::vector<torch::Tensor>& outputs,
                  const std::vector<torch::Tensor>& targets, const std::string& what,
                  const std::string& name, const std::string& hint);

}  // namespace strata::recompute
