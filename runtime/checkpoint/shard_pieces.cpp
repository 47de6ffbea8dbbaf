#include "runtime/checkpoint/shard_pieces.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::checkpoint {

json pieces_json(const std::vector<zero::ShardPiece>& pieces) {
  json out = json::array();
  for (const auto& p : pieces) out.push_back({p.flat_begin, p.length, p.offset});
  return out;
}

std::vector<zero::ShardPiece> saved_pieces(const TensorFile& file, int rank) {
  const int64_t n = file.at("master").numel();
  if (!file.scalars.contains("shard_pieces")) return {{rank * n, n, 0}};
  std::vector<zero::ShardPiece> pieces;
  for (const auto& p : file.scalars.at("shard_pieces")) {
    if (!p.is_array() || p.size() != 3)
      throw Error(fmt::format("{}: shard_pieces holds {}, expected [flat_begin, length, offset]",
                              file.path, p.dump()));
    pieces.push_back({p[0].get<int64_t>(), p[1].get<int64_t>(), p[2].get<int64_t>()});
  }
  return pieces;
}

zero::ShardMap saved_shard_map(const std::vector<TensorFile>& files) {
  std::vector<std::vector<zero::ShardPiece>> per_rank;
  for (size_t r = 0; r < files.size(); ++r)
    per_rank.push_back(saved_pieces(files[r], static_cast<int>(r)));
  return zero::ShardMap::from_pieces(std::move(per_rank), files.at(0).at("master").numel());
}

}  // namespace strata::checkpoint
