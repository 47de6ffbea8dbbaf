// Precision blocks: fp16, bf16 (legacy name bfloat16), Apex amp, torch_autocast
// (runtime/precision_config.py, runtime/constants.py).
#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

Block make_fp16() {
  BlockBuilder<Fp16Config> b("fp16");
  b.add(&Fp16Config::enabled, "enabled").autoable();
  b.add(&Fp16Config::auto_cast, "auto_cast").pending("casting the model's inputs to fp16");
  b.add(&Fp16Config::loss_scale, "loss_scale").min(0);  // 0 = dynamic
  b.add(&Fp16Config::initial_scale_power, "initial_scale_power").range(0, 100);
  b.add(&Fp16Config::loss_scale_window, "loss_scale_window").min(1);
  b.add(&Fp16Config::hysteresis, "hysteresis").min(1);
  b.add(&Fp16Config::consecutive_hysteresis, "consecutive_hysteresis");
  b.add(&Fp16Config::min_loss_scale, "min_loss_scale").positive();
  b.add(&Fp16Config::fp16_master_weights_and_grads, "fp16_master_weights_and_grads")
      .not_implemented("fp16 master weights and gradients change the optimizer's precision");
  Block block = b.build();
  block.auto_is_default = true;
  return block;
}

Block make_bf16() {
  BlockBuilder<Bf16Config> b("bf16");
  b.add(&Bf16Config::enabled, "enabled").autoable();
  b.add(&Bf16Config::immediate_grad_update, "immediate_grad_update")
      .ignored("a scheduling choice of DeepSpeed's bf16 optimizer");
  b.add(&Bf16Config::check_grad_overflow, "check_grad_overflow");
  b.add(&Bf16Config::bf16_master_weights_and_grads, "bf16_master_weights_and_grads")
      .not_implemented("bf16 master weights and gradients change the optimizer's precision");
  b.add(&Bf16Config::bf16_optimizer_states, "bf16_optimizer_states")
      .not_implemented("bf16 optimizer states change the optimizer's precision");
  Block block = b.build();
  block.auto_is_default = true;
  return block;
}

// Apex AMP: every key but `enabled` goes to amp.initialize, so they are kept as written.
Block make_amp() {
  BlockBuilder<ShallowConfig> b("amp");
  b.add(&ShallowConfig::enabled, "enabled")
      .autoable()
      .not_implemented("Apex AMP casts the model and optimizer; use bf16 or fp16 instead");
  b.setting(&ShallowConfig::settings, "opt_level", Kind::String);
  for (const char* key : {"cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                          "master_weights", "loss_scale", "cast_model_outputs", "num_losses",
                          "verbosity", "min_loss_scale", "max_loss_scale"})
    b.setting(&ShallowConfig::settings, key, Kind::Any);
  return b.build();
}

Block make_torch_autocast() {
  BlockBuilder<TorchAutocastConfig> b("torch_autocast");
  b.add(&TorchAutocastConfig::enabled, "enabled")
      .not_implemented("torch.autocast runs the model's ops in lower precision");
  b.add(&TorchAutocastConfig::dtype, "dtype")
      .one_of({"bfloat16", "float16", "bf16", "fp16", "half", "torch.bfloat16", "torch.float16",
               "fp32", "float32", "float", "torch.float32"});
  b.add(&TorchAutocastConfig::lower_precision_safe_modules, "lower_precision_safe_modules");
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
