// What the config reader and the engine refuse by name, as the matrix predicts it. Each rule
// cites where the refusal lives; a description the matrix predicts refused must exit non-zero
// with an error naming the key, and one it predicts accepted must train.
#include "description.h"

namespace matrix {

namespace {

bool g_cpu_fp16_trains = false;

bool deepspeed_only(const std::string& type) {
  // runtime/config/schema_optimizer.cpp deepspeed_only(): known to DeepSpeed, not implemented.
  for (const char* n : {"Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "Lion",
                        "MuAdam", "MuAdamW", "MuSGD", "Muon"})
    if (type == n) return true;
  return false;
}

std::optional<Refusal> refuse_phase(const Description& d, const Phase& p, int index) {
  auto refusal = [&](std::string key, std::string why) {
    return std::optional<Refusal>(Refusal{index, std::move(key), std::move(why)});
  };
  // runtime/config/schema_optimizer.cpp: the optimizer type is read before anything runs.
  if (deepspeed_only(d.optimizer))
    return refusal("optimizer.type", d.optimizer + " is a DeepSpeed optimizer Strata does not implement");
  // runtime/config/schema_moe.cpp: ep_size must divide num_experts (4 in tiny-moe).
  if (d.model == "tiny-moe" && 4 % p.ep_size != 0)
    return refusal("ep_size", "ep_size must divide num_experts");
  // runtime/config/rules.cpp: ep_size must divide the world size.
  if (d.model == "tiny-moe" && p.world % p.ep_size != 0)
    return refusal("ep_size", "ep_size must divide the world size");
  // runtime/config/schema_zero.cpp finish_zero: offload at stage 0 (optimizer) or below stage 3
  // (parameters) is read as "none" with a warning: not a refusal. NVMe optimizer offload needs
  // stage 3.
  // runtime/config/rules.cpp: streamed experts are stage 3's.
  if (d.model == "tiny-moe" && p.expert_unit > 0 && p.stage < 3)
    return refusal("moe.expert_unit_size", "streamed experts need stage 3");
  const std::string oo = p.stage == 0 ? "none" : p.offload_optimizer;
  if (oo == "nvme" && p.stage < 3)
    return refusal("offload_optimizer.device", "NVMe optimizer offload needs stage 3");
  // In the order the program meets them: the config's rules above (load_engine_config), then
  // train_gpt's own flags, the model's construction, and the engine's checks below.
  // examples/train_gpt.cpp (after the config is read): --zero-init builds shards, for stage 3
  // only.
  if (p.zero_init && p.stage != 3) return refusal("--zero-init", "--zero-init needs stage 3");
  // runtime/engine.cpp (Engine::validate, the constructor's first part): fp16 on a CPU device is
  // refused at initialize, before any offload is set up, as LibTorch's CPU kernels (1.13) have
  // no Half matrix products or LayerNorm.
  if (d.dtype == "fp16" && !g_cpu_fp16_trains)
    return refusal("fp16.enabled", "fp16 is GPU-only: the engine refuses it on a CPU device");
  // runtime/engine.cpp (Engine::prepare_module, after validate: the soak of session 18 found the
  // other order predicted): a PartitionedInit shards over the whole world, experts over their
  // expert-parallel groups: MoE models are not built in shards.
  if (p.zero_init && p.stage == 3 && d.model == "tiny-moe")
    return refusal("PartitionedInit", "MoE layers cannot be built inside a PartitionedInit");
  // Parameter offload without optimizer offload trains (the master and the optimizer stay on the
  // device; runtime/engine_offload.cpp offload_parameters): not a refusal.
  // runtime/engine_offload.cpp finish_optimizer_offload: NVMe steps Strata's Adam/AdamW only.
  if (oo == "nvme" && d.optimizer == "SGD")
    return refusal("offload_optimizer.device", "the NVMe optimizer tier steps Adam/AdamW only");
  // ZenFlow: the generator draws the block only where the schema (schema_zero.cpp: stages 1-2,
  // device "cpu", no super_offload) and the engine (engine_groups.cpp: Adam/AdamW, no experts)
  // take it.
  return std::nullopt;
}

}  // namespace

void set_cpu_fp16_trains(bool trains) { g_cpu_fp16_trains = trains; }

// runtime/engine.cpp uses_partitioned_optimizer: stage 0 in fp32 (autocast's parameters are
// fp32 too) without MoE steps each parameter itself; everything else through flat partitions.
bool plain_path(const Description& d, const Phase& p) {
  return p.stage == 0 && (d.dtype == "fp32" || d.dtype == "autocast") && d.model != "tiny-moe";
}

std::optional<Refusal> predict_refusal(const Description& d) {
  for (size_t i = 0; i < d.phases.size(); ++i) {
    if (auto r = refuse_phase(d, d.phases[i], int(i))) return r;
    // runtime/engine_checkpoint.cpp load_checkpoint: a checkpoint of the plain path resumes on
    // the plain path only, and one of flat partitions on flat partitions only ("resume it with
    // the same precision and ZeRO stage" / "... a ZeRO stage of 1 or 2").
    if (i > 0 && plain_path(d, d.phases[0]) != plain_path(d, d.phases[i]))
      return Refusal{int(i), "ZeRO stage", "a checkpoint moves between the plain stage-0 fp32 path "
                                           "and the partitioned one"};
  }
  return std::nullopt;
}

}  // namespace matrix
