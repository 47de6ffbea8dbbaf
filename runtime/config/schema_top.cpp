// The top level of the config: DeepSpeed's scalar keys (runtime/config.py, runtime/constants.py)
// and every block, each bound to its member of Config. Unknown top-level keys are errors here too.
#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

bool non_empty(const json& v) { return !v.is_null() && !v.empty(); }

Block make_root() {
  BlockBuilder<Config> b("");
  // Batch size: the triangle train = micro x gas x world is resolved in batch.cpp.
  b.add(&Config::train_batch_size, "train_batch_size").min(1);
  b.add(&Config::train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu").min(1);
  b.add(&Config::gradient_accumulation_steps, "gradient_accumulation_steps").min(1);
  b.add(&Config::steps_per_print, "steps_per_print").min(1);
  b.add(&Config::gradient_clipping, "gradient_clipping").min(0);
  b.add(&Config::prescale_gradients, "prescale_gradients")
      .ignored("dividing by the world size before or after the all-reduce gives the same mean");
  b.add(&Config::gradient_predivide_factor, "gradient_predivide_factor")
      .positive()
      .ignored("the pre-division is undone after the all-reduce; the mean is the same");
  b.add(&Config::communication_data_type, "communication_data_type")
      .one_of({"fp16", "bf16", "fp32"}, true)
      .value_alias("bfp16", "bf16");
  b.add(&Config::seq_parallel_comm_data_type, "seq_parallel_comm_data_type")
      .alias("seq_parallel_communication_data_type")
      .one_of({"fp16", "bf16", "fp32"}, true)
      .ignored("Strata has no sequence parallelism");
  b.add(&Config::sequence_parallel_size, "sequence_parallel_size")
      .min(1)
      .not_implemented("sequence parallelism splits each sample across ranks");
  b.add(&Config::wall_clock_breakdown, "wall_clock_breakdown")
      .ignored("Strata's progress line reports the step time, not a per-phase breakdown");
  b.add(&Config::memory_breakdown, "memory_breakdown").ignored("no memory breakdown is printed");
  b.add(&Config::dump_state, "dump_state").ignored("the engine's state is not dumped");
  b.add(&Config::zero_allow_untested_optimizer, "zero_allow_untested_optimizer");
  b.add(&Config::zero_force_ds_cpu_optimizer, "zero_force_ds_cpu_optimizer");
  b.add(&Config::sparse_gradients, "sparse_gradients")
      .ignored("gradients are all-reduced dense; the result is the same");
  b.add(&Config::disable_allgather, "disable_allgather").ignored("deprecated in DeepSpeed");
  b.add(&Config::dataloader_drop_last, "dataloader_drop_last")
      .ignored("the program builds its data loader, not the engine");
  b.add(&Config::vocabulary_size, "vocabulary_size").min(1);
  b.add(&Config::graph_harvesting, "graph_harvesting").ignored("no CUDA graph capture");
  b.add(&Config::managed_gradient_accumulation, "managed_gradient_accumulation")
      .not_implemented("the engine always steps the optimizer at the accumulation boundary");
  b.add(&Config::gradient_allreduce_op, "gradient_allreduce_op")
      .one_of({"mean", "sum"}, true)
      .not_implemented("gradients are averaged over the data-parallel ranks");
  b.add(&Config::use_data_before_expert_parallelism, "use_data_before_expert_parallelism")
      .ignored("Strata lays out its expert-parallel groups one way");
  b.add(&Config::disable_python_gc, "disable_python_gc").ignored("there is no Python");

  b.block(&Config::fp16, "fp16", fp16_block());
  b.block(&Config::bf16, "bf16", bf16_block()).deprecated_alias("bfloat16");
  b.block(&Config::amp, "amp", amp_block());
  b.block(&Config::torch_autocast, "torch_autocast", torch_autocast_block());
  b.block(&Config::zero_optimization, "zero_optimization", zero_block());
  b.block(&Config::aio, "aio", aio_block());
  b.block(&Config::optimizer, "optimizer", optimizer_block()).printed = [](const void* o) {
    return static_cast<const Config*>(o)->optimizer.present;
  };
  b.block(&Config::scheduler, "scheduler", scheduler_block()).printed = [](const void* o) {
    return static_cast<const Config*>(o)->scheduler.present;
  };
  b.block(&Config::tensorboard, "tensorboard", tensorboard_block());
  b.block(&Config::csv_monitor, "csv_monitor", csv_monitor_block());
  b.block(&Config::wandb, "wandb", wandb_block());
  b.block(&Config::comet, "comet", comet_block());
  b.block(&Config::flops_profiler, "flops_profiler", flops_profiler_block());
  b.block(&Config::comms_logger, "comms_logger", comms_logger_block());
  b.block(&Config::timers, "timers", timers_block());
  b.block(&Config::activation_checkpointing, "activation_checkpointing", activation_checkpointing_block());
  b.block(&Config::checkpoint, "checkpoint", checkpoint_block());
  b.block(&Config::data_types, "data_types", data_types_block());
  b.block(&Config::compile, "compile", compile_block());
  b.block(&Config::tensor_parallel, "tensor_parallel", tensor_parallel_block());
  b.block(&Config::hybrid_engine, "hybrid_engine", hybrid_engine_block());
  b.block(&Config::eigenvalue, "eigenvalue", eigenvalue_block());
  b.block(&Config::progressive_layer_drop, "progressive_layer_drop", progressive_layer_drop_block());
  b.block(&Config::pipeline, "pipeline", pipeline_block());
  b.block(&Config::nebula, "nebula", nebula_block());
  b.block(&Config::autotuning, "autotuning", autotuning_block());
  b.block(&Config::compression_training, "compression_training", compression_training_block());
  b.block(&Config::curriculum_learning, "curriculum_learning", curriculum_learning_block());
  b.block(&Config::data_efficiency, "data_efficiency", data_efficiency_block());
  b.block(&Config::elasticity, "elasticity", elasticity_block());
  b.block(&Config::quantize_training, "quantize_training", quantize_training_block());
  b.add(&Config::sparse_attention, "sparse_attention")
      .as(Kind::Object)
      .when(non_empty)
      .not_implemented("sparse attention replaces the model's attention");
  b.add(&Config::expert_parallel, "expert_parallel")
      .as(Kind::Object)
      .when([](const json& v) { return json_flag(v, "enabled"); })
      .not_implemented("DeepSpeed's AutoEP rewrites the model; Strata's MoE is the `moe` block");
  b.add(&Config::weight_quantization, "weight_quantization")
      .as(Kind::Object)
      .when(non_empty)
      .not_implemented("quantized weights (inference) change the numerics");
  b.add(&Config::datastates, "datastates")
      .as(Kind::Object)
      .when(non_empty)
      .ignored("Strata writes its own checkpoints");
  b.block(&Config::moe, "moe", moe_block());
  b.block(&Config::launcher, "launcher", launcher_block());
  return b.build();
}

}  // namespace

const Block& root_block() {
  static const Block b = make_root();
  return b;
}

}  // namespace strata::schema
