// Which elements of the flat parameter layout (flat_params.h) each rank's partition holds, and
// where in the partition they sit. Every rank's partition has the same length, padding included,
// so partition-sized tensors (fp32 master, optimizer state, gradient accumulator) line up for
// collectives.
//   - contiguous(): rank r holds [r*P, (r+1)*P) (ZeRO-1: reduced gradients arrive whole, so any
//     split will do, and the all-gather writes the flat layout in place).
//   - bucketed(): every gradient bucket [lo, hi) is cut into `parts` chunks of c elements
//     (c = ceil((hi - lo) / parts), aligned) and rank r holds chunk r of every bucket, one after
//     another (FSDP's sharding, per bucket). A bucket's reduction is then one reduce-scatter whose
//     output is exactly this rank's piece (ZeRO-2): half the bytes of an all-reduce.
// Checkpoints record each rank's pieces, so a partition saved under one map can be put back into
// the flat layout and re-cut under another (another world size, another bucket size).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace strata::zero {

struct ShardPiece {
  int64_t flat_begin = 0;  // the flat elements [flat_begin, flat_begin + length) ...
  int64_t length = 0;
  int64_t offset = 0;  // ... are partition elements [offset, offset + length)
  bool operator==(const ShardPiece& o) const {
    return flat_begin == o.flat_begin && length == o.length && offset == o.offset;
  }
};

class ShardMap {
 public:
  // One bucket of a bucketed map: flat range [lo, hi), chunk elements per rank, and where this
  // bucket's chunk starts in every rank's partition.
  struct Bucket {
    int64_t lo = 0, hi = 0, chunk = 0, base = 0;
  };

  static ShardMap contiguous(int64_t padded_numel, int64_t parts);
  // `ranges`: disjoint flat ranges [lo, hi), in the order their chunks are laid out.
  static ShardMap bucketed(const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t parts,
                           int64_t alignment = 64);
  // As recorded by a checkpoint: each rank's pieces and the common partition length.
  static ShardMap from_pieces(std::vector<std::vector<ShardPiece>> per_rank,
                              int64_t partition_numel);

  int64_t parts() const { return static_cast<int64_t>(pieces_.size()); }
  int64_t partition_numel() const { return partition_numel_; }
  const std::vector<ShardPiece>& pieces(int64_t rank) const { return pieces_.at(rank); }
  const std::vector<Bucket>& buckets() const { return buckets_; }  // empty unless bucketed()
  // Rank r's partition is the flat range [r*P, (r+1)*P) (partition and flat layout coincide).
  bool is_contiguous() const { return contiguous_; }

  // Rank `rank`'s partition of `flat` as a view of it (contiguous maps only).
  torch::Tensor range(const torch::Tensor& flat, int64_t rank) const;
  // Rank `rank`'s partition of a tensor in the flat layout (a copy; padding, and pieces past the
  // end of `flat`, are zero).
  torch::Tensor gather(const torch::Tensor& flat, int64_t rank) const;
  // Writes partition tensor `part` of rank `rank` into its places in `flat` (what lies past the
  // end of `flat` is padding and dropped).
  void scatter(const torch::Tensor& part, int64_t rank, const torch::Tensor& flat) const;
  // Writes bucket `bucket`'s chunks of every rank, as an all-gather of them returns them (rank
  // after rank, parts() x chunk elements), into their places in `flat` (bucketed maps).
  void scatter_bucket(const torch::Tensor& gathered, size_t bucket, const torch::Tensor& flat) const;
  // The flat layout (flat_numel elements) from every rank's partition.
  torch::Tensor assemble(const std::vector<torch::Tensor>& partitions, int64_t flat_numel) const;

 private:
  std::vector<std::vector<ShardPiece>> pieces_;
  std::vector<Bucket> buckets_;
  int64_t partition_numel_ = 0;
  bool contiguous_ = false;
};

}  // namespace strata::zero
