// DeepSpeed's expert-parallel layout, computed without processes.
#include <gtest/gtest.h>

#include "comm/topology.h"
#include "runtime/error.h"

namespace strata::comm {
namespace {

using Groups = std::vector<std::vector<int>>;

TEST(CommTopology, World16Ep2) {
  Layout l = expert_layout(16, 2);
  EXPECT_EQ(l.data_parallel.size(), 16u);
  ASSERT_EQ(l.expert_parallel.size(), 8u);
  EXPECT_EQ(l.expert_parallel[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(l.expert_parallel[1], (std::vector<int>{2, 3}));
  EXPECT_EQ(l.expert_parallel[7], (std::vector<int>{14, 15}));
  EXPECT_EQ(l.expert_data_parallel,
            (Groups{{0, 2, 4, 6, 8, 10, 12, 14}, {1, 3, 5, 7, 9, 11, 13, 15}}));
}

TEST(CommTopology, World8Ep4AndEdges) {
  Layout l = expert_layout(8, 4, 8);
  EXPECT_EQ(l.expert_parallel, (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(l.expert_data_parallel, (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  Layout one = expert_layout(4, 1);
  EXPECT_EQ(one.expert_parallel, (Groups{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(one.expert_data_parallel, (Groups{{0, 1, 2, 3}}));
  Layout all = expert_layout(4, 4);
  EXPECT_EQ(all.expert_parallel, (Groups{{0, 1, 2, 3}}));
  EXPECT_EQ(all.expert_data_parallel, (Groups{{0}, {1}, {2}, {3}}));
}

TEST(CommTopology, ClearErrors) {
  auto message = [](int world, int ep, std::optional<int> experts) {
    try {
      expert_layout(world, ep, experts);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message(6, 4, std::nullopt).find("4 does not divide the world size 6"),
            std::string::npos);
  EXPECT_NE(message(8, 4, 6).find("does not divide the number of experts 6"), std::string::npos);
  EXPECT_NE(message(8, 0, std::nullopt).find("must be at least 1"), std::string::npos);
}

}  // namespace
}  // namespace strata::comm
