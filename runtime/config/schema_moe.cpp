// Strata's own `moe` block: the gate and expert parallelism of its MoE layers (moe/), with the
// names and defaults of DeepSpeed's deepspeed.moe.layer.MoE arguments.
#include <fmt/format.h>

#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

Block make_moe() {
  BlockBuilder<MoeConfig> b("moe");
  b.add(&MoeConfig::num_experts, "num_experts")
      .min(1)
      .describe("Experts in each MoE layer");
  b.add(&MoeConfig::ep_size, "ep_size")
      .min(1)
      .describe("Ranks in each expert-parallel group, among which the layer's experts are split");
  b.add(&MoeConfig::top_k, "top_k")
      .min(1)
      .describe("Experts each token is routed to (DeepSpeed's argument k; top-1 or top-2 gating)");
  b.add(&MoeConfig::capacity_factor, "capacity_factor")
      .positive()
      .describe("Expert capacity during training, as a multiple of tokens / num_experts");
  b.add(&MoeConfig::eval_capacity_factor, "eval_capacity_factor")
      .positive()
      .describe("Expert capacity during evaluation, as a multiple of tokens / num_experts");
  b.add(&MoeConfig::min_capacity, "min_capacity")
      .min(0)
      .describe("Least capacity of each expert, whatever the capacity factor");
  b.add(&MoeConfig::drop_tokens, "drop_tokens")
      .describe("Drop tokens that exceed an expert's capacity (false: capacity grows to fit them all)");
  b.add(&MoeConfig::use_rts, "use_rts")
      .describe("Random Token Selection: choose at random which tokens keep their place within capacity");
  b.add(&MoeConfig::noisy_gate_policy, "noisy_gate_policy")
      .one_of({"None", "Jitter", "RSample"})
      .describe("Gate noise while training: None, Jitter (multiplicative, on its input, any top_k) or RSample "
                "(on its logits, top_k 1)");
  b.add(&MoeConfig::aux_loss_coef, "aux_loss_coef")
      .min(0)
      .describe("Weight of the gate's load-balancing loss in the MoE layer's loss(), which the program adds to "
                "the training loss");
  b.add(&MoeConfig::top2_2nd_expert_sampling, "top2_2nd_expert_sampling")
      .describe("Top-2 gating: add Gumbel noise to the logits that choose each token's second expert");
  b.add(&MoeConfig::drop_policy, "drop_policy")
      .one_of({"probs", "position"})
      .describe("Top-k gating (k >= 3), over capacity: keep the most probable routes (probs) or the first in "
                "token order (position)");
  b.add(&MoeConfig::router_z_loss_coef, "router_z_loss_coef")
      .min(0)
      .describe("Weight of the router z-loss (ST-MoE: mean squared logsumexp of the logits) in the MoE "
                "layer's loss(); 0 turns it off");
  b.add(&MoeConfig::use_residual, "use_residual")
      .describe("Residual MoE (PR-MoE): a dense MLP beside the experts, mixed with their output by a "
                "learned softmax coefficient per token");
  Block block = b.build();
  block.finish = [](void* obj, Ctx& ctx, const std::string& path) {
    auto& m = *static_cast<MoeConfig*>(obj);
    const std::string prefix = path + ".";
    for (auto it = ctx.present.lower_bound(prefix);
         it != ctx.present.end() && it->compare(0, prefix.size(), prefix) == 0; ++it)
      m.given.insert(it->substr(prefix.size()));
    // A key left out is the program's to fill (from its model): no check against it.
    const bool experts = m.given.count("num_experts") != 0, k = m.given.count("top_k") != 0;
    if (experts && m.num_experts % m.ep_size != 0)
      ctx.error(join(path, "ep_size"),
                fmt::format("{}.ep_size = {} must divide num_experts = {} (each expert-parallel rank holds "
                            "num_experts / ep_size experts)", path, m.ep_size, m.num_experts));
    if (experts && k && m.top_k > m.num_experts)
      ctx.error(join(path, "top_k"),
                fmt::format("{}.top_k = {} exceeds num_experts = {}", path, m.top_k, m.num_experts));
    if (k && m.top_k >= 2 && m.noisy_gate_policy != "None")
      ctx.warn(join(path, "noisy_gate_policy"),
               fmt::format("{}.noisy_gate_policy = \"{}\" is applied by top-1 gating only (as in DeepSpeed); "
                           "with top_k = {} it does nothing", path, m.noisy_gate_policy, m.top_k));
    if (k && m.top_k <= 2 && m.drop_policy != "probs")
      ctx.warn(join(path, "drop_policy"),
               fmt::format("{}.drop_policy = \"{}\" applies to top-k gating with k >= 3; with top_k = {} "
                           "DeepSpeed's rule for k = {} decides who is dropped", path, m.drop_policy,
                           m.top_k, m.top_k));
  };
  return block;
}

}  // namespace

const Block& moe_block() {
  static const Block b = make_moe();
  return b;
}

}  // namespace strata::schema
