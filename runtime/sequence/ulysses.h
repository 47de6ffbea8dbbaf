// Ulysses sequence parallelism (DeepSpeed-Ulysses, and ALST on top of it): the P ranks of a
// sequence-parallel group each hold one contiguous shard of every sample's sequence, in rank
// order, and run every layer on it except attention. Around attention one all-to-all turns q, k
// and v from [batch, all heads, seq / P, head_dim] into [batch, heads / P, seq, head_dim] (the
// whole sequence, this rank's heads); attention runs unchanged; one all-to-all turns its output
// back. Backward runs the same exchanges in reverse (comm/autograd.h).
//
//   auto out = strata::sequence::ulysses_attention(q, k, v, sp_group,
//       [](auto& q, auto& k, auto& v) { return my_causal_attention(q, k, v); });
//
// Grouped-query attention as DeepSpeed handles it: with kv_heads divisible by P each rank gets
// kv_heads / P of them, the ones its query heads use; with fewer kv heads than ranks (P divisible
// by kv_heads) each kv head is replicated P / kv_heads times first, so that each rank gets the
// one its query heads use (the replicas' gradients sum back into the head).
#pragma once

#include <cstdint>
#include <functional>

#include <torch/torch.h>

#include "comm/process_group.h"

namespace strata::sequence {

// Attention over the whole sequence for this rank's heads: q [B, H / P, S, hd], k and v
// [B, KV', S, hd] (KV' = max(KV, P) / P kv heads) -> [B, H / P, S, hd].
using AttentionFn = std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& v)>;

// q [B, H, S / P, hd], k and v [B, KV, S / P, hd]: this rank's shard of positions, every head ->
// attention's output for this rank's positions, every head, [B, H, S / P, hd]. group null or of
// one rank: attention(q, k, v). H must be divisible by P, and KV by P or P by KV; strata::Error
// names the shapes otherwise. Every member calls it, in the same order, forward and backward.
torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const comm::GroupPtr& group,
                                const AttentionFn& attention);

// How many exchanges ulysses_attention has run in this process (over groups of 2+ ranks): the
// engine checks that a model under sequence_parallel_size > 1 made any.
uint64_t exchanges();

// This rank's contiguous shard of `x` along `dim` (the sequence): length / P positions from
// rank * length / P. length must be divisible by P.
torch::Tensor shard_sequence(const torch::Tensor& x, const comm::GroupPtr& group, int64_t dim = 1);

// Hugging Face's causal-LM labels shifted before the sequence is cut: position t is labelled
// with labels[:, t + 1] and the last position with `ignore_index`, so that each shard carries
// the labels of its own positions (the one after a shard's last position lives on the next rank).
torch::Tensor shift_labels(const torch::Tensor& labels, int64_t ignore_index = -100);

}  // namespace strata::sequence
