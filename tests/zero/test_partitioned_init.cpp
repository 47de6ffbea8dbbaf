// PartitionedInit (DeepSpeed's zero.Init) in one process, with every tensor partitioned: a
// construction that reads what it just made in an out-of-place op, or a tensor partitioned
// earlier, sees the values it would see outside the scope, and a parameter made by an
// out-of-place op (`randn(...) * 0.02`) is partitioned like one made by a factory. (An out-of-place op allocates its
// output through a factory op, which partitions what the construction moved past: once that
// freed the op's own input before the kernel read it.) The multi-rank behaviour and the engine's
// side: tests/runtime/engine/test_engine_stage3.cpp.
#include <gtest/gtest.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "zero/partitioned_init.h"

namespace {

struct InitLikeUsersImpl : torch::nn::Module {
  InitLikeUsersImpl() {
    torch::NoGradGuard no_grad;
    a = register_parameter("a", torch::randn({64, 32}) * 0.02);  // a fresh tensor, scaled
    b = register_parameter("b", torch::empty({32}));
    b.copy_(torch::rand({32}) * 2.0 - 1.0);  // Linear's uniform init, written out
    c = register_parameter("c", a * 3.0 + 1.0);  // `a` was partitioned by then: gathered, read
    fc = register_module("fc", torch::nn::Linear(32, 16));
  }
  torch::Tensor a, b, c;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(InitLikeUsers);

TEST(PartitionedInit, OpsReadingFreshOrPartitionedTensorsSeeTheirValues) {
  torch::manual_seed(5);
  InitLikeUsers plain;
  torch::manual_seed(5);
  strata::zero::PartitionedInitOptions options;
  options.min_numel = 0;
  auto init = strata::zero::PartitionedInit::create(nullptr, options);
  InitLikeUsers built;
  init->finish();
  const auto expected = plain->named_parameters();
  for (const auto& p : built->named_parameters()) {
    ASSERT_TRUE(init->shard_of(p.value())) << p.key() << " was not partitioned";
    EXPECT_TRUE(torch::equal(init->full_value(p.value()), expected[p.key()])) << p.key();
  }
}

// A model built in bf16 shards keeps its bool and integer tensors as they are: only floating-point
// tensors take the model's dtype (an int64 index table cast to bf16 loses every value past 256).
struct MixedBuffersImpl : torch::nn::Module {
  MixedBuffersImpl() {
    w = register_parameter("w", torch::randn({300, 8}));
    index = register_buffer("index", torch::arange(2400, torch::kLong));
    mask = register_buffer("mask", torch::arange(2400) % 3 == 0);
  }
  torch::Tensor w, index, mask;
};
TORCH_MODULE(MixedBuffers);

TEST(PartitionedInit, CastsFloatingPointTensorsOnlyToTheModelsDtype) {
  torch::manual_seed(6);
  MixedBuffers plain;
  torch::manual_seed(6);
  strata::zero::PartitionedInitOptions options;
  options.min_numel = 0;
  options.dtype = torch::kBFloat16;
  auto init = strata::zero::PartitionedInit::create(nullptr, options);
  MixedBuffers built;
  init->finish();
  init->restore_except({built->w});
  EXPECT_EQ(built->w.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(init->full_value(built->w), plain->w.to(torch::kBFloat16)));
  ASSERT_EQ(built->index.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(built->index, plain->index));
  ASSERT_EQ(built->mask.scalar_type(), torch::kBool);
  EXPECT_TRUE(torch::equal(built->mask, plain->mask));
}

// LibTorch's Linear allocates its bias before it draws its weight, so the weight is partitioned
// when kaiming_uniform_ comes back to it. The draw must still be the fp32 one: a bf16 weight
// would be drawn in bf16 (uniform_ takes 8 random bits there, 256 values in all), another model
// than the one built whole and cast (the differential matrix found it: tiny-zoo, --zero-init in
// bf16). Whole-model equality, weights and biases, at the model's dtype after finish().
TEST(PartitionedInit, InPlaceInitialisationDrawsAsWithoutPartitioning) {
  for (const auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat}) {
    torch::manual_seed(5);
    torch::nn::Sequential plain(torch::nn::Linear(64, 64), torch::nn::Linear(64, 32),
                                torch::nn::Embedding(50, 16));
    torch::manual_seed(5);
    strata::zero::PartitionedInitOptions options;
    options.dtype = dtype;
    options.min_numel = 64;
    auto init = strata::zero::PartitionedInit::create(nullptr, options);
    torch::nn::Sequential built(torch::nn::Linear(64, 64), torch::nn::Linear(64, 32),
                                torch::nn::Embedding(50, 16));
    init->finish();
    const auto expected = plain->named_parameters();
    for (const auto& p : built->named_parameters()) {
      // Below min_numel a tensor stays whole, as built (the engine casts it later).
      const bool sharded = init->shard_of(p.value()).has_value();
      EXPECT_EQ(sharded, p.value().numel() >= 64) << p.key();
      const auto want = sharded ? expected[p.key()].to(dtype) : expected[p.key()];
      EXPECT_EQ(p.value().scalar_type(), want.scalar_type()) << p.key() << " after finish()";
      const auto value = sharded ? init->full_value(p.value()) : p.value();
      EXPECT_TRUE(torch::equal(value, want))
          << p.key() << " in " << c10::toString(dtype) << ": largest difference "
          << (value.to(torch::kFloat) - want.to(torch::kFloat)).abs().max().item<float>();
    }
  }
}

// Once the engine holds the shards (release()), no op pays for the scope's callback any more,
// though the user may keep the scope's handle for the whole run.
TEST(PartitionedInit, ReleaseStopsWatchingOpsWhileTheHandleLives) {
  ASSERT_FALSE(at::hasGlobalCallbacks());
  strata::zero::PartitionedInitOptions options;
  options.min_numel = 64;
  auto init = strata::zero::PartitionedInit::create(nullptr, options);
  EXPECT_TRUE(at::hasGlobalCallbacks());
  torch::nn::Linear layer(64, 64);
  init->finish();
  EXPECT_TRUE(at::hasGlobalCallbacks());  // an op touching a shard still gathers it
  init->release();
  EXPECT_FALSE(at::hasGlobalCallbacks());
  init.reset();  // and the handle's end removes nothing twice
  EXPECT_FALSE(at::hasGlobalCallbacks());
}

}  // namespace
