// The call check's verdicts and messages (comm/check.h) from hand-made headers, no processes:
// every member must reach the same verdict from the same words.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/check.h"
#include "comm/process_group.h"
#include "comm/runtime.h"

namespace strata::comm::detail {
namespace {

GroupInfo group_of(int size, int rank = 0, std::string name = "world") {
  GroupInfo g;
  g.name = std::move(name);
  g.rank = rank;
  for (int r = 0; r < size; ++r) g.world_ranks.push_back(r);
  return g;
}

Signature reduce(int64_t numel, at::ScalarType dt = at::kFloat, ReduceOp op = ReduceOp::Sum) {
  Signature s;
  s.coll = Coll::AllReduce;
  s.op = int64_t(op);
  s.dtype = int64_t(dt);
  s.device = 0;
  s.in_numel = s.out_numel = numel;
  return s;
}

Signature a2a(std::vector<int64_t> send, std::vector<int64_t> recv) {
  Signature s;
  s.coll = Coll::AllToAll;
  s.dtype = int64_t(at::kInt);
  s.device = 0;
  s.send_counts = std::move(send);
  s.recv_counts = std::move(recv);
  return s;
}

std::vector<int64_t> headers(const std::vector<Signature>& sigs) {
  std::vector<int64_t> all;
  for (size_t r = 0; r < sigs.size(); ++r) {
    auto h = encode(sigs[r], int(r), int(sigs.size()));
    EXPECT_EQ(h.size(), kWords);
    all.insert(all.end(), h.begin(), h.end());
  }
  return all;
}

TEST(CommCheck, EqualCallsAgree) {
  EXPECT_TRUE(compare(group_of(3), 1, headers({reduce(10), reduce(10), reduce(10)})).ok);
}

TEST(CommCheck, DifferentSizesNameTheRanksAndWhatEachPassed) {
  const Verdict v = compare(group_of(3, 1), 7, headers({reduce(10), reduce(20), reduce(10)}));
  EXPECT_FALSE(v.ok);
  EXPECT_FALSE(v.need_counts);
  EXPECT_NE(v.message.find("all_reduce on group world: the members' calls differ (call #7"),
            std::string::npos)
      << v.message;
  EXPECT_NE(v.message.find("ranks 0, 2: all_reduce(sum) of 10 float32; rank 1: all_reduce(sum) "
                           "of 20 float32"),
            std::string::npos)
      << v.message;
}

TEST(CommCheck, DtypeOpAndCollectiveMustMatch) {
  auto v = compare(group_of(2), 1, headers({reduce(4), reduce(4, at::kBFloat16)}));
  EXPECT_NE(v.message.find("rank 1: all_reduce(sum) of 4 bfloat16"), std::string::npos);
  v = compare(group_of(2), 1, headers({reduce(4), reduce(4, at::kFloat, ReduceOp::Max)}));
  EXPECT_NE(v.message.find("rank 1: all_reduce(max) of 4 float32"), std::string::npos);
  Signature barrier;
  v = compare(group_of(2, 1), 1, headers({reduce(4), barrier}));
  EXPECT_NE(v.message.find("barrier on group world"), std::string::npos) << v.message;
  EXPECT_NE(v.message.find("rank 1: barrier"), std::string::npos) << v.message;
}

TEST(CommCheck, SubGroupsNameTheirWorldRanks) {
  GroupInfo g = group_of(2, 0, "world/g0");
  g.world_ranks = {1, 3};
  auto v = compare(g, 2, headers({reduce(4), reduce(5)}));
  EXPECT_NE(v.message.find("group world/g0 (world ranks [1, 3])"), std::string::npos)
      << v.message;
}

TEST(CommCheck, AllToAllSplitsAgreeByHashAndDisagreeByPair) {
  // Rank 0 sends 1 to itself and 2 to rank 1; rank 1 sends 3 to rank 0 and 4 to itself.
  std::vector<Signature> good = {a2a({1, 2}, {1, 3}), a2a({3, 4}, {2, 4})};
  EXPECT_TRUE(compare(group_of(2), 1, headers(good)).ok);
  std::vector<Signature> bad = {a2a({1, 2}, {1, 3}), a2a({3, 4}, {5, 4})};
  const Verdict v = compare(group_of(2), 1, headers(bad));
  EXPECT_FALSE(v.ok);
  ASSERT_TRUE(v.need_counts);
  std::vector<int64_t> all;
  for (auto& s : bad) {
    auto c = counts_of(s, 2);
    all.insert(all.end(), c.begin(), c.end());
  }
  auto m = counts_mismatch(group_of(2), 1, bad[0], all);
  ASSERT_TRUE(m.has_value());
  EXPECT_NE(m->find("rank 0 sends 2 elements to rank 1, which expects 5"), std::string::npos)
      << *m;
  all.clear();
  for (auto& s : good) {
    auto c = counts_of(s, 2);
    all.insert(all.end(), c.begin(), c.end());
  }
  EXPECT_FALSE(counts_mismatch(group_of(2), 1, good[0], all).has_value());
}

TEST(CommCheck, DtypeNames) {
  EXPECT_EQ(dtype_name(int64_t(at::kHalf)), "float16");
  EXPECT_EQ(dtype_name(int64_t(at::kBool)), "Bool");
  EXPECT_EQ(dtype_name(int64_t(at::kShort)), "int16");
  EXPECT_EQ(dtype_name(-1), "dtype #-1");
}

}  // namespace
}  // namespace strata::comm::detail
