// Rules across blocks, run once every block is read: precision exclusivity, the batch triangle,
// and what to do with "auto"s nothing resolved.
#include <fmt/format.h>

#include "runtime/config/autos.h"
#include "runtime/config/rules.h"

namespace strata::schema {
namespace {

void precision(const Config& cfg, Ctx& ctx) {
  if (cfg.fp16.enabled && cfg.bf16.enabled)
    ctx.error("bf16.enabled", "fp16.enabled and bf16.enabled are both true; enable one of them");
  // Gradients are summed in fp32 (the default under mixed precision) or in the model's own
  // 16-bit dtype; any other 16-bit dtype would round twice.
  const auto& accum = cfg.data_types.grad_accum_dtype;
  const char* model = cfg.fp16.enabled ? "fp16" : cfg.bf16.enabled ? "bf16" : "fp32";
  if (accum && *accum != "fp32" && *accum != model)
    ctx.error("data_types.grad_accum_dtype",
              fmt::format("data_types.grad_accum_dtype = \"{}\" but the model trains in {}: "
                          "gradients are summed in fp32 or in the model's own dtype; write "
                          "\"fp32\" (the default) or \"{}\"",
                          *accum, model, model));
}

// Expert parallelism splits the world into EP groups of ep_size ranks (comm/topology.h). A world
// of 1 is also what tools that do not know the world check with (strata-config's default,
// strata-run's first pass): there only a world the loader was told is real is checked.
void moe(const Config& cfg, Ctx& ctx) {
  const auto& m = cfg.moe;
  const bool known = cfg.world_size > 1 || ctx.options.world_is_real;
  if (known && m.ep_size > 1 && cfg.world_size % m.ep_size != 0)
    ctx.error("moe.ep_size", fmt::format("moe.ep_size = {} does not divide the world size {}: expert-parallel "
                                         "groups are ep_size consecutive ranks; choose an ep_size that "
                                         "divides {}", m.ep_size, cfg.world_size, cfg.world_size));
  // Streaming is how ZeRO-3 gathers experts; below it every rank keeps its experts whole and the
  // key would only split their computation.
  if (m.expert_unit_size > 0 && cfg.zero_optimization.stage < 3)
    ctx.error("moe.expert_unit_size",
              fmt::format("moe.expert_unit_size = {} streams experts through the device at ZeRO stage 3, "
                          "but zero_optimization.stage is {}: set the stage to 3 or drop the key",
                          m.expert_unit_size, cfg.zero_optimization.stage));
}

// Ulysses: sequence-parallel groups are sequence_parallel_size consecutive ranks
// (comm/topology.h), so it divides the world. Its MoE layers are not built yet.
void sequence(const Config& cfg, Ctx& ctx) {
  const int64_t sp = cfg.sequence_parallel_size;
  if (sp <= 1) return;
  const bool known = cfg.world_size > 1 || ctx.options.world_is_real;
  if (known && cfg.world_size % sp != 0)
    ctx.error("sequence_parallel_size",
              fmt::format("sequence_parallel_size = {} does not divide the world size {}: "
                          "sequence-parallel groups are sequence_parallel_size consecutive ranks; "
                          "choose a divisor of {}",
                          sp, cfg.world_size, cfg.world_size));
  if (!cfg.moe.given.empty())
    ctx.error("sequence_parallel_size",
              fmt::format("sequence_parallel_size = {} with a moe block: sequence parallelism of "
                          "MoE layers is not built yet (their balance loss and expert exchange "
                          "assume whole sequences); drop one of the two",
                          sp));
}

void unresolved_autos(Ctx& ctx) {
  for (const std::string& path : ctx.unresolved) {
    const std::string from = auto_source(path);
    const std::string how = from.empty() ? "write a value" : fmt::format("the program passes {}, or write a value", from);
    const std::string flags = auto_needs(path);
    if (ctx.options.allow_unresolved_auto)
      ctx.warn(path, fmt::format("{} = \"auto\" stays unresolved here; in training it comes from {}{}", path,
                                 from.empty() ? "a value you write" : from,
                                 flags.empty() ? "" : " (here: " + flags + ")"));
    else
      ctx.error(path, fmt::format("{} = \"auto\" and nothing resolves it: {}", path, how));
  }
}

}  // namespace

void apply_rules(Config& cfg, Ctx& ctx) {
  precision(cfg, ctx);
  moe(cfg, ctx);
  sequence(cfg, ctx);
  resolve_batch(cfg, ctx);
  unresolved_autos(ctx);
}

}  // namespace strata::schema
