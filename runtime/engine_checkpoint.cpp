// Engine::save_checkpoint / load_checkpoint: what the engine's state is, in which file.
//   model_states (rank 0): the module's parameters and buffers as trained (16-bit under mixed
//     precision), the step counters, loss scaler, LR schedule and the program's client state;
//   each parameter group's master weights and optimizer state (ParamGroup::state_files): the
//     dense group's optim_states (runtime/engine_dense_states.cpp), the MoE experts'
//     expert_states (runtime/engine_experts.cpp);
//   each rank's random generators.
// At stage 3 nothing here is whole in host memory: the model is written and installed one unit
// at a time. Every file a rank reads is checksummed before anything is installed.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "moe/expert_params.h"
#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/rng_state.h"
#include "runtime/checkpoint/saved_partitions.h"
#include "runtime/checkpoint/shard_pieces.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/master_state.h"
#include "runtime/model_check.h"
#include "runtime/optim/state_io.h"

namespace strata {
namespace {

using checkpoint::NamedTensors;
using checkpoint::pieces_json;

using Names = std::unordered_set<std::string>;

// The module's parameters and buffers but the MoE experts (`skip`), saved per expert apart.
NamedTensors model_tensors(torch::nn::Module& module, const Names& skip) {
  NamedTensors out;
  for (const auto& p : module.named_parameters())
    if (!skip.count(p.key())) out.emplace_back("param." + p.key(), p.value());
  for (const auto& b : module.named_buffers()) out.emplace_back("buffer." + b.key(), b.value());
  return out;
}

// Every submodule's path, in module order (the module archive needs its parameter-free ones).
std::vector<std::string> submodule_paths(torch::nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& m : module.named_modules("", /*include_self=*/false)) out.push_back(m.key());
  return out;
}

// The saved model's tensors by name, with their dtypes; empty when the checkpoint has no
// model_states (load_shared names what is missing).
using SavedDtypes = std::unordered_map<std::string, torch::ScalarType>;
SavedDtypes saved_model_dtypes(const checkpoint::CheckpointReader& reader) {
  const auto* entry = reader.manifest().find("model_states", -1);
  SavedDtypes saved;
  if (!entry) return saved;
  for (const auto& s : checkpoint::read_tensor_file_info(reader.path_of(*entry)).tensors)
    saved.emplace(s.name, s.dtype);
  return saved;
}

// Strata cast every buffer to the 16-bit dtype (LibTorch's Module::to) until issue 28, so bf16/fp16
// checkpoints hold bool and integer buffers (BatchNorm's num_batches_tracked) as 16-bit floats.
// Such a buffer is accepted as saved (its `expected` spec is changed) and returned by name, to be
// converted back to the model's dtype once loaded.
std::vector<std::pair<std::string, torch::ScalarType>> accept_cast_buffers(
    const checkpoint::CheckpointReader& reader, const SavedDtypes& saved,
    std::vector<checkpoint::TensorSpec>& expected) {
  std::vector<std::pair<std::string, torch::ScalarType>> cast;
  for (auto& spec : expected) {
    const auto it = saved.find(spec.name);
    if (spec.name.rfind("buffer.", 0) != 0 || it == saved.end() || c10::isFloatingType(spec.dtype) ||
        (it->second != torch::kBFloat16 && it->second != torch::kHalf))
      continue;
    cast.emplace_back(spec.name, spec.dtype);
    log::info("[strata] checkpoint {}: {} was saved as {} (written before Strata kept integer and "
              "bool buffers in their own dtype); restored as {}",
              reader.folder(), spec.name, c10::toString(it->second), c10::toString(spec.dtype));
    spec.dtype = it->second;
  }
  return cast;
}

// The MoE routers' balancing biases became buffers (moe::kExpertBiasBuffer) after checkpoints
// that kept them only in expert_states' scalars (read there, engine_experts.cpp): such a bias,
// absent from the saved model, is left out of what is read (its spec and its target), and named.
Names accept_absent_float32_buffers(const checkpoint::CheckpointReader& reader,
                                    const SavedDtypes& saved,
                                    std::vector<checkpoint::TensorSpec>& expected,
                                    NamedTensors& targets) {
  if (saved.empty()) return {};  // no model_states: load_shared names what is missing
  Names absent;
  for (const auto& spec : expected)
    if (spec.name.rfind("buffer.", 0) == 0 && moe::is_float32_buffer_name(spec.name) &&
        !saved.count(spec.name))
      absent.insert(spec.name);
  if (absent.empty()) return absent;
  expected.erase(std::remove_if(expected.begin(), expected.end(),
                                [&](const checkpoint::TensorSpec& s) { return absent.count(s.name) > 0; }),
                 expected.end());
  targets.erase(std::remove_if(targets.begin(), targets.end(),
                               [&](const auto& t) { return absent.count(t.first) > 0; }),
                targets.end());
  log::info("[strata] checkpoint {}: {} MoE expert bias buffer(s) not in the saved model (saved "
            "before they were buffers); restored from the experts' scalars",
            reader.folder(), absent.size());
  return absent;
}

// The saved model as install_stage3_weights reads it: each tensor from the file when it is
// asked for (a unit's parameters at a time), integer buffers saved as 16-bit converted back.
struct StreamedModel {
  const checkpoint::TensorFileReader& file;
  const std::vector<std::pair<std::string, torch::ScalarType>>& cast;
  const Names& absent;  // accept_absent_float32_buffers

  bool has(const std::string& name) const { return !absent.count(name); }

  torch::Tensor at(const std::string& name) const {
    auto t = file.at(name);
    for (const auto& [buffer, dtype] : cast)
      if (name == buffer) t = t.to(dtype);
    return t;
  }
};

}  // namespace

std::unordered_set<std::string> Engine::expert_names() const {
  std::unordered_set<std::string> names;
  for (const auto& e : experts_) names.insert(e.name);
  return names;
}

std::vector<std::pair<std::string, torch::Tensor>> Engine::stage3_host_copies(bool keep,
                                                                              bool with_experts) {
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> copies;
  auto copy = [&](const zero::ParamUnits& units, zero::ParamCoordinator& coordinator) {
    for (size_t u = 0; u < units.size(); ++u) {
      coordinator.pin({u});
      if (keep)
        for (const auto& p : units.unit(u).params)
          copies[p.unsafeGetTensorImpl()] = p.detach().to(torch::kCPU, /*non_blocking=*/false,
                                                          /*copy=*/true);
      coordinator.unpin();
      coordinator.release_all();
    }
  };
  copy(*dense().units(), *dense().coordinator());
  if (with_experts && expert_group() && expert_group()->units())
    copy(*expert_group()->units(), *expert_group()->coordinator());
  NamedTensors out;
  if (!keep) return out;
  const auto skip = with_experts ? Names{} : expert_names();
  for (const auto& p : module_->named_parameters()) {
    if (skip.count(p.key())) continue;
    // Not in a unit (a parameter that is not floating point): whole on every rank.
    const auto it = copies.find(p.value().unsafeGetTensorImpl());
    out.emplace_back("param." + p.key(), it != copies.end() ? it->second : p.value().detach().cpu());
  }
  for (const auto& b : module_->named_buffers()) out.emplace_back("buffer." + b.key(), b.value());
  return out;
}

template <class TensorFile>
void Engine::install_stage3_weights(const TensorFile& states) {
  for (size_t u = 0; u < dense().units()->size(); ++u) {
    std::vector<torch::Tensor> values;
    for (const auto& name : dense().units()->unit(u).names) values.push_back(states.at("param." + name));
    dense().units()->assign(u, values);
  }
  for (const auto& p : module_->named_parameters())
    if (dense().units()->unit_of(p.value().storage().unsafeGetStorageImpl()) < 0 && !is_expert(p.value()))
      p.value().copy_(states.at("param." + p.key()));  // kept whole (not floating point)
  for (const auto& b : module_->named_buffers())
    if (states.has("buffer." + b.key())) b.value().copy_(states.at("buffer." + b.key()));
}

void Engine::stream_stage3_model(checkpoint::TensorFileWriter* out) {
  // Every name of each parameter (tied weights have several), experts left out.
  const auto skip = expert_names();
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names_of;
  for (const auto& p : module_->named_parameters())
    if (!skip.count(p.key())) names_of[p.value().unsafeGetTensorImpl()].push_back(p.key());
  std::unordered_set<const c10::TensorImpl*> in_units;
  for (size_t u = 0; u < dense().units()->size(); ++u) {
    dense().coordinator()->pin({u});
    for (const auto& p : dense().units()->unit(u).params) {
      in_units.insert(p.unsafeGetTensorImpl());
      if (!out) continue;
      const auto it = names_of.find(p.unsafeGetTensorImpl());
      if (it != names_of.end())
        for (const auto& name : it->second) out->add("param." + name, p);
    }
    dense().coordinator()->unpin();
    dense().coordinator()->release_all();
  }
  if (!out) return;
  for (const auto& p : module_->named_parameters())  // not in a unit (not floating point): whole
    if (!skip.count(p.key()) && !in_units.count(p.value().unsafeGetTensorImpl()))
      out->add("param." + p.key(), p.value());
  for (const auto& b : module_->named_buffers()) out->add("buffer." + b.key(), b.value());
}

void Engine::save_16bit_model(const std::string& dir, const std::string& file) {
  torch::NoGradGuard no_grad;
  settle_step();
  if (dense().coordinator() && !config_.zero_optimization.stage3_gather_16bit_weights_on_model_save)
    throw Error(fmt::format(
        "{}: save_16bit_model at ZeRO stage 3 gathers every weight to rank 0; set "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save to true, or save a "
        "checkpoint (save_checkpoint) and consolidate it with `strata-ckpt consolidate`",
        config_.source));
  if (expert_groups_.expert_parallel && expert_groups_.expert_parallel->size() > 1)
    throw Error(fmt::format(
        "{}: save_16bit_model writes rank 0's module, and with moe.ep_size {} rank 0 holds only "
        "some of the experts; save a checkpoint (save_checkpoint), which keeps every expert",
        config_.source, expert_groups_.expert_parallel->size()));
  const bool writer = data_parallel_rank() == 0;
  if (file.size() >= 12 && file.compare(file.size() - 12, 12, ".safetensors") == 0) {
    if (file != checkpoint::kHfWeightsFile)
      throw Error(fmt::format("save_16bit_model({}, {}): a .safetensors save is a Hugging Face "
                              "folder, whose weights are named {} (or shards of it with an "
                              "index); pass that name",
                              dir, file, checkpoint::kHfWeightsFile));
    stream_16bit_safetensors(dir, writer);
    if (group_) group_->barrier();
    log::info("[strata] saved the 16-bit model to {} (safetensors)", dir);
    return;
  }
  NamedTensors params, buffers;
  const auto whole =
      dense().coordinator() ? stage3_host_copies(writer, /*with_experts=*/true) : model_tensors(*module_, {});
  for (const auto& [key, t] : whole) {
    const bool param = key.rfind("param.", 0) == 0;
    (param ? params : buffers).emplace_back(key.substr(key.find('.') + 1), t.detach().cpu());
  }
  if (writer) {
    std::filesystem::create_directories(dir);
    checkpoint::save_module_archive(dir + "/" + file, params, buffers, submodule_paths(*module_));
  }
  if (group_) group_->barrier();  // the file exists before any rank goes on
  log::info("[strata] saved the 16-bit model to {}/{}", dir, file);
}


void Engine::stream_16bit_safetensors(const std::string& dir, bool writer) {
  // Each tensor once, under its first name (a tied weight is saved once, as save_pretrained
  // does), then the buffers; every rank walks the same plan (stage 3 gathers collectively).
  std::vector<checkpoint::TensorSpec> specs;
  std::unordered_map<std::string, torch::Tensor> tensors;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module_->named_parameters())
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) {
      specs.push_back({p.key(), p.value().scalar_type(), p.value().sizes().vec()});
      tensors.emplace(p.key(), p.value());
    }
  for (const auto& b : module_->named_buffers()) {
    specs.push_back({b.key(), b.value().scalar_type(), b.value().sizes().vec()});
    tensors.emplace(b.key(), b.value());
  }
  std::unique_ptr<checkpoint::HfFolderWriter> out;
  if (writer) out = std::make_unique<checkpoint::HfFolderWriter>(dir, specs, checkpoint::kHfDefaultShardBytes);
  // Stage 3: the unit holding the next tensor is gathered (the last one released first), so one
  // unit at a time is whole.
  struct Pinned {
    zero::ParamUnits* units;
    zero::ParamCoordinator* coordinator;
    int64_t unit = -1;
  };
  std::vector<Pinned> holders;
  for (const auto& g : groups_)
    if (g->units()) holders.push_back({g->units(), g->coordinator()});
  auto unpin = [](Pinned& h) {
    if (h.unit < 0) return;
    h.coordinator->unpin();
    h.coordinator->release_all();
    h.unit = -1;
  };
  for (const auto& shard : checkpoint::hf_shard_plan(specs, checkpoint::kHfDefaultShardBytes))
    for (const auto& spec : shard) {
      const auto& t = tensors.at(spec.name);
      for (auto& h : holders) {
        const auto u = t.has_storage() ? h.units->unit_of(t.storage().unsafeGetStorageImpl()) : -1;
        if (u < 0 || u == h.unit) continue;
        for (auto& other : holders) unpin(other);
        h.coordinator->pin({size_t(u)});
        h.unit = u;
      }
      if (out) out->write(t.detach());
    }
  for (auto& h : holders) unpin(h);
  if (out) out->commit();
}

void Engine::save_checkpoint(const std::string& dir, std::string tag, const json& client_state) {
  torch::NoGradGuard no_grad;
  settle_step();
  if (tag.empty()) tag = fmt::format("global_step{}", global_steps_);
  // Inside an accumulation window the partial gradient lives only in this process: a resume
  // would step on part of a window (at another world size, on a window of another length).
  if (micro_steps_ % gradient_accumulation_steps() != 0)
    throw Error(fmt::format(
        "save_checkpoint({}, {}): called inside a gradient accumulation window (micro-step {} "
        "of {}: the window's partial gradients are not saved, so a resume would step on part "
        "of a window); save after the engine->step() that ends a window "
        "(is_gradient_accumulation_boundary() true before it)",
        dir, tag, micro_steps_ % gradient_accumulation_steps(), gradient_accumulation_steps()));
  const int rank = data_parallel_rank(), world = data_parallel_size();
  checkpoint::CheckpointWriter writer(dir, tag, rank, world);

  // The position is global steps and samples (DeepSpeed's); micro-steps follow from them and
  // this run's accumulation, which another world size changes.
  json engine_state = {{"global_steps", global_steps_},
                       {"micro_steps", micro_steps_},
                       {"gradient_accumulation_steps", gradient_accumulation_steps()},
                       {"global_samples", global_samples()},
                       {"skipped_steps", skipped_steps_},
                       {"loss_scaler", scaler_.state()},
                       {"client_state", client_state},
                       {checkpoint::kSubmodulesKey, submodule_paths(*module_)}};
  if (lr_scheduler_) engine_state["lr_scheduler"] = lr_scheduler_->state_dict();
  if (dense().coordinator()) {
    // Stage 3: the units gathered one at a time, each written into rank 0's file as it comes;
    // the footer lists the tensors in the module's order, as the other stages write them.
    std::vector<std::string> order;
    for (const auto& [name, t] : model_tensors(*module_, expert_names())) order.push_back(name);
    if (rank == 0)
      writer.stream_shared(
          "model_states",
          [&](checkpoint::TensorFileWriter& out) { stream_stage3_model(&out); }, engine_state,
          order);
    else
      stream_stage3_model(nullptr);
  } else if (rank == 0) {
    writer.write_shared("model_states", model_tensors(*module_, expert_names()), engine_state);
  }

  for (const auto& g : groups_) g->state_files().save(writer);
  // Each rank's random generators (dropout's draws), so that a resume is exact for them too.
  writer.write_partition(checkpoint::kRngStatesKind, checkpoint::capture_rng_states());

  if (group_) group_->barrier();  // every rank's files are written
  if (rank == 0) {
    checkpoint::RunInfo info;
    info.zero_stage = static_cast<int>(config_.zero_optimization.stage);
    info.compute_dtype = checkpoint::dtype_name(params_.front().scalar_type());
    info.extra = {{"global_steps", global_steps_}};
    writer.commit(info);
  }
  if (group_) group_->barrier();  // `latest` names the new checkpoint before anyone goes on
  log::info("[strata] saved checkpoint {}/{}", dir, tag);
}

json Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  torch::NoGradGuard no_grad;
  settle_step();
  // Everything is read and checked first; the engine changes only once all of it has passed, so
  // a checkpoint that does not fit leaves the model, master weights and optimizer as they were.
  checkpoint::CheckpointReader reader(dir, tag, {/*verify_checksums=*/false});
  auto model = model_tensors(*module_, expert_names());
  auto specs = checkpoint::specs_of(model);
  const auto saved = saved_model_dtypes(reader);
  const auto cast_buffers = accept_cast_buffers(reader, saved, specs);
  const auto absent = accept_absent_float32_buffers(reader, saved, specs, model);
  // Stage 3 reads the model a unit at a time from the verified file; the other stages, whose
  // model is whole in memory anyway, load it whole.
  std::optional<checkpoint::TensorFile> states;
  std::unique_ptr<checkpoint::TensorFileReader> streamed;
  if (dense().units()) {
    streamed = reader.open_shared("model_states", &specs);
  } else {
    states = reader.load_shared("model_states", specs);
    for (auto& [name, t] : states->tensors)
      for (const auto& [cast, dtype] : cast_buffers)
        if (name == cast) t = t.to(dtype);
  }
  const json& engine_state = streamed ? streamed->scalars() : states->scalars;
  const auto global_steps = engine_state.at("global_steps").get<int64_t>();
  const auto saved_micro_steps = engine_state.at("micro_steps").get<int64_t>();
  // Checkpoints before the accumulation was recorded: a boundary is micro = global x gas.
  const int64_t saved_gas =
      engine_state.contains("gradient_accumulation_steps")
          ? engine_state.at("gradient_accumulation_steps").get<int64_t>()
          : (global_steps > 0 && saved_micro_steps % global_steps == 0
                 ? saved_micro_steps / global_steps
                 : (global_steps == 0 && saved_micro_steps == 0 ? 1 : 0));
  if (saved_gas <= 0 || saved_micro_steps != global_steps * saved_gas)
    throw Error(fmt::format(
        "{}: saved inside a gradient accumulation window (micro-step {} after {} optimizer "
        "steps): its partial gradients are not in the checkpoint, so no resume continues that "
        "window exactly; resume from a checkpoint saved after an optimizer step",
        reader.folder(), saved_micro_steps, global_steps));
  // This run's accumulation, whatever the saved run's was (another world size changes it).
  const int64_t micro_steps = global_steps * gradient_accumulation_steps();
  const auto skipped_steps = engine_state.at("skipped_steps").get<int64_t>();
  LossScaler scaler = scaler_;
  scaler.load_state(engine_state.at("loss_scaler"));
  const json client_state = engine_state.at("client_state");
  const bool has_schedule = lr_scheduler_ && engine_state.contains("lr_scheduler");
  if (has_schedule) engine_state.at("lr_scheduler").at("last_batch_iteration").get<int64_t>();

  // Each group's master weights and optimizer state, read and checked.
  if (!expert_group() && reader.has_partition("expert_states"))
    throw Error(fmt::format("{}: the checkpoint holds MoE experts and this model has no MoE "
                            "layer", reader.folder()));
  std::vector<GroupInstall> installs;
  for (const auto& g : groups_) installs.push_back(g->state_files().read(reader, saved_micro_steps));
  // This rank's generator states: absent from checkpoints saved before they were kept, and for
  // a rank the saving world did not have.
  std::optional<checkpoint::TensorFile> rng;
  const bool has_rng = reader.has_partition(checkpoint::kRngStatesKind);
  if (has_rng && data_parallel_rank() < reader.world_size())
    rng = reader.load_partition(checkpoint::kRngStatesKind, data_parallel_rank());

  // Everything fits: install it. LibTorch's own archive goes first, one of the two steps that can
  // still fail (it is checked only by loading it).
  for (const auto& i : installs)
    if (i.first) i.first();
  // Then the generators, which LibTorch checks as it sets them (a state of another version).
  if (rng) {
    const auto missing = checkpoint::restore_rng_states(*rng);
    if (!missing.empty())
      log::info("[strata] checkpoint {}: random generators restored but for {}", reader.folder(),
                missing);
  } else {
    log::info("[strata] checkpoint {}: the random generators were not restored ({}); dropout and "
              "other random draws continue from this process's state",
              reader.folder(),
              has_rng ? fmt::format("saved by {} rank(s), this is rank {}", reader.world_size(),
                                    data_parallel_rank())
                      : std::string("saved before checkpoints kept them"));
  }
  if (dense().units())
    install_stage3_weights(StreamedModel{*streamed, cast_buffers, absent});
  else
    states->copy_to(model);
  for (const auto& i : installs)
    if (i.install) i.install();
  // offload_optimizer.ratio: the device share takes its state from the host master and moments
  // the checkpoint wrote.
  for (const auto& g : groups_)
    if (auto* p = g->partitioned()) p->load_device_share();
  global_steps_ = global_steps;
  micro_steps_ = micro_steps;
  skipped_steps_ = skipped_steps;
  scaler_ = scaler;
  if (has_schedule) lr_scheduler_->load_state_dict(engine_state.at("lr_scheduler"));
  follow_lr_schedule();  // the experts' optimizer steps at the schedule's lr too, not its own
  log::info("[strata] loaded checkpoint {} (step {}, saved by {} rank(s))", reader.folder(),
            global_steps_, reader.world_size());
  return client_state;
}

}  // namespace strata
