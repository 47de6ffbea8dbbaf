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
  for (const char* technique : {"weight_quantization", "activation_quantization", "sparse_pruning",
                                "row_pruning", "head_pruning", "channel_pruning"})
    b.setting(&ShallowConfig::settings, technique, Kind::Object)
        .when([](const json& v) { return v.is_object() && json_flag(v.value("shared_parameters", json()), "enabled"); })
        .not_implemented(why);
  b.setting(&ShallowConfig::settings, "layer_reduction", Kind::Object)
      .when([](const json& v) { return json_flag(v, "enabled"); })
      .not_implemented("layer reduction (distillation) changes the model");
  return b.build();
}

// Older DeepSpeed turned MoQ on by the block's presence; `"enabled": false` turns it off.
Block make_quantize_training() {
  Block block = shallow_block("quantize_training", Support::Implemented, "",
                              {{"quantize_bits", Kind::Object}, {"quantize_type", Kind::String},
                               {"quantize_schedule", Kind::Object}, {"quantize_groups", Kind::Int},
                               {"fp16_mixed_quantize", Kind::Object}, {"quantize_verbose", Kind::Bool},
                               {"quantize_eigenvalue", Kind::Bool}, {"quantizer_kernel", Kind::Bool},
                               {"quantize_algo", Kind::Object}, {"quantize_rounding", Kind::Any},
                               {"eigenvalue", Kind::Object}});
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
      "autotuning", Support::Ignored, "autotuning is run by DeepSpeed's launcher",
      {{"fast", Kind::Bool}, {"results_dir", Kind::String}, {"exps_dir", Kind::String}, {"overwrite", Kind::Bool},
       {"start_profile_step", Kind::Int}, {"end_profile_step", Kind::Int}, {"start_step", Kind::Int},
       {"end_step", Kind::Int}, {"metric_path", Kind::String}, {"metric", Kind::String},
       {"tuner_type", Kind::String}, {"tuner_early_stopping", Kind::Int}, {"tuner_num_trials", Kind::Int},
       {"arg_mappings", Kind::Object}, {"max_train_batch_size", Kind::Int}, {"min_train_batch_size", Kind::Int},
       {"max_train_micro_batch_size_per_gpu", Kind::Int}, {"min_train_micro_batch_size_per_gpu", Kind::Int},
       {"num_tuning_micro_batch_sizes", Kind::Int}, {"mp_size", Kind::Int}, {"model_info_path", Kind::String},
       {"model_info", Kind::Object}});
  return b;
}

const Block& compression_training_block() {
  static const Block b = make_compression_training();
  return b;
}

const Block& curriculum_learning_block() {
  static const Block b = shallow_block(
      "curriculum_learning", Support::NotImplemented, "curriculum learning changes the data each step sees",
      {{"curriculum_type", Kind::String}, {"min_difficulty", Kind::Int}, {"max_difficulty", Kind::Int},
       {"schedule_type", Kind::String}, {"schedule_config", Kind::Object}});
  return b;
}

const Block& data_efficiency_block() {
  static const Block b = shallow_block(
      "data_efficiency", Support::NotImplemented,
      "data sampling and routing (curriculum, random-LTD) change the data and the model",
      {{"seed", Kind::Int}, {"data_routing", Kind::Object}, {"data_sampling", Kind::Object}});
  return b;
}

const Block& elasticity_block() {
  static const Block b = shallow_block(
      "elasticity", Support::NotImplemented, "elastic training picks the batch size from the GPU count",
      {{"max_train_batch_size", Kind::Int}, {"micro_batch_sizes", Kind::Any}, {"min_gpus", Kind::Int},
       {"max_gpus", Kind::Int}, {"min_time", Kind::Int}, {"version", Kind::Any},
       {"ignore_non_elastic_batch_info", Kind::Bool}, {"num_gpus_per_node", Kind::Int},
       {"model_parallel_size", Kind::Int}, {"prefer_larger_batch", Kind::Bool}});
  return b;
}

const Block& quantize_training_block() {
  static const Block b = make_quantize_training();
  return b;
}

}  // namespace strata::schema
