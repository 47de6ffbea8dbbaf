// The example trainer (the main job): a GPT in plain LibTorch, trained by Strata's engine from
// one JSON config. The loop reads like nanoGPT's: data, forward, backward, step, log.
//
//   build/bin/train_gpt --config configs/gpt_tiny.json [--model tiny] [--steps N] [--seed S]
//                       [--data FILE] [--metrics-jsonl FILE] [--device cpu|cuda]
//                       [--save-dir DIR] [--save-every N] [--resume DIR] [--print-config]
//                       [--applied-steps N]
//                       [--activation-checkpointing none|every|every:K|selective]
//                       [--tiled-mlp none|auto|N]
//                       [--moe-padding K] [--expert-kernel auto|batched|grouped]
//                       [--hf-model DIR [--hf-export DIR]]
//                       [--lr ... --precision fp32|bf16|fp16: examples/train_args.h]
//
// A Hugging Face or Megatron-DeepSpeed config runs as its program would run it: "auto" filled
// from the flags and the model, and a client AdamW where the config names no optimizer.
// --hf-model DIR trains a Hugging Face model instead (models/causal_lm.h, from the folder's
// config.json), its weights imported from the folder's safetensors (runtime/checkpoint/
// import_weights.h; with --zero-init each rank reads only its shards), its loss Hugging Face's
// (labels = the inputs, shifted inside); --hf-export writes a Hugging Face folder at each save.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <functional>
#include <optional>

#include <unistd.h>

#include <c10/core/DeviceGuard.h>
#include <strata/strata.h>
#include <torch/torch.h>

#include "comm/env.h"
#include "examples/data.h"
#include "runtime/data/token_dataset.h"
#include "examples/gpt.h"
#include "examples/gpt_moe.h"
#include "examples/train_args.h"
#include "examples/train_metrics.h"
#include "models/causal_lm.h"
#include "runtime/checkpoint/hf_export.h"
#include "runtime/checkpoint/import_weights.h"
#include "runtime/log.h"
#include "runtime/optim/state_io.h"

namespace {

using strata::Error;
using Clock = std::chrono::steady_clock;

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds) + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// --state-digest: FNV-1a over the bytes of every parameter the optimizer steps (the fp32 master
// under ZeRO) and of its state tensors, in order.
uint64_t state_digest(const torch::optim::Optimizer& optimizer) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const torch::Tensor& t) {
    const auto c = t.detach().to(torch::kCPU).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0, n = size_t(c.numel()) * c.element_size(); i < n; ++i)
      h = (h ^ p[i]) * 1099511628211ull;
  };
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) {
      mix(p);
      if (const auto state = strata::optim::export_param_state(optimizer, p))
        for (const auto& [name, t] : state->tensors) mix(t);
    }
  return h;
}

// --hf-model: the example GPT's shape fields a Hugging Face config fills (the data's vocabulary,
// the "auto" values from the hidden size, the log line); sequences default to 256 tokens.
strata::examples::GPTConfig hf_shape(const strata::models::DecoderConfig& c, const std::string& dir) {
  strata::examples::GPTConfig g;
  g.name = dir;
  g.vocab = c.vocab_size;
  g.d_model = c.hidden_size;
  g.layers = c.num_hidden_layers;
  g.heads = c.num_attention_heads;
  g.ffn = c.intermediate_size;
  g.seq_len = c.max_position_embeddings > 0 ? std::min<int64_t>(256, c.max_position_embeddings) : 256;
  return g;
}

std::string absolute_path(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  char cwd[4096];
  return ::getcwd(cwd, sizeof cwd) ? std::string(cwd) + "/" + path : path;
}

// Steps to run when --steps is not given: the schedule's length when it has one.
int64_t default_steps(const strata::Config& config) {
  const auto& params = config.scheduler.params;
  if (config.scheduler.present && params.contains("total_num_steps") &&
      params["total_num_steps"].is_number_integer())
    return params["total_num_steps"].get<int64_t>();
  return strata::examples::kDefaultSteps;
}

int run(const strata::examples::TrainArgs& args) {
  using namespace strata::examples;
  // --data tokens:A.bin[,B.bin...] (uint16 ids) or tokens32:... (uint32): pre-tokenized files
  // (runtime/data/token_dataset.h), sampled in one global order; else bytes of a text file, or the
  // built-in synthetic language.
  const auto token_files = parse_token_files(args.data);
  std::optional<TokenData> text;
  if (token_files.token_bytes == 0)
    text.emplace(args.data.empty() ? TokenData::synthetic() : TokenData::from_file(args.data));
  torch::Device device = torch::kCPU;
  if (args.device == "cuda" || (args.device.empty() && torch::cuda::is_available())) {
    // One GPU per rank. strata-run shows each rank only its own GPU (cuda:0 then); launchers
    // that show every GPU of the node to every rank (mpirun, srun) need the local rank to pick.
    const auto visible = static_cast<int>(torch::cuda::device_count());
    if (visible == 0)
      throw Error("--device cuda: no CUDA device here (or this LibTorch was built without CUDA)");
    const int local_rank = strata::comm::read_rank_env().local_rank;
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % visible));
  } else if (!args.device.empty() && args.device != "cpu") {
    throw Error(fmt::format("--device {}: expected cpu or cuda", args.device));
  }
  // The current device too, for whatever allocates on "the" GPU without naming one.
  std::optional<c10::DeviceGuard> on_device;
  if (device.is_cuda()) on_device.emplace(device);

  // The config first: an MoE model's layers are built from its moe block and its groups.
  // "auto" and absent batch keys come from the flags and the model, as the HF Trainer fills them.
  const bool hf = !args.hf_model.empty();
  std::optional<strata::models::DecoderConfig> hf_config;
  GPTConfig model_config;
  if (hf) {
    hf_config = strata::models::read_hf_config(args.hf_model);
    hf_config->checkpointing = args.activation_checkpointing;
    hf_config->init_weights = false;  // every weight comes from the folder or the checkpoint
    model_config = hf_shape(*hf_config, args.hf_model);
  } else {
    model_config = GPTConfig::by_name(args.model);
  }
  if (args.seq_len) model_config.seq_len = *args.seq_len;  // shorter sequences, same weights
  model_config.checkpointing = args.activation_checkpointing;  // the blocks' checkpoint policy
  model_config.moe_padding = args.moe_padding;  // used_token of the MoE layers
  strata::InitOptions init;
  init.autos = auto_values(args, model_config);
  auto config = strata::load_engine_config(args.config, init);
  {  // A flag given on the command line must agree with what the config writes (HF's check).
    std::ifstream in(args.config);
    check_flags_match_config(nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/true,
                                                   /*ignore_comments=*/true),
                             args, args.config);
  }
  // The tiled feed-forward: the flag, else the config's activation_checkpointing.mlp_tiles.
  model_config.mlp_tiles =
      args.tiled_mlp.value_or(config.activation_checkpointing.mlp_tiles.value_or(-1));
  if (hf) hf_config->mlp_tiles = model_config.mlp_tiles;
  const std::string filled = describe_filled(config, args, model_config);
  if (!filled.empty())
    strata::log::info("train_gpt: values the config leaves to the program, from train_gpt's:{}",
                      filled);
  const int64_t steps = args.steps.value_or(default_steps(config));
  const std::string client = add_client_optimizer(config, args, steps, init);
  if (!client.empty())
    strata::log::info("train_gpt: the config names no optimizer{}; passing train_gpt's own: {}",
                      config.scheduler.present ? "" : " or scheduler", client);
  if (args.print_config && (!init.group || init.group->rank() == 0))
    std::printf("%s\n", strata::to_json(config).dump(2).c_str());
  torch::manual_seed(args.seed);
  // --zero-init (DeepSpeed's zero.Init): at stage 3 the model is built in shards, so that no
  // rank ever holds it whole (zero/partitioned_init.h).
  if (args.zero_init) {
    if (args.host_init)
      throw Error("--zero-init and --host-init: choose one (--zero-init builds the model in shards "
                  "on the device, --host-init whole in host memory)");
    if (config.zero_optimization.stage != 3)
      throw Error("--zero-init builds the model in shards for ZeRO stage 3; the config's stage is " +
                  std::to_string(config.zero_optimization.stage));
    strata::zero::PartitionedInitOptions po;
    po.dtype = config.bf16.enabled ? torch::kBFloat16 : config.fp16.enabled ? torch::kHalf
                                                                              : torch::kFloat;
    po.device = device;
    po.min_numel = config.zero_optimization.stage3_param_persistence_threshold.value;
    init.partitioned_init = strata::zero::PartitionedInit::create(init.group, po);
  }
  std::unique_ptr<strata::data::TokenDataset> tokens;
  if (!text) {
    strata::data::TokenDatasetOptions o;
    o.files = token_files.files;
    o.token_bytes = token_files.token_bytes;
    o.seq_len = model_config.seq_len;
    o.vocab_size = model_config.vocab;
    o.seed = args.seed;
    tokens = std::make_unique<strata::data::TokenDataset>(o);
  }
  // The engine, the module it trains and the step's loss, for either model.
  std::shared_ptr<strata::Engine> engine;
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_of;
  const bool partitioned = init.partitioned_init != nullptr;
  if (hf) {
    // Qwen3-MoE, Mixtral: the config's moe block places the experts (ep_size, capacity); the
    // routing is config.json's. Without drop_tokens in the block, dropless, as transformers.
    strata::models::MoEPlacement placement;
    if (hf_config->num_experts > 0 && !config.moe.given.empty()) {
      auto o = strata::moe::MoEOptions::from_config(config.moe, hf_config->hidden_size,
                                                    hf_config->moe_intermediate_size, 0, args.seed,
                                                    init.group);
      if (!config.moe.given.count("drop_tokens")) o.drop_tokens = false;
      const auto differs =
          strata::models::moe_layer_options(*hf_config, 0, o).differs_from(config.moe);
      if (!differs.empty())
        throw Error(fmt::format("{}: {} (config.json of --hf-model {} says how its experts route; "
                                "drop the key)", args.config, differs, args.hf_model));
      placement = o;
    }
    const auto rss_before = host_rss().first;  // the process before the model: LibTorch, buffers
    strata::models::CausalLM model(*hf_config, placement);
    model->set_balance_group(init.group);  // the balance loss over every rank's tokens
    // Ulysses: each rank feeds its shard of every sample's positions (the engine finds the same
    // cached group).
    if (config.sequence_parallel_size > 1)
      model->set_sequence_parallel(
          strata::comm::sequence_group(init.group, int(config.sequence_parallel_size)));
    if (init.partitioned_init) init.partitioned_init->finish();
    const auto rss_built = host_rss().first;
    if (args.resume.empty()) {  // (a resume's checkpoint holds the weights)
      const auto t0 = Clock::now();
      auto io = strata::models::hf_import_options(*model);
      io.partitioned = init.partitioned_init;
      const strata::checkpoint::HfWeights weights(args.hf_model);
      const auto r = strata::checkpoint::import_weights(*model, weights, io);
      // Every rank says what it read and the most host memory it has held so far.
      const auto [rss, peak] = host_rss();
      std::fprintf(stderr,
                   "train_gpt: rank %d imported %lld tensors of %s (%.1f MB of its %.1f MB read%s) "
                   "in %.1f s; host memory %.1f MB before the model, %.1f MB built, %.1f MB now, peak "
                   "%.1f MB\n",
                   init.group ? init.group->rank() : 0, static_cast<long long>(r.tensors),
                   args.hf_model.c_str(), r.bytes_read / 1e6, weights.total_bytes() / 1e6,
                   partitioned ? ": its shards" : "",
                   std::chrono::duration<double>(Clock::now() - t0).count(), rss_before / 1e6,
                   rss_built / 1e6, rss / 1e6, peak / 1e6);
    }
    if (args.host_init)
      init.device = device;
    else if (!partitioned)
      model->to(device);
    auto e = std::make_shared<strata::ModelEngine<strata::models::CausalLM>>(model, std::move(config),
                                                                             std::move(init));
    // Hugging Face's causal-LM loss: the labels are the inputs, shifted inside the model.
    loss_of = [e](const torch::Tensor& tokens, const torch::Tensor&) {
      return e->forward(tokens, tokens);
    };
    module = model.ptr();
    engine = e;
  } else {
    GPT model = make_gpt(model_config, config.moe, args.seed, init.group);
    if (config.sequence_parallel_size > 1)  // Ulysses (the engine finds the same cached group)
      model->set_sequence_parallel(
          strata::comm::sequence_group(init.group, int(config.sequence_parallel_size)));
    if (init.partitioned_init) init.partitioned_init->finish();
    const auto layers = strata::moe::moe_layers(*model);
    if (args.expert_kernel != "auto")  // forced: the grouped kernel runs the packed-routes path
      for (auto* layer : layers)
        layer->experts->set_kernel(args.expert_kernel == "grouped" ? strata::moe::ExpertKernel::Grouped
                                                                   : strata::moe::ExpertKernel::Batched);
    // --host-init: built in host memory, moved by the engine (at stage 3 a unit at a time, so a
    // model larger than the device trains); otherwise here, whole (a PartitionedInit's shards are
    // on the device already).
    if (args.host_init)
      init.device = device;
    else if (!partitioned)
      model->to(device);
    auto e = std::make_shared<strata::ModelEngine<GPT>>(model, std::move(config), std::move(init));
    loss_of = [e](const torch::Tensor& tokens, const torch::Tensor& targets) {
      return e->forward(tokens, targets);
    };
    module = model.ptr();
    engine = e;
  }
  const auto moe_layers = strata::moe::moe_layers(*module);
  if (hf && text && model_config.vocab < 256)  // the text's tokens are its bytes
    throw Error(fmt::format("--hf-model {}: its vocabulary has {} tokens, fewer than the 256 byte "
                            "values of the built-in or --data text; give token files "
                            "(--data tokens:...)", args.hf_model, model_config.vocab));

  const int64_t micro = engine->train_micro_batch_size_per_gpu();
  const int64_t gas = engine->gradient_accumulation_steps();
  const int64_t world = engine->data_parallel_size();
  const int64_t rank = engine->data_parallel_rank();
  // Ulysses: the ranks of a sequence-parallel group draw the same samples (each feeds its shard
  // of their positions); the data is split over the batch shards.
  const int64_t sp = engine->sequence_parallel_size();
  const int64_t shards = engine->batch_shards(), shard = engine->batch_shard();
  const int64_t tokens_per_step = engine->train_batch_size() * model_config.seq_len;
  int64_t parameters = 0;
  for (const auto& p : module->parameters()) parameters += p.numel();
  strata::log::info("train_gpt: model {} ({:.2f}M parameters) on {}, data: {}",
                    hf ? fmt::format("{} ({})", args.hf_model, family_name(hf_config->family))
                       : args.model,
                    parameters / 1e6, device.str(),
                    text ? text->description()
                         : fmt::format("{} token file(s), {} samples of {} tokens per epoch",
                                       token_files.files.size(), tokens->samples_per_epoch(),
                                       model_config.seq_len));
  strata::log::info(
      "train_gpt: {} steps of {} samples ({} micro x {} accumulation x {} ranks{}) x {} tokens",
      steps, engine->train_batch_size(), micro, gas, shards,
      sp > 1 ? fmt::format(", each sample's tokens split over {} ranks", sp) : std::string(),
      model_config.seq_len);

  std::ofstream metrics;
  if (!args.metrics_jsonl.empty() && rank == 0) {
    metrics.open(args.metrics_jsonl, std::ios::trunc);
    if (!metrics) throw Error(fmt::format("--metrics-jsonl {}: cannot open for writing",
                                          args.metrics_jsonl));
  }

  // Resuming: the checkpoint restores the model, optimizer, schedule and loss scale; its client
  // state says which step's data comes next (batches are a function of the step).
  // Token files: the position of step 0's first sample in the dataset's global order. A resume
  // continues at the position the checkpoint saved, whatever the new batch layout.
  const int64_t global_batch = micro * shards * gas;
  int64_t data_start = 0;
  int64_t first_step = 0;
  if (!args.resume.empty()) {
    const auto client = engine->load_checkpoint(args.resume);
    first_step = client.at("next_step").get<int64_t>();
    if (tokens && client.contains("data_position"))
      data_start = client.at("data_position").get<int64_t>() - first_step * global_batch;
    strata::log::info("train_gpt: resumed from {} at step {}", args.resume, first_step);
  }
  auto save = [&](int64_t next_step) {
    nlohmann::json client = {{"next_step", next_step}, {"seed", args.seed}};
    if (tokens) client["data_position"] = data_start + next_step * global_batch;
    // The Hugging Face folder the model came from: strata-ckpt's export copies its config.json.
    if (hf) client[strata::checkpoint::kHfSourceKey] = absolute_path(args.hf_model);
    const auto tag = fmt::format("step{}", next_step);
    engine->save_checkpoint(args.save_dir, tag, client);
    if (!args.hf_export.empty()) {
      const auto out = fmt::format("{}/{}", args.hf_export, tag);
      if (rank == 0) {
        const auto r = strata::checkpoint::export_hf_folder(
            strata::checkpoint::FullWeights(args.save_dir, tag), out,
            strata::models::hf_export_options(*hf_config));
        strata::log::info("train_gpt: exported {} tensors ({}) in {} shard(s) to {}", r.tensors,
                          c10::toString(r.dtype), r.shards, out);
      }
      if (auto& group = engine->data_parallel_group()) group->barrier();
    }
  };

  const auto start = Clock::now();
  double first_loss = 0.0, last_loss = 0.0;
  int64_t ran = 0;
  double report_s = 0.0;  // the last step's logging and metrics row
  for (int64_t step = first_step; step < steps; ++step) {
    const auto step_start = Clock::now();
    auto loss_sum = torch::zeros({}, torch::TensorOptions().device(device));
    // MoE: the layers' auxiliary loss (mean over micro-batches and ranks) and dropped routes.
    auto moe_sums = torch::zeros({2}, torch::TensorOptions().dtype(torch::kDouble).device(device));
    // Each layer's routes per expert (chosen, before drops), summed over micro-batches and ranks.
    auto moe_loads = torch::zeros({int64_t(moe_layers.size()),
                                   moe_layers.empty() ? 0 : moe_layers[0]->options().num_experts},
                                  torch::TensorOptions().dtype(torch::kLong).device(device));
    int64_t skipped_units = 0;  // streamed experts left unread (this rank's forwards)
    const auto nvme_before = engine->nvme_traffic();
    // The device's memory at the step's start: its peak during the step above that is what lives
    // only inside a step, the activations (checkpointed inputs included) and, where they occur,
    // gathered stage-3 units, gradient buckets in flight and the loss's chunks.
    const auto memory_before = strata::device_memory(device);
    strata::reset_device_memory_peak(device);
    // Token files: the samples this rank read, in its micro-batches' order.
    std::vector<int64_t> sample_ids;
    for (int64_t m = 0; m < gas; ++m) {
      // Sample j of the global batch is the same whatever the world: ranks take slices.
      const int64_t first = (m * shards + shard) * micro;
      TokenData::Batch batch;
      if (tokens) {
        auto b = tokens->batch(strata::data::TokenDataset::first_position(step, m, shard, shards,
                                                                          micro, gas, data_start),
                               micro);
        batch = {b.tokens, b.targets};
        sample_ids.insert(sample_ids.end(), b.ids.begin(), b.ids.end());
      } else {
        batch = text->batch(args.seed, step, first, micro, model_config.seq_len);
      }
      // The engine keys the gates' noise by this global micro-batch (its chunk m * world + rank
      // of the step's batch), so any world size and accumulation draws the same for the same
      // samples, resumed or not.
      // Ulysses: this rank's shard of the sample's positions (labels shifted across the shards by
      // the model).
      const auto& sequence_group = engine->sequence_parallel_group();
      using strata::sequence::shard_sequence;
      auto loss = loss_of(shard_sequence(batch.tokens.to(device), sequence_group),
                          shard_sequence(batch.targets.to(device), sequence_group));
      for (auto* layer : moe_layers) {
        moe_sums[0] += layer->last().l_aux.detach().to(torch::kDouble);
        moe_sums[1] += layer->last().dropped.to(torch::kDouble);
      }
      for (size_t l = 0; l < moe_layers.size(); ++l) {
        moe_loads[int64_t(l)] += moe_layers[l]->last().exp_counts;
        skipped_units += moe_layers[l]->experts->last_skipped_units();
      }
      engine->backward(loss);
      engine->step();
      loss_sum += loss.detach();
    }
    // Token files: the step's samples in global order (rank r's micro-batch m at chunk
    // m * world + r), for the metrics.
    std::vector<int64_t> step_ids;
    if (tokens) {
      auto mine = torch::tensor(sample_ids, torch::kLong);
      auto all = torch::empty({world, gas * micro}, torch::kLong);
      if (auto& group = engine->data_parallel_group(); group && world > 1)
        group->all_gather(all, mine);
      else
        all[0].copy_(mine);
      step_ids.resize(size_t(global_batch));
      for (int64_t r = 0; r < shards; ++r)  // shard r's samples, from its group's first rank
        for (int64_t m = 0; m < gas; ++m)
          for (int64_t i = 0; i < micro; ++i)
            step_ids[size_t((m * shards + r) * micro + i)] =
                all[r * sp][m * micro + i].item<int64_t>();
    }
    // The global batch's mean loss (ranks' means averaged): one host sync per optimizer step.
    if (auto& group = engine->data_parallel_group()) {
      group->all_reduce(loss_sum, strata::comm::ReduceOp::Avg);
      if (!moe_layers.empty()) {
        group->all_reduce(moe_sums, strata::comm::ReduceOp::Sum);
        group->all_reduce(moe_loads, strata::comm::ReduceOp::Sum);
      }
    }
    // Ulysses: a group's ranks hold parts of one sample's loss, summed (x sp over the mean).
    const double loss = loss_sum.item<double>() * double(sp) / gas;
    const std::vector<double> lrs = engine->get_lr();  // the experts' groups after the dense ones
    const double lr = lrs.at(0);
    const auto now = Clock::now();
    const double step_s = std::chrono::duration<double>(now - step_start).count();
    const double elapsed = std::chrono::duration<double>(now - start).count();
    const double tokens_per_s = tokens_per_step / step_s;
    if (step == first_step) first_loss = loss;
    last_loss = loss;

    strata::log::status(fmt::format(
        "step {:>{}}/{} | loss {:.4f} | lr {:.3e} | {:.0f} tok/s | elapsed {} | ETA {}", step + 1,
        std::to_string(steps).size(), steps, loss, lr, tokens_per_s, format_duration(elapsed),
        format_duration(elapsed / (step + 1 - first_step) * (steps - step - 1))));
    engine->write_monitor_events(
        {{"Train/Samples/tokens_per_s", tokens_per_s, engine->global_samples()}});
    // --state-digest: every rank's hash, gathered (a collective: every rank takes part).
    std::vector<std::string> digests;
    if (args.state_digest) {
      uint64_t h = state_digest(engine->optimizer());
      if (auto* experts = engine->expert_optimizer()) h = h * 1099511628211ull ^ state_digest(*experts);
      auto mine = torch::tensor({static_cast<int64_t>(h)}, torch::kLong).to(device);
      auto all = torch::empty({world}, torch::kLong).to(device);
      if (auto& group = engine->data_parallel_group(); group && world > 1)
        group->all_gather(all, mine);
      else
        all.copy_(mine);
      const auto host = all.cpu();
      for (int64_t r = 0; r < world; ++r)
        digests.push_back(fmt::format("{:016x}", static_cast<uint64_t>(host[r].item<int64_t>())));
    }
    if (metrics.is_open()) {
      nlohmann::json row = {{"step", step + 1},      {"loss", loss},
                            {"lr", lr},              {"lrs", lrs},
                            {"tokens_per_s", tokens_per_s},
                            {"step_time_s", step_s}, {"samples", engine->global_samples()},
                            // Since the loop began, and what the last row's reporting took
                            // (outside step_time_s): where a run's wall time goes between steps.
                            {"elapsed_s", elapsed}, {"report_s", report_s}};
      add_engine_metrics(row, *engine);
      if (tokens) row["sample_ids"] = step_ids;
      if (args.state_digest) row["state_digest"] = digests;
      if (const auto m = strata::device_memory(device); m && memory_before) {  // CUDA only
        row["activation_bytes_peak"] = m->peak - memory_before->allocated;
        // The step's peak over this rank's tokens in it: the long-context figure (issue 58).
        row["device_peak_bytes"] = m->peak;
        row["device_bytes_per_token"] = double(m->peak) / double(micro * gas * model_config.seq_len);
      }
      if (!moe_layers.empty()) {
        const auto sums = moe_sums.cpu();
        row["l_aux"] = sums[0].item<double>() / double(gas * world);
        row["dropped_tokens"] = static_cast<int64_t>(sums[1].item<double>());
        // Balance per layer: the busiest expert's routes over the mean, and the idle experts.
        const auto loads = moe_loads.cpu().to(torch::kDouble);
        std::vector<double> max_over_mean;
        std::vector<int64_t> idle;
        for (int64_t l = 0; l < loads.size(0); ++l) {
          max_over_mean.push_back(loads[l].max().item<double>() /
                                  std::max(loads[l].mean().item<double>(), 1e-30));
          idle.push_back(loads[l].eq(0).sum().item<int64_t>());
        }
        row["expert_load_max_over_mean"] = max_over_mean;
        row["idle_experts"] = idle;
      }
      if (const auto t = engine->nvme_traffic(); t.read_bytes + t.written_bytes > 0) {
        // NVMe offload, this rank, this step: bytes read and written, and the time the step
        // waited for reads (what the reads ahead did not hide), and for writes or for all
        // outstanding I/O at once (wait_all).
        row["nvme_read_bytes"] = t.read_bytes - nvme_before.read_bytes;
        row["nvme_written_bytes"] = t.written_bytes - nvme_before.written_bytes;
        row["nvme_read_wait_s"] = t.read_wait_s - nvme_before.read_wait_s;
        row["nvme_write_wait_s"] =
            t.write_wait_s + t.wait_all_s - nvme_before.write_wait_s - nvme_before.wait_all_s;
      }
      if (engine->expert_window_bytes() > 0) row["skipped_expert_units"] = skipped_units;
      metrics << row.dump() << '\n' << std::flush;
      if (!metrics) throw Error(fmt::format("--metrics-jsonl {}: write failed",
                                            args.metrics_jsonl));
    }
    report_s = std::chrono::duration<double>(Clock::now() - now).count();
    if (!std::isfinite(loss))
      throw Error(fmt::format("the loss became {} at step {}; lower the learning rate", loss,
                              step + 1));
    ++ran;
    // --applied-steps: enough optimizer steps went through (fp16 overflow skips do not count).
    const bool enough = args.applied_steps &&
                        engine->global_steps() - engine->skipped_steps() >= *args.applied_steps;
    const bool last = step + 1 == steps || enough;
    if (!args.save_dir.empty() && (last || (args.save_every > 0 && (step + 1) % args.save_every == 0)))
      save(step + 1);
    if (enough) break;
  }
  strata::log::end_status();
  if (hf)
    std::fprintf(stderr, "train_gpt: rank %lld host memory peak %.1f MB\n",
                 static_cast<long long>(rank), host_rss().second / 1e6);
  const double total = std::chrono::duration<double>(Clock::now() - start).count();
  const int64_t skipped = engine->skipped_steps();
  strata::log::info("train_gpt: loss {:.4f} -> {:.4f} in {} steps ({} applied, {} skipped for "
                    "gradient overflow), {}",
                    first_loss, last_loss, ran, engine->global_steps() - skipped, skipped,
                    format_duration(total));
  if (args.applied_steps && engine->global_steps() - skipped < *args.applied_steps)
    throw Error(fmt::format("--applied-steps {}: only {} of {} steps were applied ({} skipped for "
                            "gradient overflow); raise --steps, or lower the config's "
                            "fp16.initial_scale_power",
                            *args.applied_steps, engine->global_steps() - skipped,
                            engine->global_steps(), skipped));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(strata::examples::parse_train_args(argc, argv));
  } catch (const c10::Error& e) {
    // LibTorch's own message without its C++ backtrace, which says nothing to a user.
    strata::log::end_status();
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    strata::log::end_status();
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 1;
  }
}
