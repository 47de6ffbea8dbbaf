// DeepSpeed features with deep configs that Strata does not implement: autotuning, compression,
// curriculum learning, data efficiency, elasticity, MoQ. Read shallowly (first-level keys and
// `enabled`); enabling one that would change the math is an error.
#include <fmt/format.h>

#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

Block make_compression_training() {
  BlockBuilder<ShallowConfig> b("compression_training");
  const char* why = "compression (quantization, pruning) changes the model";
  for (const auto& [technique, what] : std::vector<std::pair<const char*, const char*>>{
           {"weight_quantization", "Quantize weights during training, lowering their bits on a schedule"},
           {"activation_quantization", "Quantize activations during training"},
           {"sparse_pruning", "Prune individual weights (unstructured or N:M sparsity)"},
           {"row_pruning", "Prune rows of a linear layer (and the matching columns of the next)"},
           {"head_pruning", "Prune attention heads"},
           {"channel_pruning", "Prune output channels of convolution layers"}})
    b.setting(&ShallowConfig::settings, technique, Kind::Object)
        .when([](const json& v) { return v.is_object() && json_flag(v.value("shared_parameters", json()), "enabled"); })
        .not_implemented(why)
        .describe(what);
  b.setting(&ShallowConfig::settings, "layer_reduction", Kind::Object)
      .when([](const json& v) { return json_flag(v, "enabled"); })
      .not_implemented("layer reduction (distillation) changes the model")
      .describe("Keep a subset of the layers, initialized from a teacher model's, for distillation");
  return b.build();
}

// Older DeepSpeed turned MoQ on by the block's presence; `"enabled": false` turns it off.
Block make_quantize_training() {
  Block block = shallow_block(
      "quantize_training", Support::Implemented, "", "Turn MoQ quantization-aware training on",
      {{"quantize_bits", Kind::Object, "start_bits and target_bits: precision falls from the one to the other"},
       {"quantize_type", Kind::String, "Quantization type: symmetric or asymmetric"},
       {"quantize_schedule", Kind::Object, "quantize_period and schedule_offset: when and how fast bits fall"},
       {"quantize_groups", Kind::Int, "Groups each weight matrix is split into, each with its own scale"},
       {"fp16_mixed_quantize", Kind::Object, "Blend fp16 and quantized weights, shifting by quantize_change_ratio"},
       {"quantize_verbose", Kind::Bool, "Print details of the quantization"},
       {"quantize_eigenvalue", Kind::Bool, "Schedule quantization by eigenvalues (the eigenvalue block)"},
       {"quantizer_kernel", Kind::Bool, "Use DeepSpeed's quantization kernel"},
       {"quantize_algo", Kind::Object, "q_type (symmetric or asymmetric) and rounding (nearest or stochastic)"},
       {"quantize_rounding", Kind::Any, "Rounding of quantized values: nearest or stochastic"},
       {"eigenvalue", Kind::Object, "Eigenvalue settings used by MoQ's eigenvalue schedule"}});
  block.finish = [](void* obj, Ctx& ctx, const std::string& path) {
    const auto& q = *static_cast<ShallowConfig*>(obj);
    const bool off = ctx.present.count(join(path, "enabled")) && !q.enabled;
    if (q.enabled || (!q.settings.empty() && !off))
      ctx.error(path, fmt::format("{}: MoQ (quantization-aware training) is not implemented in Strata; it "
                                  "changes the model's weights; remove the block",
                                  path));
  };
  return block;
}

}  // namespace

const Block& autotuning_block() {
  static const Block b = shallow_block(
      "autotuning", Support::Ignored, "autotuning is run by DeepSpeed's launcher", "Run the autotuner",
      {{"fast", Kind::Bool, "Tune only the ZeRO stage and the micro-batch size"},
       {"results_dir", Kind::String, "Folder of the autotuning results"},
       {"exps_dir", Kind::String, "Folder of the autotuning experiment descriptions"},
       {"overwrite", Kind::Bool, "Run experiments again whose results already exist"},
       {"start_profile_step", Kind::Int, "Training step at which an experiment starts profiling"},
       {"end_profile_step", Kind::Int, "Training step at which an experiment stops profiling"},
       {"start_step", Kind::Int, "Older spelling of start_profile_step"},
       {"end_step", Kind::Int, "Older spelling of end_profile_step"},
       {"metric_path", Kind::String, "File an experiment writes its metric to"},
       {"metric", Kind::String, "Metric experiments are ranked by: latency, throughput or FLOPS"},
       {"tuner_type", Kind::String, "Search order within a ZeRO stage: gridsearch, random or model_based"},
       {"tuner_early_stopping", Kind::Int, "Experiments run past the best one before the search stops"},
       {"tuner_num_trials", Kind::Int, "Most experiments per ZeRO stage"},
       {"arg_mappings", Kind::Object, "Maps config keys to the training script's command-line arguments"},
       {"max_train_batch_size", Kind::Int, "Largest global batch size to consider"},
       {"min_train_batch_size", Kind::Int, "Smallest global batch size to consider"},
       {"max_train_micro_batch_size_per_gpu", Kind::Int, "Largest micro-batch size per GPU to consider"},
       {"min_train_micro_batch_size_per_gpu", Kind::Int, "Smallest micro-batch size per GPU to consider"},
       {"num_tuning_micro_batch_sizes", Kind::Int, "Number of micro-batch sizes to explore"},
       {"mp_size", Kind::Int, "Model-parallel degree of the model being tuned"},
       {"model_info_path", Kind::String, "File with the model's information (parameters, hidden size, layers)"},
       {"model_info", Kind::Object, "The model's information given inline, or profile to measure it"}});
  return b;
}

const Block& compression_training_block() {
  static const Block b = make_compression_training();
  return b;
}

const Block& curriculum_learning_block() {
  static const Block b = shallow_block(
      "curriculum_learning", Support::NotImplemented, "curriculum learning changes the data each step sees",
      "Turn curriculum learning on",
      {{"curriculum_type", Kind::String, "Difficulty metric, e.g. seqlen"},
       {"min_difficulty", Kind::Int, "Difficulty at the first step"},
       {"max_difficulty", Kind::Int, "Difficulty at the end of the curriculum"},
       {"schedule_type", Kind::String, "Pacing function: fixed_linear, fixed_root or fixed_discrete"},
       {"schedule_config", Kind::Object, "Pacing parameters (total_curriculum_step, difficulty_step, ...)"}});
  return b;
}

const Block& data_efficiency_block() {
  static const Block b = shallow_block(
      "data_efficiency", Support::NotImplemented,
      "data sampling and routing (curriculum, random-LTD) change the data and the model",
      "Turn the data efficiency library on",
      {{"seed", Kind::Int, "Random seed of the data sampling"},
       {"data_routing", Kind::Object, "Data routing techniques (random-LTD token dropping)"},
       {"data_sampling", Kind::Object, "Data sampling techniques (curriculum learning)"}});
  return b;
}

const Block& elasticity_block() {
  static const Block b = shallow_block(
      "elasticity", Support::NotImplemented, "elastic training picks the batch size from the GPU count",
      "Compute the global batch size for elastic training",
      {{"max_train_batch_size", Kind::Int, "Largest acceptable global batch size"},
       {"micro_batch_sizes", Kind::Any, "Acceptable micro-batch sizes per GPU"},
       {"min_gpus", Kind::Int, "Fewest GPUs the batch size must work with"},
       {"max_gpus", Kind::Int, "Most GPUs the batch size must work with"},
       {"min_time", Kind::Int, "Minutes to run before scaling again (v0.1); 0: unknown"},
       {"version", Kind::Any, "Version of the elastic logic (0.1 or 0.2)"},
       {"ignore_non_elastic_batch_info", Kind::Bool, "Ignore batch keys given outside the elasticity block"},
       {"num_gpus_per_node", Kind::Int, "GPUs per node (v0.2, for model parallelism)"},
       {"model_parallel_size", Kind::Int, "Tensor or model-parallel degree (v0.2)"},
       {"prefer_larger_batch", Kind::Bool, "Prefer the batch size closest to max_train_batch_size"}});
  return b;
}

const Block& quantize_training_block() {
  static const Block b = make_quantize_training();
  return b;
}

}  // namespace strata::schema
