// "auto" as Hugging Face's DeepSpeed integration resolves it (transformers/integrations/
// deepspeed.py: trainer_config_process and trainer_config_finalize), from the values the
// program passes in LoadOptions::autos. One row per key that HF fills; the batch sizes are also
// derived from each other in batch.cpp.
#include <cmath>
#include <functional>

#include "runtime/config/autos.h"
#include "runtime/config/schema.h"

namespace strata::schema {
namespace {

using Source = std::function<std::optional<json>(const AutoValues&)>;

struct Rule {
  const char* path;
  const char* from;  // what the program passes, for messages
  Source value;
};

template <class T>
Source member(std::optional<T> AutoValues::*m) {
  return [m](const AutoValues& a) -> std::optional<json> {
    if (a.*m) return json(*(a.*m));
    return std::nullopt;
  };
}

// HF derives the ZeRO bucket sizes from the model's hidden size.
Source hidden(double factor, int power) {
  return [factor, power](const AutoValues& a) -> std::optional<json> {
    if (!a.hidden_size || *a.hidden_size <= 0) return std::nullopt;
    const double v = factor * std::pow(static_cast<double>(*a.hidden_size), power);
    if (v >= 9.0e18) return std::nullopt;
    return json(static_cast<int64_t>(v));
  };
}

const std::vector<Rule>& rules() {
  static const std::vector<Rule> all = {
      {"train_micro_batch_size_per_gpu", "AutoValues::micro_batch_per_gpu (HF: per_device_train_batch_size)",
       member(&AutoValues::micro_batch_per_gpu)},
      {"gradient_accumulation_steps", "AutoValues::gradient_accumulation_steps",
       member(&AutoValues::gradient_accumulation_steps)},
      {"train_batch_size", "the other two batch sizes and the world size",
       [](const AutoValues&) { return std::nullopt; }},
      {"gradient_clipping", "AutoValues::max_grad_norm", member(&AutoValues::max_grad_norm)},
      {"fp16.enabled", "AutoValues::fp16", member(&AutoValues::fp16)},
      {"bf16.enabled", "AutoValues::bf16", member(&AutoValues::bf16)},
      // HF: amp.enabled = (fp16 backend == apex); Strata has no Apex.
      {"amp.enabled", "", [](const AutoValues&) { return json(false); }},
      {"zero_optimization.reduce_bucket_size", "AutoValues::hidden_size (hidden^2)", hidden(1.0, 2)},
      {"zero_optimization.stage3_prefetch_bucket_size", "AutoValues::hidden_size (0.9 hidden^2)", hidden(0.9, 2)},
      {"zero_optimization.stage3_param_persistence_threshold", "AutoValues::hidden_size (10 hidden)",
       hidden(10.0, 1)},
      {"optimizer.params.lr", "AutoValues::lr", member(&AutoValues::lr)},
      {"optimizer.params.betas", "AutoValues::beta1 and beta2",
       [](const AutoValues& a) -> std::optional<json> {
         if (a.beta1 && a.beta2) return json::array({*a.beta1, *a.beta2});
         return std::nullopt;
       }},
      {"optimizer.params.eps", "AutoValues::eps", member(&AutoValues::eps)},
      {"optimizer.params.weight_decay", "AutoValues::weight_decay", member(&AutoValues::weight_decay)},
      {"scheduler.params.warmup_min_lr", "", [](const AutoValues&) { return json(0.0); }},
      {"scheduler.params.warmup_max_lr", "AutoValues::lr", member(&AutoValues::lr)},
      {"scheduler.params.warmup_num_steps", "AutoValues::warmup_steps", member(&AutoValues::warmup_steps)},
      {"scheduler.params.total_num_steps", "AutoValues::total_steps", member(&AutoValues::total_steps)},
  };
  return all;
}

}  // namespace

std::optional<json> resolve_auto(const std::string& path, const Ctx& ctx) {
  for (const Rule& r : rules())
    if (path == r.path) return r.value(ctx.options.autos);
  return std::nullopt;
}

std::string auto_source(const std::string& path) {
  for (const Rule& r : rules())
    if (path == r.path) return r.from;
  return "";
}

}  // namespace strata::schema
