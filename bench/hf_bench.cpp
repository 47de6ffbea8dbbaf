// strata-bench hf: a published architecture (models/causal_lm.h) built from a Hugging Face
// config.json and trained by the engine the way ../shared/bench/peer_hf_deepspeed.py trains
// transformers' own class: one fixed batch of B x T random tokens, labels = the inputs, 3 warm-up
// steps and 10 timed, and the peer's FLOP formula, so the two JSON lines compare field by field.
// From a folder with weights (bench/peer_hf.py --save writes one, with the peer's batch) both
// sides start from the same weights and, with --batch, train on the same tokens: every step's
// loss ("losses", warm-up steps first) compares with the peer's --log-losses.
//   strata-bench hf --hf-model DIR|config.json --config FILE [--B 4] [--T 2048] [--steps 10]
//                   [--warmup 3] [--batch FILE (B x T int64, row-major)] [--seed S]
//                   [--activation-checkpointing every|every:K] [--tiled-mlp none|auto|N]
//                   [--profile STEPS] [--device cuda|cpu] [--fused-projections 1|0] [--sdpa-gqa 1|0]
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "bench/bench_device.h"
#include "bench/op_profile.h"
#include "models/causal_lm.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/engine.h"
#include "runtime/error.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct HfArgs {
  std::string hf_model, config, batch_file, device, checkpointing;
  int64_t B = 4, T = 2048, steps = 10, warmup = 3, profile = 0, seed = 0;
  std::optional<int64_t> tiled_mlp;
  bool fused_projections = true;  // models::DecoderConfig::fused_projections
  bool sdpa_gqa = true;           // models::DecoderConfig::sdpa_gqa
};

HfArgs parse_hf(int argc, char** argv) {
  HfArgs a;
  for (int i = 2; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw Error("strata-bench hf: " + flag + " needs a value");
    const std::string value = argv[i + 1];
    if (flag == "--hf-model") a.hf_model = value;
    else if (flag == "--config") a.config = value;
    else if (flag == "--batch") a.batch_file = value;
    else if (flag == "--device") a.device = value;
    else if (flag == "--activation-checkpointing") a.checkpointing = value;
    else if (flag == "--B") a.B = std::stoll(value);
    else if (flag == "--T") a.T = std::stoll(value);
    else if (flag == "--steps") a.steps = std::stoll(value);
    else if (flag == "--warmup") a.warmup = std::stoll(value);
    else if (flag == "--profile") a.profile = std::stoll(value);
    else if (flag == "--seed") a.seed = std::stoll(value);
    else if (flag == "--fused-projections") a.fused_projections = value != "0";
    else if (flag == "--sdpa-gqa") a.sdpa_gqa = value != "0";
    else if (flag == "--tiled-mlp")
      a.tiled_mlp = value == "none" ? -1 : value == "auto" ? 0 : std::stoll(value);
    else
      throw Error("strata-bench hf: unknown option " + flag +
                  " (usage: strata-bench hf --hf-model DIR --config FILE [--B N] [--T N] "
                  "[--steps N] [--warmup N] [--batch FILE] [--seed S] "
                  "[--activation-checkpointing every|every:K] [--tiled-mlp none|auto|N] "
                  "[--profile STEPS] [--device cuda|cpu] [--fused-projections 1|0] [--sdpa-gqa 1|0])");
  }
  if (a.hf_model.empty() || a.config.empty())
    throw Error("strata-bench hf: --hf-model DIR and --config FILE are required");
  if (a.B <= 0 || a.T <= 1 || a.steps <= 0 || a.warmup < 0)
    throw Error("strata-bench hf: --B and --steps must be positive, --T at least 2");
  return a;
}

// B x T int64 tokens, row-major, as bench/peer_hf.py --save writes its batch (numpy's tofile).
torch::Tensor read_batch(const std::string& path, int64_t B, int64_t T, int64_t vocab) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("strata-bench hf: cannot open --batch " + path);
  const auto bytes = std::filesystem::file_size(path);
  if (bytes != uint64_t(B * T) * sizeof(int64_t))
    throw Error(fmt::format("strata-bench hf: --batch {} holds {} bytes; B {} x T {} int64 tokens "
                            "are {} (give the B and T it was written with)",
                            path, bytes, B, T, B * T * 8));
  auto t = torch::empty({B, T}, torch::kLong);
  in.read(reinterpret_cast<char*>(t.data_ptr<int64_t>()), std::streamsize(bytes));
  const int64_t lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
  if (lo < 0 || hi >= vocab)
    throw Error(fmt::format("strata-bench hf: --batch {} has token ids in [{}, {}], outside the "
                            "model's vocabulary of {}",
                            path, lo, hi, vocab));
  return t;
}

// The peer's count: the parameters a token's matrix products use (attention, the MLP or the k
// routed experts and the router, the head; not the embedding lookup) and causal attention's
// 6 L d T per token, d being hidden_size as the peer writes it.
double active_parameters(const models::DecoderConfig& c) {
  const double d = double(c.hidden_size), hd = double(c.head_dim);
  const double attn = 2 * d * double(c.num_attention_heads) * hd +
                      2 * d * double(c.num_key_value_heads) * hd;
  double layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    layers += attn + (c.is_moe_layer(l) ? 3 * d * double(c.moe_intermediate_size) *
                                                  double(c.num_experts_per_tok) +
                                              d * double(c.num_experts)
                                        : 3 * d * double(c.intermediate_size));
  return layers + double(c.vocab_size) * d;
}

bool has_weights(const std::string& dir) {
  namespace fs = std::filesystem;
  return fs::is_directory(dir) && (fs::exists(fs::path(dir) / "model.safetensors") ||
                                   fs::exists(fs::path(dir) / "model.safetensors.index.json"));
}

}  // namespace

int run_hf(int argc, char** argv) {
  const HfArgs args = parse_hf(argc, argv);
  const torch::Device device = bench_device(args.device);
  const double peak = matmul_peak(device);
  auto hf = models::read_hf_config(args.hf_model);
  hf.checkpointing = args.checkpointing;
  hf.fused_projections = args.fused_projections;
  hf.sdpa_gqa = args.sdpa_gqa;
  const bool weights = has_weights(args.hf_model);
  hf.init_weights = !weights;  // transformers' draw only when nothing is loaded over it

  InitOptions init;
  auto config = load_engine_config(args.config, init);
  hf.mlp_tiles = args.tiled_mlp.value_or(config.activation_checkpointing.mlp_tiles.value_or(-1));
  torch::manual_seed(args.seed);
  models::CausalLM model(hf);
  if (weights) {
    const checkpoint::HfWeights files(args.hf_model);
    checkpoint::import_weights(*model, files, models::hf_import_options(*model));
  }
  model->to(device);
  int64_t n_params = 0;  // before the engine partitions them
  for (const auto& t : model->parameters()) n_params += t.numel();
  auto engine = std::make_shared<ModelEngine<models::CausalLM>>(model, std::move(config),
                                                                std::move(init));
  if (engine->train_micro_batch_size_per_gpu() != args.B ||
      engine->gradient_accumulation_steps() != 1)
    throw Error(fmt::format("strata-bench hf: {} trains micro-batches of {} with {} accumulation "
                            "steps; the bench (as the peer) steps once per micro-batch of --B {}",
                            args.config, engine->train_micro_batch_size_per_gpu(),
                            engine->gradient_accumulation_steps(), args.B));
  torch::Tensor tokens;
  if (!args.batch_file.empty()) {
    tokens = read_batch(args.batch_file, args.B, args.T, hf.vocab_size).to(device);
  } else {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(uint64_t(1 + args.seed));
    tokens = torch::randint(0, hf.vocab_size, {args.B, args.T}, g, torch::kLong).to(device);
  }
  auto step = [&] {
    auto loss = engine->forward(tokens, tokens);  // Hugging Face's loss: the labels shift inside
    engine->backward(loss);
    engine->step();
    return loss.detach();
  };
  std::vector<torch::Tensor> losses;  // read after the timed steps: no sync among them
  const auto w0 = Clock::now();
  for (int64_t i = 0; i < args.warmup; ++i) losses.push_back(step());
  synchronize(device);
  const double warm = std::chrono::duration<double>(Clock::now() - w0).count();
  reset_peak_memory(device);
  const auto nvme0 = engine->nvme_traffic();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < args.steps; ++i) losses.push_back(step());
  synchronize(device);
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count() / double(args.steps);
  const auto nvme1 = engine->nvme_traffic();

  const double tok = double(args.B * args.T);
  const double L = double(hf.num_hidden_layers), d = double(hf.hidden_size);
  const double active = active_parameters(hf);
  const double flops = 6 * active * tok + 12 * L * d * double(args.T) * tok / 2;
  const auto& pc = engine->config();
  const std::string precision = pc.bf16.enabled ? "bf16" : pc.fp16.enabled ? "fp16" : "fp32";
  std::vector<double> loss_values;
  for (const auto& l : losses) loss_values.push_back(l.item<double>());
  nlohmann::json r = {
      {"name", fmt::format("strata {} L{}{} {} stage {}{} x{}", models::family_name(hf.family),
                           hf.num_hidden_layers,
                           args.checkpointing.empty() ? "" : " ckpt " + args.checkpointing,
                           precision, pc.zero_optimization.stage,
                           engine->last_offload_times() ? " offload-cpu" : "",
                           engine->data_parallel_size())},
      {"active_M", active / 1e6}, {"B", args.B}, {"T", args.T}, {"step_ms", dt * 1e3},
      {"tok_s", tok / dt}, {"tflops", flops / dt / 1e12}, {"mfu", flops / dt / 1e12 / peak},
      {"peak_tflops", peak}, {"mem_GiB", peak_memory_gib(device)},
      {"reserved_GiB", peak_memory_gib(device, /*reserved=*/true)}, {"warm_s", warm},
      {"loss", loss_values.back()}, {"losses", loss_values},
      {"weights", weights ? args.hf_model : std::string("random (seed ") +
                                                std::to_string(args.seed) + ")"}};
  // Model states by tier, per parameter (this rank's; the swap files beside), and the disk's
  // traffic per timed step.
  const auto states = engine->model_state_bytes();
  const double n = double(n_params);
  r["params_M"] = n / 1e6;
  r["state_bytes_per_param"] = {{"device", double(states.device()) / n},
                                {"host", double(states.host) / n},
                                {"nvme", double(states.nvme) / n}};
  if (const auto moved = (nvme1.read_bytes - nvme0.read_bytes) + (nvme1.written_bytes - nvme0.written_bytes);
      moved > 0) {
    const double steps = double(args.steps);
    r["nvme_per_step"] = {{"read_GB", double(nvme1.read_bytes - nvme0.read_bytes) / steps / 1e9},
                          {"written_GB", double(nvme1.written_bytes - nvme0.written_bytes) / steps / 1e9},
                          {"GB_s", double(moved) / steps / 1e9 / dt},
                          {"read_wait_s", (nvme1.read_wait_s - nvme0.read_wait_s) / steps},
                          {"write_wait_s", (nvme1.write_wait_s - nvme0.write_wait_s) / steps}};
  }
  if (args.profile > 0 && engine->data_parallel_rank() == 0) {
    synchronize(device);
    const auto p0 = Clock::now();
    OpProfile profile;
    for (int64_t i = 0; i < args.profile; ++i) {
      step();
      profile.reattach();
    }
    synchronize(device);
    const double wall_ms =
        std::chrono::duration<double, std::milli>(Clock::now() - p0).count();
    const double idle = profile.print(40, static_cast<int>(args.profile), wall_ms);
    if (idle >= 0) r["gpu_idle_share"] = idle;
  }
  if (engine->data_parallel_rank() == 0) {
    std::printf("%s\n", r.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace strata::bench
