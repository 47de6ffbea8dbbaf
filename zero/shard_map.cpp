#include "zero/shard_map.h"

#include <algorithm>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::zero {

ShardMap ShardMap::contiguous(int64_t padded_numel, int64_t parts) {
  if (parts < 1 || padded_numel % parts != 0)
    throw Error(fmt::format("ShardMap: {} elements do not split into {} equal partitions",
                            padded_numel, parts));
  ShardMap map;
  map.partition_numel_ = padded_numel / parts;
  map.contiguous_ = true;
  for (int64_t r = 0; r < parts; ++r)
    map.pieces_.push_back({{r * map.partition_numel_, map.partition_numel_, 0}});
  return map;
}

ShardMap ShardMap::bucketed(const std::vector<std::pair<int64_t, int64_t>>& ranges,
                            int64_t parts, int64_t alignment) {
  if (parts < 1 || alignment < 1) throw Error("ShardMap: parts and alignment must be >= 1");
  ShardMap map;
  map.pieces_.resize(parts);
  int64_t base = 0;
  for (const auto& [lo, hi] : ranges) {
    if (hi < lo) throw Error(fmt::format("ShardMap: bucket range [{}, {}) is reversed", lo, hi));
    int64_t chunk = (hi - lo + parts - 1) / parts;
    chunk = (chunk + alignment - 1) / alignment * alignment;
    map.buckets_.push_back({lo, hi, chunk, base});
    for (int64_t r = 0; r < parts; ++r) {
      const int64_t begin = std::min(lo + r * chunk, hi), end = std::min(lo + (r + 1) * chunk, hi);
      if (end > begin) map.pieces_[r].push_back({begin, end - begin, base});
    }
    base += chunk;
  }
  map.partition_numel_ = base;
  map.contiguous_ = parts == 1 && ranges.size() == 1 && ranges[0].first == 0;
  return map;
}

ShardMap ShardMap::from_pieces(std::vector<std::vector<ShardPiece>> per_rank,
                               int64_t partition_numel) {
  ShardMap map;
  for (const auto& pieces : per_rank)
    for (const auto& p : pieces)
      if (p.length < 0 || p.offset < 0 || p.flat_begin < 0 || p.offset + p.length > partition_numel)
        throw Error(fmt::format("ShardMap: piece (flat {}, length {}, offset {}) does not fit a "
                                "partition of {} elements",
                                p.flat_begin, p.length, p.offset, partition_numel));
  map.pieces_ = std::move(per_rank);
  map.partition_numel_ = partition_numel;
  map.contiguous_ = true;
  for (int64_t r = 0; r < map.parts(); ++r) {
    const auto& p = map.pieces_[r];
    map.contiguous_ = map.contiguous_ && p.size() == 1 && p[0].offset == 0 &&
                      p[0].length == partition_numel && p[0].flat_begin == r * partition_numel;
  }
  return map;
}

torch::Tensor ShardMap::range(const torch::Tensor& flat, int64_t rank) const {
  if (!contiguous_)
    throw Error("ShardMap::range: this map's partitions are not ranges of the flat layout");
  return flat.narrow(0, rank * partition_numel_, partition_numel_);
}

torch::Tensor ShardMap::gather(const torch::Tensor& flat, int64_t rank) const {
  auto part = torch::zeros({partition_numel_}, flat.options());
  for (const auto& p : pieces(rank)) {
    if (p.flat_begin >= flat.numel()) continue;  // padding past the flat layout stays zero
    const int64_t n = std::min(p.length, flat.numel() - p.flat_begin);
    part.narrow(0, p.offset, n).copy_(flat.narrow(0, p.flat_begin, n));
  }
  return part;
}

void ShardMap::scatter(const torch::Tensor& part, int64_t rank, const torch::Tensor& flat) const {
  for (const auto& p : pieces(rank)) {
    if (p.flat_begin >= flat.numel()) continue;  // padding past the flat layout
    const int64_t n = std::min(p.length, flat.numel() - p.flat_begin);
    flat.narrow(0, p.flat_begin, n).copy_(part.narrow(0, p.offset, n));
  }
}

void ShardMap::scatter_bucket(const torch::Tensor& gathered, size_t bucket,
                              const torch::Tensor& flat) const {
  const auto& b = buckets_.at(bucket);
  for (int64_t r = 0; r < parts(); ++r) {
    const int64_t begin = b.lo + r * b.chunk;
    if (begin >= b.hi) break;  // this rank's chunk and the rest are padding
    const int64_t n = std::min(b.chunk, b.hi - begin);
    flat.narrow(0, begin, n).copy_(gathered.narrow(0, r * b.chunk, n));
  }
}

torch::Tensor ShardMap::assemble(const std::vector<torch::Tensor>& partitions,
                                 int64_t flat_numel) const {
  if (static_cast<int64_t>(partitions.size()) != parts())
    throw Error(fmt::format("ShardMap: {} partitions given for a map of {}", partitions.size(),
                            parts()));
  auto flat = torch::zeros({flat_numel}, partitions.at(0).options());
  for (int64_t r = 0; r < parts(); ++r) scatter(partitions[r], r, flat);
  return flat;
}

}  // namespace strata::zero
