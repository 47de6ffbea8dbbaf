#include "runtime/checkpoint/shard_pieces.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::checkpoint {

json pieces_json(const std::vector<zero::ShardPiece>& pieces) {
  json out = json::array();
  for (const auto& p : pieces) out.push_back({p.flat_begin, p.length, p.offset});
  return out;
}

std::vector<zero::ShardPiece> pieces_from_json(const json& list, const std::string& key,
                                               const std::string& path) {
  if (!list.is_array())
    throw Error(fmt::format("{}: {} is {}, expected a list of [flat_begin, length, offset]", path,
                            key, list.type_name()));
  std::vector<zero::ShardPiece> pieces;
  for (const auto& p : list) {
    if (!p.is_array() || p.size() != 3)
      throw Error(fmt::format("{}: {} holds {}, expected [flat_begin, length, offset]", path, key,
                              p.dump()));
    const std::string where = path + ": " + key;
    pieces.push_back({json_int(p[0], where), json_int(p[1], where), json_int(p[2], where)});
  }
  return pieces;
}

void check_pieces(const std::vector<std::vector<zero::ShardPiece>>& per_rank,
                  const std::vector<int64_t>& partition_numel, int64_t flat_numel, bool past_end,
                  const std::vector<std::string>& paths) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  struct Placed {
    zero::ShardPiece piece;
    size_t rank;
  };
  std::vector<Placed> flat;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    std::vector<zero::ShardPiece> in_partition;
    for (const auto& p : per_rank[r]) {
      const int64_t n = partition_numel[r];
      if (p.flat_begin < 0 || p.length < 0 || p.offset < 0 || p.length > n ||
          p.offset > n - p.length || p.flat_begin > kMax - p.length ||
          (!past_end && p.flat_begin + p.length > flat_numel))
        throw Error(fmt::format("{}: piece [flat {}, length {}, offset {}] does not fit its "
                                "partition of {} elements{}",
                                paths[r], p.flat_begin, p.length, p.offset, n,
                                past_end ? "" : fmt::format(" in {} elements", flat_numel)));
      if (p.length == 0) continue;
      flat.push_back({p, r});
      in_partition.push_back(p);
    }
    std::sort(in_partition.begin(), in_partition.end(),
              [](const auto& a, const auto& b) { return a.offset < b.offset; });
    for (size_t i = 1; i < in_partition.size(); ++i)
      if (in_partition[i].offset < in_partition[i - 1].offset + in_partition[i - 1].length)
        throw Error(fmt::format("{}: two pieces share partition element {}", paths[r],
                                in_partition[i].offset));
  }
  std::sort(flat.begin(), flat.end(), [](const Placed& a, const Placed& b) {
    return a.piece.flat_begin < b.piece.flat_begin;
  });
  int64_t covered = 0;  // [0, covered) is covered exactly once
  for (const auto& [p, r] : flat) {
    if (p.flat_begin < covered)
      throw Error(fmt::format("{}: piece [flat {}, length {}] overlaps another partition's",
                              paths[r], p.flat_begin, p.length));
    if (p.flat_begin > covered && covered < flat_numel) break;  // a gap: reported below
    covered = p.flat_begin + p.length;
  }
  if (covered < flat_numel)
    throw Error(fmt::format("{}: the saved partitions cover flat elements [0, {}) of {}, not all",
                            paths.empty() ? std::string("checkpoint") : paths[0], covered,
                            flat_numel));
}

namespace {

// The shape of tensor `name` in `file`'s footer.
const std::vector<int64_t>& shape_in(const TensorFileInfo& file, const std::string& name) {
  for (const auto& t : file.tensors)
    if (t.name == name) return t.shape;
  throw Error(fmt::format("checkpoint file '{}': tensor '{}' is missing", file.path, name));
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;  // bounded when the footer was parsed (tensor_bytes)
  return n;
}

}  // namespace

TensorFileInfo info_of(const TensorFile& file) {
  TensorFileInfo info;
  info.path = file.path;
  info.crc32c = file.crc32c;
  info.tensors = specs_of(file.tensors);
  info.scalars = file.scalars;
  return info;
}

std::vector<zero::ShardPiece> saved_pieces(const TensorFile& file, int rank) {
  return saved_pieces(info_of(file), rank);
}

zero::ShardMap saved_shard_map(const std::vector<TensorFile>& files) {
  std::vector<TensorFileInfo> infos;
  for (const auto& f : files) infos.push_back(info_of(f));
  return saved_shard_map(infos);
}

std::vector<zero::ShardPiece> saved_pieces(const TensorFileInfo& file, int rank) {
  const int64_t n = numel_of(shape_in(file, "master"));
  std::vector<zero::ShardPiece> pieces;
  if (!file.scalars.contains("shard_pieces")) {
    if (n > 0 && rank > std::numeric_limits<int64_t>::max() / n - 1)
      throw Error(fmt::format("{}: rank {} of {} elements overflows", file.path, rank, n));
    pieces = {{rank * n, n, 0}};
  } else {
    pieces = pieces_from_json(file.scalars.at("shard_pieces"), "shard_pieces", file.path);
  }
  check_pieces({pieces}, {n}, 0, /*past_end=*/true, {file.path});
  return pieces;
}

zero::ShardMap saved_shard_map(const std::vector<TensorFileInfo>& files) {
  if (files.empty()) throw Error("checkpoint: no optim_states partitions to re-partition");
  const int64_t n = numel_of(shape_in(files[0], "master"));
  std::vector<std::vector<zero::ShardPiece>> per_rank;
  std::vector<std::string> paths;
  int64_t flat_numel = 0;
  for (size_t r = 0; r < files.size(); ++r) {
    const auto& f = files[r];
    const auto& shape = shape_in(f, "master");
    if (shape.size() != 1)
      throw Error(fmt::format("{}: its master partition has shape {}, not a flat list", f.path,
                              shape_text(shape)));
    if (shape[0] != n)
      throw Error(fmt::format("{}: its master partition has {} elements, rank 0's {}", f.path,
                              shape[0], n));
    const json numel = f.scalars.value("flat_numel", json());
    const int64_t mine = numel.is_null() ? 0 : json_int(numel, f.path + ": flat_numel");
    if (r == 0) flat_numel = mine;
    if (mine != flat_numel || mine < 0)
      throw Error(fmt::format("{}: flat_numel {} differs from rank 0's {}", f.path, mine,
                              flat_numel));
    per_rank.push_back(saved_pieces(f, static_cast<int>(r)));
    paths.push_back(f.path);
  }
  check_pieces(per_rank, std::vector<int64_t>(files.size(), n), flat_numel, /*past_end=*/true,
               paths);
  return zero::ShardMap::from_pieces(std::move(per_rank), n);
}

}  // namespace strata::checkpoint
