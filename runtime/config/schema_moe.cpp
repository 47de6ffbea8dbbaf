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
      .when([](const json& v) { return v.get<int64_t>() > 1; })
      .pending("mixture-of-experts layers");
  b.add(&MoeConfig::ep_size, "ep_size").min(1);
  b.add(&MoeConfig::top_k, "top_k").min(1);
  b.add(&MoeConfig::capacity_factor, "capacity_factor").positive();
  b.add(&MoeConfig::eval_capacity_factor, "eval_capacity_factor").positive();
  b.add(&MoeConfig::min_capacity, "min_capacity").min(0);
  b.add(&MoeConfig::drop_tokens, "drop_tokens");
  b.add(&MoeConfig::use_rts, "use_rts");
  b.add(&MoeConfig::noisy_gate_policy, "noisy_gate_policy").one_of({"None", "Jitter", "RSample"});
  b.add(&MoeConfig::aux_loss_coef, "aux_loss_coef").min(0);
  Block block = b.build();
  block.finish = [](void* obj, Ctx& ctx, const std::string& path) {
    const auto& m = *static_cast<MoeConfig*>(obj);
    if (m.num_experts % m.ep_size != 0)
      ctx.error(join(path, "ep_size"),
                fmt::format("{}.ep_size = {} must divide num_experts = {} (each expert-parallel rank holds "
                            "num_experts / ep_size experts)", path, m.ep_size, m.num_experts));
    if (m.top_k > m.num_experts)
      ctx.error(join(path, "top_k"),
                fmt::format("{}.top_k = {} exceeds num_experts = {}", path, m.top_k, m.num_experts));
  };
  return block;
}

}  // namespace

const Block& moe_block() {
  static const Block b = make_moe();
  return b;
}

}  // namespace strata::schema
