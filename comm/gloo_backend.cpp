// Gloo collectives for CPU tensors.
//
// Symbols: pip LibTorch 2.x carries its own, newer Gloo inside libtorch_cpu.so and exports its
// symbols. Strata is compiled against Debian's libgloo headers, so its calls must bind to
// Debian's libgloo.so: comm/CMakeLists.txt puts libgloo first among every executable's needed
// libraries (the dynamic linker binds to the first definition it finds), and
// gloo_library_path() lets a test check where gloo::allreduce resolved.
#include "comm/gloo_backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include "runtime/error.h"

namespace strata::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;
using ReduceFn = void (*)(void*, const void*, const void*, size_t);

// The rendezvous store as Gloo sees it (wrapped per group in a gloo::rendezvous::PrefixStore).
// Gloo publishes each member's address under "<prefix>/<group rank>"; a wait that times out
// names the members whose keys never came, by world rank, as every other error does.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(detail::Store& store, std::chrono::milliseconds timeout, const GroupInfo& group)
      : store_(store),
        timeout_(timeout),
        group_(group),
        prefix_("strata/gloo/" + group.name + "/") {}
  const std::string& prefix() const { return prefix_; }
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    auto v = store_.get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    if (store_.wait_for(keys, timeout)) return;
    throw Error(fmt::format("Gloo rendezvous of group {} timed out after {} s: {}", group_.name,
                            timeout.count() / 1000.0, missing(keys)));
  }

 private:
  // "rank 3 never published its address (...)", or the keys when they are not members' addresses
  // or the store cannot say which are missing.
  std::string missing(const std::vector<std::string>& keys) {
    std::vector<std::string> absent;
    try {
      for (const auto& k : keys)
        if (!store_.check({k})) absent.push_back(k);
    } catch (const std::exception&) {
      absent = keys;  // the store itself is gone; its own error came first on other paths
    }
    std::vector<int> ranks;
    for (const auto& k : absent) {
      if (k.compare(0, prefix_.size(), prefix_) != 0) return keys_text(absent);
      const std::string tail = k.substr(prefix_.size());
      if (tail.empty() || tail.find_first_not_of("0123456789") != std::string::npos ||
          tail.size() > 6)
        return keys_text(absent);
      const int g = std::stoi(tail);
      if (g >= group_.size()) return keys_text(absent);
      ranks.push_back(group_.world_ranks[size_t(g)]);
    }
    if (ranks.empty()) return keys_text(keys);
    return fmt::format("rank{} {} never published {} Gloo address (store key{} {}): the process "
                       "died, hangs or has not started",
                       ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "),
                       ranks.size() > 1 ? "their" : "its", absent.size() > 1 ? "s" : "",
                       fmt::join(absent, ", "));
  }
  static std::string keys_text(const std::vector<std::string>& keys) {
    return fmt::format("waiting for store key(s) {}", fmt::join(keys, ", "));
  }

  detail::Store& store_;
  std::chrono::milliseconds timeout_;
  const GroupInfo& group_;
  std::string prefix_;
};

class CpuWork : public Work {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Calls f(T{}) with the element type Gloo reduces this dtype in (after reduction_buffer()).
// Collectives that only move data move bytes, whatever the dtype.
template <class F>
void with_gloo_type(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kDouble: return f(double{});
    case at::kInt: return f(int32_t{});
    case at::kLong: return f(int64_t{});
    case at::kByte: return f(uint8_t{});
    default: throw Error(fmt::format("Gloo: unsupported dtype {}", c10::toString(type)));
  }
}

template <class T>
ReduceFn reduce_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return static_cast<ReduceFn>(&gloo::sum<T>);
    case ReduceOp::Max: return static_cast<ReduceFn>(&gloo::max<T>);
    case ReduceOp::Min: return static_cast<ReduceFn>(&gloo::min<T>);
  }
  return nullptr;
}

// float16 and bfloat16 reduce in float32 and round once at the end, so a Sum or Avg whose result
// is representable is never inf (2 x 40960 overflows float16 on the way to the mean 40960). NCCL
// gets there another way: its ncclAvg on floating types multiplies by 1/n before summing
// (PreMulSum). A Sum beyond the dtype's range is inf on both.
torch::Tensor reduction_buffer(const torch::Tensor& t, bool copy) {
  if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) return t.to(at::kFloat);
  return copy ? t.clone() : t;
}

template <class T>
T* ptr_of(const torch::Tensor& t) {
  static char empty[16];
  return t.numel() == 0 ? reinterpret_cast<T*>(empty) : static_cast<T*>(t.data_ptr());
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace

std::shared_ptr<void> make_gloo_device(const RankEnv& env) {
  gloo::transport::tcp::attr attr;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    attr.iface = ifname;
  } else if (is_loopback(env.master_addr) || env.world_size == 1) {
    attr.hostname = "127.0.0.1";
  } else {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    attr.hostname = name;
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {}: could not create the Gloo TCP device on {}: {} (set "
                            "GLOO_SOCKET_IFNAME to the network interface to use)",
                            env.rank, attr.iface.empty() ? attr.hostname : attr.iface, e.what()));
  }
}

std::string gloo_library_path() {
  void* sym = dlsym(RTLD_DEFAULT, "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE");
  Dl_info info{};
  if (!sym || !dladdr(sym, &info) || !info.dli_fname) return "";
  return info.dli_fname;
}

struct GlooBackend::Impl {
  GroupInfo info;
  std::shared_ptr<GroupHealth> health;
  std::shared_ptr<gloo::rendezvous::Context> ctx;

  struct Task {
    std::string name;
    Call call;  // with a signature: compare the members' calls before the body
    std::function<void()> body;
    std::shared_ptr<CpuWork> work;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stop = false;
  std::thread worker;

  std::chrono::milliseconds timeout() const { return info.rt->timeout; }
  uint32_t tag(uint64_t seq) const { return static_cast<uint32_t>(seq); }

  WorkPtr submit(std::string name, const Call& call, std::function<void()> body) {
    auto work = std::make_shared<CpuWork>();
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back({std::move(name), call, std::move(body), work});
    }
    cv.notify_one();
    return work;
  }

  void run() {
    // The worker's copies belong to the collectives, not to the program: op callbacks (profilers,
    // ZeRO-3's gather-on-use) must not see them.
    at::DisableRecordFunctionGuard no_op_callbacks;
    while (true) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [this] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      task.work->finish(execute(task));
    }
  }

  std::exception_ptr execute(const Task& task) {
    if (auto broken = health->error())
      return std::make_exception_ptr(Error(fmt::format(
          "{} was not run: group {} is broken by an earlier error: {}", task.name, info.name,
          *broken)));
    const auto start = Clock::now();
    try {
      if (task.call.check) verify(*task.call.check, task.call.seq);
      task.body();
      return nullptr;
    } catch (const Mismatch&) {
      return std::current_exception();  // every member threw it and nothing moved
    } catch (const Error& e) {
      health->fail(e.what());
      return std::current_exception();
    } catch (const std::exception& e) {
      // gloo::IoException when a peer's connection breaks or a receive times out.
      const auto elapsed =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
      const std::string what = e.what();
      const bool timed_out = what.find("Timed out") != std::string::npos ||
                             elapsed >= timeout() - std::chrono::milliseconds(20);
      const bool from_gloo = dynamic_cast<const gloo::Exception*>(&e) != nullptr;
      std::string message =
          from_gloo ? failure_message(info, task.name, task.call.seq, elapsed, timed_out,
                                      "Gloo: " + what)
                    : fmt::format("{} failed on rank {} of {} in group {}: {}", task.name,
                                  info.rank, info.size(), info.name, what);
      health->fail(message);
      return std::make_exception_ptr(Error(message));
    }
  }

  std::chrono::milliseconds left_ms(Clock::time_point deadline) const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  }

  // An all-gather in one round of messages: `mine` goes to every other member, theirs come back
  // in rank order. Every member sends the same number of words, so the receives cannot overrun.
  std::vector<int64_t> exchange(const std::vector<int64_t>& mine, uint64_t slot) {
    const int n = info.size(), r = info.rank;
    const size_t bytes = mine.size() * sizeof(int64_t);
    std::vector<int64_t> all(mine.size() * n);
    std::copy(mine.begin(), mine.end(), all.begin() + size_t(r) * mine.size());
    auto send = ctx->createUnboundBuffer(const_cast<int64_t*>(mine.data()), bytes);
    auto recv = ctx->createUnboundBuffer(all.data(), bytes * n);
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      recv->recv(p, slot, size_t(p) * bytes, bytes);
      send->send(p, slot, 0, bytes);
    }
    const auto deadline = Clock::now() + timeout();
    for (int i = 0; i < n - 1; ++i)
      if (!recv->waitRecv(left_ms(deadline)) || !send->waitSend(left_ms(deadline)))
        throw gloo::IoException("the call check's exchange was aborted");
    return all;
  }

  // Compares the members' calls (check.h); throws Mismatch on every member when they differ.
  void verify(const Signature& sig, uint64_t seq) {
    const int n = info.size();
    if (n == 1) return;
    const uint64_t slot = (uint64_t(0xC4) << 56) | (uint64_t(tag(seq)) << 16);
    const Verdict v = compare(info, seq, exchange(encode(sig, info.rank, n), slot));
    if (v.ok) return;
    if (!v.need_counts) throw Mismatch(v.message);
    if (auto m = counts_mismatch(info, seq, sig, exchange(counts_of(sig, n), slot + 1)))
      throw Mismatch(*m);
  }

  // Ring reduce-scatter over Gloo's unbound buffers (this Gloo has no function-style
  // reduce_scatter): size-1 steps, each sending one accumulated chunk to the right neighbour and
  // adding the chunk received from the left one. Bandwidth-optimal, like the first half of a
  // ring all-reduce.
  void ring_reduce_scatter(const torch::Tensor& out, const torch::Tensor& in, ReduceOp op,
                           uint64_t seq) {
    const int n = info.size(), r = info.rank;
    torch::Tensor acc = reduction_buffer(in, /*copy=*/true);
    const int64_t chunk = out.numel();
    torch::Tensor tmp = torch::empty({chunk}, acc.options());
    if (n > 1 && chunk > 0) {
      const size_t bytes = size_t(chunk) * acc.element_size();
      auto send = ctx->createUnboundBuffer(acc.data_ptr(), bytes * n);
      auto recv = ctx->createUnboundBuffer(tmp.data_ptr(), bytes);
      ReduceFn fn = nullptr;
      with_gloo_type(acc.scalar_type(), [&](auto t) { fn = reduce_fn<decltype(t)>(op); });
      const uint64_t base = (uint64_t(0xA5) << 56) | (uint64_t(tag(seq)) << 16);
      const auto deadline = Clock::now() + timeout();
      const int right = (r + 1) % n, left = (r + n - 1) % n;
      for (int step = 0; step < n - 1; ++step) {
        const int send_chunk = ((r - step - 1) % n + n) % n;
        const int recv_chunk = ((r - step - 2) % n + n) % n;
        recv->recv(left, base + step);
        send->send(right, base + step, size_t(send_chunk) * bytes, bytes);
        if (!recv->waitRecv(left_ms(deadline)) || !send->waitSend(left_ms(deadline)))
          throw gloo::IoException("reduce_scatter: a transfer was aborted");
        char* dst = static_cast<char*>(acc.data_ptr()) + size_t(recv_chunk) * bytes;
        fn(dst, dst, tmp.data_ptr(), size_t(chunk));
      }
    }
    torch::Tensor mine = acc.view({-1}).narrow(0, int64_t(r) * chunk, chunk);
    if (op == ReduceOp::Avg) mine.div_(n);
    out.view({-1}).copy_(mine);
  }
};

GlooBackend::GlooBackend(GroupInfo info, std::shared_ptr<GroupHealth> health)
    : impl_(std::make_unique<Impl>()) {
  impl_->info = std::move(info);
  impl_->health = std::move(health);
  const GroupInfo& g = impl_->info;
  auto device = std::static_pointer_cast<gloo::transport::Device>(g.rt->gloo_device);
  try {
    auto ctx = std::make_shared<gloo::rendezvous::Context>(g.rank, g.size());
    ctx->setTimeout(g.rt->timeout);
    GlooStore store(*g.rt->store, g.rt->timeout, g);
    gloo::rendezvous::PrefixStore prefixed(store.prefix().substr(0, store.prefix().size() - 1),
                                           store);
    ctx->connectFullMesh(prefixed, device);
    // No member returns before every member has connected: one that returned and exited at once
    // (a refusal right after the group forms) closed its sockets under a member still in its
    // handshake, which then failed with "Connection closed by peer" (test_ulysses under ASan).
    gloo::BarrierOptions connected(ctx);
    connected.setTimeout(g.rt->timeout);
    gloo::barrier(connected);
    impl_->ctx = std::move(ctx);
  } catch (const std::exception& e) {
    throw Error(fmt::format("group {}: rank {} of {} could not connect to the other members over "
                            "Gloo: {}",
                            g.name, g.rank, g.size(), e.what()));
  }
  impl_->worker = std::thread([impl = impl_.get()] { impl->run(); });
}

GlooBackend::~GlooBackend() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->worker.joinable()) impl_->worker.join();
}

WorkPtr GlooBackend::all_reduce(torch::Tensor t, ReduceOp op, const Call& call) {
  Impl* m = impl_.get();
  const uint32_t tag = m->tag(call.seq);
  return m->submit("all_reduce", call, [m, t, op, tag] {
    if (t.numel() == 0 || m->info.size() == 1) return;
    torch::Tensor buf = reduction_buffer(t, /*copy=*/false);
    with_gloo_type(buf.scalar_type(), [&](auto type) {
      using T = decltype(type);
      gloo::AllreduceOptions o(m->ctx);
      o.setOutput<T>(static_cast<T*>(buf.data_ptr()), size_t(buf.numel()));
      o.setReduceFunction(reduce_fn<T>(op));
      o.setTag(tag);
      o.setTimeout(m->timeout());
      gloo::allreduce(o);
    });
    if (op == ReduceOp::Avg) buf.div_(m->info.size());
    if (!buf.is_same(t)) t.copy_(buf);
  });
}

// Moves bytes: any dtype (bool masks, int8, int16, complex, ...).
WorkPtr GlooBackend::broadcast(torch::Tensor t, int root, const Call& call) {
  Impl* m = impl_.get();
  const uint32_t tag = m->tag(call.seq);
  return m->submit("broadcast", call, [m, t, root, tag] {
    if (t.numel() == 0 || m->info.size() == 1) return;
    gloo::BroadcastOptions o(m->ctx);
    o.setRoot(root);
    o.setOutput<uint8_t>(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());  // root: the input
    o.setTag(tag);
    o.setTimeout(m->timeout());
    gloo::broadcast(o);
  });
}

WorkPtr GlooBackend::all_gather(torch::Tensor out, torch::Tensor in, const Call& call) {
  Impl* m = impl_.get();
  const uint32_t tag = m->tag(call.seq);
  return m->submit("all_gather", call, [m, out, in, tag] {
    if (in.numel() == 0) return;
    if (m->info.size() == 1) {
      out.view({-1}).copy_(in.view({-1}));
      return;
    }
    gloo::AllgatherOptions o(m->ctx);
    o.setInput<uint8_t>(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
    o.setOutput<uint8_t>(static_cast<uint8_t*>(out.data_ptr()), out.nbytes());
    o.setTag(tag);
    o.setTimeout(m->timeout());
    gloo::allgather(o);
  });
}

WorkPtr GlooBackend::reduce_scatter(torch::Tensor out, torch::Tensor in, ReduceOp op,
                                    const Call& call) {
  Impl* m = impl_.get();
  const uint64_t seq = call.seq;
  return m->submit("reduce_scatter", call,
                   [m, out, in, op, seq] { m->ring_reduce_scatter(out, in, op, seq); });
}

WorkPtr GlooBackend::all_to_all(torch::Tensor out, torch::Tensor in,
                                std::vector<int64_t> out_counts, std::vector<int64_t> in_counts,
                                const Call& call) {
  Impl* m = impl_.get();
  const uint32_t tag = m->tag(call.seq);
  // In bytes, so that any dtype moves.
  const int64_t esize = in.element_size();
  for (auto& c : out_counts) c *= esize;
  for (auto& c : in_counts) c *= esize;
  return m->submit("all_to_all_single", call, [m, out, in, out_counts, in_counts, tag] {
    if (m->info.size() == 1) {
      if (in.numel() > 0) out.view({-1}).copy_(in.view({-1}));
      return;
    }
    gloo::AlltoallvOptions o(m->ctx);
    o.setInput<uint8_t>(ptr_of<uint8_t>(in), in_counts);
    o.setOutput<uint8_t>(ptr_of<uint8_t>(out), out_counts);
    o.setTag(tag);
    o.setTimeout(m->timeout());
    gloo::alltoallv(o);
  });
}

WorkPtr GlooBackend::barrier(const Call& call) {
  Impl* m = impl_.get();
  const uint32_t tag = m->tag(call.seq);
  return m->submit("barrier", call, [m, tag] {
    if (m->info.size() == 1) return;
    gloo::BarrierOptions o(m->ctx);
    o.setTag(tag);
    o.setTimeout(m->timeout());
    gloo::barrier(o);
  });
}

WorkPtr GlooBackend::check(const Signature& sig, uint64_t seq) {
  return impl_->submit(coll_name(sig.coll), Call{seq, sig}, [] {});
}

}  // namespace strata::comm::detail
