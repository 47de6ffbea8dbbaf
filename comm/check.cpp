// Comparing the members' calls (see check.h). Pure functions of the exchanged words, so that
// every member reaches the same verdict and the same message.
#include "comm/check.h"

#include <c10/core/ScalarType.h>

#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/process_group.h"
#include "comm/runtime.h"

namespace strata::comm::detail {
namespace {

constexpr int64_t kMagic = 0x53545243484b0001;  // "STRCHK", version 1
enum Word { kMagicW, kColl, kOp, kDtype, kDevice, kIn, kOut, kRoot, kSplits };
static_assert(kSplits + 1 == kWords, "header layout");

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The hash weight of the split matrix entry "from sends to `to`".
uint64_t weight(int from, int to) { return mix((uint64_t(uint32_t(from)) << 32) | uint32_t(to)); }

std::string where(const GroupInfo& g) {
  return g.name == "world" ? "group world"
                           : fmt::format("group {} (world ranks [{}])", g.name,
                                         fmt::join(g.world_ranks, ", "));
}

std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return fmt::format("rank {}", ranks[0]);
  if (ranks.size() <= 6) return fmt::format("ranks {}", fmt::join(ranks, ", "));
  return fmt::format("ranks {}, {}, ... ({} ranks)", ranks[0], ranks[1], ranks.size());
}

// One header in words, e.g. "all_reduce(sum) of 10 float32".
std::string describe(const int64_t* h) {
  const Coll c = Coll(h[kColl]);
  if (c == Coll::Barrier) return "barrier";
  const std::string op = h[kOp] >= 0 ? fmt::format("({})", to_string(ReduceOp(h[kOp]))) : "";
  const std::string dt = dtype_name(h[kDtype]);
  const std::string dev = h[kDevice] == 1 ? " on CUDA" : "";
  switch (c) {
    case Coll::AllReduce: return fmt::format("all_reduce{} of {} {}{}", op, h[kIn], dt, dev);
    case Coll::Broadcast:
      return fmt::format("broadcast of {} {} from rank {}{}", h[kIn], dt, h[kRoot], dev);
    case Coll::AllGather:
      return fmt::format("all_gather of {} {} per rank{}", h[kIn], dt, dev);
    case Coll::ReduceScatter:
      return fmt::format("reduce_scatter{} of {} {} per rank{}", op, h[kOut], dt, dev);
    case Coll::AllToAll: return fmt::format("all_to_all_single of {}{}", dt, dev);
    case Coll::Barrier: break;
  }
  return fmt::format("an unknown collective ({})", h[kColl]);
}

// The words that must be equal on every member.
std::vector<int64_t> key(const int64_t* h) {
  const Coll c = Coll(h[kColl]);
  if (c == Coll::Barrier) return {h[kColl]};
  if (c == Coll::AllToAll) return {h[kColl], h[kDevice], h[kDtype]};
  return {h[kColl], h[kOp], h[kDtype], h[kDevice], h[kIn], h[kOut], h[kRoot]};
}

constexpr const char* kStillUsable = "nothing was sent, and the group can still be used";

}  // namespace

const char* coll_name(Coll c) {
  switch (c) {
    case Coll::AllReduce: return "all_reduce";
    case Coll::Broadcast: return "broadcast";
    case Coll::AllGather: return "all_gather";
    case Coll::ReduceScatter: return "reduce_scatter";
    case Coll::AllToAll: return "all_to_all_single";
    case Coll::Barrier: return "barrier";
  }
  return "?";
}

std::string dtype_name(int64_t scalar_type) {
  switch (at::ScalarType(scalar_type)) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    default: break;
  }
  if (scalar_type < 0 || scalar_type >= int64_t(at::ScalarType::NumOptions))
    return fmt::format("dtype #{}", scalar_type);
  return c10::toString(at::ScalarType(scalar_type));
}

std::vector<int64_t> encode(const Signature& s, int rank, int size) {
  uint64_t splits = 0;  // wraps
  if (s.coll == Coll::AllToAll) {
    for (int q = 0; q < size; ++q) {
      splits += uint64_t(s.send_counts[q]) * weight(rank, q);
      splits -= uint64_t(s.recv_counts[q]) * weight(q, rank);
    }
  }
  return {kMagic,      int64_t(s.coll), s.op,   s.dtype,         s.device,
          s.in_numel, s.out_numel,     s.root, int64_t(splits)};
}

Verdict compare(const GroupInfo& g, uint64_t seq, const std::vector<int64_t>& headers) {
  const int n = g.size();
  auto at = [&](int r) { return headers.data() + size_t(r) * kWords; };
  const std::string mine = coll_name(Coll(at(g.rank)[kColl]));
  for (int r = 0; r < n; ++r)
    if (at(r)[kMagicW] != kMagic)
      return {false, false,
              fmt::format("{} on {}: the check header from rank {} is damaged (another Strata "
                          "version, or STRATA_COMM_CHECK differs between the ranks)",
                          mine, where(g), r)};
  bool same = true;
  for (int r = 1; r < n && same; ++r) same = key(at(r)) == key(at(0));
  if (!same) {
    std::vector<std::pair<std::string, std::vector<int>>> calls;  // in order of first rank
    std::map<std::string, size_t> index;
    for (int r = 0; r < n; ++r) {
      const std::string d = describe(at(r));
      auto [it, fresh] = index.emplace(d, calls.size());
      if (fresh) calls.push_back({d, {}});
      calls[it->second].second.push_back(r);
    }
    std::vector<std::string> parts;
    for (auto& [d, ranks] : calls) parts.push_back(rank_list(ranks) + ": " + d);
    return {false, false,
            fmt::format("{} on {}: the members' calls differ (call #{} on the group): {}. Every "
                        "member must call the same collective with the same dtype and element "
                        "count (all_gather, reduce_scatter: the same count per rank); {}",
                        mine, where(g), seq, fmt::join(parts, "; "), kStillUsable)};
  }
  if (Coll(at(0)[kColl]) == Coll::AllToAll) {
    uint64_t sum = 0;
    for (int r = 0; r < n; ++r) sum += uint64_t(at(r)[kSplits]);
    if (sum != 0) return {false, true, ""};
  }
  return {};
}

std::vector<int64_t> counts_of(const Signature& s, int size) {
  std::vector<int64_t> v(2 * size_t(size), 0);
  for (int q = 0; q < size && q < int(s.send_counts.size()); ++q) v[q] = s.send_counts[q];
  for (int q = 0; q < size && q < int(s.recv_counts.size()); ++q) v[size + q] = s.recv_counts[q];
  return v;
}

std::optional<std::string> counts_mismatch(const GroupInfo& g, uint64_t seq,
                                           const Signature& mine, const std::vector<int64_t>& all) {
  const int n = g.size();
  auto send = [&](int p, int q) { return all[size_t(p) * 2 * n + q]; };
  auto recv = [&](int p, int q) { return all[size_t(p) * 2 * n + n + q]; };
  std::vector<std::string> pairs;
  int bad = 0;
  for (int p = 0; p < n; ++p)
    for (int q = 0; q < n; ++q)
      if (send(p, q) != recv(q, p) && bad++ < 4)
        pairs.push_back(fmt::format("rank {} sends {} elements to rank {}, which expects {}", p,
                                    send(p, q), q, recv(q, p)));
  if (bad > 4) pairs.push_back(fmt::format("{} more pairs", bad - 4));
  if (bad == 0) return std::nullopt;  // the hash collided; the splits agree
  return fmt::format("{} on {}: the split sizes differ (call #{} on the group, {}): {}. Rank p's "
                     "input split for rank q must equal rank q's output split for rank p; {}",
                     coll_name(mine.coll), where(g), seq, dtype_name(mine.dtype),
                     fmt::join(pairs, "; "), kStillUsable);
}

}  // namespace strata::comm::detail
