// zero::ShardMap: which flat elements each rank's partition holds (contiguous for ZeRO-1, every
// bucket sharded across the ranks for ZeRO-2), and the round trip flat -> partitions -> flat.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/error.h"
#include "zero/shard_map.h"

namespace {

using strata::zero::ShardMap;
using strata::zero::ShardPiece;

TEST(ShardMap, ContiguousGivesEachRankOneRange) {
  const auto map = ShardMap::contiguous(12, 3);
  EXPECT_TRUE(map.is_contiguous());
  EXPECT_EQ(map.partition_numel(), 4);
  EXPECT_EQ(map.pieces(2), (std::vector<ShardPiece>{{8, 4, 0}}));
  EXPECT_TRUE(map.buckets().empty());
  const auto flat = torch::arange(12);
  auto view = map.range(flat, 1);
  EXPECT_TRUE(torch::equal(view, torch::arange(4, 8)));
  EXPECT_EQ(view.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + 4);  // a view, not a copy
  EXPECT_THROW(ShardMap::contiguous(10, 3), strata::Error);
  EXPECT_THROW(ShardMap::bucketed({{0, 8}}, 2, 4).range(flat, 0), strata::Error);
}

TEST(ShardMap, BucketedCutsEveryBucketIntoOneChunkPerRank) {
  // Buckets in backward order: [60, 100) first, then [0, 60); chunks aligned to 4 elements.
  const auto map = ShardMap::bucketed({{60, 100}, {0, 60}}, 3, 4);
  ASSERT_EQ(map.buckets().size(), 2u);
  EXPECT_EQ(map.buckets()[0].chunk, 16);  // ceil(40 / 3) = 14 -> 16
  EXPECT_EQ(map.buckets()[1].chunk, 20);
  EXPECT_EQ(map.buckets()[1].base, 16);
  EXPECT_EQ(map.partition_numel(), 36);
  EXPECT_FALSE(map.is_contiguous());
  // Rank 2: the last 8 of the first bucket (then padding), the last 20 of the second.
  EXPECT_EQ(map.pieces(2), (std::vector<ShardPiece>{{92, 8, 0}, {40, 20, 16}}));
  EXPECT_EQ(map.pieces(0), (std::vector<ShardPiece>{{60, 16, 0}, {0, 20, 16}}));
}

TEST(ShardMap, GatherScatterAndAssembleRoundTrip) {
  const auto map = ShardMap::bucketed({{70, 103}, {30, 70}, {0, 30}}, 4, 8);
  const auto flat = torch::arange(103, torch::kFloat) + 1;
  std::vector<torch::Tensor> parts;
  int64_t covered = 0;
  for (int64_t r = 0; r < map.parts(); ++r) {
    parts.push_back(map.gather(flat, r));
    EXPECT_EQ(parts.back().numel(), map.partition_numel());
    covered += parts.back().count_nonzero().item<int64_t>();  // padding is zero
  }
  EXPECT_EQ(covered, 103);  // every element in exactly one partition
  EXPECT_TRUE(torch::equal(map.assemble(parts, 103), flat));
  // Re-cut under another map (another world size and buckets): the same flat values.
  const auto other = ShardMap::contiguous(104, 2);
  std::vector<torch::Tensor> again;
  const auto assembled = map.assemble(parts, 103);
  for (int64_t r = 0; r < 2; ++r) again.push_back(other.gather(assembled, r));
  EXPECT_TRUE(torch::equal(other.assemble(again, 103), flat));
}

TEST(ShardMap, ScatterBucketPlacesAnAllGatheredBucket) {
  const auto map = ShardMap::bucketed({{40, 70}, {0, 40}}, 3, 4);
  const auto flat = torch::arange(70, torch::kFloat);
  auto rebuilt = torch::zeros({70});
  for (size_t b = 0; b < map.buckets().size(); ++b) {
    const auto& bucket = map.buckets()[b];
    std::vector<torch::Tensor> chunks;  // what an all-gather of each rank's chunk returns
    for (int64_t r = 0; r < 3; ++r)
      chunks.push_back(map.gather(flat, r).narrow(0, bucket.base, bucket.chunk));
    map.scatter_bucket(torch::cat(chunks), b, rebuilt);
  }
  EXPECT_TRUE(torch::equal(rebuilt, flat));
}

TEST(ShardMap, FromPiecesChecksThatPiecesFit) {
  const auto map = ShardMap::from_pieces({{{0, 4, 0}}, {{4, 4, 0}}}, 4);
  EXPECT_TRUE(map.is_contiguous());
  EXPECT_THROW(ShardMap::from_pieces({{{0, 5, 0}}}, 4), strata::Error);
}

}  // namespace
