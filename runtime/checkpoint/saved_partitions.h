// A checkpoint's partitions of the flat parameter layout (each rank's optim_states: the fp32
// master and the optimizer state, with the pieces shard_pieces.h describes), read by range: one
// rank's partition under another ShardMap (another world size, stage or bucket size) is cut out
// of the saved files piece by piece, a window at a time, never through the whole flat layout.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "runtime/checkpoint/tensor_stream.h"
#include "zero/shard_map.h"

namespace strata::checkpoint {

// Windows of a partition, given as its pieces of a layout, read from saved partitions that hold
// other pieces of the same layout: files[r] holds saved[r] (each saved element once).
class PieceReader {
 public:
  PieceReader(std::vector<const TensorFileReader*> files,
              const std::vector<std::vector<zero::ShardPiece>>& saved, int64_t layout_numel);
  // Elements [begin, begin + n) of the partition whose pieces are `target`, of saved tensor
  // `name`, into `dst` (n elements of the saved dtype); what no piece covers reads as zero.
  void read(const std::string& name, const std::vector<zero::ShardPiece>& target, int64_t begin,
            int64_t n, void* dst) const;

 private:
  struct Placed {
    zero::ShardPiece piece;
    size_t rank;
  };
  std::vector<const TensorFileReader*> files_;
  int64_t numel_ = 0;
  std::vector<Placed> by_flat_;  // every saved piece, by flat_begin
};

class SavedPartitions {
 public:
  // files[r]: saved rank r's partition file (or the one shared file), opened and verified. Checks
  // their pieces (saved_shard_map).
  explicit SavedPartitions(std::vector<std::unique_ptr<TensorFileReader>> files);

  int parts() const { return static_cast<int>(files_.size()); }
  const TensorFileReader& file(int rank) const { return *files_.at(size_t(rank)); }
  const json& scalars() const { return files_.front()->scalars(); }  // rank 0's
  const zero::ShardMap& saved() const { return saved_; }
  int64_t flat_numel() const { return flat_numel_; }
  // Whether partition `part` of `target` is exactly what saved rank `part` holds (the same world
  // size and cut): then a tensor no other map can re-cut (LibTorch's archive) still applies.
  bool same_as_saved(const zero::ShardMap& target, int64_t part) const;

  // Elements [begin, begin + n) of partition `part` of `target`, of saved tensor `name` ("master",
  // "state.exp_avg", ...), into `dst` (n elements of the saved dtype); padding reads as zero.
  void read(const std::string& name, const zero::ShardMap& target, int64_t part, int64_t begin,
            int64_t n, void* dst) const {
    pieces_.read(name, target.pieces(part), begin, n, dst);
  }
  // Checks the checksums of the saved files that partition `part` of `target` reads (opened
  // without: the other ranks' files need not be read).
  void verify_for(const zero::ShardMap& target, int64_t part) const;

 private:
  std::vector<std::unique_ptr<TensorFileReader>> files_;
  zero::ShardMap saved_;
  int64_t flat_numel_ = 0;
  PieceReader pieces_;
};

}  // namespace strata::checkpoint
