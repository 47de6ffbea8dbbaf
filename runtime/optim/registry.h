// The optimizer registry: the config's `optimizer.type` names an entry, case-insensitively.
// Built in: "adam" (adam_w_mode from params, false when absent: the config layer normalises
// DeepSpeed's "Adam" with adam_w_mode true to "adamw"), "adamw" (always decoupled weight decay),
// "sgd". Params read: adam/adamw lr, betas, eps, weight_decay, bias_correction (adam_w_mode
// optional); sgd lr, momentum, dampening, weight_decay, nesterov.
// A program adds its own before building the engine:
//
//   strata::register_optimizer("Lion", [](std::vector<torch::Tensor> params, const json& cfg) {
//     return std::make_unique<MyLion>(std::move(params), cfg.at("lr").get<double>());
//   });
//
// and lists the name in LoadOptions::extra_optimizers so the config accepts it.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/config/config.h"

namespace strata {

// params_cfg is the config's `optimizer.params` (built-in types: every key filled, "auto"s
// resolved; registered types: as written).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::Tensor> params, const json& params_cfg)>;

// Throws strata::Error if the name (compared case-insensitively) is taken or the factory empty.
void register_optimizer(const std::string& name, OptimizerFactory factory);

// Builds config.type over params. Unknown type: strata::Error listing the registered names.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& config,
                                                        std::vector<torch::Tensor> params);

// Registered names, spelled as registered, sorted case-insensitively.
std::vector<std::string> optimizer_names();

}  // namespace strata
