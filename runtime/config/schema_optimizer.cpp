// The optimizer block: `type` picks a built-in (Adam, AdamW, SGD, DeepSpeed's semantics), a type
// the program registered (LoadOptions::extra_optimizers, params passed through), or an error.
// Built-in params are checked against their table below and come out complete: every key, its
// default filled in, "auto" resolved, so the factories read params.at("lr") and nothing else.
#include <fmt/format.h>

#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

// DeepSpeed's Adam (FusedAdam / DeepSpeedCPUAdam / torch.optim.Adam[W]) params.
struct AdamParams {
  Autoable<double> lr{1e-3};
  Autoable<std::vector<double>> betas{{0.9, 0.999}};
  Autoable<double> eps{1e-8};
  Autoable<double> weight_decay{0.0};
  bool bias_correction = true;
  bool adam_w_mode = true;  // DeepSpeed: "Adam" means decoupled weight decay unless false
  bool amsgrad = false;
  bool torch_adam = false;  // picks DeepSpeed's implementation; the math is the same
};

// torch.optim.SGD: lr has no default.
struct SgdParams {
  Autoable<double> lr{0.0};
  double momentum = 0.0;
  double dampening = 0.0;
  Autoable<double> weight_decay{0.0};
  bool nesterov = false;
};

// DeepSpeed rejects max_grad_norm in optimizer params; say where it belongs.
template <class T>
void reject_max_grad_norm(BlockBuilder<T>& b) {
  b.legacy("max_grad_norm", [](Ctx& ctx, T&, const json&, const std::string& path) {
    ctx.error(path, fmt::format("{} is not an optimizer parameter (DeepSpeed rejects it too); "
                                "write \"gradient_clipping\": <value> at the top level",
                                path));
  })
      .describe("Not an optimizer parameter: DeepSpeed rejects it here; clipping is the top-level "
                "gradient_clipping");
}

Block make_adam() {
  BlockBuilder<AdamParams> b("optimizer.params (Adam)");
  b.add(&AdamParams::lr, "lr")
      .min(0)
      .describe("Learning rate");
  b.add(&AdamParams::betas, "betas")
      .len(2).min(0).below(1)
      .describe("Coefficients of the running averages of the gradient and its square");
  b.add(&AdamParams::eps, "eps")
      .min(0)
      .describe("Term added to the denominator for numerical stability");
  b.add(&AdamParams::weight_decay, "weight_decay")
      .min(0)
      .describe("Weight decay coefficient (decoupled from the gradient in AdamW mode, added to it as L2 otherwise)");
  b.add(&AdamParams::bias_correction, "bias_correction")
      .describe("Correct the bias of the moment estimates toward zero in early steps");
  b.add(&AdamParams::adam_w_mode, "adam_w_mode")
      .describe("Type Adam only: apply weight decay decoupled, as AdamW (true) or as L2 regularization (false)");
  b.add(&AdamParams::amsgrad, "amsgrad")
      .not_implemented("AMSGrad keeps the running maximum of v")
      .describe("Use the AMSGrad variant, which keeps the maximum of the second-moment estimate");
  b.add(&AdamParams::torch_adam, "torch_adam")
      .describe("Use PyTorch's Adam implementation instead of DeepSpeed's fused Adam");
  reject_max_grad_norm(b);
  return b.build();
}

Block make_sgd() {
  BlockBuilder<SgdParams> b("optimizer.params (SGD)");
  b.add(&SgdParams::lr, "lr")
      .min(0).must_be_given()
      .describe("Learning rate (torch.optim.SGD; required)");
  b.add(&SgdParams::momentum, "momentum")
      .min(0)
      .describe("Momentum factor");
  b.add(&SgdParams::dampening, "dampening")
      .min(0)
      .describe("Dampening applied to the momentum");
  b.add(&SgdParams::weight_decay, "weight_decay")
      .min(0)
      .describe("Weight decay (L2 penalty added to the gradient)");
  b.add(&SgdParams::nesterov, "nesterov")
      .describe("Use Nesterov momentum");
  reject_max_grad_norm(b);
  Block block = b.build();
  block.finish = [](void* obj, Ctx& ctx, const std::string& path) {
    const auto& p = *static_cast<SgdParams*>(obj);
    if (p.nesterov && (p.momentum <= 0 || p.dampening != 0))
      ctx.error(join(path, "nesterov"),
                fmt::format("{}.nesterov = true needs momentum > 0 and dampening = 0 (momentum is {}, "
                            "dampening {})", path, p.momentum, p.dampening));
  };
  return block;
}

const Block& adam_block() {
  static const Block b = make_adam();
  return b;
}
const Block& sgd_block() {
  static const Block b = make_sgd();
  return b;
}

// DeepSpeed's own optimizers (runtime/config.py DEEPSPEED_OPTIMIZERS) that Strata lacks.
const std::vector<std::string>& deepspeed_only() {
  static const std::vector<std::string> names = {"Lamb",   "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
                                                 "Adagrad", "Lion",      "MuAdam",      "MuAdamW",
                                                 "MuSGD",  "Muon"};
  return names;
}

// HF fills these params of any optimizer; a registered type gets them too.
void resolve_passthrough_autos(json& params, const std::string& path, Ctx& ctx) {
  for (const char* key : {"lr", "betas", "eps", "weight_decay"}) {
    auto it = params.find(key);
    if (it == params.end() || *it != "auto") continue;
    if (auto v = resolve_auto(join(path, key), ctx)) *it = *v;
  }
}

void finish_optimizer(void* obj, Ctx& ctx, const std::string& path) {
  auto& o = *static_cast<OptimizerConfig*>(obj);
  o.present = true;
  const std::string type_path = join(path, "type");
  if (!ctx.present.count(type_path) || ctx.has_error_at(type_path)) return;  // already reported
  if (o.type.empty()) {
    ctx.error(type_path, fmt::format("{} is empty; name one (Adam, AdamW, SGD, ...)", type_path));
    return;
  }
  const std::string pp = join(path, "params");
  const json raw = o.params.is_null() ? json::object() : o.params;
  const std::string t = lower(o.type);
  if (t == "adam" || t == "adamw") {
    AdamParams p;
    read_block(adam_block(), &p, raw, pp, ctx);
    if (t == "adamw") {
      if (ctx.present.count(pp + ".adam_w_mode") && !p.adam_w_mode)
        ctx.error(pp + ".adam_w_mode",
                  fmt::format("{}.adam_w_mode = false contradicts type \"{}\" (AdamW always decouples "
                              "weight decay); write type \"Adam\" for L2-coupled Adam",
                              pp, o.type));
      p.adam_w_mode = true;
    }
    o.type = p.adam_w_mode ? "adamw" : "adam";
    o.params = print_block(adam_block(), &p, pp, ctx.unresolved);
    return;
  }
  if (t == "sgd") {
    SgdParams p;
    read_block(sgd_block(), &p, raw, pp, ctx);
    o.type = "sgd";
    o.params = print_block(sgd_block(), &p, pp, ctx.unresolved);
    return;
  }
  for (const std::string& name : deepspeed_only()) {
    if (t == lower(name)) {
      ctx.error(join(path, "type"),
                fmt::format("{}.type = \"{}\" is a known DeepSpeed optimizer, not implemented in Strata; "
                            "use Adam, AdamW or SGD",
                            path, o.type));
      return;
    }
  }
  for (const std::string& name : ctx.options.extra_optimizers) {
    if (iequals(t, name)) {
      o.params = raw;
      resolve_passthrough_autos(o.params, pp, ctx);
      return;
    }
  }
  std::vector<std::string> known = {"Adam", "AdamW", "SGD"};
  known.insert(known.end(), deepspeed_only().begin(), deepspeed_only().end());
  known.insert(known.end(), ctx.options.extra_optimizers.begin(), ctx.options.extra_optimizers.end());
  const std::string best = closest(o.type, known);
  if (!best.empty()) {
    ctx.error(join(path, "type"),
              fmt::format("{}.type = \"{}\" is not a known optimizer; did you mean \"{}\"? (another optimizer "
                          "must be registered by the program: LoadOptions::extra_optimizers)",
                          path, o.type, best));
  } else if (ctx.options.allow_unresolved_auto) {
    ctx.warn(join(path, "type"),
             fmt::format("{}.type = \"{}\" is not built in (Adam, AdamW, SGD): the program must register "
                         "it (LoadOptions::extra_optimizers); its params are not checked here",
                         path, o.type));
    o.params = raw;
  } else {
    ctx.error(join(path, "type"),
              fmt::format("{}.type = \"{}\" is not a known optimizer: built in are Adam, AdamW and SGD; a "
                          "program can register its own (LoadOptions::extra_optimizers)",
                          path, o.type));
  }
}

Block make_optimizer() {
  BlockBuilder<OptimizerConfig> b("optimizer");
  b.add(&OptimizerConfig::type, "type")
      .must_be_given().not_null()
      .describe("Optimizer name: DeepSpeed's own (Adam, AdamW, Lamb, OneBitAdam, ...) or one from torch.optim");
  b.add(&OptimizerConfig::params, "params")
      .as(Kind::Object).can_be_null()
      .describe("Arguments passed to the optimizer's constructor");
  b.add(&OptimizerConfig::legacy_fusion, "legacy_fusion")
      .ignored("an fp16 optimizer detail of DeepSpeed")
      .describe("Use the legacy fused fp16 optimizer path");
  Block block = b.build();
  block.finish = finish_optimizer;
  return block;
}

}  // namespace

const Block& optimizer_block() {
  static const Block b = make_optimizer();
  return b;
}

std::vector<const Block*> optimizer_params_blocks() { return {&adam_block(), &sgd_block()}; }

}  // namespace strata::schema
