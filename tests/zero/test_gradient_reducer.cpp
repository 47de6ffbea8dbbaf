// zero::GradientReducer in one process, partition mode (ZeRO-2's path): the partition's gradient
// accumulator receives exactly autograd's gradients, laid out as the bucketed ShardMap says, and
// a backward holds only the buckets in flight, not a second copy of every gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "zero/flat_params.h"
#include "zero/gradient_reducer.h"
#include "zero/shard_map.h"

namespace {

using strata::zero::FlatParams;
using strata::zero::GradientReducer;
using strata::zero::ShardMap;

// One process's partition-mode reducer over `flat` with `plan`'s buckets: the options it was made
// with (their partition_grad is its accumulator, their shards its layout) and the reducer.
struct PartitionReducer {
  GradientReducer::Options options;
  std::shared_ptr<GradientReducer> reducer;
};

PartitionReducer partition_reducer(const FlatParams& flat,
                                   const std::vector<std::vector<size_t>>& plan,
                                   torch::ScalarType comm_dtype) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& bucket : plan) ranges.push_back(flat.range_of(bucket));
  PartitionReducer r;
  auto& o = r.options;
  o.mode = GradientReducer::Mode::kPartition;
  o.plan = plan;
  o.comm_dtype = comm_dtype;
  for (size_t k = 0; k < flat.params().size(); ++k) o.flat_offsets.push_back(flat.offset(k));
  o.shards = ShardMap::bucketed(ranges, 1);
  o.partition_grad = torch::zeros({o.shards.partition_numel()});
  r.reducer = GradientReducer::create(flat.params(), nullptr, o);
  return r;
}

TEST(GradientReducer, PartitionModeAccumulatesAutogradsGradientsWithFewBucketsAlive) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  const int layers = 8, width = 16;
  for (int i = 0; i < layers; ++i)
    net->push_back(torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(false)));
  const auto x = torch::randn({4, width});

  // Autograd's own gradients first (the reference), then the same backward through the reducer.
  net->forward(x).pow(2).sum().backward();
  std::vector<torch::Tensor> expected;
  for (auto& p : net->parameters()) {
    expected.push_back(p.grad().clone());
    p.mutable_grad() = torch::Tensor();
  }

  FlatParams flat(net->parameters(), 1);
  const auto plan = GradientReducer::plan(flat.params(), width * width);  // one layer per bucket
  ASSERT_EQ(plan.size(), size_t(layers));
  // In one process a gradient goes straight into the accumulator (no bucket at all), unless the
  // communication dtype would round it (then through buckets, as with a group: float64 here,
  // exact, to watch the buckets' lifetime).
  for (const auto comm_dtype : {torch::kFloat, torch::kDouble}) {
    SCOPED_TRACE(c10::toString(comm_dtype));
    auto made = partition_reducer(flat, plan, comm_dtype);
    const auto& o = made.options;
    const auto& reducer = made.reducer;
    const auto& shards = o.shards;

    for (int micro = 0; micro < 2; ++micro) {  // two micro-steps accumulate
      reducer->begin_backward(micro == 1);
      net->forward(x).pow(2).sum().backward();
      reducer->finish();
      EXPECT_EQ(reducer->live_bucket_numel(), 0) << "a bucket outlived its backward";
    }
    if (comm_dtype == torch::kFloat) {
      EXPECT_EQ(reducer->peak_bucket_numel(), 0);
    } else {
      // At most the undelivered launched buckets plus the one filling: not all eight.
      EXPECT_LE(reducer->peak_bucket_numel(), 3 * width * width);
      EXPECT_GE(reducer->peak_bucket_numel(), width * width);
    }

    auto got = torch::zeros({flat.padded_numel()});
    shards.scatter(o.partition_grad, 0, got);
    for (size_t k = 0; k < expected.size(); ++k) {
      EXPECT_TRUE(torch::allclose(flat.view(got, k), 2 * expected[k], 1e-6, 1e-6)) << "param " << k;
      EXPECT_FALSE(flat.params()[k].grad().defined()) << "param " << k << " kept its .grad";
    }
  }
}

// A new window (begin_window, as the optimizer's step ends) is overwritten by its first
// contribution instead of being zeroed first: the stale window never leaks into the next, a
// parameter without a gradient reads zeros, and a step taken without a backward (settle_window)
// reads zeros everywhere. In place (float32) and through delivered buckets (float64).
TEST(GradientReducer, AWindowOverwritesTheLastWithoutAZeroingPass) {
  torch::manual_seed(1);
  auto used = torch::nn::Linear(torch::nn::LinearOptions(8, 8).bias(false));
  auto unused = torch::nn::Linear(torch::nn::LinearOptions(8, 8).bias(false));
  std::vector<torch::Tensor> params = {used->weight, unused->weight};
  const auto x = torch::randn({3, 8});
  FlatParams flat(params, 1);
  const auto plan = GradientReducer::plan(flat.params(), 64);
  for (const auto comm_dtype : {torch::kFloat, torch::kDouble}) {
    SCOPED_TRACE(c10::toString(comm_dtype));
    auto made = partition_reducer(flat, plan, comm_dtype);
    const auto& o = made.options;
    const auto& reducer = made.reducer;
    const auto& shards = o.shards;
    auto backward = [&](double scale) {
      reducer->begin_backward(true);
      (used->forward(x).pow(2).sum() * scale).backward();
      reducer->finish();
    };
    auto place = [&](size_t k) {
      auto got = torch::zeros({flat.padded_numel()});
      shards.scatter(o.partition_grad, 0, got);
      return flat.view(got, k).clone();
    };
    backward(1.0);
    const auto once = place(0);
    o.partition_grad.fill_(7.0);  // what a stale window could hold, padding apart
    reducer->begin_window();
    backward(3.0);
    EXPECT_TRUE(torch::allclose(place(0), 3 * once, 1e-6, 1e-6));
    EXPECT_TRUE(torch::equal(place(1), torch::zeros({8, 8}))) << "no gradient reads zero";
    reducer->begin_window();
    reducer->settle_window();  // a step without a backward
    EXPECT_TRUE(torch::equal(place(0), torch::zeros({8, 8})));
  }
}

}  // namespace
