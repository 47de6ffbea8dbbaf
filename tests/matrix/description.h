// The differential test matrix's run descriptions (issue 30): one training run drawn from the whole
// feature space that train_gpt offers (ZeRO stage, world size, accumulation, dtype, optimizer,
// schedule, clipping, offload, bucket and persistence sizes, model variants, MoE keys), optionally
// saved after some step and resumed at another world size / stage / ep_size / thread count.
// Everything here is plain data and JSON: the driver needs no LibTorch and compiles in seconds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace matrix {

// One launch of train_gpt: the part of a description that may change at a resume.
struct Phase {
  int world = 1;           // CPU ranks over Gloo (strata-run --num_gpus)
  int gas = 1;             // gradient_accumulation_steps; (world / sp) * gas is `per_step`
  int stage = 0;           // zero_optimization.stage
  std::string offload_optimizer = "none";  // none | cpu | nvme
  std::string offload_param = "none";      // none | cpu | nvme
  int ep_size = 1;         // moe.ep_size (tiny-moe only)
  int threads = 0;         // OMP_NUM_THREADS; 0: unset (the launcher shares the cores out)
  int adam_grain = 0;      // STRATA_CPU_ADAM_GRAIN (the CPU Adam's least elements per thread); 0: unset
  bool zero_init = false;  // --zero-init (stage 3 only; refused otherwise)
  int expert_unit = 0;     // moe.expert_unit_size (tiny-moe at stage 3; 0: not streamed)
  int expert_window = 0;   // moe.expert_window (0: left out)
  int exchange_chunks = 0; // moe.exchange_chunks (tiny-moe at ep_size > 1; 0: left out)
  bool super_offload = false;  // offload_optimizer.super_offload (device cpu, Adam/AdamW)
  // Activation checkpointing: train_gpt --activation-checkpointing (every | every:2 | selective;
  // "": none) and where the checkpointed inputs wait (the activation_checkpointing block):
  // "" as they are, "cpu" (cpu_checkpointing), "nvme" (nvme_path), "contiguous"
  // (contiguous_memory_optimization with number_checkpoints), "extras" (as they are, with
  // profile, synchronize_checkpoint_boundary and partition_activations' warning).
  std::string checkpointing = "";
  std::string checkpoint_store = "";
  // Tiled feed-forward (tiny-moe: its experts' rows): activation_checkpointing.mlp_tiles, -1 left
  // out, 0 derived from the shapes, N tiles (runtime/util/tiled.h).
  int mlp_tiles = -1;
  // Ulysses (issue 62): sequence_parallel_size; world is sp x the ranks that draw different
  // samples. 1: none (left out). Never with tiny-moe (refused: not built).
  int sp = 1;
  // ZenFlow (issue 61): zero_optimization.zenflow with this topk_ratio (0: no block), at
  // update_interval 1, where it is the exact step whatever the selection (docs/zenflow.md): held
  // against the oracle like any other phase. zenflow_select: select_interval with select_strategy
  // "step" (0: "auto", selected once); zenflow_warmup: full_warm_up_rounds.
  double zenflow = 0.0;
  int zenflow_select = 0;
  int zenflow_warmup = 0;
  // offload_optimizer.max_in_cpu with device nvme (issue 60): state elements kept in host memory
  // (0: left out, all in the swap files).
  int64_t nvme_in_cpu = 0;
};

struct Description {
  uint64_t seed = 1234;         // train_gpt --seed: the model's init and the data
  std::string model = "tiny";   // tiny | tiny-tied | tiny-zoo | tiny-moe
  // The model with GPT-2's dropout (train_gpt --model NAME-dropout): every rank draws its own
  // masks, so the stage-0 oracle sees other ones. Such a description (drawn only with activation
  // checkpointing in some phase) runs twice: without dropout against the oracle, then with it
  // against its twin without checkpointing, where the recomputations must draw the forward's
  // masks.
  bool dropout = false;
  // The model with an explicit attention mask (train_gpt --model NAME-masked): every block takes
  // it as a second tensor, so each checkpoint of a whole block keeps two inputs in its store.
  // The same math as the causal model's; the oracle runs it too. Drawn with checkpointing.
  bool masked = false;
  std::string dtype = "fp32";   // fp32 | bf16 | fp16 | autocast (torch_autocast bf16, fp32 params)
  std::string optimizer = "AdamW";  // Adam | AdamW | SGD | Lamb | Lion | ... (the last refused)
  std::string scheduler = "none";   // none | WarmupLR | WarmupDecayLR | WarmupCosineLR
  double clip = 0.0;            // gradient_clipping
  int micro = 2;                // train_micro_batch_size_per_gpu (the same in every phase: the
                                // MoE capacity is per gate call, so calls must see the same tokens)
  int per_step = 2;             // micro-batches per optimizer step: world * gas in every phase
  int steps = 6;                // optimizer steps in all
  int save_at = 0;              // 0: one phase; else phase 0 runs steps [0, save_at) and saves,
                                // phase 1 resumes and runs to `steps`
  std::vector<Phase> phases;    // 1 or 2
  // zero_optimization knobs (0: the key is left out, the default applies)
  int64_t persistence_threshold = 0;  // stage3_param_persistence_threshold (-1: 0 given)
  int64_t reduce_bucket_size = 0;
  int64_t allgather_bucket_size = 0;
  int64_t prefetch_bucket_size = 0;
  int64_t max_live_parameters = 0;
  int64_t max_reuse_distance = -1;    // -1: left out
  int64_t sub_group_size = 0;
  // moe block (tiny-moe)
  int top_k = 2;
  double capacity_factor = 1.0;
  bool drop_tokens = true;
  std::string noisy_gate_policy = "None";
  // train_gpt --moe-padding K (top-1 only): the last K positions of each sequence are padding
  // for the MoE layers (used_token), on the capped (drop_tokens) and dropless paths; 0: none.
  int moe_padding = 0;
  // train_gpt --expert-kernel ("" leaves it auto; "grouped" forces the grouped kernel, whose
  // packed routes run at ep_size 1 in place of the padded buffer). The oracle runs the default
  // kernel, so the two paths are held against each other.
  std::string expert_kernel = "";
  // train_gpt --data tokens:FILE (issue 66): a uint16 token file the runner writes from the seed,
  // sampled in the dataset's global order (the oracle reads the same file); false: the built-in
  // synthetic language.
  bool token_data = false;
};

nlohmann::json to_json(const Description& d);
Description from_json(const nlohmann::json& j);
std::string summary(const Description& d);  // one line, for logs and reports

// The description drawn for `seed` (a pure function of it), on at most max_world ranks.
Description generate(uint64_t seed, int max_world);
Description generate(uint64_t seed);  // max_world 4

// A refusal the engine or the config reader must answer with a non-zero exit and an error
// naming `key` (the config key or flag at fault). `phase`: the launch that is refused.
struct Refusal {
  int phase = 0;
  std::string key;
  std::string why;
};
std::optional<Refusal> predict_refusal(const Description& d);

// The dtypes this build's CPU kernels train in (fp16 on the CPU: see refusal.cpp); set once from
// the driver's probe of train_gpt.
void set_cpu_fp16_trains(bool trains);

// Simpler descriptions than d, most simplifying first, for the shrinker: each drops or lowers one
// feature (the resume, a rank, a stage, offload, a knob, the MoE model, a step ...).
std::vector<Description> simplifications(const Description& d);

// A measure of size the shrinker must lower (so that it terminates).
int64_t complexity(const Description& d);

}  // namespace matrix
