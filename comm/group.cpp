// The ProcessGroup implementation: argument checks, contiguous staging, the per-group call
// counter that the heartbeats publish, call checking (check.h), backend choice by device,
// sub-groups, and init_process_group.
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/gloo_backend.h"
#include "comm/process_group.h"
#include "comm/runtime.h"
#include "runtime/error.h"
#if STRATA_COMM_HAS_NCCL
#include "comm/nccl_backend.h"
#endif

namespace strata::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

bool nccl_available() { return STRATA_COMM_HAS_NCCL != 0; }

namespace detail {

Runtime::~Runtime() {
  if (liveness)
    liveness->shut_down(std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(30)));
}

std::string failure_message(const GroupInfo& g, const std::string& collective, uint64_t seq,
                            std::chrono::milliseconds elapsed, bool timed_out,
                            const std::string& cause) {
  const std::string where =
      g.name == "world" ? fmt::format("rank {} of {}", g.rank, g.size())
                        : fmt::format("rank {} of {} in group {} (world rank {})", g.rank,
                                      g.size(), g.name, g.world_ranks[g.rank]);
  std::string text =
      timed_out ? fmt::format("{} timed out after {:g} s on {}", collective,
                              g.rt->timeout.count() / 1000.0, where)
                : fmt::format("{} failed after {:g} s on {}", collective, elapsed.count() / 1000.0,
                              where);
  const std::string missing = g.rt->liveness->missing_in_collective(g.name, g.world_ranks, seq);
  if (!missing.empty()) text += ": " + missing;
  if (!timed_out || missing.empty()) text += fmt::format(" [{}]", cause);
  return text;
}

}  // namespace detail

namespace {

using namespace detail;
using Clock = std::chrono::steady_clock;

enum class Kind { Cpu, Cuda };

std::string dtype_of(const torch::Tensor& t) { return dtype_name(int64_t(t.scalar_type())); }

// The dtypes the reductions take; the other collectives move bytes.
bool reducible(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kInt: case at::kLong: case at::kByte: return true;
    default: return false;
  }
}

enum class Use { Read, Write };  // does the collective write the tensor?

struct Arg {
  const char* name;
  const torch::Tensor& t;
  Use use = Use::Read;
};

// Checks the tensors of one call; returns where they live.
Kind check_tensors(const char* coll, std::initializer_list<Arg> args, bool reduction = false) {
  const Arg* first = nullptr;
  for (const Arg& a : args) {
    if (!a.t.defined()) throw Error(fmt::format("{}: the {} tensor is undefined", coll, a.name));
    if (a.t.layout() != torch::kStrided) {
      std::ostringstream layout;
      layout << a.t.layout();
      throw Error(fmt::format("{}: the {} tensor has layout {}; only dense (strided) tensors are "
                              "supported",
                              coll, a.name, layout.str()));
    }
    if (reduction && !reducible(a.t.scalar_type()))
      throw Error(fmt::format("{}: dtype {} of the {} tensor is not supported (float32, float64, "
                              "float16, bfloat16, int32, int64 and uint8 are; broadcast, "
                              "all_gather and all_to_all_single take any dtype)",
                              coll, dtype_of(a.t), a.name));
    if (!a.t.device().is_cpu() && !a.t.device().is_cuda())
      throw Error(fmt::format("{}: the {} tensor is on {}; only CPU (Gloo) and CUDA (NCCL) "
                              "tensors are supported",
                              coll, a.name, a.t.device().str()));
    if (a.use == Use::Write && at::has_internal_overlap(a.t) == at::MemOverlap::Yes)
      throw Error(fmt::format("{}: the {} tensor has elements that share memory (expanded?), so "
                              "the result cannot be written into it; pass a tensor of its own",
                              coll, a.name));
    if (!first) {
      first = &a;
      continue;
    }
    if (a.t.device().type() != first->t.device().type())
      throw Error(fmt::format("{}: mixes CPU and CUDA tensors ({} on {}, {} on {}); put both on "
                              "one device",
                              coll, first->name, first->t.device().str(), a.name,
                              a.t.device().str()));
    if (a.t.device() != first->t.device())
      throw Error(fmt::format("{}: {} is on {} but {} is on {}", coll, first->name,
                              first->t.device().str(), a.name, a.t.device().str()));
    if (a.t.scalar_type() != first->t.scalar_type())
      throw Error(fmt::format("{}: dtypes differ ({} is {}, {} is {})", coll, first->name,
                              dtype_of(first->t), a.name, dtype_of(a.t)));
  }
  return first->t.device().is_cuda() ? Kind::Cuda : Kind::Cpu;
}

// A non-contiguous tensor travels through a contiguous copy; what the collective writes is copied
// back into it when the caller waits (on CUDA, on the stream that wait() ordered after it).
class CopyBackWork final : public Work {
 public:
  CopyBackWork(WorkPtr inner, std::vector<std::pair<torch::Tensor, torch::Tensor>> back)
      : inner_(std::move(inner)), back_(std::move(back)) {}
  void wait() override {
    inner_->wait();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [user, flat] : back_) user.copy_(flat);
    back_.clear();
  }
  bool is_completed() override { return inner_->is_completed(); }

 private:
  WorkPtr inner_;
  std::mutex mu_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> back_;  // (caller's tensor, staged copy)
};

class Staging {
 public:
  // The tensor for the backend: `t` itself when contiguous.
  torch::Tensor input(const torch::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
  torch::Tensor output(const torch::Tensor& t, bool read_too) {
    if (t.is_contiguous()) return t;
    torch::Tensor flat = read_too ? t.contiguous() : torch::empty(t.sizes(), t.options());
    back_.emplace_back(t, flat);
    return flat;
  }
  WorkPtr finish(WorkPtr w) {
    if (back_.empty()) return w;
    return std::make_shared<CopyBackWork>(std::move(w), std::move(back_));
  }

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> back_;
};

Signature signature(Coll coll, const torch::Tensor& in, const torch::Tensor& out, int64_t op = -1,
                    int64_t root = -1) {
  Signature s;
  s.coll = coll;
  s.op = op;
  s.dtype = int64_t(in.scalar_type());
  s.device = in.device().is_cuda() ? 1 : 0;
  s.in_numel = in.numel();
  s.out_numel = out.numel();
  s.root = root;
  return s;
}

void check_avg(const char* coll, ReduceOp op, const torch::Tensor& t) {
  if (op == ReduceOp::Avg && !at::isFloatingType(t.scalar_type()))
    throw Error(fmt::format("{}: ReduceOp::Avg needs a floating dtype, got {}; use Sum and "
                            "divide",
                            coll, dtype_of(t)));
}

std::vector<int64_t> split_counts(const char* coll, const char* which, const torch::Tensor& t,
                                  const std::vector<int64_t>& splits, int size, int64_t row) {
  std::vector<int64_t> counts(size);
  const int64_t rows = t.size(0);
  if (splits.empty()) {
    if (rows % size != 0)
      throw Error(fmt::format("{}: {} has {} rows, not divisible by the group size {}; pass "
                              "split sizes",
                              coll, which, rows, size));
    std::fill(counts.begin(), counts.end(), rows / size * row);
    return counts;
  }
  if (int(splits.size()) != size)
    throw Error(fmt::format("{}: {} has {} split sizes, the group has {} members", coll, which,
                            splits.size(), size));
  int64_t total = 0;
  for (int i = 0; i < size; ++i) {
    if (splits[i] < 0)
      throw Error(fmt::format("{}: {} split size {} is negative ({})", coll, which, i, splits[i]));
    total += splits[i];
    counts[i] = splits[i] * row;
  }
  if (total != rows)
    throw Error(fmt::format("{}: {} split sizes add up to {}, but dim 0 has {} rows", coll,
                            which, total, rows));
  return counts;
}

class Group final : public ProcessGroup {
 public:
  explicit Group(GroupInfo info) : info_(std::move(info)), health_(std::make_shared<GroupHealth>()) {
    info_.rt->liveness->track(info_.name, info_.called);
    gloo_ = std::make_unique<GlooBackend>(info_, health_);
  }

  int rank() const override { return info_.rank; }
  int size() const override { return info_.size(); }
  const std::vector<int>& world_ranks() const override { return info_.world_ranks; }
  const std::string& name() const override { return info_.name; }
  std::chrono::milliseconds timeout() const override { return info_.rt->timeout; }

  WorkPtr all_reduce_async(torch::Tensor t, ReduceOp op) override {
    const char* coll = "all_reduce";
    Kind k = check_tensors(coll, {{"input", t, Use::Write}}, /*reduction=*/true);
    check_avg(coll, op, t);
    Staging st;
    torch::Tensor flat = st.output(t, /*read_too=*/true);
    Call call = enter(coll, k, signature(Coll::AllReduce, t, t, int64_t(op)));
    return st.finish(backend(k, coll, t.device(), call).all_reduce(flat, op, call));
  }

  WorkPtr broadcast_async(torch::Tensor t, int root) override {
    const char* coll = "broadcast";
    Kind k = check_tensors(coll, {{"input", t, rank() == root ? Use::Read : Use::Write}});
    if (root < 0 || root >= size())
      throw Error(fmt::format("broadcast: root {} is not a rank of group {} (size {})", root,
                              name(), size()));
    Staging st;
    torch::Tensor flat = st.output(t, /*read_too=*/rank() == root);
    Call call = enter(coll, k, signature(Coll::Broadcast, t, t, -1, root));
    return st.finish(backend(k, coll, t.device(), call).broadcast(flat, root, call));
  }

  WorkPtr all_gather_async(torch::Tensor out, torch::Tensor in) override {
    const char* coll = "all_gather";
    Kind k = check_tensors(coll, {{"output", out, Use::Write}, {"input", in}});
    if (out.numel() != in.numel() * size())
      throw Error(fmt::format("all_gather: output has {} elements, expected group size {} x "
                              "input's {} = {}",
                              out.numel(), size(), in.numel(), in.numel() * size()));
    Staging st;
    torch::Tensor flat_in = st.input(in), flat_out = st.output(out, /*read_too=*/false);
    Call call = enter(coll, k, signature(Coll::AllGather, in, out));
    return st.finish(backend(k, coll, in.device(), call).all_gather(flat_out, flat_in, call));
  }

  WorkPtr reduce_scatter_async(torch::Tensor out, torch::Tensor in, ReduceOp op) override {
    const char* coll = "reduce_scatter";
    Kind k = check_tensors(coll, {{"output", out, Use::Write}, {"input", in}}, true);
    check_avg(coll, op, in);
    if (in.numel() != out.numel() * size())
      throw Error(fmt::format("reduce_scatter: input has {} elements, expected group size {} x "
                              "output's {} = {}",
                              in.numel(), size(), out.numel(), out.numel() * size()));
    Staging st;
    torch::Tensor flat_in = st.input(in), flat_out = st.output(out, /*read_too=*/false);
    Call call = enter(coll, k, signature(Coll::ReduceScatter, in, out, int64_t(op)));
    return st.finish(
        backend(k, coll, in.device(), call).reduce_scatter(flat_out, flat_in, op, call));
  }

  WorkPtr all_to_all_single_async(torch::Tensor out, torch::Tensor in,
                                  std::vector<int64_t> out_splits,
                                  std::vector<int64_t> in_splits) override {
    const char* coll = "all_to_all_single";
    Kind k = check_tensors(coll, {{"output", out, Use::Write}, {"input", in}});
    if (in.dim() == 0 || out.dim() == 0)
      throw Error("all_to_all_single: tensors need at least one dimension (split along dim 0)");
    const auto row_of = [](const torch::Tensor& t) {
      int64_t r = 1;
      for (int64_t d = 1; d < t.dim(); ++d) r *= t.size(d);
      return r;
    };
    if (row_of(in) != row_of(out))
      throw Error(fmt::format("all_to_all_single: a row (dims after 0) of input has {} elements, "
                              "of output {}",
                              row_of(in), row_of(out)));
    auto in_counts = split_counts(coll, "input", in, in_splits, size(), row_of(in));
    auto out_counts = split_counts(coll, "output", out, out_splits, size(), row_of(out));
    Staging st;
    torch::Tensor flat_in = st.input(in), flat_out = st.output(out, /*read_too=*/false);
    int64_t to_others = 0;
    for (int p = 0; p < size(); ++p)
      if (p != rank()) to_others += in_counts[size_t(p)];
    count_all_to_all(to_others * int64_t(in.element_size()),
                     in_counts[size_t(rank())] * int64_t(in.element_size()));
    Signature sig = signature(Coll::AllToAll, in, out);
    sig.send_counts = in_counts;
    sig.recv_counts = out_counts;
    Call call = enter(coll, k, std::move(sig));
    return st.finish(backend(k, coll, in.device(), call)
                         .all_to_all(flat_out, flat_in, std::move(out_counts),
                                     std::move(in_counts), call));
  }

  WorkPtr barrier_async() override {
    Signature sig;
    sig.coll = Coll::Barrier;
    return gloo_->barrier(enter("barrier", Kind::Cpu, std::move(sig)));
  }

  GroupPtr new_group(const std::vector<int>& ranks) override {
    if (ranks.empty()) throw Error(fmt::format("new_group on {}: the rank list is empty", name()));
    std::set<int> seen;
    for (int r : ranks) {
      if (r < 0 || r >= size())
        throw Error(fmt::format("new_group on {}: rank {} is not a rank of this group (size {})",
                                name(), r, size()));
      if (!seen.insert(r).second)
        throw Error(fmt::format("new_group on {}: rank {} is listed twice", name(), r));
    }
    const std::string child = fmt::format("{}/g{}", name(), next_child());
    if (!seen.count(rank())) return nullptr;
    return make_child(child, ranks, "new_group");
  }

  GroupPtr split(int color, int key) override {
    auto mine = torch::tensor({int64_t(color), int64_t(key)}, torch::kLong);
    auto all = torch::empty({2 * int64_t(size())}, torch::kLong);
    all_gather(all, mine);
    const std::string child = fmt::format("{}/s{}c{}", name(), next_child(), color);
    if (color < 0) return nullptr;
    auto v = all.accessor<int64_t, 1>();
    std::vector<std::pair<int64_t, int>> order;  // (key, rank here)
    for (int r = 0; r < size(); ++r)
      if (v[2 * r] == color) order.emplace_back(v[2 * r + 1], r);
    std::sort(order.begin(), order.end());
    std::vector<int> ranks;
    for (auto& [k, r] : order) ranks.push_back(r);
    return make_child(child, ranks, "split");
  }

 private:
  // Counts the call; carries its signature when the members compare calls of this kind.
  Call enter(const char* coll, Kind kind, Signature sig) {
    if (auto broken = health_->error())
      throw Error(fmt::format("{} on group {}: the group is broken by an earlier error: {}", coll,
                              name(), *broken));
    Call call{++*info_.called, std::nullopt};
    const CommCheck mode = info_.rt->check;
    if (mode == CommCheck::All || (mode == CommCheck::Cpu && kind == Kind::Cpu))
      call.check = std::move(sig);
    return call;
  }

  int next_child() {
    std::lock_guard<std::mutex> lock(mu_);
    return children_++;
  }

  // For CUDA tensors, compares the members' calls first when asked to (blocking, over Gloo).
  Backend& backend(Kind kind, const char* coll, const torch::Device& device, Call& call) {
    if (kind == Kind::Cpu) return *gloo_;
#if STRATA_COMM_HAS_NCCL
    if (call.check) {
      gloo_->check(*call.check, call.seq)->wait();
      call.check.reset();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!nccl_) nccl_ = make_nccl_backend(info_, health_, device, coll);
    if (nccl_device_ < 0) nccl_device_ = device.index();
    if (device.index() != nccl_device_)
      throw Error(fmt::format("{}: group {} uses cuda:{} on this rank, not {} (one GPU per rank)",
                              coll, name(), nccl_device_, device.str()));
    return *nccl_;
#else
    throw Error(fmt::format("{}: CUDA tensors need the NCCL backend, and this build of Strata "
                            "has none (built without NCCL)",
                            coll));
#endif
  }

  // Members meet under the child's store prefix, check that they agree on the member list,
  // then connect Gloo.
  GroupPtr make_child(const std::string& child, const std::vector<int>& ranks, const char* how) {
    GroupInfo ci;
    ci.rt = info_.rt;
    ci.name = child;
    ci.called = std::make_shared<std::atomic<uint64_t>>(0);
    for (size_t i = 0; i < ranks.size(); ++i) {
      ci.world_ranks.push_back(info_.world_ranks[ranks[i]]);
      if (ranks[i] == rank()) ci.rank = int(i);
    }
    Store& store = *info_.rt->store;
    const std::string members = fmt::format("{}", fmt::join(ci.world_ranks, ","));
    auto key = [&](int r) { return fmt::format("strata/grp/{}/{}", child, r); };
    store.set(key(ci.rank), members);
    std::vector<std::string> keys;
    for (int r = 0; r < ci.size(); ++r) keys.push_back(key(r));
    if (!store.wait_for(keys, timeout())) {
      std::vector<int> missing;
      for (int r = 0; r < ci.size(); ++r)
        if (!store.check({key(r)})) missing.push_back(ci.world_ranks[r]);
      throw Error(fmt::format(
          "{} timed out after {:g} s on rank {} of {} creating group {} (world ranks [{}]): {}",
          how, timeout().count() / 1000.0, rank(), size(), child, members,
          info_.rt->liveness->describe_absent(missing, fmt::format("call {} for it", how))));
    }
    if (ci.rank != 0) {
      const std::string first = store.get(key(0));
      if (first != members)
        throw Error(fmt::format("{} on group {}: members disagree on group {}: world rank {} "
                                "made it [{}], this rank (world rank {}) [{}]; every member must "
                                "pass the same ranks in the same order",
                                how, name(), child, ci.world_ranks[0], first,
                                info_.world_ranks[rank()], members));
    }
    return std::make_shared<Group>(std::move(ci));
  }

  GroupInfo info_;
  std::shared_ptr<GroupHealth> health_;
  std::unique_ptr<GlooBackend> gloo_;
  std::mutex mu_;
  int children_ = 0;
#if STRATA_COMM_HAS_NCCL
  std::unique_ptr<Backend> nccl_;
  int nccl_device_ = -1;
#endif
};

}  // namespace

GroupPtr init_process_group(const InitOptions& options) {
  const RankEnv env = options.env ? *options.env : read_rank_env();
  auto rt = std::make_shared<Runtime>();
  rt->env = env;
  rt->timeout = resolve_timeout(options.timeout_s);
  rt->check = resolve_comm_check(options.check);
  if (options.blocking_wait) {
    rt->blocking_wait = *options.blocking_wait;
  } else if (const char* v = std::getenv("STRATA_NCCL_BLOCKING_WAIT")) {
    rt->blocking_wait = std::string(v) == "1";
  }
  const std::string where = fmt::format("rank {} of {}", env.rank, env.world_size);
  const auto start = Clock::now();
  try {
    const StoreAccess access = read_store_access();
    const bool many_hosts = env.local_world_size < env.world_size;
    if (env.rank == 0 && many_hosts) {
      // A name that is this host's loopback alias listens where no other host can reach it.
      if (const std::string loop = loopback_name(env.master_addr); !loop.empty())
        throw Error(fmt::format("MASTER_ADDR '{}' resolves to {} here, a loopback address (as "
                                "Debian's /etc/hosts maps the host's own name to 127.0.1.1), but "
                                "the job has ranks on other hosts, which cannot reach it; set "
                                "MASTER_ADDR to this host's address on their network",
                                env.master_addr, loop));
      if (access.secret.empty())
        std::fprintf(stderr, "strata: warning: STRATA_JOB_SECRET is not set, so anyone who "
                             "reaches %s:%d can read and write the rendezvous keys; strata-run "
                             "sets one per job, under SLURM or mpirun export the same random "
                             "value to every rank\n",
                     env.master_addr.c_str(), env.master_port);
    }
    const StoreAuth auth{access.secret, access.listen_all, access.auth_timeout};
    rt->store = Store::open(env.master_addr, env.master_port, env.rank == 0, rt->timeout, auth);
    auto beat_client = Store::open(env.master_addr, rt->store->port(), false, rt->timeout, auth);
    // Beat often enough that a dead rank is recognised well inside one timeout.
    const auto interval = std::clamp<std::chrono::milliseconds>(
        rt->timeout / 10, std::chrono::milliseconds(100), std::chrono::seconds(2));
    rt->liveness = std::make_unique<Liveness>(env.rank, env.world_size, std::move(beat_client),
                                              interval);
    if (env.rank == 0) rt->store->set("strata/comm_check", to_string(rt->check));
  } catch (const Error& e) {
    throw Error(fmt::format("rendezvous failed on {} ({} convention): {}", where, env.convention,
                            e.what()));
  }
  // Every rank's first heartbeat is its arrival.
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(Liveness::key(r));
  const auto left = rt->timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                      Clock::now() - start);
  if (!rt->store->wait_for(keys, std::max(left, std::chrono::milliseconds(1)))) {
    std::vector<int> missing;
    for (int r = 0; r < env.world_size; ++r)
      if (!rt->store->check({Liveness::key(r)})) missing.push_back(r);
    throw Error(fmt::format("rendezvous timed out after {:g} s on {}: rank{} {} never arrived "
                            "(the store is at {}:{}; {} convention)",
                            rt->timeout.count() / 1000.0, where, missing.size() > 1 ? "s" : "",
                            fmt::join(missing, ", "), env.master_addr, rt->store->port(),
                            env.convention));
  }
  // A rank that checks calls would wait for the headers of one that does not.
  if (env.rank != 0) {
    const std::string first = rt->store->get("strata/comm_check");
    if (first != to_string(rt->check))
      throw Error(fmt::format("STRATA_COMM_CHECK differs between the ranks: rank 0 has {}, {} has "
                              "{}; set the same value on every rank",
                              first, where, to_string(rt->check)));
  }
  rt->gloo_device = make_gloo_device(env);
  GroupInfo world;
  world.rt = rt;
  world.name = "world";
  world.rank = env.rank;
  world.world_ranks.resize(env.world_size);
  std::iota(world.world_ranks.begin(), world.world_ranks.end(), 0);
  world.called = std::make_shared<std::atomic<uint64_t>>(0);
  return std::make_shared<Group>(std::move(world));
}

}  // namespace strata::comm
