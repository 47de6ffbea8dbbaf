// A world of one process: every collective works, and bad arguments are refused with an error
// that names the collective. Also checks which libgloo the Gloo calls bind to.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/gloo_backend.h"
#include "comm/process_group.h"
#include "comm/runtime.h"
#include "comm/store.h"
#include "runtime/error.h"

namespace strata::comm {
namespace {

GroupPtr world_of_one() {
  InitOptions o;
  o.env = RankEnv{};
  o.env->master_port = 0;  // any free port
  o.timeout_s = 10;
  return init_process_group(o);
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

#define EXPECT_ERROR(call, text) EXPECT_NE(error_of([&] { call; }).find(text), std::string::npos) \
    << error_of([&] { call; })

TEST(CommSingleProcess, CollectivesOfOne) {
  auto pg = world_of_one();
  EXPECT_EQ(pg->rank(), 0);
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->name(), "world");
  auto t = torch::arange(6, torch::kFloat);
  pg->all_reduce(t, ReduceOp::Avg);
  EXPECT_TRUE(t.equal(torch::arange(6, torch::kFloat)));
  auto out = torch::zeros({6}, torch::kBFloat16);
  pg->all_gather(out, t.to(torch::kBFloat16));
  EXPECT_TRUE(out.equal(t.to(torch::kBFloat16)));
  auto rs = torch::zeros({6}, torch::kLong);
  pg->reduce_scatter(rs, torch::arange(6, torch::kLong), ReduceOp::Max);
  EXPECT_TRUE(rs.equal(torch::arange(6, torch::kLong)));
  auto a2a = torch::zeros({3, 2}, torch::kByte);
  pg->all_to_all_single(a2a, torch::ones({3, 2}, torch::kByte), {3}, {3});
  EXPECT_EQ(a2a.sum().item<int64_t>(), 6);
  pg->broadcast(t, 0);
  pg->barrier();
  auto sub = pg->new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->name(), "world/g0");
  EXPECT_EQ(pg->split(-1, 0), nullptr);
}

TEST(CommSingleProcess, BadArgumentsNameTheCollective) {
  auto pg = world_of_one();
  auto t = torch::zeros({4, 4});
  EXPECT_ERROR(pg->all_reduce(torch::zeros({1}).expand({4})),
               "all_reduce: the input tensor has elements that share memory");
  EXPECT_ERROR(pg->broadcast(torch::zeros({2, 2}).to_sparse(), 0),
               "broadcast: the input tensor has layout Sparse");
  EXPECT_ERROR(pg->all_reduce(torch::zeros({2}, torch::kBool)),
               "all_reduce: dtype Bool of the input tensor is not supported");
  EXPECT_ERROR(pg->all_reduce(torch::zeros({2}, torch::kLong), ReduceOp::Avg),
               "all_reduce: ReduceOp::Avg needs a floating dtype, got int64");
  EXPECT_ERROR(pg->all_reduce(torch::empty({2}, torch::TensorOptions().device(torch::kMeta))),
               "all_reduce: the input tensor is on meta");
  EXPECT_ERROR(pg->broadcast(t, 1), "broadcast: root 1 is not a rank of group world");
  EXPECT_ERROR(pg->all_gather(torch::zeros({3}), torch::zeros({2})),
               "all_gather: output has 3 elements, expected group size 1 x input's 2");
  EXPECT_ERROR(pg->all_gather(torch::zeros({2}, torch::kDouble), torch::zeros({2})),
               "all_gather: dtypes differ (output is float64, input is float32)");
  EXPECT_ERROR(pg->reduce_scatter(torch::zeros({3}), torch::zeros({2})),
               "reduce_scatter: input has 2 elements");
  EXPECT_ERROR(pg->all_to_all_single(torch::zeros({3, 2}), torch::zeros({3, 2}), {2}, {3}),
               "all_to_all_single: output split sizes add up to 2, but dim 0 has 3 rows");
  EXPECT_ERROR(pg->all_to_all_single(torch::zeros({3, 2}), torch::zeros({3, 3})),
               "all_to_all_single: a row (dims after 0) of input has 3 elements, of output 2");
  EXPECT_ERROR(pg->all_to_all_single(torch::zeros({3}), torch::zeros({3}), {1, 2}, {3}),
               "all_to_all_single: output has 2 split sizes, the group has 1 members");
  EXPECT_ERROR(pg->new_group({0, 0}), "new_group on world: rank 0 is listed twice");
  EXPECT_ERROR(pg->new_group({1}), "new_group on world: rank 1 is not a rank of this group");
  // The group still works after refused calls.
  pg->all_reduce(t);
}

// Non-contiguous tensors get their results in place; data movers take any dtype.
TEST(CommSingleProcess, ViewsAndAnyDtype) {
  auto pg = world_of_one();
  auto m = torch::arange(12, torch::kFloat).reshape({3, 4});
  pg->all_reduce(m.t(), ReduceOp::Avg);
  EXPECT_TRUE(m.equal(torch::arange(12, torch::kFloat).reshape({3, 4})));
  auto mask = torch::tensor({true, false, true});
  pg->broadcast(mask, 0);
  auto buf = torch::zeros({3, 2}, torch::kShort);
  pg->all_gather(buf.select(1, 1), torch::tensor({1, 2, 3}, torch::kShort));  // stride 2
  EXPECT_TRUE(buf.equal(torch::tensor({{0, 1}, {0, 2}, {0, 3}}, torch::kShort)));
  EXPECT_ERROR(pg->all_reduce(mask), "all_reduce: dtype Bool of the input tensor is not supported");
}

// A member that passed the rendezvous but died before Gloo connected (a process killed at
// start-up): the others' error names it by world rank, not by a store key.
TEST(CommSingleProcess, GlooConnectNamesTheMemberThatNeverCame) {
  auto rt = std::make_shared<detail::Runtime>();
  rt->env.master_addr = "127.0.0.1";
  rt->timeout = std::chrono::milliseconds(300);
  rt->store = detail::Store::open("127.0.0.1", 0, /*server=*/true, std::chrono::seconds(5));
  rt->gloo_device = detail::make_gloo_device(rt->env);
  detail::GroupInfo g;
  g.rt = rt;
  g.name = "world/g1";
  g.rank = 0;
  g.world_ranks = {2, 5};  // this process is world rank 2; world rank 5 never connects
  g.called = std::make_shared<std::atomic<uint64_t>>(0);
  const std::string error = error_of(
      [&] { detail::GlooBackend(g, std::make_shared<detail::GroupHealth>()); });
  EXPECT_NE(error.find("group world/g1: rank 0 of 2 could not connect"), std::string::npos)
      << error;
  EXPECT_NE(error.find("timed out after 0.3 s: rank 5 never published its Gloo address (store "
                       "key strata/gloo/world/g1/1)"),
            std::string::npos)
      << error;
}

TEST(CommSingleProcess, GlooSymbolsBindToTheLibglooStrataWasBuiltAgainst) {
  const std::string path = detail::gloo_library_path();
  EXPECT_NE(path.find("libgloo"), std::string::npos)
      << "gloo::allreduce resolves to '" << path
      << "': another Gloo (e.g. the copy inside pip LibTorch's libtorch_cpu.so) comes first";
}

}  // namespace
}  // namespace strata::comm
