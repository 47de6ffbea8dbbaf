// The top level of the config: DeepSpeed's scalar keys (runtime/config.py, runtime/constants.py)
// and every block, each bound to its member of Config. Unknown top-level keys are errors here too.
#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

bool non_empty(const json& v) { return !v.is_null() && !v.empty(); }

Block make_root() {
  BlockBuilder<Config> b("");
  // Batch size: the triangle train = micro x gas x world is resolved in batch.cpp.
  b.add(&Config::train_batch_size, "train_batch_size")
      .min(1)
      .describe("Effective batch size: samples per optimizer step, i.e. micro-batch size x accumulation steps x "
                "data-parallel ranks");
  b.add(&Config::train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu")
      .min(1)
      .describe("Samples one rank processes in one forward/backward pass, without accumulation");
  b.add(&Config::gradient_accumulation_steps, "gradient_accumulation_steps")
      .min(1)
      .describe("Micro-batches whose gradients are accumulated and averaged before each optimizer step");
  b.add(&Config::steps_per_print, "steps_per_print")
      .min(1)
      .describe("Print a progress report (step, skipped steps, learning rate, momentum) every N training steps");
  b.add(&Config::gradient_clipping, "gradient_clipping")
      .min(0)
      .describe("Clip gradients to this global L2 norm before the optimizer step; 0 turns clipping off");
  b.add(&Config::prescale_gradients, "prescale_gradients")
      .ignored("dividing by the world size before or after the all-reduce gives the same mean")
      .describe("Divide gradients by the data-parallel size before the all-reduce rather than after it");
  b.add(&Config::gradient_predivide_factor, "gradient_predivide_factor")
      .positive()
      .ignored("the pre-division is undone after the all-reduce; the mean is the same")
      .describe("Divide gradients by this factor before the mean all-reduce (the rest after it), for fp16 "
                "stability at scale");
  b.add(&Config::communication_data_type, "communication_data_type")
      .one_of({"fp16", "bf16", "fp32"}, true)
      .value_alias("bfp16", "bf16")
      .describe("Data type gradients are reduced in across data-parallel ranks; unset: the training precision's");
  b.add(&Config::seq_parallel_comm_data_type, "seq_parallel_comm_data_type")
      .alias("seq_parallel_communication_data_type")
      .one_of({"fp16", "bf16", "fp32"}, true)
      .ignored("Strata's sequence-parallel gradients reduce over the data-parallel group like any "
               "other, in communication_data_type; its attention exchange moves the activations' "
               "own dtype")
      .describe("Data type of the gradient communication of sequence parallelism (fp32 by default)");
  // Strata: groups of consecutive ranks; the batch keys count world / sequence_parallel_size
  // data-parallel ranks (rules.cpp, batch.cpp); built into models::CausalLM and the example GPT,
  // a model of one's own calls strata::sequence::ulysses_attention (README, docs/models.md).
  b.add(&Config::sequence_parallel_size, "sequence_parallel_size")
      .min(1)
      .describe("Ranks that split each sample's sequence between them (DeepSpeed-Ulysses sequence "
                "parallelism); 1: none");
  b.add(&Config::wall_clock_breakdown, "wall_clock_breakdown")
      .ignored("Strata's progress line reports the step time, not a per-phase breakdown")
      .describe("Time the forward, backward and optimizer-step phases and report each");
  b.add(&Config::memory_breakdown, "memory_breakdown")
      .ignored("no memory breakdown is printed")
      .describe("Report device memory use before and after forward, backward and step");
  b.add(&Config::dump_state, "dump_state")
      .ignored("the engine's state is not dumped")
      .describe("Print the engine's state after initialization");
  b.add(&Config::zero_allow_untested_optimizer, "zero_allow_untested_optimizer")
      .describe("Allow ZeRO with an optimizer DeepSpeed has not tested with it (one the client passes)");
  b.add(&Config::zero_force_ds_cpu_optimizer, "zero_force_ds_cpu_optimizer")
      .describe("With ZeRO-Offload, require DeepSpeed's CPU optimizer (DeepSpeedCPUAdam); false allows a client "
                "optimizer");
  b.add(&Config::sparse_gradients, "sparse_gradients")
      .ignored("gradients are all-reduced dense; the result is the same")
      .describe("Communicate torch.nn.Embedding gradients in sparse (CSR) form; essentially deprecated");
  b.add(&Config::disable_allgather, "disable_allgather")
      .ignored("deprecated in DeepSpeed")
      .describe("Legacy switch against all-gathering parameters; parsed but not used by current DeepSpeed");
  b.add(&Config::dataloader_drop_last, "dataloader_drop_last")
      .ignored("the program builds its data loader, not the engine")
      .describe("Drop the last incomplete batch in the data loader DeepSpeed builds (deepspeed_io)");
  b.add(&Config::vocabulary_size, "vocabulary_size")
      .min(1)
      .describe("The model's vocabulary size; DeepSpeed warns when it is not a multiple of 8 (tensor-core "
                "alignment)");
  b.add(&Config::graph_harvesting, "graph_harvesting")
      .ignored("no CUDA graph capture")
      .describe("Capture the optimizer's short kernel sequences in CUDA graphs and replay them");
  b.add(&Config::managed_gradient_accumulation, "managed_gradient_accumulation")
      .not_implemented("the engine always steps the optimizer at the accumulation boundary")
      .describe("true: DeepSpeed counts micro-steps and steps at the accumulation boundary; false: the client "
                "calls step() there");
  b.add(&Config::gradient_allreduce_op, "gradient_allreduce_op")
      .one_of({"mean", "sum"}, true)
      .not_implemented("gradients are averaged over the data-parallel ranks")
      .describe("How gradients combine across data-parallel ranks: mean averages them, sum keeps the unscaled sum");
  b.add(&Config::use_data_before_expert_parallelism, "use_data_before_expert_parallelism")
      .ignored("Strata lays out its expert-parallel groups one way")
      .describe("Build MoE process groups in data-then-expert (D + E) rank order instead of expert-then-data");
  b.add(&Config::disable_python_gc, "disable_python_gc")
      .ignored("there is no Python")
      .describe("Turn Python's cyclic garbage collector off during training; the program collects at safe points");
  // Strata's own key, PyTorch DDP's broadcast_buffers. False, as DeepSpeed: each rank's buffers
  // follow its own batches and checkpoints keep rank 0's.
  b.add(&Config::broadcast_buffers, "broadcast_buffers")
      .describe("Strata's own (DDP's broadcast_buffers): every rank takes rank 0's buffers (BatchNorm "
                "statistics) before each training forward");

  b.block(&Config::fp16, "fp16", fp16_block())
      .describe("Mixed-precision training in fp16 with fp32 master weights and loss scaling");
  b.block(&Config::bf16, "bf16", bf16_block())
      .deprecated_alias("bfloat16")
      .describe("Mixed-precision training in bfloat16 with fp32 master weights (no loss scaling needed)");
  b.block(&Config::amp, "amp", amp_block())
      .describe("NVIDIA Apex AMP mixed precision; keys besides enabled go to amp.initialize");
  b.block(&Config::torch_autocast, "torch_autocast", torch_autocast_block())
      .describe("PyTorch's native torch.autocast mixed precision, applied by the engine");
  b.block(&Config::zero_optimization, "zero_optimization", zero_block())
      .describe("ZeRO: partition optimizer states (stage 1), gradients (2) and parameters (3) across data-parallel "
                "ranks");
  b.block(&Config::aio, "aio", aio_block())
      .describe("Asynchronous I/O settings for offloading parameters and optimizer states to NVMe");
  b.block(&Config::optimizer, "optimizer", optimizer_block())
      .describe("The optimizer DeepSpeed builds: its type and the params passed to its constructor")
      .printed = [](const void* o) {
    return static_cast<const Config*>(o)->optimizer.present;
  };
  b.block(&Config::scheduler, "scheduler", scheduler_block())
      .describe("The learning-rate schedule DeepSpeed steps with the optimizer: its type and params")
      .printed = [](const void* o) {
    return static_cast<const Config*>(o)->scheduler.present;
  };
  b.block(&Config::tensorboard, "tensorboard", tensorboard_block())
      .describe("Log training metrics (loss, learning rate, loss scale) to TensorBoard");
  b.block(&Config::csv_monitor, "csv_monitor", csv_monitor_block())
      .describe("Log training metrics to local CSV files");
  b.block(&Config::wandb, "wandb", wandb_block())
      .describe("Log training metrics to Weights & Biases");
  b.block(&Config::comet, "comet", comet_block())
      .describe("Log training metrics to Comet");
  b.block(&Config::flops_profiler, "flops_profiler", flops_profiler_block())
      .describe("Profile the model's FLOPs, parameters and latency at one training step");
  b.block(&Config::comms_logger, "comms_logger", comms_logger_block())
      .describe("Log and time communication operations launched through deepspeed.comm");
  b.block(&Config::timers, "timers", timers_block())
      .describe("Engine timers");
  b.block(&Config::activation_checkpointing, "activation_checkpointing", activation_checkpointing_block())
      .describe("Settings of deepspeed.checkpointing, the activation checkpointing the model calls "
                "(docs/activation_checkpointing.md)");
  b.block(&Config::checkpoint, "checkpoint", checkpoint_block())
      .describe("Checkpoint saving and loading options");
  b.block(&Config::data_types, "data_types", data_types_block())
      .describe("Data types of gradient accumulation, parameters and buffers");
  b.block(&Config::compile, "compile", compile_block())
      .describe("DeepCompile: DeepSpeed's compiler-based optimizations of the training graph");
  b.block(&Config::tensor_parallel, "tensor_parallel", tensor_parallel_block())
      .describe("AutoTP: automatic tensor parallelism for training");
  b.block(&Config::hybrid_engine, "hybrid_engine", hybrid_engine_block())
      .describe("Hybrid Engine: switch the model between training and DeepSpeed's inference kernels (RLHF "
                "generation)");
  b.block(&Config::eigenvalue, "eigenvalue", eigenvalue_block())
      .describe("Eigenvalue computation (power iteration) that schedules MoQ quantization");
  b.block(&Config::progressive_layer_drop, "progressive_layer_drop", progressive_layer_drop_block())
      .describe("Progressive Layer Drop: stochastically skip transformer layers with a growing drop rate");
  b.block(&Config::pipeline, "pipeline", pipeline_block())
      .describe("Pipeline-parallel engine settings for a PipelineModule");
  b.block(&Config::nebula, "nebula", nebula_block())
      .describe("Azure Nebula asynchronous checkpoint service");
  b.block(&Config::autotuning, "autotuning", autotuning_block())
      .describe("DeepSpeed Autotuner: searches ZeRO stages and micro-batch sizes for the fastest configuration");
  b.block(&Config::compression_training, "compression_training", compression_training_block())
      .describe("DeepSpeed Compression: quantization, pruning and layer reduction during training");
  b.block(&Config::curriculum_learning, "curriculum_learning", curriculum_learning_block())
      .describe("Legacy curriculum learning: grow the difficulty (e.g. sequence length) of samples during training");
  b.block(&Config::data_efficiency, "data_efficiency", data_efficiency_block())
      .describe("Data Efficiency library: curriculum data sampling and random layerwise token dropping "
                "(random-LTD)");
  b.block(&Config::elasticity, "elasticity", elasticity_block())
      .describe("Elastic training: pick a batch size that stays valid as the number of GPUs changes");
  b.block(&Config::quantize_training, "quantize_training", quantize_training_block())
      .describe("MoQ (Mixture-of-Quantization): quantization-aware training that lowers weight precision on a "
                "schedule");
  b.add(&Config::sparse_attention, "sparse_attention")
      .as(Kind::Object)
      .when(non_empty)
      .not_implemented("sparse attention replaces the model's attention")
      .describe("Sparse self-attention kernels: the sparsity layout (mode, block size, windows) of DeepSpeed's "
                "SparseSelfAttention");
  b.add(&Config::expert_parallel, "expert_parallel")
      .as(Kind::Object)
      .when([](const json& v) { return json_flag(v, "enabled"); })
      .not_implemented("DeepSpeed's AutoEP rewrites the model; Strata's MoE is the `moe` block")
      .describe("AutoEP: detect a Hugging Face model's MoE layers and replace them with expert-parallel ones");
  b.add(&Config::weight_quantization, "weight_quantization")
      .as(Kind::Object)
      .when(non_empty)
      .not_implemented("quantized weights (inference) change the numerics")
      .describe("Quantize the model's weights on load (post-training, for inference)");
  b.add(&Config::datastates, "datastates")
      .as(Kind::Object)
      .when(non_empty)
      .ignored("Strata writes its own checkpoints")
      .describe("DataStates-LLM asynchronous checkpointing engine");
  b.block(&Config::moe, "moe", moe_block())
      .describe("Mixture-of-experts layers: the arguments of deepspeed.moe.layer.MoE (Strata's own block)");
  b.block(&Config::launcher, "launcher", launcher_block())
      .describe("Launcher settings as keys: the deepspeed launcher's command-line flags (Strata's own block)");
  return b.build();
}

}  // namespace

const Block& root_block() {
  static const Block b = make_root();
  return b;
}

}  // namespace strata::schema
