// One bad config per validation rule; each message must name the JSON path and say what is
// allowed or what to do.
#include "tests/runtime/config/config_test_util.h"

namespace strata::test {
namespace {

TEST(ConfigRejects, UnknownTopLevelKeyWithDidYouMean) {
  const std::string m = load_error(with(R"("gradient_acumulation_steps": 1)"));
  EXPECT_CONTAINS(m, "unknown key 'gradient_acumulation_steps'");
  EXPECT_CONTAINS(m, "did you mean 'gradient_accumulation_steps'?");
  EXPECT_CONTAINS(m, "test.json:1:");  // file:line:column of the key
}

TEST(ConfigRejects, UnknownNestedKeyWithDidYouMean) {
  const std::string m = load_error(
      "{\n  \"train_batch_size\": 8,\n  \"zero_optimization\": {\n"
      "    \"stage\": 3,\n    \"stage3_param_persitance_threshold\": 1e5\n  }\n}");
  EXPECT_CONTAINS(m, "unknown key 'zero_optimization.stage3_param_persitance_threshold'");
  EXPECT_CONTAINS(m, "did you mean 'stage3_param_persistence_threshold'?");
  EXPECT_CONTAINS(m, "test.json:5:");
}

TEST(ConfigRejects, UnknownKeyIsCaseInsensitiveForSuggestions) {
  EXPECT_CONTAINS(load_error(R"({"Train_Batch_Size": 8})"), "did you mean 'train_batch_size'?");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"Stage": 1})")), "did you mean 'stage'?");
}

TEST(ConfigRejects, UnknownKeyWithoutNeighbourSaysRemoveIt) {
  const std::string m = load_error(with(R"("hidden-size": 768)"));
  EXPECT_CONTAINS(m, "unknown key 'hidden-size'");
  EXPECT_CONTAINS(m, "remove it");
}

TEST(ConfigRejects, UnknownKeyDeepInOptimizerParams) {
  const std::string m = load_error(with(R"("optimizer": {"type": "Adam", "params": {"lr": 1e-3, "beta": [0.9, 0.99]}})"));
  EXPECT_CONTAINS(m, "unknown key 'optimizer.params.beta'");
  EXPECT_CONTAINS(m, "did you mean 'betas'?");
}

TEST(ConfigRejects, WrongType) {
  EXPECT_CONTAINS(load_error(with(R"("steps_per_print": [10])")),
                  "steps_per_print = [10]: expected an integer, found a list");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"offload_param": "cpu"})")),
                  "zero_optimization.offload_param: expected an object");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": "Adam", "params": {"betas": 0.9}})")),
                  "optimizer.params.betas = 0.9: expected a list of 2 numbers");
  EXPECT_CONTAINS(load_error(with(R"("fp16": {"enabled": 1})")), "fp16.enabled = 1: expected true or false");
}

TEST(ConfigRejects, StringBooleanHint) {
  const std::string m = load_error(with(R"("fp16": {"enabled": "true"})"));
  EXPECT_CONTAINS(m, "fp16.enabled = \"true\"");
  EXPECT_CONTAINS(m, "write true without quotes");
  EXPECT_CONTAINS(load_error(with(R"("wall_clock_breakdown": "False")")), "write false without quotes");
}

TEST(ConfigRejects, NumberInStringHint) {
  const std::string m = load_error(R"({"train_batch_size": "32"})");
  EXPECT_CONTAINS(m, "train_batch_size = \"32\"");
  EXPECT_CONTAINS(m, "write 32 without quotes");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"reduce_bucket_size": "5e8"})")),
                  "write 5e8 without quotes");
}

TEST(ConfigRejects, RangeAndChoices) {
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"stage": 4})")),
                  "zero_optimization.stage = 4 is out of range; allowed: >= 0 and <= 3");
  const std::string device = load_error(with(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}})"));
  EXPECT_CONTAINS(device, "zero_optimization.offload_param.device = \"gpu\": expected one of none|cpu|nvme");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"allgather_bucket_size": 0})")),
                  "zero_optimization.allgather_bucket_size = 0 is out of range; allowed: > 0");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"reduce_bucket_size": -1})")),
                  "zero_optimization.reduce_bucket_size = -1 is out of range; allowed: >= 0");
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 0})"), "train_batch_size = 0 is out of range; allowed: >= 1");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}})")),
                  "optimizer.params.betas[1] = 1.5 is out of range; allowed: >= 0 and < 1");
  EXPECT_CONTAINS(load_error(with(R"("communication_data_type": "fp8")")),
                  "communication_data_type = \"fp8\": expected one of fp16|bf16|fp32");
}

TEST(ConfigRejects, FractionForIntegerButIntegralFloatsAccepted) {
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 1.5})"), "train_batch_size = 1.5: expected an integer");
  const Config c = load(with(R"("zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2.0e8})"));
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size.value, 500000000);
  EXPECT_EQ(c.zero_optimization.allgather_bucket_size, 200000000);
}

TEST(ConfigRejects, DuplicateKeys) {
  const std::string top = load_error("{\"train_batch_size\": 8,\n \"train_batch_size\": 16}");
  EXPECT_CONTAINS(top, "duplicate key 'train_batch_size'");
  EXPECT_CONTAINS(top, "test.json:2:");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"stage": 1, "stage": 2})")),
                  "duplicate key 'zero_optimization.stage'");
  EXPECT_CONTAINS(load_error(with(R"("x": [{"a": 1}, {"b": 1, "b": 2}])")), "duplicate key 'x[1].b'");
}

TEST(ConfigRejects, NestingDepthLimit) {
  std::string deep = with(R"("optimizer": {"type": "Adam", "params": {"lr": )" + std::string(200, '[') +
                          std::string(200, ']') + "}}");
  const std::string m = load_error(deep);
  EXPECT_CONTAINS(m, "nesting deeper than 64 levels");
  EXPECT_CONTAINS(m, "optimizer.params.lr");
}

TEST(ConfigRejects, NaNAndInfinityAreNotJson) {
  for (const char* literal : {"NaN", "Infinity", "-Infinity", "nan", "inf"}) {
    const std::string m = load_error(with(std::string(R"("gradient_clipping": )") + literal));
    EXPECT_CONTAINS(m, "invalid JSON");
    EXPECT_CONTAINS(m, "test.json:1:");
  }
  EXPECT_CONTAINS(load_error(with(R"("gradient_clipping": NaN)")), "NaN and Infinity are not JSON numbers");
}

TEST(ConfigRejects, HugeNumbersAreRangeErrors) {
  EXPECT_CONTAINS(load_error(with(R"("gradient_clipping": 1e400)")),
                  "gradient_clipping: the number 1e400 is too large");
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 1e30})"),
                  "train_batch_size = 1e+30 is out of range for an integer");
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 18446744073709551615})"),
                  "train_batch_size = 18446744073709551615 is out of range for an integer");
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 99999999999999999999999})"), "out of range for an integer");
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": -9e18})"), "train_batch_size");
}

TEST(ConfigRejects, Fp16AndBf16BothEnabled) {
  EXPECT_CONTAINS(load_error(with(R"("fp16": {"enabled": true}, "bf16": {"enabled": true})")),
                  "fp16.enabled and bf16.enabled are both true");
  EXPECT_CONTAINS(load_error(with(R"("fp16": {"enabled": true}, "bfloat16": {"enabled": true})")),
                  "fp16.enabled and bf16.enabled are both true");
}

TEST(ConfigRejects, TorchAutocastWithoutALowerPrecision) {
  EXPECT_CONTAINS(load_error(with(R"("torch_autocast": {"enabled": true, "dtype": "float32"})")),
                  "torch_autocast.dtype = \"float32\": expected one of");
  EXPECT_CONTAINS(load_error(with(R"("torch_autocast": {"lower_precision_safe_modules": "torch.nn.Linear"})")),
                  "torch_autocast.lower_precision_safe_modules");
}

TEST(ConfigRejects, GradAccumDtypeIsFp32OrTheModels) {
  const std::string m = load_error(
      with(R"("bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp16"})"));
  EXPECT_CONTAINS(m, "data_types.grad_accum_dtype = \"fp16\" but the model trains in bf16");
  EXPECT_CONTAINS(m, "\"fp32\" (the default) or \"bf16\"");
  EXPECT_CONTAINS(load_error(with(R"("data_types": {"grad_accum_dtype": "bf16"})")),
                  "the model trains in fp32");
}

TEST(ConfigRejects, BatchTriangleMustHoldExactly) {
  const std::string m = load_error(
      R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})");
  EXPECT_CONTAINS(m, "train_batch_size = 32 but train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                     "world size = 4 x 2 x 1 = 8");
  LoadOptions four;
  four.world_size = 4;
  EXPECT_NO_THROW(parse_config_text(
      R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", "t", four));
}

TEST(ConfigRejects, BatchDerivationMustDivide) {
  const std::string gas = load_error(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})");
  EXPECT_CONTAINS(gas, "gradient_accumulation_steps cannot be derived");
  EXPECT_CONTAINS(gas, "train_batch_size = 30 is not a multiple of train_micro_batch_size_per_gpu x world size = 4 x 1");
  const std::string micro = load_error(R"({"train_batch_size": 30, "gradient_accumulation_steps": 4})");
  EXPECT_CONTAINS(micro, "train_micro_batch_size_per_gpu cannot be derived");
  LoadOptions three;
  three.world_size = 3;
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 8})", three),
                  "train_batch_size = 8 is not a multiple of the world size 3");
  EXPECT_CONTAINS(load_error(R"({"gradient_accumulation_steps": 4})"), "the batch size is not set");
  EXPECT_CONTAINS(load_error(R"({})"), "give train_batch_size or train_micro_batch_size_per_gpu");
}

// Ulysses: the batch keys count world / sequence_parallel_size ranks (DeepSpeed's dp_world_size),
// and say so; sequence_parallel_size divides the world; MoE layers are not split yet.
TEST(ConfigRejects, SequenceParallelSizeCountsTheDataParallelRanks) {
  LoadOptions eight;
  eight.world_size = 8;
  const Config c = load(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                            "sequence_parallel_size": 2})", eight);
  EXPECT_EQ(c.train_batch_size.value, 24);  // 2 x 3 x (8 / 2)
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                                 "gradient_accumulation_steps": 2, "sequence_parallel_size": 4})",
                             eight),
                  "train_batch_size = 32 but train_micro_batch_size_per_gpu x "
                  "gradient_accumulation_steps x data-parallel size (world 8 / "
                  "sequence_parallel_size 4) = 2 x 2 x 2 = 8");
  LoadOptions four;
  four.world_size = 4;
  EXPECT_CONTAINS(load_error(R"({"train_micro_batch_size_per_gpu": 2,
                                 "sequence_parallel_size": 3})", four),
                  "sequence_parallel_size = 3 does not divide the world size 4");
  EXPECT_CONTAINS(load_error(R"({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2,
                                 "moe": {"num_experts": 4}})", four),
                  "sequence parallelism of MoE layers is not built yet");
}

TEST(ConfigRejects, UnresolvableAutoNamesTheKeyAndWhatResolvesIt) {
  const std::string lr = load_error(with(R"("optimizer": {"type": "AdamW", "params": {"lr": "auto"}})"));
  EXPECT_CONTAINS(lr, "optimizer.params.lr = \"auto\" and nothing resolves it");
  EXPECT_CONTAINS(lr, "AutoValues::lr");
  const std::string micro = load_error(R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1})");
  EXPECT_CONTAINS(micro, "train_micro_batch_size_per_gpu = \"auto\" and nothing resolves it");
  EXPECT_CONTAINS(micro, "AutoValues::micro_batch_per_gpu");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"reduce_bucket_size": "auto"})")),
                  "AutoValues::hidden_size");
  EXPECT_CONTAINS(load_error(with(R"("steps_per_print": "auto")")),
                  "steps_per_print = \"auto\": \"auto\" is not resolvable for this key");
}

struct MathCase {
  const char* members;
  const char* path;
};

TEST(ConfigRejects, UnimplementedMathChangingFeatures) {
  const MathCase cases[] = {
      {R"("zero_optimization": {"stage": 3, "zero_quantized_weights": true})", "zero_optimization.zero_quantized_weights"},
      {R"("zero_optimization": {"stage": 2, "zero_quantized_gradients": true})", "zero_optimization.zero_quantized_gradients"},
      {R"("optimizer": {"type": "Adam", "params": {"amsgrad": true}})", "optimizer.params.amsgrad"},
      {R"("compression_training": {"weight_quantization": {"shared_parameters": {"enabled": true}}})",
       "compression_training.weight_quantization"},
      {R"("curriculum_learning": {"enabled": true, "curriculum_type": "seqlen"})", "curriculum_learning.enabled"},
      {R"("data_efficiency": {"enabled": true})", "data_efficiency.enabled"},
      {R"("sparse_attention": {"mode": "fixed"})", "sparse_attention"},
      {R"("elasticity": {"enabled": true, "max_train_batch_size": 64})", "elasticity.enabled"},
      {R"("progressive_layer_drop": {"enabled": true, "theta": 0.5})", "progressive_layer_drop.enabled"},
      {R"("amp": {"enabled": true, "opt_level": "O1"})", "amp.enabled"},
      {R"("fp16": {"enabled": true, "fp16_master_weights_and_grads": true})", "fp16.fp16_master_weights_and_grads"},
      {R"("gradient_allreduce_op": "sum")", "gradient_allreduce_op"},
      {R"("tensor_parallel": {"autotp_size": 4})", "tensor_parallel.autotp_size"},
  };
  for (const MathCase& c : cases) {
    const std::string m = load_error(with(c.members));
    EXPECT_CONTAINS(m, c.path);
    EXPECT_CONTAINS(m, "not implemented in Strata");
  }
  const std::string onebit = load_error(with(R"("optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 100}})"));
  EXPECT_CONTAINS(onebit, "optimizer.type = \"OneBitAdam\" is a known DeepSpeed optimizer, not implemented in Strata");
  // Disabled, the same blocks are fine.
  EXPECT_NO_THROW(parse_config_text(with(R"("curriculum_learning": {"enabled": false}, "amp": {"enabled": false},
      "elasticity": {"enabled": false}, "tensor_parallel": {"autotp_size": 1})"), "t"));
}

TEST(ConfigRejects, AliasAndCanonicalBothGiven) {
  const std::string m = load_error(
      with(R"("zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6})"));
  EXPECT_CONTAINS(m, "'zero_optimization.prefetch_bucket_size' and 'zero_optimization.stage3_prefetch_bucket_size' "
                     "both set 'zero_optimization.stage3_prefetch_bucket_size'; keep one");
  EXPECT_CONTAINS(load_error(with(R"("bf16": {"enabled": true}, "bfloat16": {"enabled": true})")),
                  "both set 'bf16'");
  EXPECT_CONTAINS(load_error(with(R"("aio": {"thread_count": 2, "intra_op_parallelism": 2})")),
                  "both set 'aio.intra_op_parallelism'");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"stage": 2, "cpu_offload": true,
                                    "offload_optimizer": {"device": "cpu"}})")),
                  "zero_optimization.cpu_offload (legacy) and zero_optimization.offload_optimizer both given");
}

TEST(ConfigRejects, OptimizerTypes) {
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": "AdamWW"})")), "did you mean \"AdamW\"?");
  const std::string far = load_error(with(R"("optimizer": {"type": "Frobnicate"})"));
  EXPECT_CONTAINS(far, "optimizer.type = \"Frobnicate\" is not a known optimizer");
  EXPECT_CONTAINS(far, "LoadOptions::extra_optimizers");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}})")),
                  "optimizer.params.adam_w_mode = false contradicts type \"AdamW\"");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": "SGD", "params": {"momentum": 0.9}})")),
                  "optimizer.params.lr is missing");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": true}})")),
                  "optimizer.params.nesterov = true needs momentum > 0");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"params": {"lr": 0.1}})")), "optimizer.type is missing");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": ""})")), "optimizer.type is empty");
  EXPECT_CONTAINS(load_error(with(R"("optimizer": {"type": "Adam", "params": {"lr": 0.1, "max_grad_norm": 1.0}})")),
                  "write \"gradient_clipping\"");
}

TEST(ConfigRejects, SchedulerTypesAndParams) {
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})")),
                  "scheduler.params.total_num_steps is missing");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "WarmupCosineLRR", "params": {}})")),
                  "did you mean \"WarmupCosineLR\"?");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_type": 1}})")),
                  "scheduler.params.warmup_type = 1");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}})")),
                  "scheduler.params.warmup_num_steps = -1 is out of range");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}})")),
                  "scheduler.params.cycle_min_lr is missing");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, -1]}})")),
                  "scheduler.params.warmup_max_lr[1] = -1 is out of range");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "high"}})")),
                  "expected a number or a list of numbers (one per param group)");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01,
                                      "cycle_max_lr": 0.1, "cycle_max_mom": [0.9, -1]}})")),
                  "scheduler.params.cycle_max_mom[1] = -1 is out of range");
  EXPECT_CONTAINS(load_error(with(R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "low",
                                      "cycle_max_lr": 0.1}})")),
                  "scheduler.params.cycle_min_lr");
}

// What DeepSpeed's OneCycle raises on (ValueError since #8166; a null first stair count is a
// TypeError at its first step) stays an error here, naming the key and what is allowed.
TEST(ConfigRejects, OneCycleShapeDeepSpeedFailsOn) {
  auto one_cycle = [](const std::string& params) {
    return load_error(with(R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01,
                               "cycle_max_lr": 0.1, )" + params + "}}"));
  };
  EXPECT_CONTAINS(one_cycle(R"("cycle_second_step_size": -1)"),
                  "scheduler.params.cycle_second_step_size = -1 is out of range; allowed: >= 0");
  EXPECT_CONTAINS(one_cycle(R"("cycle_second_step_size": -0.5)"),
                  "scheduler.params.cycle_second_step_size = -0.5");
  EXPECT_CONTAINS(one_cycle(R"("cycle_first_step_size": 0)"),
                  "scheduler.params.cycle_first_step_size = 0 is out of range; allowed: > 0");
  EXPECT_CONTAINS(one_cycle(R"("cycle_first_step_size": -4, "cycle_second_step_size": 10)"),
                  "scheduler.params.cycle_first_step_size = -4 is out of range; allowed: > 0");
  EXPECT_CONTAINS(one_cycle(R"("cycle_first_step_size": 0, "cycle_second_step_size": 0)"),
                  "scheduler.params.cycle_first_step_size = 0 is out of range; allowed: > 0");
  EXPECT_CONTAINS(one_cycle(R"("cycle_first_stair_count": null)"),
                  "scheduler.params.cycle_first_stair_count = null: expected an integer");
  EXPECT_CONTAINS(one_cycle(R"("cycle_second_stair_count": "-1")"),
                  "scheduler.params.cycle_second_stair_count = \"-1\": expected an integer");
}

TEST(ConfigRejects, OffloadRules) {
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}})")),
                  "zero_optimization.offload_param.nvme_path is required");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}})")),
                  "zero_optimization.offload_optimizer.device = \"nvme\" needs stage 3");
}

TEST(ConfigRejects, NotAnObject) {
  EXPECT_CONTAINS(load_error("[1, 2]"), "a config is a JSON object");
  EXPECT_CONTAINS(load_error("42"), "a config is a JSON object");
  EXPECT_CONTAINS(load_error(""), "the file is empty");
  EXPECT_CONTAINS(load_error("  \n "), "the file is empty");
}

TEST(ConfigRejects, AllProblemsInOnePassEachPrefixedWithTheFile) {
  try {
    parse_config_text(
        "{\n \"train_batch_size\": \"8\",\n \"zero_optimization\": {\"stage\": 7, \"overlap_com\": true},\n"
        " \"fp16\": {\"enabled\": \"yes\"},\n \"optimizer\": {\"type\": \"Lamb\"}\n}",
        "multi.json");
    FAIL() << "loaded";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.problems().size(), 5u) << e.what();
    for (const std::string& p : e.problems()) EXPECT_EQ(p.rfind("multi.json:", 0), 0u) << p;
    EXPECT_EQ(e.source(), "multi.json");
    const std::string all = e.what();
    EXPECT_CONTAINS(all, "train_batch_size = \"8\"");
    EXPECT_CONTAINS(all, "zero_optimization.stage = 7");
    EXPECT_CONTAINS(all, "did you mean 'overlap_comm'?");
    EXPECT_CONTAINS(all, "fp16.enabled = \"yes\"");
    EXPECT_CONTAINS(all, "\"Lamb\" is a known DeepSpeed optimizer");
    // ConfigError is a strata::Error, so callers can catch either.
    const Error& base = e;
    EXPECT_EQ(std::string(base.what()), all);
  }
}

TEST(ConfigRejects, BadWorldSize) {
  LoadOptions zero;
  zero.world_size = 0;
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 8})", zero), "world size 0 must be at least 1");
}

}  // namespace
}  // namespace strata::test
