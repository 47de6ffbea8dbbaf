// The batch triangle: train_batch_size = train_micro_batch_size_per_gpu x
// gradient_accumulation_steps x world size, exactly. DeepSpeed's rules for the missing ones
// (runtime/config.py _set_batch_related_parameters), but a derivation must divide exactly where
// DeepSpeed floors. An "auto" nothing resolved counts as missing here.
// A file with no batch size at all takes the program's (AutoValues::micro_batch_per_gpu).
#include <algorithm>

#include <fmt/format.h>

#include "runtime/config/rules.h"
#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

const char* const T = "train_batch_size";
const char* const M = "train_micro_batch_size_per_gpu";
const char* const G = "gradient_accumulation_steps";

bool mul(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

void derived(Autoable<int64_t>& field, const char* key, int64_t value, Ctx& ctx) {
  if (field.is_auto) ctx.filled.push_back({key, json(value), ""});
  field.value = value;
  field.is_auto = false;
  auto& u = ctx.unresolved;
  u.erase(std::remove(u.begin(), u.end(), key), u.end());
}

}  // namespace

void resolve_batch(Config& cfg, Ctx& ctx) {
  if (!ctx.options.check_batch_triangle) return;
  // A batch key that failed to read already has its error; deriving from it would only add noise.
  for (const Issue& i : ctx.issues)
    if (i.error && (i.path == T || i.path == M || i.path == G)) return;
  auto& t = cfg.train_batch_size;
  auto& m = cfg.train_micro_batch_size_per_gpu;
  auto& g = cfg.gradient_accumulation_steps;
  // No batch size in the file: the program's own (AutoValues) fills it, as accelerate and
  // Lightning fill absent batch keys from the trainer's values.
  const AutoValues& autos = ctx.options.autos;
  if (!ctx.present.count(T) && !ctx.present.count(M) && autos.micro_batch_per_gpu) {
    if (!assign(root_block(), &cfg, M, json(*autos.micro_batch_per_gpu), "", ctx)) return;
    ctx.present.insert(M);
    ctx.filled.push_back({M, json(*autos.micro_batch_per_gpu), "micro_batch_per_gpu"});
    if (!ctx.present.count(G) && autos.gradient_accumulation_steps) {
      if (!assign(root_block(), &cfg, G, json(*autos.gradient_accumulation_steps), "", ctx)) return;
      ctx.present.insert(G);
      ctx.filled.push_back({G, json(*autos.gradient_accumulation_steps), "gradient_accumulation_steps"});
    }
  }
  auto known = [&](const char* key, const Autoable<int64_t>& a) { return ctx.present.count(key) && !a.is_auto; };
  const bool has_t = known(T, t), has_m = known(M, m), has_g = known(G, g);
  // The ranks that draw different samples: under Ulysses a sequence-parallel group of
  // sequence_parallel_size ranks shares each sample (DeepSpeed's dp_world_size), said as such.
  const int64_t sp = cfg.sequence_parallel_size;
  const bool split = sp > 1 && cfg.world_size % sp == 0;
  const int64_t world = split ? cfg.world_size / sp : cfg.world_size;
  const std::string world_size =
      split ? fmt::format("data-parallel size (world {} / sequence_parallel_size {})",
                          cfg.world_size, sp)
            : std::string("world size");
  int64_t mw = 0, mgw = 0;

  if (has_t && has_m && has_g) {
    if (!mul(m.value, world, mw) || !mul(mw, g.value, mgw) || mgw != t.value)
      ctx.error(T, fmt::format("{} = {} but {} x {} x {} = {} x {} x {} = {}; they must match "
                               "exactly (or give two and let the third be derived)",
                               T, t.value, M, G, world_size, m.value, g.value, world,
                               mgw && mw ? fmt::format("{}", mgw) : std::string("(overflow)")));
    return;
  }
  if (has_t && (has_m || has_g)) {
    // Derive the missing factor: t / (known factor x world) must be a whole number.
    const int64_t other = has_m ? m.value : g.value;
    const char* other_key = has_m ? M : G;
    const char* missing_key = has_m ? G : M;
    int64_t divisor = 0;
    if (!mul(other, world, divisor) || t.value % divisor != 0) {
      ctx.error(T, fmt::format("{} cannot be derived: {} = {} is not a multiple of {} x {} = {} x "
                               "{}; make {} a multiple of {} or give {}",
                               missing_key, T, t.value, other_key, world_size, other, world, T,
                               divisor ? fmt::format("{}", divisor) : std::string("it"), missing_key));
      return;
    }
    derived(has_m ? g : m, missing_key, t.value / divisor, ctx);
    return;
  }
  if (has_m && has_g) {
    if (!mul(m.value, world, mw) || !mul(mw, g.value, mgw)) {
      ctx.error(M, fmt::format("{} x {} x {} overflows", M, G, world_size));
      return;
    }
    derived(t, T, mgw, ctx);
    return;
  }
  if (has_t) {  // only train: one accumulation step
    if (t.value % world != 0) {
      ctx.error(T, fmt::format("{} = {} is not a multiple of the {} {}; {} cannot be derived",
                               T, t.value, world_size, world, M));
      return;
    }
    derived(g, G, 1, ctx);
    derived(m, M, t.value / world, ctx);
    return;
  }
  if (has_m) {  // only micro: one accumulation step
    if (!mul(m.value, world, mw)) {
      ctx.error(M, fmt::format("{} x {} overflows", M, world_size));
      return;
    }
    derived(g, G, 1, ctx);
    derived(t, T, mw, ctx);
    return;
  }
  // Unresolved "auto"s are reported with what would resolve them (rules.cpp).
  if (t.is_auto || m.is_auto) return;
  // A tool without a program (strata-config check) says what the program would pass.
  const char* from_program = ctx.options.allow_unresolved_auto
                                 ? ", or pass the program's: --auto micro_batch_per_gpu=N"
                                 : ", or pass AutoValues::micro_batch_per_gpu";
  ctx.error(ctx.present.count(G) ? G : "",
            fmt::format("the batch size is not set: give {} or {} (and optionally {}){}", T, M, G,
                        from_program));
}

}  // namespace strata::schema
