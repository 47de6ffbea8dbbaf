// train_gpt's command line, and what it hands the engine beside the config: the values for
// "auto" (as Hugging Face's Trainer fills them from its TrainingArguments and the model) and,
// when the config names no optimizer, a client AdamW and schedule (as Megatron-DeepSpeed builds
// them in the program). The flags mirror the Trainer's arguments, with its defaults:
//
//   --lr 5e-5  --weight-decay 0  --betas 0.9,0.999  --eps 1e-8  --clip 1.0  --micro-batch 8
//   --grad-accum 1  --warmup-steps 0  --steps (the schedule's total_num_steps, else 200)
//   --precision fp32|bf16|fp16 (fp32)
//
// They fill only what the config leaves to the program ("auto", absent batch keys, a missing
// optimizer or scheduler). A flag given on the command line that disagrees with a value written
// in the config (not "auto") is an error naming both, as the Trainer's own check raises one
// (check_flags_match_config); a default that disagrees is not, and the config's value holds.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <strata/strata.h>

#include "examples/gpt.h"

namespace strata::examples {

// The run's length when neither --steps nor the config's schedule gives one.
constexpr int64_t kDefaultSteps = 200;

struct TrainArgs {
  std::string config;
  std::string model = "tiny";
  std::optional<int64_t> steps;
  uint64_t seed = 1234;
  std::string data;
  std::string metrics_jsonl;
  std::string device;
  std::string save_dir;
  int64_t save_every = 0;  // 0: only at the end
  std::string resume;
  std::optional<int64_t> seq_len;  // tokens per sample, instead of the model's
  bool zero_init = false;          // build the model in shards (stage 3)
  bool host_init = false;          // build it in host memory; the engine moves it (InitOptions::device)
  bool print_config = false;       // print the resolved config, as DeepSpeed logs it
  // Metrics: "state_digest", each rank's hash of its optimizer's parameters (the fp32 master
  // where there is one) and state after the step: two runs that must train alike compare bit
  // for bit (the speculative offloaded step against the synchronous one, tests).
  bool state_digest = false;
  // Stop once this many optimizer steps have been applied in all (steps skipped for an fp16
  // gradient overflow do not count); --steps still bounds the run.
  std::optional<int64_t> applied_steps;
  std::string activation_checkpointing;  // none|every|every:K|selective (GPTConfig::checkpointing)
  // --tiled-mlp none|auto|N: the blocks' feed-forward over tiles of the sequence (GPTConfig::
  // mlp_tiles, DecoderConfig::mlp_tiles: -1, 0, N); unset: the config's
  // activation_checkpointing.mlp_tiles, else untiled.
  std::optional<int64_t> tiled_mlp;
  // MoE models: the last K positions of every sequence are padding for the MoE layers (their
  // used_token; top-1 gating only): GPTConfig::moe_padding.
  int64_t moe_padding = 0;
  // The built-in experts' kernel on every MoE layer (moe/experts.h): auto, batched or grouped
  // (forced, also where LibTorch has no native grouped product: a loop over the groups).
  std::string expert_kernel = "auto";
  // A Hugging Face model folder (config.json and safetensors weights: Llama-3, Qwen3) to train
  // instead of the example GPT, its weights imported at any stage (with --zero-init, each rank
  // reads only its shards); and where to export a Hugging Face folder at each save (needs
  // --save-dir: HF_EXPORT/step<N>, from the checkpoint just written).
  std::string hf_model;
  std::string hf_export;

  // The Trainer's hyper-parameters (HF TrainingArguments' defaults).
  double lr = 5e-5;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double clip = 1.0;
  int64_t micro_batch = 8;
  int64_t grad_accum = 1;
  int64_t warmup_steps = 0;
  std::string precision = "fp32";

  std::set<std::string> given;  // the flags on the command line, to tell them from defaults
};

// Exits for --help and --version; throws strata::Error for a bad command line.
TrainArgs parse_train_args(int argc, char** argv);

// Hugging Face's trainer_config_process mismatch check, for the flags given on the command line:
// each config key below written as a value (not "auto", not null) must equal its flag's value.
//   --micro-batch  train_micro_batch_size_per_gpu     --grad-accum  gradient_accumulation_steps
//   --clip         gradient_clipping                  --lr          optimizer.params.lr,
//   --betas        optimizer.params.betas                           scheduler.params.warmup_max_lr
//   --eps          optimizer.params.eps               --weight-decay optimizer.params.weight_decay
//   --warmup-steps scheduler.params.warmup_num_steps  --precision   fp16.enabled, bf16.enabled
// --steps is not compared with scheduler.params.total_num_steps, unlike HF's max_steps: it is
// how long this run goes, and a schedule may be stopped early (a smoke test, a resumed run).
// `doc` is the config file as written; throws strata::Error listing every disagreement.
void check_flags_match_config(const nlohmann::json& doc, const TrainArgs& args,
                              const std::string& source);

// What the flags and the model resolve "auto" to. `steps` is the run's length when --steps
// fixed it (else the schedule's own total_num_steps, or train_gpt's 200, is used).
AutoValues auto_values(const TrainArgs& args, const GPTConfig& model);

// One line per value taken from the program (Config::filled), each naming the flag or the model
// size it came from; "" when the config had nothing to fill.
std::string describe_filled(const Config& config, const TrainArgs& args, const GPTConfig& model);

// With no optimizer in the config: an AdamW from the flags (and, with no scheduler either,
// DeepSpeed's WarmupCosineLR over `steps` with --warmup-steps), as Megatron-DeepSpeed passes
// its own to deepspeed.initialize. Returns what was passed, for the log; "" when nothing was.
std::string add_client_optimizer(const Config& config, const TrainArgs& args, int64_t steps,
                                 InitOptions& init);

}  // namespace strata::examples
