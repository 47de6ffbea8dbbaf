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
  b.add(&MoeConfig::score_func, "score_func")
      .one_of({"softmax", "sigmoid"})
      .describe("Router scores: softmax (DeepSpeed-MoE) or sigmoid per expert (DeepSeek-V3: top-k of score + "
                "bias, weights unbiased)");
  b.add(&MoeConfig::bias_update_speed, "bias_update_speed")
      .min(0)
      .describe("Loss-free balancing (DeepSeek-V3): each step, each expert's routing bias moves this far "
                "toward the mean load; 0: no bias");
  b.add(&MoeConfig::n_group, "n_group")
      .min(1)
      .describe("Group-limited routing (DeepSeek-V3): experts in n_group groups, tokens routed within their "
                "topk_group best");
  b.add(&MoeConfig::topk_group, "topk_group")
      .min(1)
      .describe("Group-limited routing: the groups each token may route to (of n_group)");
  b.add(&MoeConfig::norm_topk_prob, "norm_topk_prob")
      .describe("The k chosen scores normalised to sum 1 as combine weights (sigmoid; softmax at top_k >= 2)");
  b.add(&MoeConfig::route_scale, "route_scale")
      .positive()
      .describe("Sigmoid router: scale of the combine weights (DeepSeek-V3's routed_scaling_factor)");
  b.add(&MoeConfig::n_shared_experts, "n_shared_experts")
      .min(0)
      .describe("Shared experts (DeepSeek-V3): one MLP of n x the expert FFN on every token, added to the "
                "routed output");
  b.add(&MoeConfig::expert_unit_size, "expert_unit_size")
      .min(0)
      .describe("ZeRO-3: stream each layer's experts in units of this many, gathered and released one unit at a "
                "time; 0: one unit per layer");
  b.add(&MoeConfig::expert_window, "expert_window")
      .min(1)
      .describe("With expert_unit_size: the expert units on the device at once, at most (the one computing and "
                "those ahead)");
  b.add(&MoeConfig::exchange_chunks, "exchange_chunks")
      .min(1)
      .describe("Expert parallelism: exchanges a layer's routed rows are cut into (by local experts), each "
                "overlapping other chunks' experts");
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
    const bool sigmoid = m.score_func == "sigmoid";
    // Beside the softmax router these would do nothing: refused when they ask for something (a
    // printed config spells every key at its default).
    const std::pair<const char*, bool> sigmoid_only[] = {
        {"bias_update_speed", m.bias_update_speed != 0.0}, {"n_group", m.n_group != 1},
        {"topk_group", m.topk_group != 1}, {"route_scale", m.route_scale != 1.0}};
    for (const auto& [key, asks] : sigmoid_only)
      if (!sigmoid && asks)
        ctx.error(join(path, key),
                  fmt::format("{}.{} applies to the sigmoid router (DeepSeek-V3); set {}.score_func to "
                              "\"sigmoid\" or drop the key", path, key, path));
    if (!sigmoid && !m.norm_topk_prob && k && m.top_k == 1)
      ctx.error(join(path, "norm_topk_prob"),
                fmt::format("{}.norm_topk_prob = false: top-1 softmax gating weighs by the raw "
                            "probability already (DeepSpeed's top1gating); drop the key", path));
    if (m.topk_group > m.n_group)
      ctx.error(join(path, "topk_group"),
                fmt::format("{}.topk_group = {} exceeds n_group = {}", path, m.topk_group, m.n_group));
    if (experts && m.num_experts % m.n_group != 0)
      ctx.error(join(path, "n_group"),
                fmt::format("{}.n_group = {} must divide num_experts = {} (groups of equal size)", path,
                            m.n_group, m.num_experts));
    if (experts && m.n_group > 1 && m.num_experts / m.n_group < 2)
      ctx.error(join(path, "n_group"),
                fmt::format("{}.n_group = {} leaves fewer than 2 experts per group (a group is scored by "
                            "its top-2 experts); use at most {} groups", path, m.n_group, m.num_experts / 2));
    if (sigmoid && m.noisy_gate_policy == "RSample")
      ctx.warn(join(path, "noisy_gate_policy"),
               fmt::format("{}.noisy_gate_policy = \"RSample\" applies to softmax top-1 gating; the sigmoid "
                           "router ignores it", path));
    if (experts && k && m.n_group > 1 && m.top_k > m.topk_group * (m.num_experts / m.n_group))
      ctx.error(join(path, "topk_group"),
                fmt::format("{}.top_k = {} exceeds the {} experts of topk_group = {} groups", path, m.top_k,
                            m.topk_group * (m.num_experts / m.n_group), m.topk_group));
    // (A printed config spells every key: the default window asks for nothing.)
    if (m.given.count("expert_window") && m.expert_window != MoeConfig{}.expert_window &&
        m.expert_unit_size == 0)
      ctx.error(join(path, "expert_window"),
                fmt::format("{}.expert_window bounds streamed experts; set {}.expert_unit_size (experts per "
                            "unit, e.g. 1) or drop the key", path, path));
    if (k && m.top_k <= 2 && m.drop_policy != "probs" && !sigmoid)
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
