// The smaller blocks: aio, activation_checkpointing, checkpoint, data_types, compile,
// tensor_parallel, hybrid_engine, eigenvalue, progressive_layer_drop, pipeline, nebula
// (swap_tensor/aio_config.py, activation_checkpointing/config.py, runtime/constants.py,
// compile/config.py, tensor_parallel/config.py, nebula/config.py).
#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

bool given_int_above(const json& v, int64_t limit) {
  return v.is_number_integer() && v.get<int64_t>() > limit;
}

Block make_aio() {
  BlockBuilder<AioConfig> b("aio");
  b.add(&AioConfig::block_size, "block_size").positive();
  b.add(&AioConfig::queue_depth, "queue_depth").positive();
  b.add(&AioConfig::intra_op_parallelism, "intra_op_parallelism").positive().deprecated_alias("thread_count");
  b.add(&AioConfig::single_submit, "single_submit");
  b.add(&AioConfig::overlap_events, "overlap_events");
  b.add(&AioConfig::use_gds, "use_gds").ignored("GPUDirect Storage; Strata's NVMe tier uses io_uring");
  return b.build();
}

Block make_activation_checkpointing() {
  const char* why = "it configures deepspeed.checkpointing, which the model itself calls";
  BlockBuilder<ActivationCheckpointingConfig> b("activation_checkpointing");
  b.add(&ActivationCheckpointingConfig::partition_activations, "partition_activations").ignored(why);
  b.add(&ActivationCheckpointingConfig::contiguous_memory_optimization, "contiguous_memory_optimization")
      .ignored(why);
  b.add(&ActivationCheckpointingConfig::cpu_checkpointing, "cpu_checkpointing").ignored(why);
  b.add(&ActivationCheckpointingConfig::number_checkpoints, "number_checkpoints").min(1).ignored(why);
  b.add(&ActivationCheckpointingConfig::synchronize_checkpoint_boundary, "synchronize_checkpoint_boundary")
      .ignored(why);
  b.add(&ActivationCheckpointingConfig::profile, "profile").ignored(why);
  return b.build();
}

Block make_parallel_write() {
  BlockBuilder<CheckpointParallelWriteConfig> b("checkpoint.parallel_write");
  b.add(&CheckpointParallelWriteConfig::pipeline_stage, "pipeline_stage").ignored("no pipeline stages");
  return b.build();
}

const Block& parallel_write_block() {
  static const Block b = make_parallel_write();
  return b;
}

Block make_checkpoint() {
  BlockBuilder<CheckpointConfig> b("checkpoint");
  b.add(&CheckpointConfig::tag_validation, "tag_validation").one_of({"Ignore", "Warn", "Fail"}, true);
  b.add(&CheckpointConfig::load_universal, "load_universal").ignored("DeepSpeed's universal-checkpoint loader");
  b.add(&CheckpointConfig::use_node_local_storage, "use_node_local_storage")
      .ignored("Strata writes checkpoints to the path the program gives");
  b.block(&CheckpointConfig::parallel_write, "parallel_write", parallel_write_block());
  return b.build();
}

Block make_data_types() {
  auto sixteen_bit = [](const json& v) { return !v.is_null() && v != "fp32"; };
  BlockBuilder<DataTypesConfig> b("data_types");
  // fp32, or the model's own 16-bit dtype (checked across blocks in rules.cpp).
  b.add(&DataTypesConfig::grad_accum_dtype, "grad_accum_dtype").one_of({"fp32", "fp16", "bf16"});
  b.add(&DataTypesConfig::param_dtype, "param_dtype")
      .one_of({"fp32", "fp16", "bf16"})
      .when(sixteen_bit)
      .not_implemented("16-bit parameters outside fp16/bf16 mixed precision");
  b.add(&DataTypesConfig::buffer_dtype, "buffer_dtype")
      .one_of({"fp32", "fp16", "bf16"})
      .when(sixteen_bit)
      .not_implemented("16-bit module buffers");
  return b.build();
}

Block make_compile() {
  BlockBuilder<ShallowConfig> b("compile");
  b.add(&ShallowConfig::enabled, "deepcompile").ignored("DeepSpeed's graph compiler; Strata runs the model eagerly");
  for (const char* key : {"free_activation", "offload_activation", "offload_opt_states", "double_buffer",
                          "symmetric_memory", "debug_log", "offload_parameters", "sync_before_reduce",
                          "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
                          "keep_int_input_tensors", "keep_all_input_tensors"})
    b.setting(&ShallowConfig::settings, key, Kind::Bool);
  b.setting(&ShallowConfig::settings, "free_activation_threshold", Kind::Int).min(0);
  b.setting(&ShallowConfig::settings, "passes", Kind::StringList)
      .when([](const json& v) { return v.is_array() && !v.empty(); })
      .not_implemented("compiler passes such as autosp (sequence parallelism) change how data is split");
  return b.build();
}

Block make_tensor_parallel() {
  BlockBuilder<ShallowConfig> b("tensor_parallel");
  b.setting(&ShallowConfig::settings, "autotp_size", Kind::Int)
      .min(0)
      .when([](const json& v) { return given_int_above(v, 1); })
      .not_implemented("tensor parallelism splits layers across ranks");
  b.setting(&ShallowConfig::settings, "preset_model", Kind::String);
  for (const char* key : {"tp_overlap_comm", "vocab_parallel_lm_head", "keep_module_on_host"})
    b.setting(&ShallowConfig::settings, key, Kind::Bool);
  for (const char* key : {"partition_config", "tp"})
    b.setting(&ShallowConfig::settings, key, Kind::Object);
  b.setting(&ShallowConfig::settings, "dtype", Kind::Any);
  return b.build();
}

// A shallow block whose `enabled` has the given support and whose other keys are just kept.
Block make_shallow(const char* name, Support support, const char* why,
                   std::vector<std::pair<const char*, Kind>> keys) {
  BlockBuilder<ShallowConfig> b(name);
  b.add(&ShallowConfig::enabled, "enabled").level(support, why);
  for (const auto& [key, kind] : keys)
    b.setting(&ShallowConfig::settings, key, kind);
  return b.build();
}

Block make_pipeline() {
  BlockBuilder<ShallowConfig> b("pipeline");
  const char* why = "it configures DeepSpeed's PipelineModule; Strata has no pipeline parallelism";
  for (const auto& [key, kind] : std::vector<std::pair<const char*, Kind>>{
           {"stages", Kind::Any}, {"partition", Kind::String}, {"seed_layers", Kind::Bool},
           {"activation_checkpoint_interval", Kind::Int}, {"pipe_partitioned", Kind::Bool},
           {"grad_partitioned", Kind::Bool}})
    b.setting(&ShallowConfig::settings, key, kind).ignored(why);
  return b.build();
}

}  // namespace

const Block& aio_block() { static const Block b = make_aio(); return b; }
const Block& activation_checkpointing_block() { static const Block b = make_activation_checkpointing(); return b; }
const Block& checkpoint_block() { static const Block b = make_checkpoint(); return b; }
const Block& data_types_block() { static const Block b = make_data_types(); return b; }
const Block& compile_block() { static const Block b = make_compile(); return b; }
const Block& tensor_parallel_block() { static const Block b = make_tensor_parallel(); return b; }
const Block& pipeline_block() { static const Block b = make_pipeline(); return b; }

const Block& hybrid_engine_block() {
  static const Block b = make_shallow(
      "hybrid_engine", Support::Ignored, "generation with DeepSpeed's inference kernels; training is unaffected",
      {{"max_out_tokens", Kind::Int}, {"inference_tp_size", Kind::Int}, {"release_inference_cache", Kind::Bool},
       {"pin_parameters", Kind::Bool}, {"tp_gather_partition_size", Kind::Int}, {"enable_cuda_graph", Kind::Bool}});
  return b;
}

const Block& eigenvalue_block() {
  static const Block b = make_shallow(
      "eigenvalue", Support::Ignored, "eigenvalue estimates only feed DeepSpeed's MoQ schedule",
      {{"verbose", Kind::Bool}, {"max_iter", Kind::Int}, {"tol", Kind::Float}, {"stability", Kind::Float},
       {"gas_boundary_resolution", Kind::Int}, {"layer_name", Kind::String}, {"layer_num", Kind::Int}});
  return b;
}

const Block& progressive_layer_drop_block() {
  static const Block b = make_shallow("progressive_layer_drop", Support::NotImplemented,
                                      "dropping layers changes the forward pass",
                                      {{"theta", Kind::Float}, {"gamma", Kind::Float}});
  return b;
}

const Block& nebula_block() {
  static const Block b = make_shallow(
      "nebula", Support::Ignored, "Azure's Nebula checkpoint service",
      {{"persistent_storage_path", Kind::String}, {"persistent_time_interval", Kind::Int},
       {"num_of_version_in_retention", Kind::Int}, {"enable_nebula_load", Kind::Bool}, {"load_path", Kind::String}});
  return b;
}

// Shared with schema_features.cpp.
Block shallow_block(const char* name, Support support, const char* why,
                    std::vector<std::pair<const char*, Kind>> keys) {
  return make_shallow(name, support, why, std::move(keys));
}

}  // namespace strata::schema
