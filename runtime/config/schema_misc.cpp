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
  b.add(&AioConfig::block_size, "block_size")
      .positive()
      .describe("I/O block size in bytes");
  b.add(&AioConfig::queue_depth, "queue_depth")
      .positive()
      .describe("I/O queue depth");
  b.add(&AioConfig::intra_op_parallelism, "intra_op_parallelism")
      .positive().deprecated_alias("thread_count")
      .describe("Parallelism within each read or write request a thread submits");
  b.add(&AioConfig::single_submit, "single_submit")
      .describe("Submit requests to the device one by one instead of as one batch");
  b.add(&AioConfig::overlap_events, "overlap_events")
      .describe("Submit requests without waiting for earlier ones to complete");
  b.add(&AioConfig::use_gds, "use_gds")
      .ignored("GPUDirect Storage; Strata's NVMe tier uses io_uring")
      .describe("Use NVIDIA GPUDirect Storage between the GPU and NVMe");
  return b.build();
}

Block make_activation_checkpointing() {
  // What strata::checkpoint() (runtime/checkpointing/checkpoint.h), which the model calls, does
  // with the checkpointed inputs; runtime/checkpointing/settings.h says how each key acts here,
  // docs/activation_checkpointing.md where Strata differs from DeepSpeed.
  BlockBuilder<ActivationCheckpointingConfig> b("activation_checkpointing");
  b.add(&ActivationCheckpointingConfig::partition_activations, "partition_activations")
      .ignored("Strata has no model parallelism: there is nothing to partition over, as in "
               "DeepSpeed without model parallelism")
      .describe("Partition checkpointed activations across model-parallel ranks");
  b.add(&ActivationCheckpointingConfig::contiguous_memory_optimization, "contiguous_memory_optimization")
      .describe("Copy checkpointed activations into one contiguous buffer preallocated for "
                "number_checkpoints checkpoints");
  b.add(&ActivationCheckpointingConfig::cpu_checkpointing, "cpu_checkpointing")
      .describe("Offload checkpointed activations to CPU memory until their recomputation");
  b.add(&ActivationCheckpointingConfig::number_checkpoints, "number_checkpoints")
      .min(1)
      .describe("Number of activation checkpoints, to size the contiguous buffer");
  b.add(&ActivationCheckpointingConfig::synchronize_checkpoint_boundary, "synchronize_checkpoint_boundary")
      .describe("Synchronize the device at each checkpoint boundary");
  b.add(&ActivationCheckpointingConfig::profile, "profile")
      .describe("Log the forward and recomputation time of each checkpointed function");
  b.add(&ActivationCheckpointingConfig::nvme_path, "nvme_path")
      .describe("Strata's own: keep checkpointed activations in NVMe swap files under this "
                "folder (docs/activation_checkpointing.md)");
  b.add(&ActivationCheckpointingConfig::mlp_tiles, "mlp_tiles")
      .min(0)
      .describe("Strata's own: run the model's feed-forward over this many sequence tiles (0: "
                "ceil(seq / hidden), ALST's TiledMLP)");
  return b.build();
}

Block make_parallel_write() {
  BlockBuilder<CheckpointParallelWriteConfig> b("checkpoint.parallel_write");
  b.add(&CheckpointParallelWriteConfig::pipeline_stage, "pipeline_stage")
      .ignored("no pipeline stages")
      .describe("Spread the writing of a checkpoint over the pipeline stages");
  return b.build();
}

const Block& parallel_write_block() {
  static const Block b = make_parallel_write();
  return b;
}

Block make_checkpoint() {
  BlockBuilder<CheckpointConfig> b("checkpoint");
  b.add(&CheckpointConfig::tag_validation, "tag_validation")
      .one_of({"Ignore", "Warn", "Fail"}, true)
      .describe("Check that all ranks save under the same checkpoint tag: Ignore, Warn or Fail");
  b.add(&CheckpointConfig::load_universal, "load_universal")
      .ignored("DeepSpeed's universal-checkpoint loader")
      .describe("Load a universal checkpoint (converted to load at another parallel layout)");
  b.add(&CheckpointConfig::use_node_local_storage, "use_node_local_storage")
      .ignored("Strata writes checkpoints to the path the program gives")
      .describe("Save checkpoint files by local rank, so loading needs no shared file system");
  b.block(&CheckpointConfig::parallel_write, "parallel_write", parallel_write_block())
      .describe("Parallel writing of checkpoints");
  return b.build();
}

Block make_data_types() {
  auto sixteen_bit = [](const json& v) { return !v.is_null() && v != "fp32"; };
  BlockBuilder<DataTypesConfig> b("data_types");
  // fp32, or the model's own 16-bit dtype (checked across blocks in rules.cpp).
  b.add(&DataTypesConfig::grad_accum_dtype, "grad_accum_dtype")
      .one_of({"fp32", "fp16", "bf16"})
      .describe("Data type gradients are accumulated in; unset: the model's type");
  b.add(&DataTypesConfig::param_dtype, "param_dtype")
      .one_of({"fp32", "fp16", "bf16"})
      .when(sixteen_bit)
      .not_implemented("16-bit parameters outside fp16/bf16 mixed precision")
      .describe("Data type parameters are cast to (FSDP-style mixed-precision policy); unset: the training "
                "precision's");
  b.add(&DataTypesConfig::buffer_dtype, "buffer_dtype")
      .one_of({"fp32", "fp16", "bf16"})
      .when(sixteen_bit)
      .not_implemented("16-bit module buffers")
      .describe("Data type module buffers are cast to; unset: the buffers keep their dtype");
  return b.build();
}

Block make_compile() {
  BlockBuilder<ShallowConfig> b("compile");
  b.add(&ShallowConfig::enabled, "deepcompile")
      .ignored("DeepSpeed's graph compiler; Strata runs the model eagerly")
      .describe("Turn DeepCompile on: compile the training graph with DeepSpeed's optimization passes");
  for (const auto& [key, what] : std::vector<std::pair<const char*, const char*>>{
           {"free_activation", "Free activations eagerly once they are no longer needed"},
           {"offload_activation", "Move saved activations to pinned host memory until backward needs them"},
           {"offload_activation_pin_memory", "Pin the host buffers of the activation offload"},
           {"offload_opt_states", "Keep optimizer states in host memory during forward and backward"},
           {"double_buffer", "Double-buffer parameter gathers"},
           {"symmetric_memory", "Use symmetric memory for communication buffers"},
           {"debug_log", "Dump the compiled graphs (debug logging)"},
           {"offload_parameters", "Offload parameters to host memory"},
           {"sync_before_reduce", "Synchronize the device before each gradient reduction"},
           {"sync_after_reduce", "Synchronize the device after each gradient reduction"},
           {"sync_before_allgather", "Synchronize the device before each parameter all-gather"},
           {"sync_after_allgather", "Synchronize the device after each parameter all-gather"},
           {"keep_int_input_tensors", "Keep the real values of integer input tensors when tracing"},
           {"keep_all_input_tensors", "Keep the real values of all input tensors when tracing"}})
    b.setting(&ShallowConfig::settings, key, Kind::Bool).describe(what);
  b.setting(&ShallowConfig::settings, "free_activation_threshold", Kind::Int)
      .min(0)
      .describe("With free_activation: activations of at least this many bytes are freed eagerly");
  b.setting(&ShallowConfig::settings, "passes", Kind::StringList)
      .when([](const json& v) { return v.is_array() && !v.empty(); })
      .not_implemented("compiler passes such as autosp (sequence parallelism) change how data is split")
      .describe("Compiler passes to apply, e.g. autosp (sequence parallelism) or autotp");
  return b.build();
}

Block make_tensor_parallel() {
  BlockBuilder<ShallowConfig> b("tensor_parallel");
  b.setting(&ShallowConfig::settings, "autotp_size", Kind::Int)
      .min(0)
      .when([](const json& v) { return given_int_above(v, 1); })
      .not_implemented("tensor parallelism splits layers across ranks")
      .describe("Tensor-parallel degree of AutoTP; 0 turns it off");
  b.setting(&ShallowConfig::settings, "preset_model", Kind::String)
      .describe("Built-in partitioning preset for a model family (llama, bloom, mixtral, qwen2, ...)");
  b.setting(&ShallowConfig::settings, "tp_overlap_comm", Kind::Bool)
      .describe("Overlap the tensor-parallel all-reduce with computation");
  b.setting(&ShallowConfig::settings, "vocab_parallel_lm_head", Kind::Bool)
      .describe("Split the output (LM head) layer over the vocabulary across tensor-parallel ranks");
  b.setting(&ShallowConfig::settings, "keep_module_on_host", Kind::Bool)
      .describe("Keep loaded checkpoint weights on the host instead of moving them to the device");
  b.setting(&ShallowConfig::settings, "partition_config", Kind::Object)
      .describe("Custom AutoTP partitioning rules: parameter-name patterns and how each is split");
  b.setting(&ShallowConfig::settings, "tp", Kind::Object)
      .describe("Tensor-parallel settings (DeepSpeedTPConfig) used to split the model across GPUs");
  b.setting(&ShallowConfig::settings, "dtype", Kind::Any)
      .describe("Data type the model is converted to");
  return b.build();
}

// A shallow block whose `enabled` has the given support and whose other keys are just kept.
Block make_shallow(const char* name, Support support, const char* why, const char* enabled_what,
                   std::vector<ShallowKey> keys) {
  BlockBuilder<ShallowConfig> b(name);
  b.add(&ShallowConfig::enabled, "enabled").level(support, why).describe(enabled_what);
  for (const ShallowKey& k : keys)
    b.setting(&ShallowConfig::settings, k.key, k.kind).describe(k.what);
  return b.build();
}

Block make_pipeline() {
  BlockBuilder<ShallowConfig> b("pipeline");
  const char* why = "it configures DeepSpeed's PipelineModule; Strata has no pipeline parallelism";
  for (const ShallowKey& k : std::vector<ShallowKey>{
           {"stages", Kind::Any, "Number of pipeline stages; auto: from the PipelineModule"},
           {"partition", Kind::String, "How layers are divided among the stages (e.g. by parameters)"},
           {"seed_layers", Kind::Bool, "Give each layer its own random seed"},
           {"activation_checkpoint_interval", Kind::Int, "Checkpoint activations every this many layers; 0: off"},
           {"pipe_partitioned", Kind::Bool, "Partition activations sent between stages across model-parallel ranks"},
           {"grad_partitioned", Kind::Bool, "Partition gradients sent between stages across model-parallel ranks"}})
    b.setting(&ShallowConfig::settings, k.key, k.kind).ignored(why).describe(k.what);
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
      "Turn the Hybrid Engine on",
      {{"max_out_tokens", Kind::Int, "Most tokens (prompt and generated) a generation may hold"},
       {"inference_tp_size", Kind::Int, "Tensor-parallel degree used for generation"},
       {"release_inference_cache", Kind::Bool, "Free the inference cache (KV buffers) after each generation"},
       {"pin_parameters", Kind::Bool, "ZeRO-3: gather all layers' parameters for a generation, not layer by layer"},
       {"tp_gather_partition_size", Kind::Int, "Layers gathered per group for tensor-parallel generation at ZeRO-3"},
       {"enable_cuda_graph", Kind::Bool, "Capture token generation in CUDA graphs and replay them"}});
  return b;
}

const Block& eigenvalue_block() {
  static const Block b = make_shallow(
      "eigenvalue", Support::Ignored, "eigenvalue estimates only feed DeepSpeed's MoQ schedule",
      "Compute eigenvalues of the layers' Hessians (for MoQ's schedule)",
      {{"verbose", Kind::Bool, "Print details of the eigenvalue computation"},
       {"max_iter", Kind::Int, "Most power iterations per eigenvalue"},
       {"tol", Kind::Float, "Tolerance at which the power iteration stops"},
       {"stability", Kind::Float, "Variance stabilization factor"},
       {"gas_boundary_resolution", Kind::Int, "Compute eigenvalues every this many accumulation boundaries"},
       {"layer_name", Kind::String, "Module scope name of the layers whose eigenvalues are computed"},
       {"layer_num", Kind::Int, "Number of layers whose eigenvalues are computed"}});
  return b;
}

const Block& progressive_layer_drop_block() {
  static const Block b = make_shallow(
      "progressive_layer_drop", Support::NotImplemented, "dropping layers changes the forward pass",
      "Turn Progressive Layer Drop on",
      {{"theta", Kind::Float, "Lowest keep probability the schedule approaches (its end point)"},
       {"gamma", Kind::Float, "Rate at which the keep probability falls toward theta"}});
  return b;
}

const Block& nebula_block() {
  static const Block b = make_shallow(
      "nebula", Support::Ignored, "Azure's Nebula checkpoint service", "Save checkpoints through Nebula",
      {{"persistent_storage_path", Kind::String, "Path of the persistent storage Nebula writes to"},
       {"persistent_time_interval", Kind::Int, "Interval at which checkpoints are persisted"},
       {"num_of_version_in_retention", Kind::Int, "Checkpoint versions kept"},
       {"enable_nebula_load", Kind::Bool, "Load checkpoints through Nebula"},
       {"nebula_load_path", Kind::String, "Path Nebula loads checkpoints from"}});
  return b;
}

// Shared with schema_features.cpp.
Block shallow_block(const char* name, Support support, const char* why, const char* enabled_what,
                    std::vector<ShallowKey> keys) {
  return make_shallow(name, support, why, enabled_what, std::move(keys));
}

}  // namespace strata::schema
