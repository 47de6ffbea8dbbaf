// What a valid config turns into: defaults, legacy spellings, built-in optimizer and scheduler
// params, Hugging Face "auto" resolution, the batch triangle, the printout, pending features.
#include <map>
#include <filesystem>
#include <set>

#include "tests/runtime/config/config_test_util.h"

namespace strata::test {
namespace {

TEST(ConfigReads, DefaultsComeFromTheStructs) {
  const Config c = load(R"({"train_batch_size": 8})");
  const Config d;
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value, 8);
  EXPECT_EQ(c.gradient_accumulation_steps.value, 1);
  EXPECT_EQ(c.steps_per_print, d.steps_per_print);
  EXPECT_EQ(c.zero_optimization.stage, 0);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size.value, d.zero_optimization.reduce_bucket_size.value);
  EXPECT_FALSE(c.zero_optimization.overlap_comm_resolved());
  EXPECT_EQ(c.aio.queue_depth, d.aio.queue_depth);
  EXPECT_FALSE(c.optimizer.present);
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_TRUE(pending_features(c).empty());
  const json j = to_json(c);
  EXPECT_EQ(j.at("zero_optimization").at("stage3_max_live_parameters"), 1000000000);
  EXPECT_EQ(j.at("fp16").at("initial_scale_power"), 16);
  EXPECT_EQ(j.at("train_micro_batch_size_per_gpu"), 8);
  EXPECT_FALSE(j.contains("optimizer"));
}

TEST(ConfigReads, LegacySpellingsMapToCanonicalKeys) {
  const Config c = load(with(R"(
    "zero_optimization": {"stage": 3, "cpu_offload": true, "cpu_offload_params": true,
      "stage3_gather_fp16_weights_on_model_save": true, "prefetch_bucket_size": 1234,
      "param_persistence_threshold": 99},
    "aio": {"thread_count": 3},
    "bfloat16": {"enabled": true},
    "communication_data_type": "bfp16",
    "seq_parallel_communication_data_type": "fp32")"));
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, "cpu");
  EXPECT_EQ(c.zero_optimization.offload_param.device, "cpu");
  EXPECT_TRUE(c.zero_optimization.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size.value, 1234);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold.value, 99);
  EXPECT_EQ(c.aio.intra_op_parallelism, 3);
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_EQ(c.communication_data_type, "bf16");
  const std::string w = joined_warnings(c);
  EXPECT_CONTAINS(w, "'zero_optimization.stage3_gather_fp16_weights_on_model_save' is a legacy spelling");
  EXPECT_CONTAINS(w, "'aio.thread_count' is a legacy spelling; read as 'aio.intra_op_parallelism'");
  EXPECT_CONTAINS(w, "'bfloat16' is a legacy spelling; read as 'bf16'");
  EXPECT_CONTAINS(w, "zero_optimization.cpu_offload is deprecated");
  // The printout uses the canonical spellings only.
  const json j = to_json(c);
  EXPECT_TRUE(j.at("zero_optimization").contains("stage3_prefetch_bucket_size"));
  EXPECT_FALSE(j.at("zero_optimization").contains("prefetch_bucket_size"));
  EXPECT_FALSE(j.at("zero_optimization").contains("cpu_offload"));
  EXPECT_FALSE(j.contains("bfloat16"));
}

TEST(ConfigReads, ZeroAsABooleanIsDeepSpeedsOldForm) {
  const Config c = load(with(R"("zero_optimization": true)"));
  EXPECT_EQ(c.zero_optimization.stage, 1);
  EXPECT_CONTAINS(joined_warnings(c), "deprecated form");
}

TEST(ConfigReads, AdamParamsAreCompleteAndAdamMeansAdamW) {
  const Config c = load(with(R"("optimizer": {"type": "Adam", "params": {"lr": 0.01}})"));
  EXPECT_EQ(c.optimizer.type, "adamw");  // DeepSpeed: adam_w_mode defaults to true
  const json& p = c.optimizer.params;
  EXPECT_DOUBLE_EQ(p.at("lr").get<double>(), 0.01);
  EXPECT_EQ(p.at("betas"), json::array({0.9, 0.999}));
  EXPECT_DOUBLE_EQ(p.at("eps").get<double>(), 1e-8);
  EXPECT_DOUBLE_EQ(p.at("weight_decay").get<double>(), 0.0);
  EXPECT_EQ(p.at("bias_correction"), true);
  EXPECT_EQ(p.at("adam_w_mode"), true);
  EXPECT_EQ(p.at("amsgrad"), false);
  EXPECT_EQ(p.at("torch_adam"), false);

  const Config coupled = load(with(R"("optimizer": {"type": "adam", "params": {"adam_w_mode": false}})"));
  EXPECT_EQ(coupled.optimizer.type, "adam");
  EXPECT_EQ(coupled.optimizer.params.at("adam_w_mode"), false);
  EXPECT_DOUBLE_EQ(coupled.optimizer.params.at("lr").get<double>(), 1e-3);

  const Config w = load(with(R"("optimizer": {"type": "ADAMW"})"));
  EXPECT_EQ(w.optimizer.type, "adamw");
  EXPECT_EQ(w.optimizer.params.at("adam_w_mode"), true);
}

TEST(ConfigReads, SgdParamsAreComplete) {
  const Config c = load(with(R"("optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true}})"));
  EXPECT_EQ(c.optimizer.type, "sgd");
  const json& p = c.optimizer.params;
  EXPECT_DOUBLE_EQ(p.at("lr").get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(p.at("momentum").get<double>(), 0.9);
  EXPECT_DOUBLE_EQ(p.at("dampening").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(p.at("weight_decay").get<double>(), 0.0);
  EXPECT_EQ(p.at("nesterov"), true);
}

TEST(ConfigReads, RegisteredOptimizerAndSchedulerPassThrough) {
  LoadOptions o;
  o.extra_optimizers = {"MyOpt"};
  o.extra_schedulers = {"MySched"};
  o.autos.lr = 0.5;
  const Config c = load(with(R"("optimizer": {"type": "myopt", "params": {"lr": "auto", "whatever": [1, 2]}},
                                 "scheduler": {"type": "MySched", "params": {"k": 1}})"), o);
  EXPECT_EQ(c.optimizer.type, "myopt");
  EXPECT_DOUBLE_EQ(c.optimizer.params.at("lr").get<double>(), 0.5);
  EXPECT_EQ(c.optimizer.params.at("whatever"), json::array({1, 2}));
  EXPECT_EQ(c.scheduler.params.at("k"), 1);
  // strata-config's mode: an unknown type far from any known one is a warning.
  LoadOptions check;
  check.allow_unresolved_auto = true;
  EXPECT_CONTAINS(joined_warnings(load(with(R"("optimizer": {"type": "Shampoo"})"), check)),
                  "the program must register it");
}

TEST(ConfigReads, SchedulerParamsAreComplete) {
  const Config one = load(with(R"("scheduler": {"type": "onecycle", "params": {"cycle_min_lr": 0.01,
      "cycle_max_lr": 0.1, "cycle_first_step_size": 500, "cycle_first_stair_count": 5}})"));
  EXPECT_EQ(one.scheduler.type, "OneCycle");
  EXPECT_EQ(one.scheduler.params.at("cycle_second_step_size"), 500);
  EXPECT_EQ(one.scheduler.params.at("cycle_second_stair_count"), 5);
  EXPECT_EQ(one.scheduler.params.at("cycle_momentum"), true);
  EXPECT_DOUBLE_EQ(one.scheduler.params.at("cycle_min_mom").get<double>(), 0.8);

  const Config cos = load(with(R"("scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}})"));
  EXPECT_EQ(cos.scheduler.params.at("warmup_num_steps"), 1000);
  EXPECT_DOUBLE_EQ(cos.scheduler.params.at("cos_min_ratio").get<double>(), 0.0001);
  EXPECT_EQ(cos.scheduler.params.at("warmup_type"), "log");

  const Config decay = load(with(R"("scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}})"));
  EXPECT_DOUBLE_EQ(decay.scheduler.params.at("warmup_max_lr").get<double>(), 0.001);

  // DeepSpeed's WarmupLR: no warmup_max_lr (None) means each param group's own lr.
  const Config warm = load(with(R"("optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
                                  "scheduler": {"type": "WarmupLR"})"));
  EXPECT_TRUE(warm.scheduler.params.at("warmup_max_lr").is_null());
  EXPECT_DOUBLE_EQ(warm.scheduler.params.at("warmup_min_lr").get<double>(), 0.0);
  EXPECT_EQ(warm.scheduler.params.at("last_batch_iteration"), -1);
  // "float or list": one value per optimizer param group.
  const Config groups = load(with(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0, 1e-5],
                                                                                  "warmup_max_lr": [1e-3, 1e-4]}})"));
  EXPECT_EQ(groups.scheduler.params.at("warmup_max_lr"), json::array({1e-3, 1e-4}));
  const Config lrrt = load(with(R"("scheduler": {"type": "LRRangeTest"})"));
  EXPECT_EQ(lrrt.scheduler.params.at("lr_range_test_step_size"), 2000);
}

// The current DeepSpeed's scheduler params: OneCycle's bounds take per-group lists (DeepSpeed
// #8201); an unknown warmup_type warns, naming the key, and reads as "log" (#8151).
TEST(ConfigReads, SchedulerParamsOfCurrentDeepSpeed) {
  const Config one = load(with(R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": [0.01, 0.002],
      "cycle_max_lr": [0.1, 0.03], "cycle_min_mom": [0.85, 0.8], "cycle_max_mom": 0.95}})"));
  EXPECT_EQ(one.scheduler.params.at("cycle_min_lr"), json::array({0.01, 0.002}));
  EXPECT_EQ(one.scheduler.params.at("cycle_min_mom"), json::array({0.85, 0.8}));
  EXPECT_DOUBLE_EQ(one.scheduler.params.at("cycle_max_mom").get<double>(), 0.95);
  EXPECT_TRUE(one.warnings.empty()) << joined_warnings(one);

  for (const char* type : {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}) {
    SCOPED_TRACE(type);
    const std::string total = std::string(type) == "WarmupLR" ? "" : R"("total_num_steps": 100, )";
    const Config c = load(with(std::string(R"("scheduler": {"type": ")") + type + R"(", "params": {)" +
                               total + R"("warmup_type": "linaer"}})"));
    EXPECT_EQ(c.scheduler.params.at("warmup_type"), "log");
    EXPECT_CONTAINS(joined_warnings(c), "scheduler.params.warmup_type = \"linaer\" is not \"log\" or "
                                        "\"linear\"; read as \"log\"");
    EXPECT_CONTAINS(joined_warnings(c), "did you mean \"linear\"?");
  }
}

// What DeepSpeed's OneCycle accepts for its cycle shape: a second half of 0 (DeepSpeed #8166
// checks cycle_second_step_size >= 0, the first half > 0) and any stair count, a count <= 0
// being a continuous half (-1 is its command line's default). Kept as written, no warning.
TEST(ConfigReads, OneCycleZeroSecondHalfAndNegativeStairCounts) {
  const std::string bounds = R"("cycle_min_lr": 0.01, "cycle_max_lr": 0.1, )";
  auto one_cycle = [&](const std::string& params) {
    return load(with(R"("scheduler": {"type": "OneCycle", "params": {)" + bounds + params + "}}"));
  };
  const Config zero = one_cycle(R"("cycle_first_step_size": 10, "cycle_second_step_size": 0)");
  EXPECT_EQ(zero.scheduler.params.at("cycle_first_step_size"), 10);
  EXPECT_EQ(zero.scheduler.params.at("cycle_second_step_size"), 0);
  EXPECT_TRUE(zero.warnings.empty()) << joined_warnings(zero);
  // 0.0 is DeepSpeed's float(0) too; null is its None, the first half's size.
  EXPECT_EQ(one_cycle(R"("cycle_second_step_size": 0.0)").scheduler.params.at("cycle_second_step_size"), 0);
  EXPECT_EQ(one_cycle(R"("cycle_first_step_size": 7, "cycle_second_step_size": null)")
                .scheduler.params.at("cycle_second_step_size"),
            7);

  const Config both = one_cycle(R"("cycle_first_stair_count": -1, "cycle_second_stair_count": -1)");
  EXPECT_EQ(both.scheduler.params.at("cycle_first_stair_count"), -1);
  EXPECT_EQ(both.scheduler.params.at("cycle_second_stair_count"), -1);
  EXPECT_TRUE(both.warnings.empty()) << joined_warnings(both);
  // The second count follows the first when unset or null; each half has its own sign.
  EXPECT_EQ(one_cycle(R"("cycle_first_stair_count": -3)").scheduler.params.at("cycle_second_stair_count"), -3);
  EXPECT_EQ(one_cycle(R"("cycle_first_stair_count": -1, "cycle_second_stair_count": null)")
                .scheduler.params.at("cycle_second_stair_count"),
            -1);
  const Config mixed = one_cycle(R"("cycle_first_stair_count": 4, "cycle_second_stair_count": -2,
                                    "cycle_second_step_size": 0)");
  EXPECT_EQ(mixed.scheduler.params.at("cycle_first_stair_count"), 4);
  EXPECT_EQ(mixed.scheduler.params.at("cycle_second_stair_count"), -2);
  EXPECT_EQ(mixed.scheduler.params.at("cycle_second_step_size"), 0);
  EXPECT_TRUE(mixed.warnings.empty()) << joined_warnings(mixed);
}

TEST(ConfigReads, HuggingFaceAutosResolve) {
  LoadOptions o;
  o.world_size = 4;
  o.autos.micro_batch_per_gpu = 2;
  o.autos.gradient_accumulation_steps = 3;
  o.autos.lr = 5e-5;
  o.autos.beta1 = 0.8;
  o.autos.beta2 = 0.99;
  o.autos.eps = 1e-6;
  o.autos.weight_decay = 0.01;
  o.autos.max_grad_norm = 0.5;
  o.autos.warmup_steps = 50;
  o.autos.total_steps = 900;
  o.autos.fp16 = false;
  o.autos.bf16 = true;
  o.autos.hidden_size = 1000;
  const Config c = load(slurp(repo_path("configs/hf_auto.json")), o);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value, 2);
  EXPECT_EQ(c.gradient_accumulation_steps.value, 3);
  EXPECT_EQ(c.train_batch_size.value, 24);  // world x micro x gas
  EXPECT_FALSE(c.train_batch_size.is_auto);
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value, 0.5);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size.value, 1000000);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size.value, 900000);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold.value, 10000);
  const json& p = c.optimizer.params;
  EXPECT_DOUBLE_EQ(p.at("lr").get<double>(), 5e-5);
  EXPECT_EQ(p.at("betas"), json::array({0.8, 0.99}));
  EXPECT_DOUBLE_EQ(p.at("eps").get<double>(), 1e-6);
  EXPECT_DOUBLE_EQ(p.at("weight_decay").get<double>(), 0.01);
  const json& s = c.scheduler.params;
  EXPECT_DOUBLE_EQ(s.at("warmup_min_lr").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(s.at("warmup_max_lr").get<double>(), 5e-5);
  EXPECT_EQ(s.at("warmup_num_steps"), 50);
  EXPECT_EQ(s.at("total_num_steps"), 900);
  EXPECT_TRUE(c.unresolved_autos.empty());
  EXPECT_EQ(to_json(c).dump().find("\"auto\""), std::string::npos);
}

TEST(ConfigReads, BatchAutosResolveFromTheOtherTwoWithoutAutoValues) {
  LoadOptions two;
  two.world_size = 2;
  const Config c = load(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                            "gradient_accumulation_steps": 2})", two);
  EXPECT_EQ(c.train_batch_size.value, 16);
  const Config m = load(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                            "gradient_accumulation_steps": 2})", two);
  EXPECT_EQ(m.train_micro_batch_size_per_gpu.value, 4);
}

TEST(ConfigReads, ABatchlessFileTakesTheProgramsBatchSize) {
  LoadOptions o;
  o.world_size = 2;
  o.autos.micro_batch_per_gpu = 3;
  o.autos.gradient_accumulation_steps = 5;
  const Config c = load(R"({"steps_per_print": 1})", o);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value, 3);
  EXPECT_EQ(c.gradient_accumulation_steps.value, 5);
  EXPECT_EQ(c.train_batch_size.value, 30);
  // A batch size in the file wins; the program's values only fill "auto"s.
  const Config t = load(R"({"train_batch_size": 8})", o);
  EXPECT_EQ(t.train_micro_batch_size_per_gpu.value, 4);
  EXPECT_EQ(t.gradient_accumulation_steps.value, 1);
}

TEST(ConfigReads, UnresolvedAutosStayAutoWhenAllowed) {
  LoadOptions check;
  check.allow_unresolved_auto = true;
  const Config c = load(slurp(repo_path("configs/hf_auto.json")), check);
  EXPECT_TRUE(c.train_batch_size.is_auto);
  const json j = to_json(c);
  EXPECT_EQ(j.at("train_batch_size"), "auto");
  EXPECT_EQ(j.at("fp16").at("enabled"), "auto");
  EXPECT_EQ(j.at("optimizer").at("params").at("lr"), "auto");
  EXPECT_EQ(j.at("scheduler").at("params").at("warmup_min_lr"), 0.0);  // HF fills it with 0
  EXPECT_CONTAINS(joined_warnings(c), "optimizer.params.lr = \"auto\" stays unresolved here");
  EXPECT_GE(c.unresolved_autos.size(), 10u);
}

TEST(ConfigReads, BatchTriangleDerivations) {
  LoadOptions two;
  two.world_size = 2;
  auto triple = [&](const std::string& text) {
    const Config c = load(text, two);
    return std::vector<int64_t>{c.train_batch_size.value, c.train_micro_batch_size_per_gpu.value,
                                c.gradient_accumulation_steps.value};
  };
  EXPECT_EQ(triple(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})"), (std::vector<int64_t>{32, 4, 4}));
  EXPECT_EQ(triple(R"({"train_batch_size": 32, "gradient_accumulation_steps": 4})"), (std::vector<int64_t>{32, 4, 4}));
  EXPECT_EQ(triple(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})"),
            (std::vector<int64_t>{24, 4, 3}));
  EXPECT_EQ(triple(R"({"train_batch_size": 32})"), (std::vector<int64_t>{32, 16, 1}));
  EXPECT_EQ(triple(R"({"train_micro_batch_size_per_gpu": 4})"), (std::vector<int64_t>{8, 4, 1}));
}

TEST(ConfigReads, ObserveOnlyKeysWarn) {
  const Config c = load(with(R"("wall_clock_breakdown": true, "flops_profiler": {"enabled": true},
      "wandb": {"enabled": true, "project": "p"}, "comms_logger": {"enabled": true},
      "prescale_gradients": true, "activation_checkpointing": {"partition_activations": true})"));
  const std::string w = joined_warnings(c);
  for (const char* key : {"wall_clock_breakdown = true", "flops_profiler.enabled = true", "wandb.enabled = true",
                          "comms_logger.enabled = true", "prescale_gradients = true",
                          "activation_checkpointing.partition_activations = true"})
    EXPECT_CONTAINS(w, key);
  EXPECT_CONTAINS(w, "has no effect in Strata");
}

TEST(ConfigReads, OffloadBelowItsStageIsIgnoredLikeDeepSpeed) {
  const Config c = load(with(R"("zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}})"));
  EXPECT_EQ(c.zero_optimization.offload_param.device, "none");
  EXPECT_CONTAINS(joined_warnings(c), "zero_optimization.offload_param.device = \"cpu\" has no effect at stage 2");
}

// Turning off overlap or reduce-scatter only slows DeepSpeed down; Strata says it does neither.
TEST(ConfigReads, CommunicationSwitchesThatChangeNothingWarn) {
  const Config c = load(with(R"("zero_optimization": {"stage": 2, "overlap_comm": false, "reduce_scatter": false})"));
  const std::string w = joined_warnings(c);
  EXPECT_CONTAINS(w, "zero_optimization.overlap_comm = false is accepted but has no effect");
  EXPECT_CONTAINS(w, "zero_optimization.reduce_scatter = false is accepted but has no effect");
  EXPECT_TRUE(load(with(R"("zero_optimization": {"stage": 2, "overlap_comm": true})")).warnings.empty());
}

TEST(ConfigReads, DeepSpeedReadsAutoAsTheDefaultInItsPydanticBlocks) {
  const Config c = load(with(R"("zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"})"));
  EXPECT_EQ(c.zero_optimization.stage3_max_live_parameters, Config().zero_optimization.stage3_max_live_parameters);
  EXPECT_CONTAINS(joined_warnings(c), "zero_optimization.stage3_max_live_parameters = \"auto\" is read as the default");
}

// Every feature the schema accepts runs: stages 0-3, bf16, MoE, offload of the optimizer (CPU,
// NVMe) and of the parameters (CPU, NVMe).
TEST(ConfigReads, NothingTheSchemaAcceptsIsPending) {
  const Config c = load(with(R"("zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
      "offload_param": {"device": "nvme", "nvme_path": "/x"}},
      "bf16": {"enabled": true}, "moe": {"num_experts": 4})"));
  EXPECT_TRUE(pending_features(c).empty());
  EXPECT_TRUE(pending_features(load(with(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}})"))).empty());
  EXPECT_TRUE(pending_features(load(with(R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}})"))).empty());
}

// The moe block remembers which keys the file gave: a program that builds its layers from its
// own model fills the others from it, and num_experts' checks wait for a block that gives it.
TEST(ConfigReads, MoeBlockKnowsTheKeysItGives) {
  const Config c = load(with(R"("moe": {"top_k": 1, "use_residual": true, "drop_tokens": false})"));
  EXPECT_EQ(c.moe.given, (std::set<std::string>{"drop_tokens", "top_k", "use_residual"}));
  EXPECT_TRUE(c.moe.use_residual);
  EXPECT_EQ(c.moe.top_k, 1);
  EXPECT_TRUE(load(with("")).moe.given.empty());
  LoadOptions two;
  two.world_size = 2;
  const Config ep = load(R"({"train_batch_size": 8, "moe": {"ep_size": 2}})", two);
  EXPECT_EQ(ep.moe.given, (std::set<std::string>{"ep_size"}));
  EXPECT_CONTAINS(load_error(R"({"train_batch_size": 8, "moe": {"ep_size": 2, "num_experts": 3}})", two),
                  "moe.ep_size = 2 must divide num_experts = 3");
  EXPECT_CONTAINS(load_error(with(R"("moe": {"top_k": 3, "num_experts": 2})")),
                  "moe.top_k = 3 exceeds num_experts = 2");
  EXPECT_CONTAINS(load_error(with(R"("moe": {"use_residual": 1})")), "moe.use_residual");
}

// DeepSeek-V3's router keys: read as given; the sigmoid router's own keys refused beside the
// softmax router (they would do nothing), groups that do not split the experts refused by name.
TEST(ConfigReads, MoeBlockReadsTheSigmoidRouterKeys) {
  const Config c = load(with(R"("moe": {"num_experts": 8, "top_k": 3, "score_func": "sigmoid",
      "bias_update_speed": 0.001, "n_group": 4, "topk_group": 2, "norm_topk_prob": false,
      "route_scale": 2.5, "n_shared_experts": 2})"));
  EXPECT_EQ(c.moe.score_func, "sigmoid");
  EXPECT_DOUBLE_EQ(c.moe.bias_update_speed, 0.001);
  EXPECT_EQ(c.moe.n_group, 4);
  EXPECT_EQ(c.moe.topk_group, 2);
  EXPECT_FALSE(c.moe.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.moe.route_scale, 2.5);
  EXPECT_EQ(c.moe.n_shared_experts, 2);
  EXPECT_EQ(load(with("")).moe.score_func, "softmax");
  EXPECT_CONTAINS(load_error(with(R"("moe": {"bias_update_speed": 0.001})")),
                  "moe.bias_update_speed applies to the sigmoid router");
  EXPECT_CONTAINS(load_error(with(R"("moe": {"score_func": "sigmoid", "n_group": 2, "topk_group": 3})")),
                  "moe.topk_group = 3 exceeds n_group = 2");
  EXPECT_CONTAINS(load_error(with(R"("moe": {"num_experts": 6, "score_func": "sigmoid", "n_group": 4})")),
                  "moe.n_group = 4 must divide num_experts = 6");
  EXPECT_CONTAINS(load_error(with(R"("moe": {"num_experts": 8, "top_k": 5, "score_func": "sigmoid",
                                             "n_group": 4, "topk_group": 2})")),
                  "moe.top_k = 5 exceeds the 4 experts of topk_group = 2 groups");
  EXPECT_CONTAINS(load_error(with(R"("moe": {"score_func": "tanh"})")), "moe.score_func");
  // The softmax router takes norm_topk_prob false at top_k >= 2 (Qwen3-MoE's), not at top-1,
  // whose weight is the probability already.
  EXPECT_FALSE(load(with(R"("moe": {"num_experts": 4, "top_k": 2, "norm_topk_prob": false})"))
                   .moe.norm_topk_prob);
  EXPECT_CONTAINS(load_error(with(R"("moe": {"num_experts": 4, "top_k": 1, "norm_topk_prob": false})")),
                  "moe.norm_topk_prob = false: top-1 softmax gating");
}

// fp16.auto_cast and torch_autocast run (runtime/autocast.h): DeepSpeed's names and defaults.
TEST(ConfigReads, AutoCastAndTorchAutocastAreNotPending) {
  const Config a = load(with(R"("fp16": {"enabled": true, "auto_cast": true})"));
  EXPECT_TRUE(a.fp16.auto_cast);
  EXPECT_TRUE(pending_features(a).empty());
  const Config t = load(with(R"("torch_autocast": {"enabled": true})"));
  EXPECT_TRUE(t.torch_autocast.enabled);
  EXPECT_EQ(t.torch_autocast.dtype, "bfloat16");  // DeepSpeed's documented default
  EXPECT_FALSE(t.torch_autocast.lower_precision_safe_modules.has_value());
  EXPECT_TRUE(pending_features(t).empty());
  const Config f = load(with(R"("torch_autocast": {"enabled": true, "dtype": "torch.float16",
                                  "lower_precision_safe_modules": ["torch.nn.Linear", "torch.nn.Conv2d"]})"));
  EXPECT_EQ(f.torch_autocast.dtype, "torch.float16");
  ASSERT_TRUE(f.torch_autocast.lower_precision_safe_modules.has_value());
  EXPECT_EQ(f.torch_autocast.lower_precision_safe_modules->size(), 2u);
  // DeepSpeed's own bf16 example runs autocast over bf16 parameters.
  EXPECT_TRUE(load(with(R"("torch_autocast": {"enabled": true}, "bf16": {"enabled": true})")).torch_autocast.enabled);
}

// Keys as DeepSpeed's code spells them (nebula/constants.py, compile/config.py).
TEST(ConfigReads, NebulaAndCompileKeysAsDeepSpeedSpellsThem) {
  const Config c = load(with(R"("nebula": {"enabled": false, "nebula_load_path": "/ckpt"},
                                 "compile": {"deepcompile": false, "offload_activation_pin_memory": true})"));
  EXPECT_TRUE(pending_features(c).empty());
}

TEST(ConfigReads, CommentsAreAcceptedAsDeepSpeedsHjsonDoes) {
  const Config c = load("{\n  // batch\n  \"train_batch_size\": 8 /* eight */\n}");
  EXPECT_EQ(c.train_batch_size.value, 8);
}

// The printout is itself a valid config that reads back to the same printout.
TEST(ConfigReads, ExampleConfigsRoundTripThroughToJson) {
  LoadOptions check;
  check.allow_unresolved_auto = true;
  size_t seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(repo_path("configs"))) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    SCOPED_TRACE(entry.path().string());
    const Config first = load_config_file(entry.path().string(), check);
    const json printed = to_json(first);
    const Config second = parse_config_text(printed.dump(2), "printed.json", check);
    EXPECT_EQ(to_json(second), printed);
  }
  EXPECT_GE(seen, 5u);
}

}  // namespace
}  // namespace strata::test

namespace strata::test {
namespace {

// #34: top-level "_" keys are comments (a note); inside a block they stay errors.
TEST(ConfigReads, UnderscoreKeysAtTheTopLevelAreComments) {
  const Config c = load(with(R"("_comment": "zero 2 for 8 GPUs", "_quantize_training": {"enabled": true})"));
  EXPECT_CONTAINS(joined_warnings(c), "'_comment' is ignored");
  EXPECT_CONTAINS(load_error(with(R"("zero_optimization": {"_stage": 2})")), "unknown key 'zero_optimization._stage'");
  EXPECT_CONTAINS(load_error(with(R"("trian_batch_size": 8)")), "did you mean");
}

// #34: each "auto" resolved from AutoValues is recorded with the member it read.
TEST(ConfigReads, FilledAutosNameTheirSource) {
  LoadOptions o;
  o.autos.micro_batch_per_gpu = 4;
  o.autos.lr = 3e-4;
  o.autos.hidden_size = 64;
  const Config c = load(R"({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                            "stage3_param_persistence_threshold": "auto"}})", o);
  std::map<std::string, std::pair<json, std::string>> filled;
  for (const auto& f : c.filled) filled[f.path] = {f.value, f.from};
  EXPECT_EQ(filled["train_micro_batch_size_per_gpu"], std::make_pair(json(4), std::string("micro_batch_per_gpu")));
  EXPECT_EQ(filled["train_batch_size"], std::make_pair(json(4), std::string("")));
  EXPECT_EQ(filled["optimizer.params.lr"], std::make_pair(json(3e-4), std::string("lr")));
  EXPECT_EQ(filled["zero_optimization.reduce_bucket_size"].first, json(4096));
  EXPECT_EQ(filled["zero_optimization.stage3_prefetch_bucket_size"].first, json(3686));
  EXPECT_EQ(filled["zero_optimization.stage3_param_persistence_threshold"].first, json(640));
}

TEST(ConfigReads, AutoValuesFromNameValueText) {
  AutoValues a;
  EXPECT_EQ(set_auto_value(a, "lr=1e-3"), "");
  EXPECT_EQ(set_auto_value(a, "bf16=true"), "");
  EXPECT_EQ(*a.lr, 1e-3);
  EXPECT_TRUE(*a.bf16);
  EXPECT_CONTAINS(set_auto_value(a, "hidden_size=big"), "expected an integer");
  EXPECT_CONTAINS(set_auto_value(a, "learning_rate=1"), "unknown name");
}

}  // namespace
}  // namespace strata::test
