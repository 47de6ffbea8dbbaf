#include "runtime/checkpoint/saved_experts.h"

#include <limits>

#include <fmt/format.h>

#include "runtime/checkpoint/shard_pieces.h"
#include "runtime/error.h"

namespace strata::checkpoint {

namespace {

// The layout's layers, checked: names, shapes without overflow, at least one expert of at least
// one element each, and in all exactly `numel` elements (so parameters() cuts inside it).
void check_layout(const json& layout, int64_t numel, const std::string& path) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (!layout.is_array()) throw Error(fmt::format("{}: expert_layout is not a list", path));
  int64_t total = 0;
  for (const auto& layer : layout) {
    layer.at("layer").get<std::string>();
    const int64_t experts = json_int(layer.at("experts"), path + ": experts of a layer");
    int64_t expert_numel = 0;
    for (const auto& p : layer.at("params")) {
      p.at("name").get<std::string>();
      p.at("stacked").get<bool>();
      const std::string where = fmt::format("{}: expert parameter {}", path, p.dump());
      const uint64_t n = tensor_bytes(json_ints(p.at("shape"), where), torch::kByte, where);
      if (int64_t(n) > kMax - expert_numel)
        throw Error(fmt::format("{}: an expert of layer {} is too large", path, layer.dump()));
      expert_numel += int64_t(n);
    }
    if (experts < 1 || expert_numel < 1 || experts > (kMax - total) / expert_numel)
      throw Error(fmt::format("{}: layer {} of expert_layout holds {} experts of {} elements",
                              path, layer.at("layer").dump(), experts, expert_numel));
    total += experts * expert_numel;
  }
  if (total != numel)
    throw Error(fmt::format("{}: expert_layout describes {} elements but expert_numel is {}", path,
                            total, numel));
}

}  // namespace

SavedExperts::SavedExperts(const CheckpointReader& reader) : folder_(reader.folder()) {
  std::vector<std::vector<zero::ShardPiece>> pieces;
  std::vector<int64_t> partition_numel;
  std::vector<std::string> paths;
  int full = -1;  // the first rank that saved the experts
  for (int r = 0; r < reader.world_size(); ++r) {
    files_.push_back(reader.open_partition("expert_states", r));
    const auto& f = *files_.back();
    const json& scalars = f.scalars();
    try {
      if (!scalars.contains("expert_layout") || !scalars.contains("expert_pieces") ||
          !scalars.contains("expert_numel"))
        throw Error(fmt::format("{}: expert_states of rank {} lacks its layout or pieces",
                                f.path(), r));
      if (r == 0) {
        layout_ = scalars.at("expert_layout");
        numel_ = json_int(scalars.at("expert_numel"), f.path() + ": expert_numel");
        check_layout(layout_, numel_, f.path());
      } else if (scalars.at("expert_layout") != layout_ || scalars.at("expert_numel") != numel_) {
        throw Error(fmt::format("{}: the ranks' expert_states describe different experts",
                                f.path()));
      }
    } catch (const json::exception& e) {
      throw Error(fmt::format("{}: malformed expert_layout ({})", f.path(), e.what()));
    }
    pieces.push_back(pieces_from_json(scalars.at("expert_pieces"), "expert_pieces", f.path()));
    // A rank that saved no experts (a later rank of an unpartitioned group) holds no elements.
    const bool saved = scalars.contains("state.type");
    partition_numel.push_back(saved ? f.numel("master") : 0);
    paths.push_back(f.path());
    if (saved && full < 0) full = r;
    if (!saved) continue;
    // Every tensor is the partition's length, as the first saving rank's master.
    for (const auto& spec : f.info().tensors)
      if (spec.shape.size() != 1 || spec.shape[0] != partition_numel[full])
        throw Error(fmt::format("{}: '{}' has shape {}, not the partition's [{}] ({}'s master)",
                                f.path(), spec.name, shape_text(spec.shape),
                                partition_numel[full], paths[full]));
  }
  if (full < 0) throw Error(fmt::format("{}: no rank saved the MoE experts", folder_));
  full_ = files_[full].get();
  // Every expert element once: no piece outside its partition or past the experts, no overlap.
  check_pieces(pieces, partition_numel, numel_, /*past_end=*/false, paths);
  std::vector<const TensorFileReader*> files;
  for (const auto& f : files_) files.push_back(f.get());
  pieces_ = std::make_unique<PieceReader>(std::move(files), pieces, numel_);
}

std::vector<std::string> SavedExperts::state_tensors() const {
  std::vector<std::string> names;
  for (const auto& spec : full_->info().tensors)
    if (spec.name.rfind("state.", 0) == 0) names.push_back(spec.name);
  return names;
}

torch::Tensor SavedExperts::assemble(const std::string& name) const {
  auto global = torch::empty({numel_}, torch::TensorOptions().dtype(dtype(name)));
  read(name, {{0, numel_, 0}}, 0, numel_, global.data_ptr());
  return global;
}

std::vector<std::pair<std::string, torch::Tensor>> SavedExperts::parameters(
    const torch::Tensor& global) const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  int64_t base = 0;
  for (const auto& layer : layout_) {
    const auto prefix = layer.at("layer").get<std::string>();
    const int64_t experts = layer.at("experts").get<int64_t>();
    std::vector<int64_t> numels, offsets;
    int64_t expert_numel = 0;
    for (const auto& p : layer.at("params")) {
      int64_t n = 1;
      for (const auto& d : p.at("shape")) n *= d.get<int64_t>();
      offsets.push_back(expert_numel);
      numels.push_back(n);
      expert_numel += n;
    }
    const auto& params = layer.at("params");
    for (size_t j = 0; j < params.size(); ++j) {
      const auto name = params[j].at("name").get<std::string>();
      const auto shape = params[j].at("shape").get<std::vector<int64_t>>();
      std::vector<torch::Tensor> per_expert;
      for (int64_t g = 0; g < experts; ++g)
        per_expert.push_back(
            global.narrow(0, base + g * expert_numel + offsets[j], numels[j]).view(shape));
      if (params[j].at("stacked").get<bool>()) {
        out.emplace_back(prefix + "." + name, torch::stack(per_expert));
      } else {
        for (int64_t g = 0; g < experts; ++g)
          out.emplace_back(fmt::format("{}.{}.{}", prefix, g, name), per_expert[g].clone());
      }
    }
    base += experts * expert_numel;
  }
  return out;
}

}  // namespace strata::checkpoint
