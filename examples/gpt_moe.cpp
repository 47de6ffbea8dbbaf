#include "examples/gpt_moe.h"

#include <memory>
#include <vector>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::examples {

moe::MoEOptions moe_options_for(const GPTConfig& model, const MoeConfig& moe, uint64_t seed,
                                const comm::GroupPtr& world) {
  if (model.experts < 1)
    throw Error(fmt::format("model '{}' has no experts (a dense model)", model.name));
  MoeConfig merged = moe;  // the block's keys, the model's gate where the block is silent
  auto given = [&](const char* key) { return moe.given.count(key) != 0; };
  if (!given("num_experts"))
    merged.num_experts = model.experts;
  else if (moe.num_experts != model.experts)
    throw Error(fmt::format("the config's moe.num_experts is {} but model '{}' has {} experts per "
                            "block; make them agree (or drop num_experts from the config)",
                            moe.num_experts, model.name, model.experts));
  if (!given("top_k")) merged.top_k = model.top_k;
  if (!given("capacity_factor")) merged.capacity_factor = model.capacity_factor;
  if (!given("eval_capacity_factor")) merged.eval_capacity_factor = model.capacity_factor;
  if (!given("aux_loss_coef")) merged.aux_loss_coef = model.aux_loss_coef;
  if (model.deepseek) {  // the router the model was designed with, where the block is silent
    if (!given("score_func")) merged.score_func = "sigmoid";
    if (!given("bias_update_speed") && merged.score_func == "sigmoid") merged.bias_update_speed = 1e-3;
    if (!given("drop_tokens")) merged.drop_tokens = false;
    if (!given("n_shared_experts")) merged.n_shared_experts = model.shared_experts;
  }
  auto options = moe::MoEOptions::from_config(merged, model.d_model, model.ffn, 0, seed, world);
  options.expert_bias = model.expert_bias;
  options.tiles = model.mlp_tiles;  // the experts over tiles of their rows (MoEOptions::tiles)
  return options;
}

GPT make_moe_gpt(const GPTConfig& config, const moe::MoEOptions& options) {
  if (options.num_experts != config.experts || options.hidden_size != config.d_model)
    throw Error(fmt::format("make_moe_gpt: the MoE options have {} experts of width {}, model '{}' "
                            "{} of width {}",
                            options.num_experts, options.hidden_size, config.name, config.experts,
                            config.d_model));
  auto layers = std::make_shared<std::vector<moe::MoE>>();
  FeedForward ffn;
  ffn.name = "moe";
  ffn.make = [options, layers](int64_t layer) {
    auto o = options;
    o.layer_id = layer;
    layers->push_back(moe::MoE(o));
    return torch::nn::AnyModule(layers->back());
  };
  ffn.aux_loss = [layers] {
    torch::Tensor total;
    for (const auto& layer : *layers) {
      const auto aux = layer->loss();
      total = total.defined() ? total + aux : aux;
    }
    return total;
  };
  return GPT(config, std::move(ffn));
}

GPT make_gpt(GPTConfig config, const MoeConfig& moe, uint64_t seed, const comm::GroupPtr& world) {
  if (config.experts == 0) return GPT(config);
  if (moe.given.count("aux_loss_coef")) config.aux_loss_coef = moe.aux_loss_coef;
  return make_moe_gpt(config, moe_options_for(config, moe, seed, world));
}

}  // namespace strata::examples
