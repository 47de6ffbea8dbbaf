// Token dispatch by permutation: the gate's routes (token, expert, slot, weight, kept) move
// tokens into a capacity-padded buffer and back, without DeepSpeed's dense [S, E, C] one-hot.
//
// Layout, DeepSpeed's: buffer row `expert * C + slot` holds the token of that route; rows no
// route fills are zero. The gate's slots are unique within an expert and already in the order
// DeepSpeed's `locations` give, so writing each route to its row IS the stable sort by expert
// followed by the capacity cut: one index_copy, O(routes * d) memory, no host sync.
// All S*k routes travel, dropped ones included (a fixed size: nothing is counted on the host):
// a dropped route's position is `rows`, a scratch row that is cut off, and it adds nothing back.
// Combining is the inverse: read each route's row, scale by its combine weight, index_add into
// the token's output row.
//
// Expert parallelism: the [E * C, d] buffer is split equally along dim 0 by all_to_all (rank p
// gets experts [p * E_local, (p + 1) * E_local)); comm::autograd::all_to_all is differentiable,
// its backward the same equal-split exchange of the gradient (it is its own inverse).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"

namespace strata::moe {

// Routes are the gate's fixed-size order, route r = choice * S + token (moe/gate.h), so a
// token's rows are found by arithmetic, not by index: route_inputs() repeats x [S, d] into
// [k * S, d] and sum_routes() adds [k * S, d] back into [S, d], each the other's backward (a
// reduction over k, no atomics, where index_select / index_add by token would scatter-add).
torch::Tensor route_inputs(const torch::Tensor& x, int64_t k);
torch::Tensor sum_routes(const torch::Tensor& routed, int64_t k);

// x [S, d]; position [k * S] int64 (position = expert * C + slot, unique, or `rows` for a
// dropped route). Returns the [rows, d] buffer, differentiable w.r.t. x.
torch::Tensor dispatch_tokens(const torch::Tensor& x, int64_t k, const torch::Tensor& position,
                              int64_t rows);

// expert_out [rows, d]; position [k * S] (rows past the end: dropped); weight [k * S] (cast to
// expert_out's dtype); kept [k * S] bool (undefined: all). Returns [S, d]: for each token the
// sum over its kept routes of weight * expert_out[position]. Differentiable w.r.t. expert_out
// and weight (a dropped route's weight gets gradient 0).
torch::Tensor combine_tokens(const torch::Tensor& expert_out, int64_t k,
                             const torch::Tensor& position, const torch::Tensor& weight,
                             const torch::Tensor& kept);

// src.index_select(0, index), where the entries of `index` below n = src.size(0) are unique and an
// entry n reads a zero row: its backward writes each row's gradient back in place (index_copy),
// where index_select's adds them (index_add with atomics, which crawl when many entries share
// a row, as dropped routes and padding rows would).
torch::Tensor gather_unique_rows(const torch::Tensor& src, const torch::Tensor& index);

// Dropless routes on one rank: every route kept and the experts' packed rows a permutation of
// the routes (route r = choice * S + token sits at row row[r]; every row of [0, k * S) is one
// route's). The packed rows are gathered from the tokens, and the tokens' outputs gathered back,
// weighted; in both directions, forward and backward, each pass is one gather, and the sums over
// a token's k routes are bag sums (detail::, below: a fixed order, float accumulation): no
// zero-filled buffer, no scatter, no atomics, nothing saved but indices, weights and the rows
// the combine reads (whose gradient needs them).
class RoutePermutation {
 public:
  RoutePermutation(const torch::Tensor& row, int64_t k);
  // x [S, w] -> the packed rows [k * S, w]; differentiable w.r.t. x.
  torch::Tensor gather(const torch::Tensor& x) const;
  // rows [k * S, d] (the experts' outputs, packed), weight [k * S] in route order (cast to the
  // rows' dtype) -> [S, d]: each token's sum of weight * its routes' rows. Differentiable w.r.t.
  // rows and weight.
  torch::Tensor combine(const torch::Tensor& rows, const torch::Tensor& weight) const;

 private:
  int64_t k_;
  torch::Tensor by_token_;      // [S * k]: token t's routes' rows at t * k + choice
  torch::Tensor token_of_row_;  // [k * S]
  torch::Tensor entry_of_row_;  // [k * S]: the row's index in by_token_
};

namespace detail {
// out[b] = sum over j < bag of weight[b * bag + j] * table[index[b * bag + j]] (weight undefined:
// 1), accumulated in float, rounded once; index.size(0) a multiple of bag. Two kernels of one
// result: embedding_bag's forward (a CPU's) and a gather followed by a batched product (a GPU's);
// RoutePermutation picks by device, the tests hold them to each other.
torch::Tensor bag_sums_embedding_bag(const torch::Tensor& table, const torch::Tensor& index,
                                     int64_t bag, const torch::Tensor& weight);
torch::Tensor bag_sums_gathered(const torch::Tensor& table, const torch::Tensor& index,
                                int64_t bag, const torch::Tensor& weight);
}  // namespace detail

}  // namespace strata::moe
