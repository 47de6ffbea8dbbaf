#include "runtime/checkpoint/saved_partitions.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "runtime/checkpoint/shard_pieces.h"
#include "runtime/error.h"

namespace strata::checkpoint {
namespace {

// The footers' scalars of files not yet verified may be damaged: what they lack or misstate is
// a strata::Error naming the file, never a JSON exception.
zero::ShardMap map_of(const std::vector<std::unique_ptr<TensorFileReader>>& files) {
  std::vector<TensorFileInfo> infos;
  for (const auto& f : files) infos.push_back(f->info());
  try {
    return saved_shard_map(infos);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{} (or another rank's partition beside it): shard_pieces or "
                            "flat_numel do not parse ({})",
                            files.front()->path(), e.what()));
  }
}

int64_t flat_numel_of(const TensorFileReader& file) {
  const json& scalars = file.scalars();
  if (!scalars.contains("flat_numel"))
    throw Error(fmt::format("{}: no flat_numel: not a flat-layout partition", file.path()));
  return json_int(scalars.at("flat_numel"), file.path() + ": flat_numel");
}

}  // namespace

namespace {

std::vector<const TensorFileReader*> pointers(
    const std::vector<std::unique_ptr<TensorFileReader>>& files) {
  std::vector<const TensorFileReader*> out;
  for (const auto& f : files) out.push_back(f.get());
  return out;
}

std::vector<std::vector<zero::ShardPiece>> pieces_of(const zero::ShardMap& map) {
  std::vector<std::vector<zero::ShardPiece>> out;
  for (int64_t r = 0; r < map.parts(); ++r) out.push_back(map.pieces(r));
  return out;
}

}  // namespace

// --- PieceReader -------------------------------------------------------------------------------

PieceReader::PieceReader(std::vector<const TensorFileReader*> files,
                         const std::vector<std::vector<zero::ShardPiece>>& saved,
                         int64_t layout_numel)
    : files_(std::move(files)), numel_(layout_numel) {
  for (size_t r = 0; r < saved.size(); ++r)
    for (const auto& p : saved[r])
      if (p.length > 0) by_flat_.push_back({p, r});
  std::sort(by_flat_.begin(), by_flat_.end(), [](const Placed& a, const Placed& b) {
    return a.piece.flat_begin < b.piece.flat_begin;
  });
}

void PieceReader::read(const std::string& name, const std::vector<zero::ShardPiece>& target,
                       int64_t begin, int64_t n, void* dst) const {
  // The dtype of every saved file that holds `name` (a rank that saved nothing holds none).
  const TensorSpec* spec = nullptr;
  for (const auto* f : files_) {
    if (!f->has(name)) continue;
    if (spec && f->spec(name).dtype != spec->dtype)
      throw Error(fmt::format("{}: tensor '{}' is {}, another rank's is {}", f->path(), name,
                              dtype_name(f->spec(name).dtype), dtype_name(spec->dtype)));
    if (!spec) spec = &f->spec(name);
  }
  if (!spec)
    throw Error(fmt::format("{}: no saved partition holds tensor '{}'",
                            files_.empty() ? std::string("checkpoint") : files_[0]->path(), name));
  const size_t element = c10::elementSize(spec->dtype);
  auto* out = static_cast<char*>(dst);
  std::memset(out, 0, size_t(n) * element);  // padding, and pieces past the layout
  const int64_t end = begin + n;
  for (const auto& p : target) {
    // The window's part of this piece, in partition elements, then in the layout.
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.length);
    if (lo >= hi) continue;
    const int64_t flat_lo = p.flat_begin + (lo - p.offset);
    const int64_t flat_hi = std::min(flat_lo + (hi - lo), numel_);
    // The saved pieces that overlap [flat_lo, flat_hi) (sorted, none overlapping another).
    auto it = std::upper_bound(by_flat_.begin(), by_flat_.end(), flat_lo,
                               [](int64_t v, const Placed& s) { return v < s.piece.flat_begin; });
    if (it != by_flat_.begin()) --it;
    for (; it != by_flat_.end() && it->piece.flat_begin < flat_hi; ++it) {
      const auto& s = it->piece;
      const int64_t x = std::max(flat_lo, s.flat_begin);
      const int64_t y = std::min(flat_hi, s.flat_begin + s.length);
      if (x >= y) continue;
      files_[it->rank]->read(name, s.offset + (x - s.flat_begin), y - x,
                             out + size_t(lo - begin + (x - flat_lo)) * element);
    }
  }
}

// --- SavedPartitions ---------------------------------------------------------------------------

SavedPartitions::SavedPartitions(std::vector<std::unique_ptr<TensorFileReader>> files)
    : files_(std::move(files)),
      saved_(map_of(files_)),
      flat_numel_(flat_numel_of(*files_.front())),
      pieces_(pointers(files_), pieces_of(saved_), flat_numel_) {}

bool SavedPartitions::same_as_saved(const zero::ShardMap& target, int64_t part) const {
  return target.parts() == saved_.parts() &&
         target.partition_numel() == saved_.partition_numel() &&
         target.pieces(part) == saved_.pieces(part);
}

void SavedPartitions::verify_for(const zero::ShardMap& target, int64_t part) const {
  for (int r = 0; r < parts(); ++r) {
    bool overlaps = same_as_saved(target, part) && r == part;
    for (const auto& want : target.pieces(part))
      for (const auto& have : saved_.pieces(r))
        overlaps = overlaps || (want.length > 0 && have.length > 0 &&
                                want.flat_begin < have.flat_begin + have.length &&
                                have.flat_begin < want.flat_begin + want.length);
    if (overlaps) files_[size_t(r)]->verify();
  }
}

}  // namespace strata::checkpoint
