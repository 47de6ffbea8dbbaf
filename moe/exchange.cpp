#include "moe/exchange.h"

#include <algorithm>

#include <fmt/format.h>

#include "comm/autograd.h"
#include "moe/dispatch.h"
#include "runtime/error.h"

namespace strata::moe {
namespace {

// Local experts [first[c], first[c + 1]) form chunk c.
std::vector<int64_t> chunk_bounds(int64_t local_experts, int64_t chunks) {
  const int64_t n = std::max<int64_t>(1, std::min(chunks, local_experts));
  std::vector<int64_t> first(size_t(n + 1));
  for (int64_t c = 0; c <= n; ++c) first[size_t(c)] = c * local_experts / n;
  return first;
}

// A permutation of `rows` rows, from blocks in one order to another: block b has `length[b]`
// rows starting at `from[b]` in the source and at `to[b]` in the destination. The destination's
// row i reads the source's row index[i]. Built on the host from block sizes (ep x E_local
// entries), expanded on the device.
torch::Tensor block_permutation(const std::vector<int64_t>& from, const std::vector<int64_t>& to,
                                const std::vector<int64_t>& length, int64_t rows,
                                const torch::Device& device) {
  // Blocks listed in destination order: index[to[b] + j] = from[b] + j.
  std::vector<size_t> order(length.size());
  for (size_t b = 0; b < order.size(); ++b) order[b] = b;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return to[a] < to[b]; });
  std::vector<int64_t> shift, repeats;
  for (size_t b : order) {
    shift.push_back(from[b] - to[b]);
    repeats.push_back(length[b]);
  }
  // Two small host vectors cross without a wait (page-locked, non-blocking); the rows' indices
  // are made on the device (repeat_interleave told its output size reads nothing back).
  const auto i64 = torch::TensorOptions().dtype(torch::kLong);
  const auto per_row =
      torch::repeat_interleave(host_to_device(torch::tensor(shift, i64), device),
                               host_to_device(torch::tensor(repeats, i64), device),
                               /*dim=*/0, /*output_size=*/rows);
  return per_row + torch::arange(rows, i64.device(device));
}

}  // namespace

ExchangeResult exchange_with_experts(const torch::Tensor& x, int64_t k, const GateRoutes& g,
                                     ExpertsImpl& experts, const comm::GroupPtr& group,
                                     int64_t chunks) {
  const int64_t E = g.num_experts, ep = group->size(), me = group->rank();
  const int64_t El = experts.local_experts();
  if (E != El * ep || experts.first_expert() != me * El)
    throw Error(fmt::format("moe exchange: {} experts over {} ranks, but rank {} holds {} from {}",
                            E, ep, me, El, experts.first_expert()));
  const auto dev = x.device();
  const auto first = chunk_bounds(El, chunks);
  const int64_t nc = int64_t(first.size()) - 1;

  // 1. Counts: kept routes per expert, and what each peer sends each local expert ([ep, El]).
  const auto counts = g.kept_counts.to(torch::kLong).contiguous();
  auto peer_counts = torch::empty_like(counts);
  group->all_to_all_single(peer_counts, counts);
  const auto host = torch::cat({counts, peer_counts}).to(torch::kCPU);  // the one host read
  const auto* hc = host.data_ptr<int64_t>();
  const int64_t* send_count = hc;      // [E]: rows to global expert p * El + e
  const int64_t* recv_count = hc + E;  // [ep * El]: rows from rank p for local expert e

  // 2. Send order: (chunk, destination rank, local expert). Each expert's kept routes take the
  // rows [base, base + count) in its slot order.
  std::vector<int64_t> base(static_cast<size_t>(E)), chunk_rows(static_cast<size_t>(nc), 0);
  std::vector<std::vector<int64_t>> send_split(size_t(nc), std::vector<int64_t>(size_t(ep), 0));
  std::vector<std::vector<int64_t>> recv_split = send_split;
  int64_t sent = 0;
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t p = 0; p < ep; ++p)
      for (int64_t e = first[size_t(c)]; e < first[size_t(c) + 1]; ++e) {
        const int64_t gexp = p * El + e;
        base[size_t(gexp)] = sent;
        sent += send_count[gexp];
        chunk_rows[size_t(c)] += send_count[gexp];
        send_split[size_t(c)][size_t(p)] += send_count[gexp];
        recv_split[size_t(c)][size_t(p)] += recv_count[p * El + e];
      }
  const auto i64 = torch::TensorOptions().dtype(torch::kLong).device(dev);
  const auto base_t = host_to_device(torch::tensor(base, torch::kLong), dev);
  const auto position =
      (base_t.index_select(0, g.expert) + g.slot).masked_fill(g.kept.logical_not(), sent);
  const auto send = dispatch_tokens(x, k, position, sent);

  // Streamed experts: the units to run, agreed once for every chunk.
  std::vector<int64_t> rows_per_expert(size_t(El), 0);
  for (int64_t p = 0; p < ep; ++p)
    for (int64_t e = 0; e < El; ++e) rows_per_expert[size_t(e)] += recv_count[p * El + e];
  const auto active = experts.agree_units(rows_per_expert);

  // 3. Every chunk's dispatch first (on a GPU they run on NCCL's stream while experts compute).
  std::vector<torch::Tensor> arrived(static_cast<size_t>(nc));
  int64_t offset = 0, received = 0;
  for (int64_t c = 0; c < nc; ++c) {
    arrived[size_t(c)] = comm::autograd::all_to_all_variable(
        send.narrow(0, offset, chunk_rows[size_t(c)]), group,
                                             send_split[size_t(c)], recv_split[size_t(c)]);
    offset += chunk_rows[size_t(c)];
  }
  const auto peer_t = peer_counts.view({ep, El});
  std::vector<torch::Tensor> returned;
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t e0 = first[size_t(c)], e1 = first[size_t(c) + 1];
    // Arrived: blocks (p, e) in rank order; the experts want (e, p).
    std::vector<int64_t> at_arrival, at_expert, length;
    std::vector<int64_t> host_counts(size_t(El), 0);
    int64_t a = 0;
    for (int64_t p = 0; p < ep; ++p)
      for (int64_t e = e0; e < e1; ++e) {
        at_arrival.push_back(a);
        a += recv_count[p * El + e];
      }
    int64_t r = 0;
    at_expert.resize(at_arrival.size());
    length.resize(at_arrival.size());
    for (int64_t e = e0; e < e1; ++e)
      for (int64_t p = 0; p < ep; ++p) {
        const size_t b = size_t(p * (e1 - e0) + (e - e0));
        at_expert[b] = r;
        length[b] = recv_count[p * El + e];
        r += length[b];
        host_counts[size_t(e)] += length[b];
      }
    const int64_t rows = a;
    received += rows;
    const auto& in = arrived[size_t(c)];
    const bool reorder = ep > 1 && e1 - e0 > 1;
    const auto packed =
        reorder ? gather_unique_rows(in, block_permutation(at_arrival, at_expert, length, rows, dev))
                : in;
    // This chunk's counts per local expert, on the device (no copy): zero outside the chunk.
    auto chunk_counts = torch::zeros({El}, i64);
    chunk_counts.narrow(0, e0, e1 - e0).copy_(peer_t.narrow(1, e0, e1 - e0).sum(0));
    // Streamed: a unit runs in the chunks that hold its experts.
    std::vector<bool> run = active;
    for (size_t j = 0; j < run.size(); ++j) {
      const auto& u = experts.units()[j];
      run[j] = run[j] && u.first < e1 && u.first + u.count > e0;
    }
    const auto out = experts.forward_rows(packed, chunk_counts, host_counts, run);
    const auto back =
        reorder ? gather_unique_rows(out, block_permutation(at_expert, at_arrival, length, rows, dev))
                : out;
    returned.push_back(
        comm::autograd::all_to_all_variable(back, group, recv_split[size_t(c)],
                                            send_split[size_t(c)]));
  }
  ExchangeResult result;
  result.rows_back = nc == 1 ? returned.front() : torch::cat(returned);
  result.position = position;
  result.sent_rows = sent;
  result.received_rows = received;
  result.sent_to.assign(size_t(ep), 0);
  result.received_from.assign(size_t(ep), 0);
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t p = 0; p < ep; ++p) {
      result.sent_to[size_t(p)] += send_split[size_t(c)][size_t(p)];
      result.received_from[size_t(p)] += recv_split[size_t(c)][size_t(p)];
    }
  return result;
}

}  // namespace strata::moe
