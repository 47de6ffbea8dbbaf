// "auto" as Hugging Face's DeepSpeed integration resolves it (transformers/integrations/
// deepspeed.py: trainer_config_process and trainer_config_finalize), from the values the
// program passes in LoadOptions::autos. One row per key that HF fills; the batch sizes are also
// derived from each other in batch.cpp. The AutoValues members are named here once, for the
// rules, for messages and for strata-config's --auto NAME=VALUE.
#include <algorithm>
#include <cmath>
#include <functional>

#include <fmt/format.h>

#include "runtime/config/autos.h"
#include "runtime/config/schema.h"

namespace strata {
namespace schema {
namespace {

using Source = std::function<std::optional<json>(const AutoValues&)>;

struct Rule {
  const char* path;
  const char* member;  // the AutoValues member(s) it reads; "" for a constant or a derivation
  const char* how;     // what is done with them, for messages ("" when used as given)
  Source value;
};

template <class T>
Source member(std::optional<T> AutoValues::*m) {
  return [m](const AutoValues& a) -> std::optional<json> {
    if (a.*m) return json(*(a.*m));
    return std::nullopt;
  };
}

Source constant(json v) {
  return [v](const AutoValues&) -> std::optional<json> { return v; };
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
      {"train_micro_batch_size_per_gpu", "micro_batch_per_gpu", "(HF: per_device_train_batch_size)",
       member(&AutoValues::micro_batch_per_gpu)},
      {"gradient_accumulation_steps", "gradient_accumulation_steps", "",
       member(&AutoValues::gradient_accumulation_steps)},
      // Derived in batch.cpp once the other two are known.
      {"train_batch_size", "", "the other two batch sizes and the world size",
       [](const AutoValues&) { return std::nullopt; }},
      {"gradient_clipping", "max_grad_norm", "", member(&AutoValues::max_grad_norm)},
      {"fp16.enabled", "fp16", "", member(&AutoValues::fp16)},
      {"bf16.enabled", "bf16", "", member(&AutoValues::bf16)},
      // HF: amp.enabled = (fp16 backend == apex); Strata has no Apex.
      {"amp.enabled", "", "false (no Apex)", constant(false)},
      {"zero_optimization.reduce_bucket_size", "hidden_size", "(hidden^2)", hidden(1.0, 2)},
      {"zero_optimization.stage3_prefetch_bucket_size", "hidden_size", "(0.9 hidden^2)", hidden(0.9, 2)},
      {"zero_optimization.stage3_param_persistence_threshold", "hidden_size", "(10 hidden)",
       hidden(10.0, 1)},
      {"optimizer.params.lr", "lr", "", member(&AutoValues::lr)},
      {"optimizer.params.betas", "beta1, beta2", "",
       [](const AutoValues& a) -> std::optional<json> {
         if (a.beta1 && a.beta2) return json::array({*a.beta1, *a.beta2});
         return std::nullopt;
       }},
      {"optimizer.params.eps", "eps", "", member(&AutoValues::eps)},
      {"optimizer.params.weight_decay", "weight_decay", "", member(&AutoValues::weight_decay)},
      {"scheduler.params.warmup_min_lr", "", "0 (as HF)", constant(0.0)},
      {"scheduler.params.warmup_max_lr", "lr", "", member(&AutoValues::lr)},
      {"scheduler.params.warmup_num_steps", "warmup_steps", "", member(&AutoValues::warmup_steps)},
      {"scheduler.params.total_num_steps", "total_steps", "", member(&AutoValues::total_steps)},
  };
  return all;
}

const Rule* rule_for(const std::string& path) {
  for (const Rule& r : rules())
    if (path == r.path) return &r;
  return nullptr;
}

std::vector<std::string> members(const Rule& r) {
  std::vector<std::string> out;
  const std::string m = r.member;
  for (size_t start = 0; start < m.size();) {
    const size_t end = std::min(m.find(", ", start), m.size());
    out.push_back(m.substr(start, end - start));
    start = end + 2;
  }
  return out;
}

// Parsers for --auto NAME=VALUE, one per AutoValues member.
template <class T>
std::function<bool(AutoValues&, const std::string&)> parse_into(std::optional<T> AutoValues::*m) {
  return [m](AutoValues& a, const std::string& text) {
    try {
      size_t used = 0;
      if constexpr (std::is_same_v<T, bool>) {
        if (text != "true" && text != "false") return false;
        a.*m = text == "true";
        return true;
      } else if constexpr (std::is_integral_v<T>) {
        a.*m = std::stoll(text, &used);
      } else {
        a.*m = std::stod(text, &used);
      }
      return used == text.size();
    } catch (const std::exception&) {
      return false;
    }
  };
}

struct ValueName {
  const char* name;
  const char* type;
  std::function<bool(AutoValues&, const std::string&)> parse;
};

const std::vector<ValueName>& value_names() {
  static const std::vector<ValueName> all = {
      {"micro_batch_per_gpu", "an integer", parse_into(&AutoValues::micro_batch_per_gpu)},
      {"gradient_accumulation_steps", "an integer", parse_into(&AutoValues::gradient_accumulation_steps)},
      {"lr", "a number", parse_into(&AutoValues::lr)},
      {"beta1", "a number", parse_into(&AutoValues::beta1)},
      {"beta2", "a number", parse_into(&AutoValues::beta2)},
      {"eps", "a number", parse_into(&AutoValues::eps)},
      {"weight_decay", "a number", parse_into(&AutoValues::weight_decay)},
      {"max_grad_norm", "a number", parse_into(&AutoValues::max_grad_norm)},
      {"warmup_steps", "an integer", parse_into(&AutoValues::warmup_steps)},
      {"total_steps", "an integer", parse_into(&AutoValues::total_steps)},
      {"fp16", "true or false", parse_into(&AutoValues::fp16)},
      {"bf16", "true or false", parse_into(&AutoValues::bf16)},
      {"hidden_size", "an integer", parse_into(&AutoValues::hidden_size)},
  };
  return all;
}

}  // namespace

std::optional<json> resolve_auto(const std::string& path, const Ctx& ctx) {
  const Rule* r = rule_for(path);
  return r ? r->value(ctx.options.autos) : std::nullopt;
}

std::string auto_member(const std::string& path) {
  const Rule* r = rule_for(path);
  return r ? r->member : "";
}

std::string auto_source(const std::string& path) {
  const Rule* r = rule_for(path);
  if (!r) return "";
  std::vector<std::string> from;
  for (const std::string& m : members(*r)) from.push_back("AutoValues::" + m);
  if (from.empty()) return r->how;
  const std::string joined = fmt::format("{}", fmt::join(from, " and "));
  return *r->how ? joined + " " + r->how : joined;
}

std::string auto_needs(const std::string& path) {
  const Rule* r = rule_for(path);
  std::vector<std::string> flags;
  if (r)
    for (const std::string& m : members(*r)) flags.push_back("--auto " + m + "=VALUE");
  return fmt::format("{}", fmt::join(flags, " "));
}

}  // namespace schema

std::string set_auto_value(AutoValues& autos, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  const std::string name = assignment.substr(0, eq);
  std::vector<std::string> names;
  for (const auto& v : schema::value_names()) {
    names.push_back(v.name);
    if (name != v.name) continue;
    if (eq == std::string::npos) return fmt::format("--auto {}: write {}=VALUE", name, name);
    if (!v.parse(autos, assignment.substr(eq + 1)))
      return fmt::format("--auto {}: expected {} after '='", assignment, v.type);
    return "";
  }
  return fmt::format("--auto {}: unknown name '{}' (known: {})", assignment, name,
                     fmt::join(names, ", "));
}

}  // namespace strata
