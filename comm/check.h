// Call checking: before a collective runs, the members compare what each of them passed to it
// (which collective, reduce op, dtype, element counts, root, all-to-all splits) and, when they
// differ, every member throws the same strata::Error and nothing is sent.
//
// Why: Gloo trusts every rank to pass the same sizes. A rank that receives more bytes than it
// posted fails a GLOO_ENFORCE on Gloo's own event-loop thread (gloo/transport/tcp/pair.cc,
// Pair::prepareRead), where nobody can catch it: std::terminate, SIGABRT. A rank that receives
// fewer bytes "succeeds" with stale data. Only an agreement on sizes before the data moves
// prevents both, so on CPU tensors it is on by default: one round of fixed-size messages per
// collective (an all-gather of kWords int64 per rank, comm/gloo_backend.cpp), which cannot overrun
// anything whatever the ranks disagree on. NCCL has the same trust; there the check is a debug
// mode (a host-blocking Gloo exchange before each CUDA collective).
//
// STRATA_COMM_CHECK (or InitOptions::check), the same on every rank:
//   cpu (default)  collectives on CPU tensors and barriers
//   all / 1        also collectives on CUDA tensors
//   off / 0        none: a mismatch on Gloo then aborts a rank inside Gloo, on NCCL it hangs
//                  until the watchdog's timeout or reads stale data
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/env.h"
#include "runtime/error.h"

namespace strata::comm::detail {

struct GroupInfo;

enum class Coll : int64_t { AllReduce = 1, Broadcast, AllGather, ReduceScatter, AllToAll, Barrier };
const char* coll_name(Coll c);
std::string dtype_name(int64_t scalar_type);  // "float32", "int64", "Bool", ...

// What one rank passed to one collective.
struct Signature {
  Coll coll = Coll::Barrier;
  int64_t op = -1;        // ReduceOp for reductions, else -1
  int64_t dtype = -1;     // at::ScalarType, -1 for barriers
  int64_t device = -1;    // 0 CPU, 1 CUDA, -1 for barriers
  int64_t in_numel = 0;   // the tensor of all_reduce and broadcast; the input otherwise
  int64_t out_numel = 0;  // the same tensor, or the output
  int64_t root = -1;      // broadcast
  std::vector<int64_t> send_counts, recv_counts;  // all_to_all: elements to / from each member
};

// One rank's fixed-size header. All-to-all splits enter as one word: the sum over the ranks of
// these words is zero when every rank's send count to p equals p's receive count from it (a
// random linear hash of the split matrix, computed from its rows minus from its columns).
constexpr size_t kWords = 9;
std::vector<int64_t> encode(const Signature& s, int rank, int size);

// Compares the headers of every member (rank r's at [r * kWords, (r + 1) * kWords)) for
// collective #seq. Every member gets the same verdict from the same headers.
struct Verdict {
  bool ok = true;
  bool need_counts = false;  // all_to_all splits disagree: exchange counts_of() for the details
  std::string message;       // when !ok and !need_counts
};
Verdict compare(const GroupInfo& g, uint64_t seq, const std::vector<int64_t>& headers);

// send_counts then recv_counts: 2 * size words, the same length on every member.
std::vector<int64_t> counts_of(const Signature& s, int size);
// The message naming the first pairs whose splits disagree (all: counts_of() of every member);
// nullopt when none does.
std::optional<std::string> counts_mismatch(const GroupInfo& g, uint64_t seq,
                                           const Signature& mine, const std::vector<int64_t>& all);

// A mismatch found by the check. Every member throws it for the same call and none sent
// anything, so the group stays usable (unlike a timeout or a broken connection).
class Mismatch : public Error {
 public:
  using Error::Error;
};

}  // namespace strata::comm::detail
