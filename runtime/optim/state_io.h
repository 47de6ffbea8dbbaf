// An optimizer's per-parameter state as named tensors, so that checkpoints can store it in the
// flat layout and re-partition it at another world size. Knows Strata's Adam and SGD state;
// for other optimizers the caller falls back to LibTorch's own archive (same world size only).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace strata::optim {

struct ParamState {
  std::string type;  // "adam", "sgd", or "none" (no state yet)
  std::vector<std::pair<std::string, torch::Tensor>> tensors;  // each shaped like the parameter
  nlohmann::json scalars = nlohmann::json::object();
};

// nullopt when the optimizer keeps a state type Strata does not know.
std::optional<ParamState> export_param_state(const torch::optim::Optimizer& optimizer,
                                             const torch::Tensor& param);
// Throws strata::Error unless `state` fits `optimizer` and `param`: its type, every tensor the
// type needs, each shaped like the parameter. Changes nothing (checkpoints check before loading).
void check_param_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                       const ParamState& state);
// Replaces `param`'s state (tensors are copied) after check_param_state. With `copy` false the
// state keeps the tensors given, which must have the parameter's dtype and device already (a
// checkpoint read into them: no second copy of a partition-sized array).
void import_param_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                        const ParamState& state, bool copy = true);

// LibTorch's own serialization of the whole optimizer, as bytes.
std::string save_optimizer_archive(torch::optim::Optimizer& optimizer);
void load_optimizer_archive(torch::optim::Optimizer& optimizer, const std::string& bytes);

}  // namespace strata::optim
