#include "runtime/sequence/ulysses.h"

#include <atomic>

#include <fmt/format.h>

#include "comm/autograd.h"
#include "runtime/error.h"

namespace strata::sequence {
namespace {

// The exchanges are equal-split all_to_alls along dim 0, so each side lays its tensor out as
// [P, ...] with block p the one rank p receives.

// [B, H, s, hd], heads in P blocks -> [P, H / P, B, s, hd]: block p holds rank p's heads.
torch::Tensor heads_to_blocks(const torch::Tensor& x, int64_t P) {
  const auto B = x.size(0), H = x.size(1), s = x.size(2), hd = x.size(3);
  return x.reshape({B, P, H / P, s, hd}).permute({1, 2, 0, 3, 4}).contiguous();
}

// Received [P (whose shard), h, B, s, hd] -> [B, h, P * s, hd]: the shards in rank order.
torch::Tensor blocks_to_sequence(const torch::Tensor& y) {
  const auto P = y.size(0), h = y.size(1), B = y.size(2), s = y.size(3), hd = y.size(4);
  return y.permute({2, 1, 0, 3, 4}).reshape({B, h, P * s, hd});
}

// [B, h, S, hd] -> [P, h, B, S / P, hd]: block p holds rank p's positions.
torch::Tensor sequence_to_blocks(const torch::Tensor& x, int64_t P) {
  const auto B = x.size(0), h = x.size(1), S = x.size(2), hd = x.size(3);
  return x.reshape({B, h, P, S / P, hd}).permute({2, 1, 0, 3, 4}).contiguous();
}

// Received [P (whose heads), h, B, s, hd] -> [B, P * h, s, hd]: the heads in rank order.
torch::Tensor blocks_to_heads(const torch::Tensor& y) {
  const auto P = y.size(0), h = y.size(1), B = y.size(2), s = y.size(3), hd = y.size(4);
  return y.permute({2, 0, 1, 3, 4}).reshape({B, P * h, s, hd});
}

std::atomic<uint64_t> exchange_count{0};

torch::Tensor gather_sequence(const torch::Tensor& x, const comm::GroupPtr& group) {
  const int64_t P = group->size();
  return blocks_to_sequence(comm::autograd::all_to_all(heads_to_blocks(x, P), group));
}

// Each kv head repeated `times` times in place (head j * times + c is copy c of head j), as
// repeat_kv does for query heads: the query heads a rank holds keep reading their own kv head.
torch::Tensor replicate_heads(const torch::Tensor& x, int64_t times) {
  if (times == 1) return x;
  const auto B = x.size(0), H = x.size(1), s = x.size(2), hd = x.size(3);
  return x.unsqueeze(2).expand({B, H, times, s, hd}).reshape({B, H * times, s, hd});
}

}  // namespace

torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const comm::GroupPtr& group,
                                const AttentionFn& attention) {
  if (q.dim() != 4 || k.dim() != 4 || v.sizes() != k.sizes() || q.size(0) != k.size(0) ||
      q.size(2) != k.size(2) || q.size(3) != k.size(3))
    throw Error(fmt::format("ulysses_attention: q {}, k {} and v {} must be [batch, heads, "
                            "sequence shard, head_dim] with k and v alike",
                            c10::str(q.sizes()), c10::str(k.sizes()), c10::str(v.sizes())));
  if (!group || group->size() == 1) return attention(q, k, v);
  const int64_t P = group->size(), H = q.size(1), KV = k.size(1);
  if (H % P != 0)
    throw Error(fmt::format("ulysses_attention: {} query heads do not split over the {} ranks of "
                            "sequence-parallel group {}; choose a sequence_parallel_size that "
                            "divides the heads",
                            H, P, group->name()));
  if (KV % P != 0 && P % KV != 0)
    throw Error(fmt::format("ulysses_attention: {} kv heads over the {} ranks of group {}: the "
                            "kv heads must be a multiple of the ranks, or the ranks of the kv "
                            "heads",
                            KV, P, group->name()));
  if (H % KV != 0)
    throw Error(fmt::format("ulysses_attention: {} query heads are not a multiple of {} kv heads",
                            H, KV));
  exchange_count.fetch_add(1, std::memory_order_relaxed);
  const int64_t times = KV < P ? P / KV : 1;
  const auto q_all = gather_sequence(q, group);
  const auto k_all = gather_sequence(replicate_heads(k, times), group);
  const auto v_all = gather_sequence(replicate_heads(v, times), group);
  const auto out = attention(q_all, k_all, v_all);
  if (out.dim() != 4 || out.size(0) != q.size(0) || out.size(1) != H / P ||
      out.size(2) != q_all.size(2))
    throw Error(fmt::format("ulysses_attention: the attention returned {} for q {}; it must keep "
                            "[batch, heads, sequence] of q",
                            c10::str(out.sizes()), c10::str(q_all.sizes())));
  return blocks_to_heads(comm::autograd::all_to_all(sequence_to_blocks(out, P), group));
}

uint64_t exchanges() { return exchange_count.load(std::memory_order_relaxed); }

torch::Tensor shard_sequence(const torch::Tensor& x, const comm::GroupPtr& group, int64_t dim) {
  if (!group || group->size() == 1) return x;
  const int64_t P = group->size(), n = x.size(dim);
  if (n % P != 0)
    throw Error(fmt::format("shard_sequence: a sequence of {} positions does not split into {} "
                            "equal shards (sequence_parallel_size); choose a sequence length that "
                            "is a multiple of it",
                            n, P));
  return x.narrow(dim, group->rank() * (n / P), n / P);
}

torch::Tensor shift_labels(const torch::Tensor& labels, int64_t ignore_index) {
  auto shifted = torch::full_like(labels, ignore_index);
  const int64_t n = labels.size(-1);
  if (n > 1) shifted.narrow(-1, 0, n - 1).copy_(labels.narrow(-1, 1, n - 1));
  return shifted;
}

}  // namespace strata::sequence
