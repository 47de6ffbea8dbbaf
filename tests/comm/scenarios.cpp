// What each rank does in the multi-process tests. Every rank's input is a known function of its
// rank; every result is checked against a value this rank computes locally in float64.
// STRATA_COMM_DEVICE=cuda runs the same collectives on CUDA tensors (NCCL).
#include <torch/torch.h>
#include <unistd.h>

#include <thread>

#include "comm/env.h"
#include "comm/process_group.h"
#include "comm/topology.h"
#include "ranks.h"
#include "runtime/error.h"
#include "scenario_util.h"

namespace strata::test {

int cuda_devices() { return int(torch::cuda::device_count()); }
bool nccl_built() { return comm::nccl_available(); }

namespace {

using namespace strata::comm;

const std::vector<torch::ScalarType>& dtypes() {
  static const std::vector<torch::ScalarType> all = {torch::kFloat, torch::kDouble, torch::kHalf,
                                                     torch::kBFloat16, torch::kInt, torch::kLong,
                                                     torch::kByte};
  return all;
}

bool floating(torch::ScalarType t) { return at::isFloatingType(t); }

std::string dtype_tag(torch::ScalarType t) { return c10::toString(t); }

// ---- the collectives, one dtype at a time ------------------------------------------------

void all_reduce_checks(ProcessGroup& pg, torch::ScalarType dt) {
  const int n = pg.size(), r = pg.rank();
  const int64_t len = 37;
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg}) {
    if (op == ReduceOp::Avg && !floating(dt)) continue;
    auto t = on_device(values(r, len), dt);
    pg.all_reduce(t, op);
    torch::Tensor want = values(0, len);
    for (int k = 1; k < n; ++k) {
      auto v = values(k, len);
      if (op == ReduceOp::Max) want = torch::maximum(want, v);
      else if (op == ReduceOp::Min) want = torch::minimum(want, v);
      else want = want + v;
    }
    if (op == ReduceOp::Avg) want = want / n;
    expect_close(t, want, std::string("all_reduce ") + to_string(op) + " " + dtype_tag(dt));
  }
}

void broadcast_checks(ProcessGroup& pg, torch::ScalarType dt) {
  const int root = pg.size() - 1;
  auto t = on_device(values(pg.rank(), 19), dt);
  pg.broadcast(t, root);
  expect_close(t, values(root, 19), "broadcast " + dtype_tag(dt));
}

void all_gather_checks(ProcessGroup& pg, torch::ScalarType dt) {
  const int n = pg.size();
  auto in = on_device(values(pg.rank(), 5), dt);
  auto out = torch::zeros({n * 5}, in.options());
  pg.all_gather(out, in);
  std::vector<torch::Tensor> parts;
  for (int k = 0; k < n; ++k) parts.push_back(values(k, 5));
  expect_close(out, torch::cat(parts), "all_gather " + dtype_tag(dt));
}

void reduce_scatter_checks(ProcessGroup& pg, torch::ScalarType dt) {
  const int n = pg.size(), r = pg.rank();
  const int64_t m = 6;
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg}) {
    if (op == ReduceOp::Avg && !floating(dt)) continue;
    auto in = on_device(values(r, n * m), dt);
    auto out = torch::zeros({m}, in.options());
    pg.reduce_scatter(out, in, op);
    torch::Tensor want = values(0, n * m);
    for (int k = 1; k < n; ++k)
      want = op == ReduceOp::Max ? torch::maximum(want, values(k, n * m)) : want + values(k, n * m);
    if (op == ReduceOp::Avg) want = want / n;
    expect_close(out, want.slice(0, r * m, (r + 1) * m),
                 std::string("reduce_scatter ") + to_string(op) + " " + dtype_tag(dt));
  }
}

// Row k of the block that src sends to dst, column c. At most 125: exact in uint8 and bfloat16.
double code(int src, int dst, int k, int c) { return src * 32 + dst * 8 + k * 3 + c; }

// rows[src][dst]: how many rows src sends to dst; width: columns per row.
void all_to_all_case(ProcessGroup& pg, torch::ScalarType dt,
                     const std::vector<std::vector<int64_t>>& rows, int64_t width, bool equal,
                     const std::string& what) {
  const int n = pg.size(), r = pg.rank();
  auto block = [&](int src, int dst) {
    auto t = torch::empty({rows[src][dst], width}, torch::kDouble);
    for (int64_t k = 0; k < rows[src][dst]; ++k)
      for (int64_t c = 0; c < width; ++c) t[k][c] = code(src, dst, int(k), int(c));
    return t;
  };
  std::vector<torch::Tensor> mine, want;
  std::vector<int64_t> in_splits, out_splits;
  for (int p = 0; p < n; ++p) {
    mine.push_back(block(r, p));
    want.push_back(block(p, r));
    in_splits.push_back(rows[r][p]);
    out_splits.push_back(rows[p][r]);
  }
  auto in = on_device(torch::cat(mine), dt);
  auto out = torch::full({torch::cat(want).size(0), width}, 255, in.options());
  if (equal)
    pg.all_to_all_single(out, in);
  else
    pg.all_to_all_single(out, in, out_splits, in_splits);
  expect_close(out, torch::cat(want), what + " " + dtype_tag(dt));
}

void all_to_all_checks(ProcessGroup& pg, torch::ScalarType dt) {
  const int n = pg.size();
  std::vector<std::vector<int64_t>> equal(n, std::vector<int64_t>(n, 2));
  all_to_all_case(pg, dt, equal, 3, /*equal=*/true, "all_to_all_single equal splits");
  // Uneven, with zero-size splits: src sends (src + 2 dst + 1) % 3 rows to dst.
  std::vector<std::vector<int64_t>> uneven(n, std::vector<int64_t>(n));
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < n; ++d) uneven[s][d] = (s + 2 * d + 1) % 3;
  all_to_all_case(pg, dt, uneven, 2, false, "all_to_all_single uneven splits");
  // Only the last rank sends (one row to everyone): the others' inputs are empty.
  std::vector<std::vector<int64_t>> one_way(n, std::vector<int64_t>(n, 0));
  for (int d = 0; d < n; ++d) one_way[n - 1][d] = 1;
  all_to_all_case(pg, dt, one_way, 2, false, "all_to_all_single empty inputs");
}

}  // namespace

STRATA_SCENARIO(collectives) {
  auto pg = init_process_group();
  check(pg->size() == read_rank_env().world_size, "world size");
  for (auto dt : dtypes()) {
    all_reduce_checks(*pg, dt);
    broadcast_checks(*pg, dt);
    all_gather_checks(*pg, dt);
    reduce_scatter_checks(*pg, dt);
    all_to_all_checks(*pg, dt);
  }
  // Large enough for several Gloo segments and ring steps.
  const int n = pg->size(), r = pg->rank();
  const int64_t big = 1 << 18;
  auto t = on_device(values(r, big), torch::kFloat);
  pg->all_reduce(t);
  torch::Tensor want = values(0, big);
  for (int k = 1; k < n; ++k) want = want + values(k, big);
  expect_close(t, want, "large all_reduce");
  auto in = on_device(values(r, big * n), torch::kFloat);
  auto out = torch::empty({big}, in.options());
  pg->reduce_scatter(out, in);
  torch::Tensor rs = values(0, big * n);
  for (int k = 1; k < n; ++k) rs = rs + values(k, big * n);
  expect_close(out, rs.slice(0, r * big, (r + 1) * big), "large reduce_scatter");
  // Empty tensors are fine.
  auto empty = torch::empty({0}, torch::TensorOptions().device(device()));
  pg->all_reduce(empty);
  pg->barrier();
}

STRATA_SCENARIO(async) {
  auto pg = init_process_group();
  const int n = pg->size(), r = pg->rank();
  auto a = on_device(values(r, 1000), torch::kFloat);
  auto g_in = on_device(values(r, 10), torch::kLong);
  auto g_out = torch::zeros({n * 10}, g_in.options());
  auto b = on_device(values(r, 7), torch::kBFloat16);
  auto rs_in = on_device(values(r, n * 4), torch::kDouble);
  auto rs_out = torch::zeros({4}, rs_in.options());
  std::vector<torch::Tensor> blocks;
  for (int p = 0; p < n; ++p) blocks.push_back(torch::full({2}, double(r * 10 + p)));
  auto x_in = on_device(torch::cat(blocks), torch::kInt);
  auto x_out = torch::zeros({2 * n}, x_in.options());

  auto w1 = pg->all_reduce_async(a);
  auto w2 = pg->all_gather_async(g_out, g_in);
  auto w3 = pg->broadcast_async(b, 0);
  auto w4 = pg->all_to_all_single_async(x_out, x_in);
  auto w5 = pg->reduce_scatter_async(rs_out, rs_in, ReduceOp::Max);
  // Waited out of order.
  w4->wait();
  w2->wait();
  w5->wait();
  w1->wait();
  w3->wait();

  torch::Tensor sum = values(0, 1000), mx = values(0, n * 4);
  std::vector<torch::Tensor> gathered{values(0, 10)}, got_blocks;
  for (int k = 1; k < n; ++k) {
    sum = sum + values(k, 1000);
    mx = torch::maximum(mx, values(k, n * 4));
    gathered.push_back(values(k, 10));
  }
  for (int p = 0; p < n; ++p) got_blocks.push_back(torch::full({2}, double(p * 10 + r)));
  expect_close(a, sum, "async all_reduce");
  expect_close(g_out, torch::cat(gathered), "async all_gather");
  expect_close(b, values(0, 7), "async broadcast");
  expect_close(x_out, torch::cat(got_blocks), "async all_to_all_single");
  expect_close(rs_out, mx.slice(0, r * 4, (r + 1) * 4), "async reduce_scatter max");
  // On CUDA, wait() orders the current stream; the copies to the host above waited for it.
  for (auto& w : {w1, w2, w3, w4, w5}) check(w->is_completed(), "is_completed after wait");

  // A handle nobody waits on completes by itself.
  auto c = on_device(values(r, 3), torch::kFloat);
  auto w6 = pg->all_reduce_async(c, ReduceOp::Min);
  const auto start = Clock::now();
  while (!w6->is_completed() && seconds_since(start) < 20)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  check(w6->is_completed(), "is_completed without wait");
  w6->wait();

  // Two groups in flight at once.
  auto twin = pg->new_group([&] {
    std::vector<int> all;
    for (int k = 0; k < n; ++k) all.push_back(k);
    return all;
  }());
  auto y = on_device(values(r, 50), torch::kFloat);
  auto z = on_device(values(r, 60), torch::kFloat);
  auto wy = twin->all_reduce_async(y);
  auto wz = pg->all_reduce_async(z);
  wz->wait();
  wy->wait();
  torch::Tensor sy = values(0, 50), sz = values(0, 60);
  for (int k = 1; k < n; ++k) sy = sy + values(k, 50), sz = sz + values(k, 60);
  expect_close(y, sy, "all_reduce on a second group");
  expect_close(z, sz, "all_reduce beside it");
}

STRATA_SCENARIO(subgroups) {
  auto pg = init_process_group();
  const int n = pg->size(), r = pg->rank();
  std::vector<int> even, odd;
  for (int k = 0; k < n; ++k) (k % 2 ? odd : even).push_back(k);
  auto ge = pg->new_group(even);
  auto go = pg->new_group(odd);
  auto mine = r % 2 ? go : ge;
  check((r % 2 ? ge : go) == nullptr, "a non-member gets nullptr");
  check(mine != nullptr, "a member gets its group");
  const auto& members = r % 2 ? odd : even;
  check(mine->world_ranks() == members, "world_ranks of the parity group");
  check(mine->world_ranks()[mine->rank()] == r, "rank in the parity group");
  auto t = on_device(torch::full({4}, double(r)), torch::kLong);
  mine->all_reduce(t);
  double s = 0;
  for (int k : members) s += k;
  expect_close(t, torch::full({4}, s), "all_reduce over the parity group");

  // split: color by parity, key -rank reverses the order.
  auto sp = pg->split(r % 2, -r);
  std::vector<int> reversed(members.rbegin(), members.rend());
  check(sp && sp->world_ranks() == reversed, "split orders members by key");
  auto in = on_device(torch::full({2}, double(r)), torch::kFloat);
  auto out = torch::zeros({2 * sp->size()}, in.options());
  sp->all_gather(out, in);
  std::vector<torch::Tensor> want;
  for (int k : reversed) want.push_back(torch::full({2}, double(k)));
  expect_close(out, torch::cat(want), "all_gather in split group");
  check(pg->split(r == 0 ? -1 : 0, 0) == nullptr || r != 0, "negative color gets nullptr");

  // Nested: the parity group's rank 0 alone, named by its rank in the parity group.
  auto solo = mine->new_group({0});
  check((solo != nullptr) == (mine->rank() == 0), "nested new_group membership");
  if (solo) {
    check(solo->size() == 1 && solo->world_ranks()[0] == members[0], "nested world rank");
    auto u = on_device(values(r, 3), torch::kFloat);
    solo->all_reduce(u);
    expect_close(u, values(r, 3), "all_reduce of one");
  }

  // DeepSpeed's expert layout, ep 2.
  if (n % 2 == 0) {
    auto groups = create_expert_groups(pg, 2, /*num_experts=*/4);
    check(groups.data_parallel == pg, "data-parallel group is the world");
    check(groups.expert_parallel->world_ranks() == std::vector<int>{r / 2 * 2, r / 2 * 2 + 1},
          "expert-parallel group");
    std::vector<int> edp;
    for (int k = r % 2; k < n; k += 2) edp.push_back(k);
    check(groups.expert_data_parallel->world_ranks() == edp, "expert-data-parallel group");
    auto e = on_device(torch::full({3}, double(r + 1)), torch::kFloat);
    groups.expert_data_parallel->all_reduce(e);
    double se = 0;
    for (int k : edp) se += k + 1;
    expect_close(e, torch::full({3}, se), "all_reduce over expert-data-parallel");
  }
  pg->barrier();
}

STRATA_SCENARIO(env_ompi) {
  RankEnv e = read_rank_env();
  check(e.convention == "OpenMPI", "convention " + e.convention);
  check(e.rank == std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")), "rank from OMPI");
  check(e.local_world_size == e.world_size, "local size from OMPI");
  auto pg = init_process_group();
  check(pg->rank() == e.rank && pg->size() == e.world_size, "group position");
  auto t = torch::ones({3});
  pg->all_reduce(t);
  expect_close(t, torch::full({3}, double(e.world_size)), "all_reduce");
}

STRATA_SCENARIO(env_slurm) {
  RankEnv e = read_rank_env();
  check(e.convention == "SLURM", "convention " + e.convention);
  check(e.rank == std::atoi(std::getenv("SLURM_PROCID")), "rank from SLURM_PROCID");
  check(e.master_addr == "localhost", "MASTER_ADDR from SLURM_JOB_NODELIST: " + e.master_addr);
  check(e.local_world_size == e.world_size, "local size from SLURM_TASKS_PER_NODE");
  auto pg = init_process_group();
  auto t = torch::ones({3}, torch::kLong);
  pg->all_reduce(t, ReduceOp::Sum);
  expect_close(t, torch::full({3}, double(e.world_size)), "all_reduce");
}

// The last rank is alive but never calls the collective. STRATA_TIMEOUT=kScenarioTimeoutS.
STRATA_SCENARIO(timeout_absent) {
  auto pg = init_process_group();
  check(pg->timeout() == std::chrono::seconds(kScenarioTimeoutS), "timeout from STRATA_TIMEOUT");
  const int n = pg->size(), r = pg->rank(), missing = n - 1;
  auto warm = on_device(torch::ones({4}), torch::kFloat);
  pg->all_reduce(warm);  // everyone is here (and NCCL is connected)
  if (r == missing) {
    // Alive well past the others' timeout.
    std::this_thread::sleep_for(std::chrono::milliseconds(2000 * kScenarioTimeoutS));
    return;
  }
  auto t = on_device(torch::ones({4}), torch::kFloat);
  const auto start = Clock::now();
  const std::vector<std::string> needles = {
      "all_reduce timed out after " + std::to_string(kScenarioTimeoutS) + " s on rank " +
          std::to_string(r) + " of " + std::to_string(n),
      "rank " + std::to_string(missing) + " did not take part (alive"};
  const char* blocking = std::getenv("STRATA_NCCL_BLOCKING_WAIT");
  if (!on_cuda() || (blocking && std::string(blocking) == "1")) {
    expect_error([&] { pg->all_reduce(t); }, needles, "all_reduce with a rank absent");
  } else {
    // CUDA, non-blocking waits: the call returns; the watchdog fails it; wait() rethrows.
    auto w = pg->all_reduce_async(t);
    while (!w->is_completed() && seconds_since(start) < 20)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    expect_error([&] { w->wait(); }, needles, "wait() on the all_reduce with a rank absent");
  }
  const double took = seconds_since(start);
  check(took > kScenarioTimeoutS - 0.5 && took < 8 + kScenarioExtraS,
        "failed after " + std::to_string(took) + " s");
  expect_error([&] { pg->barrier(); }, {"barrier on group world: the group is broken",
                                        "all_reduce timed out"},
               "later calls");
}

// The last rank dies after the first collective. STRATA_TIMEOUT=kScenarioTimeoutS.
STRATA_SCENARIO(timeout_dead) {
  auto pg = init_process_group();
  const int n = pg->size(), r = pg->rank(), dead = n - 1;
  auto warm = on_device(torch::ones({4}), torch::kFloat);
  pg->all_reduce(warm);
  if (r == dead) {
    std::cout << "rank " << r << ": exiting without a word" << std::endl;
    _exit(0);
  }
  auto in = on_device(torch::ones({4}), torch::kFloat);
  auto out = torch::zeros({4 * n}, in.options());
  const auto start = Clock::now();
  const std::vector<std::string> needles = {
      "all_gather", "on rank " + std::to_string(r) + " of " + std::to_string(n),
      "rank " + std::to_string(dead) + " did not take part (no heartbeat"};
  if (!on_cuda()) {
    // Rank 0 has called a later collective too (asynchronously): ahead, but no culprit; the
    // error names the dead rank alone.
    auto extra = torch::ones({2});
    WorkPtr gather, later;
    if (r == 0) {
      gather = pg->all_gather_async(out, in);
      later = pg->all_reduce_async(extra);
    }
    const std::string m = expect_error(
        [&] { r == 0 ? gather->wait() : pg->all_gather(out, in); }, needles,
        "all_gather with a rank dead");
    check(m.find("is ahead") == std::string::npos && m.find("alive, but") == std::string::npos,
          "only the dead rank is named beside the others' progress: " + m);
  } else {
    auto w = pg->all_gather_async(out, in);
    while (!w->is_completed() && seconds_since(start) < 20)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    expect_error([&] { w->wait(); }, needles, "wait() on the all_gather with a rank dead");
  }
  const double took = seconds_since(start);
  check(took < 8 + kScenarioExtraS, "failed after " + std::to_string(took) + " s");
}

// Started without the last rank. STRATA_TIMEOUT=kScenarioTimeoutS.
STRATA_SCENARIO(rendezvous_absent) {
  const RankEnv e = read_rank_env();
  const auto start = Clock::now();
  expect_error([] { init_process_group(); },
               {"rendezvous timed out after " + std::to_string(kScenarioTimeoutS) + " s on rank " +
                    std::to_string(e.rank) + " of " + std::to_string(e.world_size),
                "rank " + std::to_string(e.world_size - 1) + " never arrived"},
               "init without the last rank");
  check(seconds_since(start) < 6 + 2 * kScenarioExtraS,
        "took " + std::to_string(seconds_since(start)) + " s");
}

// Started without rank 0, which serves the store. STRATA_TIMEOUT=kScenarioTimeoutS.
STRATA_SCENARIO(rendezvous_no_server) {
  const RankEnv e = read_rank_env();
  const auto start = Clock::now();
  expect_error([] { init_process_group(); },
               {"rendezvous failed on rank " + std::to_string(e.rank), "rank 0"},
               "init without rank 0");
  check(seconds_since(start) < 6 + 2 * kScenarioExtraS,
        "took " + std::to_string(seconds_since(start)) + " s");
}

// The last rank never calls new_group. STRATA_TIMEOUT=kScenarioTimeoutS.
STRATA_SCENARIO(new_group_absent) {
  auto pg = init_process_group();
  const int n = pg->size(), missing = n - 1;
  pg->barrier();
  if (pg->rank() == missing) {
    std::this_thread::sleep_for(std::chrono::milliseconds(6500 + 2000 * kScenarioExtraS));
    return;
  }
  std::vector<int> all;
  for (int k = 0; k < n; ++k) all.push_back(k);
  const auto start = Clock::now();
  expect_error([&] { pg->new_group(all); },
               {"new_group timed out after " + std::to_string(kScenarioTimeoutS) + " s",
                "rank " + std::to_string(missing) + " (alive, but it did not call new_group"},
               "new_group with a rank absent");
  const double took = seconds_since(start);
  check(took > kScenarioTimeoutS - 0.5 && took < 5 + kScenarioTimeoutS,
        "failed after " + std::to_string(took) + " s");
}

}  // namespace strata::test

namespace strata::test {

// One rank, one GPU: a call that mixes CPU and CUDA tensors is refused, naming the collective.
STRATA_SCENARIO(mixed_devices) {
  auto pg = init_process_group();
  auto cpu = torch::ones({4});
  auto gpu = torch::zeros({4}, torch::Device(torch::kCUDA, 0));
  expect_error([&] { pg->all_gather(gpu, cpu); },
               {"all_gather: mixes CPU and CUDA tensors", "cuda:0", "cpu"}, "mixed all_gather");
  expect_error([&] { pg->all_to_all_single(cpu, gpu); },
               {"all_to_all_single: mixes CPU and CUDA tensors"}, "mixed all_to_all_single");
  pg->all_reduce(gpu);  // a world of one over NCCL
  check(gpu.cpu().sum().item<double>() == 0, "all_reduce of one on CUDA");
}

}  // namespace strata::test
