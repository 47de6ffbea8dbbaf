// Scenarios about what the ranks pass to a collective: calls that differ between the ranks (an
// error on every rank at once, naming the collective, the ranks and what each passed; the group
// works on), tensors of any dtype and layout, and float16 averages whose float16 sum overflows.
#include <torch/torch.h>

#include "comm/process_group.h"
#include "ranks.h"
#include "scenario_util.h"

namespace strata::test {
namespace {

using namespace strata::comm;

// Every rank must get the error at once, not after a timeout (the tests set STRATA_TIMEOUT=5).
template <class F>
void expect_mismatch(F&& call, std::vector<std::string> needles, const std::string& what) {
  const auto start = Clock::now();
  expect_error(std::forward<F>(call), std::move(needles), what);
  check(seconds_since(start) < 2, what + ": took " + std::to_string(seconds_since(start)) + " s");
}

// Rows [k * rows, (k + 1) * rows) of a [n * rows, width] matrix of rank p's values.
torch::Tensor block(int p, int n, int k, int64_t rows, int64_t width) {
  return values(p, n * rows * width).reshape({n * rows, width}).slice(0, k * rows, (k + 1) * rows);
}

}  // namespace

// The last rank passes something else than the others. Before the check, Gloo aborted a rank
// that received more than it expected (SIGABRT on Gloo's thread) and the others read stale data.
STRATA_SCENARIO(mismatch) {
  auto pg = init_process_group();
  const int n = pg->size(), r = pg->rank(), odd = n - 1;
  const bool me = r == odd;
  const std::string last = "rank " + std::to_string(odd) + ": ";
  const std::string others = n == 2 ? "rank 0: " : "ranks 0, 1: ";
  const auto f32 = torch::TensorOptions().device(device());
  const std::string usable = "the group can still be used";

  auto a = torch::ones({me ? 2000 : 1000}, f32);
  expect_mismatch([&] { pg->all_reduce(a); },
                  {"all_reduce on group world: the members' calls differ",
                   others + "all_reduce(sum) of 1000 float32",
                   last + "all_reduce(sum) of 2000 float32", usable},
                  "all_reduce of different sizes");
  check(a.sum().item<double>() == double(a.numel()), "the tensor is untouched");

  auto b = torch::ones({8}, f32.dtype(me ? torch::kDouble : torch::kFloat));
  expect_mismatch([&] { pg->all_reduce(b, ReduceOp::Max); },
                  {others + "all_reduce(max) of 8 float32", last + "all_reduce(max) of 8 float64"},
                  "all_reduce of different dtypes");

  // The root's tensor smaller (the others used to "succeed" with a stale tail), then larger (the
  // others used to abort).
  for (int64_t root_numel : {8, 32}) {
    auto c = torch::full({r == 0 ? root_numel : 16}, double(r), f32);
    const std::string rest = n == 2 ? "rank 1: " : "ranks 1, 2: ";
    expect_mismatch([&] { pg->broadcast(c, 0); },
                    {"broadcast on group world",
                     "rank 0: broadcast of " + std::to_string(root_numel) + " float32 from rank 0",
                     rest + "broadcast of 16 float32 from rank 0"},
                    "broadcast of different sizes");
    check(c.eq(double(r)).all().item<bool>(), "nothing was broadcast");
  }
  auto d = torch::zeros({4}, f32);
  expect_mismatch([&] { pg->broadcast(d, me ? 1 : 0); },
                  {others + "broadcast of 4 float32 from rank 0",
                   last + "broadcast of 4 float32 from rank 1"},
                  "broadcast from different roots");

  auto g_in = torch::ones({me ? 3 : 2}, f32), g_out = torch::zeros({n * g_in.numel()}, f32);
  expect_mismatch([&] { pg->all_gather(g_out, g_in); },
                  {others + "all_gather of 2 float32 per rank",
                   last + "all_gather of 3 float32 per rank"},
                  "all_gather of different sizes");

  auto rs_out = torch::zeros({me ? 3 : 2}, f32), rs_in = torch::ones({n * rs_out.numel()}, f32);
  expect_mismatch([&] { pg->reduce_scatter(rs_out, rs_in); },
                  {others + "reduce_scatter(sum) of 2 float32 per rank",
                   last + "reduce_scatter(sum) of 3 float32 per rank"},
                  "reduce_scatter of different sizes");

  // Equal splits: the last rank sends two rows to everyone, who expect one.
  auto x_in = torch::ones({me ? 2 * n : n, 1}, f32), x_out = torch::zeros({n, 1}, f32);
  expect_mismatch([&] { pg->all_to_all_single(x_out, x_in); },
                  {"all_to_all_single on group world: the split sizes differ",
                   "rank " + std::to_string(odd) + " sends 2 elements to rank 0, which expects 1",
                   usable},
                  "all_to_all_single with different splits");

  auto e = torch::ones({4}, f32);
  expect_mismatch([&] { me ? pg->barrier() : pg->all_reduce(e); },
                  {me ? "barrier on group world" : "all_reduce on group world",
                   others + "all_reduce(sum) of 4 float32", last + "barrier"},
                  "different collectives");

  // Nothing was sent, so the group works on.
  auto ok = on_device(values(r, 50), torch::kFloat);
  pg->all_reduce(ok);
  torch::Tensor want = values(0, 50);
  for (int k = 1; k < n; ++k) want = want + values(k, 50);
  expect_close(ok, want, "all_reduce after the mismatches");
  pg->barrier();
}

// What a model's broadcast at start-up meets: bool, int8 and int16 buffers (a causal mask,
// codes), a channels_last parameter, views. All collectives that move data take any dtype; a
// non-contiguous tensor gets its result in place.
STRATA_SCENARIO(any_dtype) {
  auto pg = init_process_group();
  const int n = pg->size(), r = pg->rank(), root = n - 1;
  auto mask = [](int k, int64_t len) { return values(k, len).remainder(2); };
  auto code8 = [](int k, int64_t len) { return values(k, len) - 6; };
  auto code16 = [](int k, int64_t len) { return values(k, len) * 1000 - 6000; };

  auto b = on_device(mask(r, 33), torch::kBool);
  pg->broadcast(b, root);
  expect_close(b, mask(root, 33), "broadcast bool");
  auto c = on_device(code8(r, 17), torch::kChar);
  pg->broadcast(c, root);
  expect_close(c, code8(root, 17), "broadcast int8");
  auto s = on_device(code16(r, 9), torch::kShort);
  pg->broadcast(s, root);
  expect_close(s, code16(root, 9), "broadcast int16");

  // channels_last: broadcast into the same storage, layout kept.
  auto w = on_device(values(r, 120).reshape({2, 3, 4, 5}), torch::kFloat)
               .contiguous(torch::MemoryFormat::ChannelsLast);
  check(!w.is_contiguous(), "channels_last is not contiguous");
  void* before = w.data_ptr();
  pg->broadcast(w, root);
  check(w.data_ptr() == before && w.is_contiguous(torch::MemoryFormat::ChannelsLast),
        "broadcast in place");
  expect_close(w, values(root, 120).reshape({2, 3, 4, 5}), "broadcast channels_last");

  // A column of a matrix: only that column changes.
  auto m = on_device(values(r, 24).reshape({4, 6}), torch::kFloat);
  pg->broadcast(m.select(1, 2), root);
  auto want_m = values(r, 24).reshape({4, 6});
  want_m.select(1, 2).copy_(values(root, 24).reshape({4, 6}).select(1, 2));
  expect_close(m, want_m, "broadcast a column");

  // all_gather of a transposed bool mask into a transposed output.
  auto g_in = on_device(mask(r, 6).reshape({3, 2}), torch::kBool).t();
  auto g_out = torch::zeros({3, 2 * n}, g_in.options()).t();
  pg->all_gather(g_out, g_in);
  std::vector<torch::Tensor> parts;
  for (int k = 0; k < n; ++k) parts.push_back(mask(k, 6).reshape({3, 2}).t().reshape({-1}));
  expect_close(g_out, torch::cat(parts), "all_gather bool, transposed");

  // all_to_all_single of int16 rows into a transposed output.
  auto x_in = on_device(code16(r, 4 * n).reshape({2 * n, 2}), torch::kShort);
  auto x_out = torch::zeros({2, 2 * n}, x_in.options()).t();
  pg->all_to_all_single(x_out, x_in);
  std::vector<torch::Tensor> rows;
  for (int p = 0; p < n; ++p) rows.push_back(block(p, n, r, 2, 2) * 1000 - 6000);
  expect_close(x_out, torch::cat(rows), "all_to_all_single int16, transposed");

  // Reductions on views: a column all-reduced, a reduce-scatter from and into transposes.
  auto q = on_device(values(r, 12).reshape({3, 4}), torch::kFloat);
  pg->all_reduce(q.select(1, 1));
  auto want_q = values(r, 12).reshape({3, 4});
  torch::Tensor col = values(0, 12).reshape({3, 4}).select(1, 1).clone();
  for (int k = 1; k < n; ++k) col += values(k, 12).reshape({3, 4}).select(1, 1);
  want_q.select(1, 1).copy_(col);
  expect_close(q, want_q, "all_reduce a column");
  auto rs_in = on_device(values(r, 4 * n).reshape({2, 2 * n}), torch::kFloat).t();
  auto rs_out = torch::zeros({2, 2}, rs_in.options()).t();
  pg->reduce_scatter(rs_out, rs_in);
  torch::Tensor sum = values(0, 4 * n).reshape({2, 2 * n}).t().reshape({-1});
  for (int k = 1; k < n; ++k) sum = sum + values(k, 4 * n).reshape({2, 2 * n}).t().reshape({-1});
  expect_close(rs_out, sum.slice(0, 4 * r, 4 * r + 4), "reduce_scatter transposed");

  // Asynchronous: the result is in place once wait() returns.
  auto v = on_device(values(r, 10).reshape({2, 5}), torch::kFloat).t();
  auto work = pg->broadcast_async(v, root);
  work->wait();
  expect_close(v, values(root, 10).reshape({2, 5}).t(), "broadcast_async of a view");
}

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
