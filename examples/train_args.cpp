// train_gpt's flags, the "auto" values and the client optimizer they make (train_args.h).
#include "examples/train_args.h"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <stdexcept>

#include <fmt/format.h>

#include "runtime/config/autos.h"
#include "runtime/optim/adam.h"

namespace strata::examples {
namespace {

const char* kUsage =
    "usage: train_gpt --config FILE [--model tiny|small|tiny-tied|tiny-zoo|tiny-moe|dense-350M|dense-1.3B|moe-8x|moe-ds]\n"
    "                 [--steps N] [--seed S] [--seq-len N] [--zero-init] [--host-init] [--print-config]\n"
    "                 [--data FILE|tokens:A.bin,...|tokens32:A.bin,...] [--metrics-jsonl FILE]\n"
    "                 [--device cpu|cuda]\n"
    "                 [--save-dir DIR] [--save-every N] [--resume DIR] [--version]\n"
    "                 [--applied-steps N]  (stop after N optimizer steps not skipped for overflow)\n"
    "                 [--state-digest]  (metrics: a hash of each rank's optimizer state per step)\n"
    "                 [--activation-checkpointing none|every|every:K|selective] [--tiled-mlp none|auto|N]\n"
    "                 [--moe-padding K]  (MoE: the last K positions of each sequence take no expert)\n"
    "                 [--expert-kernel auto|batched|grouped]  (the MoE experts' kernel)\n"
    "                 [--hf-model DIR]  (a Hugging Face Llama-3 / Qwen3 folder instead of --model)\n"
    "                 [--hf-export DIR]  (a Hugging Face folder DIR/step<N> at each save)\n"
    "  for \"auto\" and a config without optimizer (as Hugging Face's Trainer; defaults shown):\n"
    "                 [--lr 5e-5] [--weight-decay 0] [--betas 0.9,0.999] [--eps 1e-8]\n"
    "                 [--clip 1.0] [--micro-batch 8] [--grad-accum 1] [--warmup-steps 0]\n"
    "                 [--precision fp32|bf16|fp16]\n";

int64_t parse_int(const std::string& flag, const std::string& text, int64_t min) {
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size() && value >= min) return value;
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("{} {}: expected an integer >= {}", flag, text, min));
}

double parse_double(const std::string& flag, const std::string& text, double min) {
  try {
    size_t used = 0;
    const double value = std::stod(text, &used);
    if (used == text.size() && value >= min) return value;
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("{} {}: expected a number >= {}", flag, text, min));
}

void parse_betas(const std::string& text, TrainArgs& args) {
  const size_t comma = text.find(',');
  if (comma == std::string::npos) throw Error("--betas " + text + ": expected BETA1,BETA2");
  args.beta1 = parse_double("--betas", text.substr(0, comma), 0.0);
  args.beta2 = parse_double("--betas", text.substr(comma + 1), 0.0);
  if (args.beta1 >= 1.0 || args.beta2 >= 1.0)
    throw Error("--betas " + text + ": each must be in [0, 1)");
}

// What each AutoValues member (autos.cpp's names) is set from here, for the log.
std::string flag_of(const std::string& member, const TrainArgs& args, const GPTConfig& model) {
  static const std::map<std::string, std::string> flags = {
      {"micro_batch_per_gpu", "--micro-batch"},   {"gradient_accumulation_steps", "--grad-accum"},
      {"lr", "--lr"},                             {"beta1, beta2", "--betas"},
      {"eps", "--eps"},                           {"weight_decay", "--weight-decay"},
      {"max_grad_norm", "--clip"},                {"warmup_steps", "--warmup-steps"},
      {"total_steps", "--steps"},                 {"fp16", "--precision"},
      {"bf16", "--precision"}};
  if (member == "hidden_size")
    return fmt::format("--model {} (hidden size {})", args.model, model.d_model);
  const auto it = flags.find(member);
  if (it == flags.end()) return member;
  if (it->second == "--steps" && !args.steps)
    return fmt::format("--steps (not given: {})", kDefaultSteps);
  return it->second + (args.given.count(it->second) ? "" : " (default)");
}

}  // namespace

TrainArgs parse_train_args(int argc, char** argv) {
  TrainArgs args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--version") {
      std::puts(version_line());
      std::exit(0);
    }
    args.given.insert(flag);
    if (flag == "--zero-init") {
      args.zero_init = true;
      continue;
    }
    if (flag == "--host-init") {
      args.host_init = true;
      continue;
    }
    if (flag == "--print-config") {
      args.print_config = true;
      continue;
    }
    if (flag == "--state-digest") {
      args.state_digest = true;
      continue;
    }
    if (i + 1 >= argc) throw Error(fmt::format("{}: missing value\n{}", flag, kUsage));
    const std::string value = argv[++i];
    if (flag == "--config") args.config = value;
    else if (flag == "--model") args.model = value;
    else if (flag == "--steps") args.steps = parse_int(flag, value, 1);
    else if (flag == "--applied-steps") args.applied_steps = parse_int(flag, value, 1);
    else if (flag == "--seq-len") args.seq_len = parse_int(flag, value, 1);
    else if (flag == "--seed") args.seed = static_cast<uint64_t>(parse_int(flag, value, 0));
    else if (flag == "--data") args.data = value;
    else if (flag == "--metrics-jsonl") args.metrics_jsonl = value;
    else if (flag == "--device") args.device = value;
    else if (flag == "--save-dir") args.save_dir = value;
    else if (flag == "--save-every") args.save_every = parse_int(flag, value, 1);
    else if (flag == "--resume") args.resume = value;
    else if (flag == "--hf-model") args.hf_model = value;
    else if (flag == "--hf-export") args.hf_export = value;
    else if (flag == "--activation-checkpointing") args.activation_checkpointing = value;
    else if (flag == "--tiled-mlp")
      args.tiled_mlp = value == "none" ? -1 : value == "auto" ? 0 : parse_int(flag, value, 1);
    else if (flag == "--moe-padding") args.moe_padding = parse_int(flag, value, 0);
    else if (flag == "--expert-kernel") {
      if (value != "auto" && value != "batched" && value != "grouped")
        throw Error("--expert-kernel " + value + ": expected auto, batched or grouped");
      args.expert_kernel = value;
    }
    else if (flag == "--lr") args.lr = parse_double(flag, value, 0.0);
    else if (flag == "--weight-decay") args.weight_decay = parse_double(flag, value, 0.0);
    else if (flag == "--betas") parse_betas(value, args);
    else if (flag == "--eps") args.eps = parse_double(flag, value, 0.0);
    else if (flag == "--clip") args.clip = parse_double(flag, value, 0.0);
    else if (flag == "--micro-batch") args.micro_batch = parse_int(flag, value, 1);
    else if (flag == "--grad-accum") args.grad_accum = parse_int(flag, value, 1);
    else if (flag == "--warmup-steps") args.warmup_steps = parse_int(flag, value, 0);
    else if (flag == "--precision") {
      if (value != "fp32" && value != "bf16" && value != "fp16")
        throw Error("--precision " + value + ": expected fp32, bf16 or fp16");
      args.precision = value;
    } else {
      throw Error(fmt::format("unknown option {}\n{}", flag, kUsage));
    }
  }
  if (args.config.empty()) throw Error(fmt::format("--config FILE is required\n{}", kUsage));
  if (args.save_every > 0 && args.save_dir.empty())
    throw Error("--save-every needs --save-dir DIR");
  if (!args.hf_export.empty() && args.save_dir.empty())
    throw Error("--hf-export needs --save-dir DIR (each export is written from the checkpoint "
                "saved there)");
  if (!args.hf_export.empty() && args.hf_model.empty())
    throw Error("--hf-export writes a Hugging Face folder of a model given by --hf-model DIR");
  if (!args.hf_model.empty() && args.given.count("--model"))
    throw Error("--model and --hf-model: choose one (--hf-model DIR trains the Hugging Face model "
                "of that folder)");
  return args;
}

void check_flags_match_config(const nlohmann::json& doc, const TrainArgs& args,
                              const std::string& source) {
  struct Rule {
    const char* flag;
    std::vector<const char*> path;
    nlohmann::json value;  // the flag's
    std::string shown;     // the flag as it reads on the command line
  };
  const auto number = [](double v) { return fmt::format("{}", v); };
  const std::vector<Rule> rules = {
      {"--micro-batch", {"train_micro_batch_size_per_gpu"}, args.micro_batch, std::to_string(args.micro_batch)},
      {"--grad-accum", {"gradient_accumulation_steps"}, args.grad_accum, std::to_string(args.grad_accum)},
      {"--clip", {"gradient_clipping"}, args.clip, number(args.clip)},
      {"--lr", {"optimizer", "params", "lr"}, args.lr, number(args.lr)},
      {"--lr", {"scheduler", "params", "warmup_max_lr"}, args.lr, number(args.lr)},
      {"--betas", {"optimizer", "params", "betas"}, nlohmann::json::array({args.beta1, args.beta2}),
       number(args.beta1) + "," + number(args.beta2)},
      {"--eps", {"optimizer", "params", "eps"}, args.eps, number(args.eps)},
      {"--weight-decay", {"optimizer", "params", "weight_decay"}, args.weight_decay,
       number(args.weight_decay)},
      {"--warmup-steps", {"scheduler", "params", "warmup_num_steps"}, args.warmup_steps,
       std::to_string(args.warmup_steps)},
      {"--precision", {"fp16", "enabled"}, args.precision == "fp16", args.precision},
      {"--precision", {"bf16", "enabled"}, args.precision == "bf16", args.precision},
  };
  // Numbers compare by value (1 and 1.0 agree), lists element by element, as Python's != does.
  std::function<bool(const nlohmann::json&, const nlohmann::json&)> same =
      [&](const nlohmann::json& a, const nlohmann::json& b) {
        if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
        if (a.is_array() && b.is_array()) {
          if (a.size() != b.size()) return false;
          for (size_t i = 0; i < a.size(); ++i)
            if (!same(a[i], b[i])) return false;
          return true;
        }
        return a == b;
      };
  std::string mismatches;
  for (const Rule& rule : rules) {
    if (!args.given.count(rule.flag)) continue;
    const nlohmann::json* node = &doc;
    std::string key;
    for (const char* part : rule.path) {
      if (!node->is_object() || !node->contains(part)) {
        node = nullptr;
        break;
      }
      node = &(*node)[part];
      key += (key.empty() ? "" : ".") + std::string(part);
    }
    // "auto" is filled from the flag; null and other strings are the config reader's business.
    if (!node || node->is_null() || node->is_string()) continue;
    if (!same(*node, rule.value))
      mismatches += fmt::format("\n  - {} is {} in the config, {} {} on the command line", key,
                                node->dump(), rule.flag, rule.shown);
  }
  if (!mismatches.empty())
    throw Error(fmt::format("{}: flags given on the command line disagree with values written in "
                            "the config (Hugging Face's Trainer refuses these too):{}\nWrite "
                            "\"auto\" for these keys to take the flags' values, or leave the "
                            "flags out to use the config's",
                            source, mismatches));
}

AutoValues auto_values(const TrainArgs& args, const GPTConfig& model) {
  AutoValues a;
  a.micro_batch_per_gpu = args.micro_batch;
  // Accumulation only when the command line names it: a config that writes train_batch_size
  // with "auto" factors then derives it (train_batch_size / (micro x world)), where train_gpt's
  // default of 1 would contradict the written batch size at most world sizes.
  if (args.given.count("--grad-accum")) a.gradient_accumulation_steps = args.grad_accum;
  a.lr = args.lr;
  a.beta1 = args.beta1;
  a.beta2 = args.beta2;
  a.eps = args.eps;
  a.weight_decay = args.weight_decay;
  a.max_grad_norm = args.clip;
  a.warmup_steps = args.warmup_steps;
  a.total_steps = args.steps.value_or(kDefaultSteps);
  a.fp16 = args.precision == "fp16";
  a.bf16 = args.precision == "bf16";
  a.hidden_size = model.d_model;
  return a;
}

std::string describe_filled(const Config& config, const TrainArgs& args, const GPTConfig& model) {
  std::string out;
  for (const Config::Filled& f : config.filled) {
    const std::string from =
        f.from.empty() ? schema::auto_source(f.path) : flag_of(f.from, args, model);
    out += fmt::format("\n  {} = {}  <- {}", f.path, f.value.dump(), from);
  }
  return out;
}

std::string add_client_optimizer(const Config& config, const TrainArgs& args, int64_t steps,
                                 InitOptions& init) {
  if (config.optimizer.present) return "";
  const auto options = optim::AdamOptions(args.lr)
                           .betas({args.beta1, args.beta2})
                           .eps(args.eps)
                           .weight_decay(args.weight_decay)
                           .adam_w_mode(true);
  init.optimizer_builder = [options](std::vector<torch::Tensor> params) {
    return std::make_unique<optim::Adam>(std::move(params), options);
  };
  std::string what = fmt::format("AdamW (lr {}, betas {},{}, eps {}, weight decay {})", args.lr,
                                 args.beta1, args.beta2, args.eps, args.weight_decay);
  if (config.scheduler.present) return what;
  // Through the config reader, so that every other param takes DeepSpeed's default.
  const json schedule = {
      {"train_micro_batch_size_per_gpu", 1},
      {"scheduler",
       {{"type", "WarmupCosineLR"},
        {"params",
         {{"total_num_steps", steps}, {"warmup_num_steps", args.warmup_steps},
          {"warmup_type", "linear"}}}}}};
  const SchedulerConfig scheduler =
      parse_config_text(schedule.dump(), "train_gpt's client schedule").scheduler;
  init.lr_scheduler_builder = [scheduler](torch::optim::Optimizer& optimizer) {
    return make_scheduler(scheduler, optimizer);
  };
  return what + fmt::format(", WarmupCosineLR (warmup {} steps, {} steps in all)",
                            args.warmup_steps, steps);
}

}  // namespace strata::examples
