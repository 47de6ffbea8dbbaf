// The optimizer registry and its built-in entries. Factories read every param from the config
// (no defaults here: the config layer fills them for built-in types).
#include "runtime/optim/registry.h"

#include <memory>
#include <string>
#include <utility>

#include "runtime/optim/adam.h"
#include "runtime/optim/json_params.h"
#include "runtime/optim/name_registry.h"
#include "runtime/optim/sgd.h"

namespace strata {
namespace {

constexpr const char* kOptim = "optimizer.params";

// FusedAdam's params. "adamw" forces decoupled weight decay whatever adam_w_mode says (DeepSpeed
// engine.py: effective_adam_w_mode = name == adamw or adam_w_mode). The config layer normalises
// DeepSpeed's "Adam" to "adamw" (adam_w_mode true, DeepSpeed's default) or "adam" (false), so
// "adam" without adam_w_mode means false; a hand-built config may still set it.
std::unique_ptr<torch::optim::Optimizer> make_adam(std::vector<torch::Tensor> params,
                                                   const json& cfg, bool force_adam_w) {
  const bool adam_w_mode = force_adam_w || (params::has(cfg, "adam_w_mode") &&
                                            params::get_bool(cfg, "adam_w_mode", kOptim));
  const auto [beta1, beta2] = params::get_pair(cfg, "betas", kOptim);
  auto options = optim::AdamOptions(params::get_double(cfg, "lr", kOptim))
                     .betas(std::make_tuple(beta1, beta2))
                     .eps(params::get_double(cfg, "eps", kOptim))
                     .weight_decay(params::get_double(cfg, "weight_decay", kOptim))
                     .bias_correction(params::get_bool(cfg, "bias_correction", kOptim))
                     .adam_w_mode(adam_w_mode);
  return std::make_unique<optim::Adam>(std::move(params), options);
}

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<torch::Tensor> params,
                                                  const json& cfg) {
  auto options = optim::SGDOptions(params::get_double(cfg, "lr", kOptim))
                     .momentum(params::get_double(cfg, "momentum", kOptim))
                     .dampening(params::get_double(cfg, "dampening", kOptim))
                     .weight_decay(params::get_double(cfg, "weight_decay", kOptim))
                     .nesterov(params::get_bool(cfg, "nesterov", kOptim));
  return std::make_unique<optim::SGD>(std::move(params), options);
}

detail::NameRegistry<OptimizerFactory>& optimizer_registry() {
  static detail::NameRegistry<OptimizerFactory> table(
      "optimizer",
      {{"adam", [](std::vector<torch::Tensor> p,
                   const json& c) { return make_adam(std::move(p), c, /*force_adam_w=*/false); }},
       {"adamw", [](std::vector<torch::Tensor> p,
                    const json& c) { return make_adam(std::move(p), c, /*force_adam_w=*/true); }},
       {"sgd", make_sgd}});
  return table;
}

}  // namespace

void register_optimizer(const std::string& name, OptimizerFactory factory) {
  optimizer_registry().add(name, std::move(factory));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& config,
                                                        std::vector<torch::Tensor> params) {
  auto optimizer = optimizer_registry().get(config.type)(std::move(params), config.params);
  if (!optimizer)
    throw Error(fmt::format("the factory for optimizer \"{}\" returned no optimizer", config.type));
  return optimizer;
}

std::vector<std::string> optimizer_names() { return optimizer_registry().names(); }

}  // namespace strata
