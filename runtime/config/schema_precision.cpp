// Precision blocks: fp16, bf16 (legacy name bfloat16), Apex amp, torch_autocast
// (runtime/precision_config.py, runtime/constants.py).
#include <tuple>

#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

Block make_fp16() {
  BlockBuilder<Fp16Config> b("fp16");
  b.add(&Fp16Config::enabled, "enabled")
      .autoable()
      .describe("Train in fp16 mixed precision");
  b.add(&Fp16Config::auto_cast, "auto_cast")
      .describe("Cast the floating-point tensors passed to the model's forward (also inside vectors and "
                "tuples) to the model's 16-bit dtype");
  b.add(&Fp16Config::loss_scale, "loss_scale")
      .min(0)
      .describe("Static loss scale; 0 selects dynamic loss scaling");
  b.add(&Fp16Config::initial_scale_power, "initial_scale_power")
      .range(0, 100)
      .describe("Dynamic loss scaling starts at a scale of 2^initial_scale_power");
  b.add(&Fp16Config::loss_scale_window, "loss_scale_window")
      .min(1)
      .describe("Steps without overflow after which the dynamic loss scale is raised");
  b.add(&Fp16Config::hysteresis, "hysteresis")
      .min(1)
      .describe("Overflows tolerated (delayed shift) before the dynamic loss scale is lowered");
  b.add(&Fp16Config::consecutive_hysteresis, "consecutive_hysteresis")
      .describe("Refill the hysteresis on every step that does not overflow");
  b.add(&Fp16Config::min_loss_scale, "min_loss_scale")
      .positive()
      .describe("Lowest value the dynamic loss scale may fall to");
  b.add(&Fp16Config::fp16_master_weights_and_grads, "fp16_master_weights_and_grads")
      .not_implemented("fp16 master weights and gradients change the optimizer's precision")
      .describe("Keep ZeRO's master weights and gradients in fp16 instead of fp32 (with offload and CPU Adam)");
  Block block = b.build();
  block.auto_is_default = true;
  return block;
}

Block make_bf16() {
  BlockBuilder<Bf16Config> b("bf16");
  b.add(&Bf16Config::enabled, "enabled")
      .autoable()
      .describe("Train in bfloat16 mixed precision");
  b.add(&Bf16Config::immediate_grad_update, "immediate_grad_update")
      .ignored("a scheduling choice of DeepSpeed's bf16 optimizer")
      .describe("bf16 optimizer: accumulate each gradient into the fp32 gradients as soon as it is produced");
  b.add(&Bf16Config::check_grad_overflow, "check_grad_overflow")
      .describe("Check gradients for inf/NaN before the optimizer step and skip the step when found");
  b.add(&Bf16Config::bf16_master_weights_and_grads, "bf16_master_weights_and_grads")
      .not_implemented("bf16 master weights and gradients change the optimizer's precision")
      .describe("Keep ZeRO's master weights and gradients in bf16 instead of fp32");
  b.add(&Bf16Config::bf16_optimizer_states, "bf16_optimizer_states")
      .not_implemented("bf16 optimizer states change the optimizer's precision")
      .describe("Keep the optimizer states in bf16 too (needs bf16_master_weights_and_grads)");
  Block block = b.build();
  block.auto_is_default = true;
  return block;
}

// Apex AMP: every key but `enabled` goes to amp.initialize, so they are kept as written.
Block make_amp() {
  BlockBuilder<ShallowConfig> b("amp");
  b.add(&ShallowConfig::enabled, "enabled")
      .autoable()
      .not_implemented("Apex AMP casts the model and optimizer; use bf16 or fp16 instead")
      .describe("Train with NVIDIA Apex AMP (amp.initialize); not combinable with fp16 or ZeRO");
  for (const auto& [key, kind, what] : std::vector<std::tuple<const char*, Kind, const char*>>{
           {"opt_level", Kind::String, "Apex optimization level, from O0 (fp32) to O3 (pure fp16)"},
           {"cast_model_type", Kind::Any, "amp.initialize: dtype the model's parameters and buffers are cast to"},
           {"patch_torch_functions", Kind::Any, "amp.initialize: patch torch functions to run in fp16 where safe"},
           {"keep_batchnorm_fp32", Kind::Any, "amp.initialize: keep batch-norm weights in fp32"},
           {"master_weights", Kind::Any, "amp.initialize: keep fp32 master weights for the optimizer"},
           {"loss_scale", Kind::Any, "amp.initialize: a static loss scale, or dynamic"},
           {"cast_model_outputs", Kind::Any, "amp.initialize: dtype the model's outputs are cast to"},
           {"num_losses", Kind::Any, "amp.initialize: number of losses, each with its own loss scaler"},
           {"verbosity", Kind::Any, "amp.initialize: verbosity of Apex's messages"},
           {"min_loss_scale", Kind::Any, "amp.initialize: lowest value of the dynamic loss scale"},
           {"max_loss_scale", Kind::Any, "amp.initialize: highest value of the dynamic loss scale"}})
    b.setting(&ShallowConfig::settings, key, kind).describe(what);
  return b.build();
}

Block make_torch_autocast() {
  BlockBuilder<TorchAutocastConfig> b("torch_autocast");
  b.add(&TorchAutocastConfig::enabled, "enabled")
      .describe("Run the forward pass under autocast (torch.autocast) without a call in the model code; "
                "parameters stay fp32 unless fp16/bf16 cast them");
  // DeepSpeed's DtypeEnum names of the two lower-precision dtypes; fp32 would leave autocast off.
  b.add(&TorchAutocastConfig::dtype, "dtype")
      .one_of({"bfloat16", "bf16", "bfloat", "torch.bfloat16", "float16", "fp16", "half", "torch.float16"})
      .describe("Dtype autocast runs ops in (CPU: bfloat16, float16 from LibTorch 2.4; CUDA: both); "
                "lower_precision_safe_modules' gradients are reduced in it");
  b.add(&TorchAutocastConfig::lower_precision_safe_modules, "lower_precision_safe_modules")
      .describe("Module types (torch.nn.Linear, or a module's name()) whose gradients may be reduced in "
                "the autocast dtype; unset: Linear, Conv1d/2d/3d");
  return b.build();
}

}  // namespace

const Block& fp16_block() {
  static const Block b = make_fp16();
  return b;
}
const Block& bf16_block() {
  static const Block b = make_bf16();
  return b;
}
const Block& amp_block() {
  static const Block b = make_amp();
  return b;
}
const Block& torch_autocast_block() {
  static const Block b = make_torch_autocast();
  return b;
}

}  // namespace strata::schema
