// GPT-MoE: the GPT of gpt.h with Strata's mixture-of-experts layer (strata::moe::MoE) as every
// block's feed-forward, DeepSpeed-MoE's way: a model written in plain LibTorch that uses nothing
// of Strata but the MoE layer (gpt.h itself stays free of Strata).
#pragma once

#include <cstdint>

#include "examples/gpt.h"
#include "moe/layer.h"

namespace strata::examples {

// The layers' options for model `model` (experts, width) from a config's moe block: each key the
// block gives wins (num_experts must then be the model's); the model's gate fills those it leaves
// out (num_experts, top_k, capacity_factor for training and eval), DeepSpeed's MoE defaults the
// rest. `world` is the data-parallel group (null: one process); the expert-parallel group comes
// from comm::expert_groups(world, ep_size), the engine's.
moe::MoEOptions moe_options_for(const GPTConfig& model, const MoeConfig& moe, uint64_t seed,
                                const comm::GroupPtr& world);

// The model: block i's feed-forward is moe::MoE(options with layer_id i), registered as "moe"
// ("blocks.i.moe.gate.weight", "blocks.i.moe.experts.w1", ...); the loss adds the layers'
// loss(): aux_loss_coef x l_aux, plus the router z-loss under its own router_z_loss_coef.
GPT make_moe_gpt(const GPTConfig& config, const moe::MoEOptions& options);

// The model a program builds for a config file: with experts, make_moe_gpt with
// moe_options_for's options (and the moe block's aux_loss_coef when it gives one); else the plain
// GPT of gpt.h.
GPT make_gpt(GPTConfig config, const MoeConfig& moe, uint64_t seed, const comm::GroupPtr& world);

}  // namespace strata::examples
