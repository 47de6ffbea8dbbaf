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
}

void unresolved_autos(Ctx& ctx) {
  for (const std::string& path : ctx.unresolved) {
    const std::string from = auto_source(path);
    const std::string how = from.empty() ? "write a value" : fmt::format("the program passes {}, or write a value", from);
    if (ctx.options.allow_unresolved_auto)
      ctx.warn(path, fmt::format("{} = \"auto\" stays unresolved here; in training it comes from {}", path,
                                 from.empty() ? "a value you write" : from));
    else
      ctx.error(path, fmt::format("{} = \"auto\" and nothing resolves it: {}", path, how));
  }
}

}  // namespace

void apply_rules(Config& cfg, Ctx& ctx) {
  precision(cfg, ctx);
  resolve_batch(cfg, ctx);
  unresolved_autos(ctx);
}

}  // namespace strata::schema
