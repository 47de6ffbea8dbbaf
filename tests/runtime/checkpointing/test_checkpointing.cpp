// The checkpoint mechanism (runtime/checkpointing/checkpoint.h) against plain autograd.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "runtime/checkpointing/checkpoint.h"

namespace {

namespace ckpt = strata::checkpointing;

TEST(Checkpoint, PolicyParses) {
  EXPECT_EQ(ckpt::CheckpointPolicy::parse("every:3").every, 3);
  EXPECT_TRUE(ckpt::CheckpointPolicy::parse("selective").selective());
  EXPECT_THROW(ckpt::CheckpointPolicy::parse("every:0"), std::exception);
}

}  // namespace
