#include "runtime/checkpoint/saved_experts.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::checkpoint {

SavedExperts::SavedExperts(const CheckpointReader& reader) : folder_(reader.folder()) {
  std::vector<std::vector<zero::ShardPiece>> pieces;
  for (int r = 0; r < reader.world_size(); ++r) {
    files_.push_back(reader.load_partition("expert_states", r));
    const auto& f = files_.back();
    if (!f.scalars.contains("expert_layout") || !f.scalars.contains("expert_pieces") ||
        !f.scalars.contains("expert_numel"))
      throw Error(fmt::format("{}: expert_states of rank {} lacks its layout or pieces", folder_, r));
    if (r == 0) {
      layout_ = f.scalars.at("expert_layout");
      numel_ = f.scalars.at("expert_numel").get<int64_t>();
    } else if (f.scalars.at("expert_layout") != layout_) {
      throw Error(fmt::format("{}: the ranks' expert_states describe different experts", folder_));
    }
    pieces.push_back({});
    for (const auto& p : f.scalars.at("expert_pieces")) {
      if (!p.is_array() || p.size() != 3)
        throw Error(fmt::format("{}: expert_pieces holds {}, expected [begin, length, offset]",
                                f.path, p.dump()));
      pieces.back().push_back({p[0].get<int64_t>(), p[1].get<int64_t>(), p[2].get<int64_t>()});
    }
  }
  // Rank 0 always writes (its expert-data-parallel group's first rank).
  for (const auto& f : files_)
    if (f.scalars.contains("state.type")) full_ = &f;
  if (!full_) throw Error(fmt::format("{}: no rank saved the MoE experts", folder_));
  int64_t covered = 0;
  for (const auto& ps : pieces)
    for (const auto& p : ps) {
      if (p.flat_begin < 0 || p.length < 0 || p.flat_begin + p.length > numel_)
        throw Error(fmt::format("{}: an expert piece [{}, +{}) lies outside the {} expert elements",
                                folder_, p.flat_begin, p.length, numel_));
      covered += p.length;
    }
  if (covered != numel_)
    throw Error(fmt::format("{}: the saved expert partitions cover {} elements of {}", folder_,
                            covered, numel_));
  map_ = zero::ShardMap::from_pieces(std::move(pieces), full_->at("master").numel());
}

std::vector<std::string> SavedExperts::state_tensors() const {
  std::vector<std::string> names;
  for (const auto& [name, t] : full_->tensors)
    if (name.rfind("state.", 0) == 0) names.push_back(name);
  return names;
}

torch::Tensor SavedExperts::assemble(const std::string& name) const {
  std::vector<torch::Tensor> parts;
  for (const auto& f : files_)
    parts.push_back(f.scalars.contains("state.type")
                        ? f.at(name)
                        : torch::empty({0}, full_->at(name).options()));
  return map_.assemble(parts, numel_);
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
