// Scenarios about what the ranks pass to a collective: float16 averages whose float16 sum
// overflows.
#include <torch/torch.h>

#include "comm/process_group.h"
#include "ranks.h"
#include "scenario_util.h"

namespace strata::test {
using namespace strata::comm;

// float16 Avg of 40960 on every rank is 40960, though the sum (81920 on two ranks) is past
// float16's 65504: Gloo reduces float16 in float32, NCCL's ncclAvg multiplies by 1/n first.
STRATA_SCENARIO(half_average) {
  auto pg = init_process_group();
  const int n = pg->size(), r = pg->rank();
  const auto half = torch::TensorOptions().dtype(torch::kHalf).device(device());
  auto t = torch::full({1000}, 40960.0, half);
  pg->all_reduce(t, ReduceOp::Avg);
  check(t.eq(40960.0).all().item<bool>(),
        "all_reduce avg float16: got " + std::to_string(t.max().item<double>()));
  auto in = torch::full({n * 64}, 40960.0, half), out = torch::zeros({64}, half);
  pg->reduce_scatter(out, in, ReduceOp::Avg);
  check(out.eq(40960.0).all().item<bool>(),
        "reduce_scatter avg float16: got " + std::to_string(out.max().item<double>()));
  // Different values, mean computed in float64.
  auto u = torch::full({16}, 60000.0 - 10000.0 * r, half);
  pg->all_reduce(u, ReduceOp::Avg);
  double mean = 0;
  for (int k = 0; k < n; ++k) mean += (60000.0 - 10000.0 * k) / n;
  expect_close(u, torch::full({16}, mean, torch::kDouble), "all_reduce avg float16, mixed");
  // A Sum past the range is inf, on Gloo as on NCCL.
  auto s = torch::full({4}, 40960.0, half);
  pg->all_reduce(s);
  check(torch::isinf(s.cpu()).all().item<bool>(), "sum past float16's range is inf");
}

}  // namespace strata::test
