// The dense group's part of a checkpoint (optim_states): the fp32 master weights and optimizer
// state of each rank's partition of the flat layout, one file per rank at stages 1-2 (shared
// otherwise), with the partition's place in the flat layout (shard_pieces.h), so that another
// world size or sharding re-partitions them; the plain fp32 stage-0 path stores its
// per-parameter state instead. With NVMe offload the master and moments stream between the swap
// files and the checkpoint in tiles, and a partition of another world size is read from the saved
// pieces it overlaps (checkpoint/saved_partitions.h).
#include <cstring>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "runtime/checkpoint/layout.h"
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

void put_state(const optim::ParamState& state, const std::string& prefix, NamedTensors& out,
               json& scalars) {
  scalars[prefix + "type"] = state.type;
  for (const auto& item : state.scalars.items()) scalars[prefix + item.key()] = item.value();
  for (const auto& [name, t] : state.tensors) out.emplace_back(prefix + name, t.detach());
}

// LibTorch's optimizer archive travels as a uint8 tensor (JSON strings must be UTF-8).
torch::Tensor bytes_tensor(const std::string& bytes) {
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string tensor_bytes(const torch::Tensor& t) {
  const auto c = t.contiguous().cpu();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

optim::ParamState get_state(const checkpoint::TensorFile& file, const std::string& prefix) {
  optim::ParamState state;
  state.type = file.scalars.at(prefix + "type").get<std::string>();
  const std::string step = prefix + "step";
  if (file.scalars.contains(step)) state.scalars["step"] = file.scalars.at(step);
  for (const auto& [name, t] : file.tensors)
    if (name.rfind(prefix, 0) == 0 && name.find('.', prefix.size()) == std::string::npos)
      state.tensors.emplace_back(name.substr(prefix.size()), t);
  return state;
}

// The trainable tensors in the engine's order, each under its first name (model_check.h): the
// names and sizes a resume checks, and the further names of tied weights (strata-ckpt gives them
// the same weights).
// The per-parameter layout (`flat` false) records the names only, as before.
// MoE experts (`skip`) are kept apart (runtime/engine_experts.cpp).
std::vector<NamedTensor> trainables(torch::nn::Module& module, const Names& skip) {
  std::vector<NamedTensor> out;
  for (auto& p : unique_parameters(module, true))
    if (!skip.count(p.name)) out.push_back(std::move(p));
  return out;
}

void put_trainables(torch::nn::Module& module, const Names& skip, json& scalars, bool flat) {
  json names = json::array(), numels = json::array(), aliases = json::object();
  for (const auto& p : trainables(module, skip)) {
    names.push_back(p.name);
    numels.push_back(p.tensor.numel());
    for (const auto& alias : p.aliases) aliases[alias] = p.name;
  }
  scalars[flat ? "flat_params" : "param_names"] = names;
  if (!flat) return;
  scalars["flat_param_numels"] = numels;
  scalars["flat_param_aliases"] = aliases;
}

// The checkpoint's trainable tensors must be this model's, in the same order and sizes:
// optimizer state is stored by position (flat ranges or indices).
void check_same_trainables(const json& scalars, const std::string& key, torch::nn::Module& module,
                           const Names& skip, const std::string& folder) {
  if (!scalars.contains(key)) return;  // saved before the names were kept
  const auto saved = scalars.at(key).get<std::vector<std::string>>();
  const auto mine = trainables(module, skip);
  std::vector<int64_t> numels;
  if (scalars.contains("flat_param_numels"))
    numels = scalars.at("flat_param_numels").get<std::vector<int64_t>>();
  const size_t n = std::max(saved.size(), mine.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string s = i < saved.size() ? "'" + saved[i] + "'" : "nothing";
    const std::string m = i < mine.size() ? "'" + mine[i].name + "'" : "nothing";
    const bool size_differs = i < numels.size() && i < mine.size() &&
                              numels[i] != mine[i].tensor.numel();
    if (i >= saved.size() || i >= mine.size() || saved[i] != mine[i].name || size_differs)
      throw Error(fmt::format(
          "{}: the checkpoint's trainable parameters are not this model's: trainable #{} is {}{} "
          "in the checkpoint and {}{} here ({} saved, {} here). Resume with the same model and "
          "the same frozen parameters",
          folder, i, s, i < numels.size() ? fmt::format(" ({} elements)", numels[i]) : "", m,
          i < mine.size() ? fmt::format(" ({} elements)", mine[i].tensor.numel()) : "",
          saved.size(), mine.size()));
  }
}


// Where the checkpoint's flat layout comes from: stages 0-2 save the FlatParams layout; stage 3
// saves its shards as pieces of the same gap-free layout (trainable parameters in module order),
// so a checkpoint reads back at any stage and world size, and strata-ckpt consolidates it alike.
struct FlatLayout {
  int64_t numel = 0;
  zero::ShardMap shards;
  int64_t part = 0;
};

// MoE experts (`skip`) are not in it: they have their own layout (runtime/engine_experts.cpp).
FlatLayout flat_layout(torch::nn::Module& module, const zero::PartitionedOptimizer& partitioned,
                       const Names& skip) {
  const auto* units = partitioned.units();
  if (!units) return {partitioned.flat().numel(), partitioned.shards(), partitioned.partition_index()};
  std::unordered_map<const c10::TensorImpl*, int64_t> offset;
  int64_t numel = 0;
  for (const auto& p : unique_parameters(module, true)) {
    if (skip.count(p.name)) continue;
    offset[p.tensor.unsafeGetTensorImpl()] = numel;
    numel += p.tensor.numel();
  }
  std::vector<int64_t> offsets;
  for (const auto& p : units->trainable_params()) offsets.push_back(offset.at(p.unsafeGetTensorImpl()));
  return {numel, units->shards_over(offsets), partitioned.partition_index()};
}

// ZenFlow's window and selection (PartitionedOptimizer::zenflow_checkpoint), after the master
// and moments were installed. A checkpoint without them starts ZenFlow afresh (its warm-up, then
// a selection); one with them resumed without ZenFlow drops the window's summed gradients of the
// unselected columns (the master and moments are complete): said, not silent.
void install_zenflow(zero::PartitionedOptimizer& partitioned,
                     const checkpoint::SavedPartitions& saved, const PartitionSource& source,
                     const std::string& folder) {
  const json& scalars = saved.scalars();
  const bool has = scalars.contains("zenflow.steps");
  if (!has && partitioned.zenflow()) {
    partitioned.restore_zenflow({});  // afresh: warm-up, then a selection
    return;
  }
  const int64_t pending = scalars.value("zenflow.pending_steps", int64_t(0));
  if (!has || !partitioned.zenflow()) {
    if (has && scalars.at("zenflow.window").get<int64_t>() > 0)
      log::info("[strata] warning: {} was saved in ZenFlow mode with {} step(s) of the unselected "
                "columns' gradients summed but not yet applied; resumed without "
                "zero_optimization.zenflow, they are dropped",
                folder, scalars.at("zenflow.window").get<int64_t>());
    if (has && pending > 0)
      log::info("[strata] warning: {} was saved with an overlapped ZenFlow update of {} step(s) "
                "in the master weights but not yet in the model's; resumed without "
                "zero_optimization.zenflow, the next step's weights include it",
                folder, pending);
    return;
  }
  const int64_t n = partitioned.master().numel();
  zero::PartitionedOptimizer::ZenFlowCheckpoint z;
  z.steps = scalars.at("zenflow.steps").get<int64_t>();
  z.window = scalars.at("zenflow.window").get<int64_t>();
  z.columns = scalars.at("zenflow.columns").get<int64_t>();
  z.pending_steps = pending;
  z.sum = torch::empty({n}, torch::kFloat);
  z.selected = torch::empty({n}, torch::kFloat);
  source("zenflow.sum", 0, n, z.sum.data_ptr<float>());
  source("zenflow.selected", 0, n, z.selected.data_ptr<float>());
  partitioned.restore_zenflow(z);
}

}  // namespace

void Engine::save_dense_states(checkpoint::CheckpointWriter& writer) {
  const int rank = data_parallel_rank();
  NamedTensors optim;
  json scalars = json::object();
  const bool partitioned_files = dense().partitioned() && dense().partitioned()->shards().parts() > 1;
  if (dense().partitioned()) {
    const auto layout = flat_layout(*module_, *dense().partitioned(), expert_names());
    scalars["layout"] = "flat";
    scalars["flat_numel"] = layout.numel;
    // Which parameter each range of the flat layout is (strata-ckpt consolidates by it).
    put_trainables(*module_, expert_names(), scalars, /*flat=*/true);
    // Where this partition's elements sit in the flat layout (zero/shard_map.h).
    scalars["shard_pieces"] = pieces_json(layout.shards.pieces(layout.part));
    // The master and its state, streamed from wherever they live (NVMe: tile by tile). The
    // state's scalars join `scalars` while the file is written, before its footer.
    auto write = [&](checkpoint::TensorFileWriter& out) {
      if (const auto zf = dense().partitioned()->zenflow_checkpoint()) {
        // ZenFlow: the window's sum and the selection, partition-shaped like the master.
        out.add("zenflow.sum", zf->sum);
        out.add("zenflow.selected", zf->selected);
        scalars["zenflow.steps"] = zf->steps;
        scalars["zenflow.window"] = zf->window;
        scalars["zenflow.columns"] = zf->columns;
        scalars["zenflow.pending_steps"] = zf->pending_steps;
      }
      if (write_master_state(*dense().partitioned(), *dense().optimizer(), out, scalars)) return;
      scalars["archive"] = true;
      out.add("archive", bytes_tensor(optim::save_optimizer_archive(*dense().optimizer())));
    };
    if (partitioned_files)
      writer.stream_partition("optim_states", write, scalars);
    else if (rank == 0)
      writer.stream_shared("optim_states", write, scalars);
  } else {
    scalars["layout"] = "per_param";
    put_trainables(*module_, expert_names(), scalars, /*flat=*/false);
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto state = optim::export_param_state(*dense().optimizer(), params_[i]);
      if (!state) {
        optim = {{"archive", bytes_tensor(optim::save_optimizer_archive(*dense().optimizer()))}};
        scalars = {{"layout", "archive"}, {"archive", true}};
        break;
      }
      put_state(*state, fmt::format("state.{}.", i), optim, scalars);
    }
  }
  if (!dense().partitioned() && rank == 0) writer.write_shared("optim_states", optim, scalars);
}

GroupInstall Engine::read_dense_states(const checkpoint::CheckpointReader& reader, int64_t) {
  const bool partitioned_files = reader.has_partition("optim_states");
  const int saved_parts = partitioned_files ? reader.world_size() : 1;
  // What the optimizer gets: the master partition with its state read from the saved partitions
  // by range, an archive, or per-parameter states.
  std::unique_ptr<checkpoint::SavedPartitions> saved;
  std::optional<optim::ParamState> master_state;
  std::optional<std::string> archive;
  std::vector<optim::ParamState> param_states;
  zero::ShardMap shards;
  int64_t part = 0;
  if (dense().partitioned()) {
    const auto layout = flat_layout(*module_, *dense().partitioned(), expert_names());
    shards = layout.shards;
    part = layout.part;
    // Footers only, but for rank 0's file, whose scalars are checked here: the checksums of
    // the other files this rank reads are checked below, before anything is installed (with
    // another world size each rank reads a few of them, not all).
    std::vector<std::unique_ptr<checkpoint::TensorFileReader>> files;
    for (int p = 0; p < saved_parts; ++p)
      files.push_back(partitioned_files ? reader.open_partition("optim_states", p, p == 0)
                                        : reader.open_shared("optim_states", nullptr, true));
    const json& first = files.front()->scalars();
    if (first.at("layout") != "flat")
      throw Error(fmt::format("{}: saved by the plain fp32 stage-0 path; resume it with the same "
                              "precision and ZeRO stage", reader.folder()));
    check_same_trainables(first, "flat_params", *module_, expert_names(), reader.folder());
    if (first.at("flat_numel").get<int64_t>() != layout.numel)
      throw Error(fmt::format("{}: {} trainable elements saved, this model has {}",
                              reader.folder(), first.at("flat_numel").get<int64_t>(),
                              layout.numel));
    saved = std::make_unique<checkpoint::SavedPartitions>(std::move(files));
    saved->verify_for(shards, part);
    if (saved->scalars().contains("archive")) {
      // LibTorch's archive holds one partition as it was cut: only the same cut can use it.
      if (!saved->same_as_saved(shards, part))
        throw Error(fmt::format("{}: this optimizer's state cannot be re-partitioned from {} "
                                "rank(s) to {} or another sharding (only Strata's Adam and SGD "
                                "state can)",
                                reader.folder(), saved_parts, shards.parts()));
      saved->file(static_cast<int>(part)).verify();
      archive = tensor_bytes(saved->file(static_cast<int>(part)).at("archive"));
    } else {
      std::vector<std::string> names;
      for (const auto& spec : saved->file(0).info().tensors) names.push_back(spec.name);
      master_state = saved_state_header(saved->scalars(), names, dense().partitioned()->master());
      optim::check_param_state(*dense().optimizer(), dense().partitioned()->master(), *master_state);
    }
  } else {
    const auto file = partitioned_files ? reader.load_partition("optim_states", 0)
                                        : reader.load_shared("optim_states");
    const auto layout = file.scalars.at("layout").get<std::string>();
    if (layout == "flat")
      throw Error(fmt::format("{}: saved with mixed precision or ZeRO; resume it with the same "
                              "precision and a ZeRO stage of 1 or 2 (or the same stage 0 "
                              "precision)", reader.folder()));
    if (layout == "archive") {
      archive = tensor_bytes(file.at("archive"));
    } else {
      check_same_trainables(file.scalars, "param_names", *module_, expert_names(), reader.folder());
      for (size_t i = 0; i < params_.size(); ++i) {
        const auto prefix = fmt::format("state.{}.", i);
        if (!file.scalars.contains(prefix + "type"))
          throw Error(fmt::format("{}: no optimizer state for trainable parameter #{}: the "
                                  "checkpoint has fewer trainable parameters than this model",
                                  reader.folder(), i));
        param_states.push_back(get_state(file, prefix));
        optim::check_param_state(*dense().optimizer(), params_[i], param_states.back());
      }
      if (file.scalars.contains(fmt::format("state.{}.type", params_.size())))
        throw Error(fmt::format("{}: the checkpoint has more trainable parameters than this "
                                "model's {}", reader.folder(), params_.size()));
    }
  }

  GroupInstall out;
  if (archive)
    out.first = [this, bytes = std::move(*archive)] {
      optim::load_optimizer_archive(*dense().optimizer(), bytes);
    };
  out.install = [this, saved = std::shared_ptr<checkpoint::SavedPartitions>(std::move(saved)),
                 master_state, param_states, shards, part, reader_folder = reader.folder()] {
    if (dense().partitioned()) {
      auto source = [&](const std::string& name, int64_t offset, int64_t n, float* dst) {
        saved->read(name, shards, part, offset, n, dst);
      };
      if (master_state) {
        install_master_state(*dense().partitioned(), *dense().optimizer(), source, *master_state);
        install_zenflow(*dense().partitioned(), *saved, source, reader_folder);
      } else {  // the archive holds the state; the master is ours to read
        auto master = torch::empty({dense().partitioned()->master().numel()}, torch::kFloat);
        source("master", 0, master.numel(), master.data_ptr<float>());
        dense().partitioned()->master().copy_(master.view(dense().partitioned()->master().sizes()));
      }
    }
    for (size_t i = 0; i < param_states.size(); ++i)
      optim::import_param_state(*dense().optimizer(), params_[i], param_states[i]);
  };
  return out;
}
}  // namespace strata
