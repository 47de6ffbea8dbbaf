#include "moe/dispatch.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GatherUniqueRows : torch::autograd::Function<GatherUniqueRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& src,
                               const torch::Tensor& index) {
    const int64_t n = src.size(0);
    ctx->save_for_backward({index});
    ctx->saved_data["n"] = n;
    const auto rows = src.index_select(0, index.clamp_max(n - 1));
    return torch::where(index.lt(n).unsqueeze(1), rows, torch::zeros({}, rows.options()));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto index = ctx->get_saved_variables()[0];
    const int64_t n = ctx->saved_data["n"].toInt();
    const auto& g = grads[0];
    // Row n is the scratch the zero rows' gradients go to (several may: it is cut off).
    auto out = torch::zeros({n + 1, g.size(1)}, g.options()).index_copy_(0, index, g);
    return {out.narrow(0, 0, n), torch::Tensor()};
  }
};

// out[b] = sum over j < bag of weight[b * bag + j] * table[index[b * bag + j]] (weight undefined:
// 1), each sum accumulated in float and rounded once. On a GPU: the bags' rows gathered, then one
// batched product (or a sum) over each bag - CUDA's embedding_bag kernel moved about 0.33 TB/s
// here (moe-ds on an H100: 25.5 ms of a 122 ms step in 36 calls). On a CPU: embedding_bag's forward
// kernel, which reads each row once and writes nothing between; LibTorch 1.13's CPU kernel takes
// float and double only, so 16-bit tables are widened to float.
torch::Tensor bag_sums(const torch::Tensor& table, const torch::Tensor& index, int64_t bag,
                       const torch::Tensor& weight) {
  return table.is_cpu() ? detail::bag_sums_embedding_bag(table, index, bag, weight)
                        : detail::bag_sums_gathered(table, index, bag, weight);
}

// Gather of the packed rows: rows[i] = x[token_of_row[i]]; backward sums each token's k rows.
struct GatherRoutes : torch::autograd::Function<GatherRoutes> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& token_of_row, const torch::Tensor& by_token,
                               int64_t k) {
    ctx->save_for_backward({by_token});
    ctx->saved_data["k"] = k;
    return x.index_select(0, token_of_row);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto by_token = ctx->get_saved_variables()[0];
    const int64_t k = ctx->saved_data["k"].toInt();
    return {bag_sums(grads[0], by_token, k, torch::Tensor()), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

// y[t] = sum_c w[t * k + c] * rows[by_token[t * k + c]]. Backward: the rows' gradient is the
// token's, weighted (a gather with bags of 1); the weights' are dot products of the token's
// gradient with its routes' rows (one batched product).
struct CombineRoutes : torch::autograd::Function<CombineRoutes> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& rows,
                               const torch::Tensor& weight_by_token, const torch::Tensor& by_token,
                               const torch::Tensor& token_of_row, const torch::Tensor& entry_of_row,
                               int64_t k) {
    const auto w = weight_by_token.to(rows.scalar_type());
    ctx->save_for_backward({rows, w, by_token, token_of_row, entry_of_row});
    ctx->saved_data["k"] = k;
    return bag_sums(rows, by_token, k, w);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &rows = saved[0], &w = saved[1], &by_token = saved[2], &token_of_row = saved[3],
               &entry_of_row = saved[4];
    const int64_t k = ctx->saved_data["k"].toInt();
    const auto g = grads[0].contiguous();
    const int64_t S = g.size(0), d = g.size(1);
    torch::Tensor grad_rows, grad_w;
    if (ctx->needs_input_grad(0))
      grad_rows = bag_sums(g, token_of_row, 1, w.index_select(0, entry_of_row));
    if (ctx->needs_input_grad(1))
      grad_w = torch::bmm(rows.index_select(0, by_token).view({S, k, d}), g.view({S, d, 1}))
                   .view({S * k});
    return {grad_rows, grad_w, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

namespace detail {

torch::Tensor bag_sums_embedding_bag(const torch::Tensor& table, const torch::Tensor& index,
                                     int64_t bag, const torch::Tensor& weight) {
  const bool widen = table.is_cpu() && table.scalar_type() != torch::kFloat &&
                     table.scalar_type() != torch::kDouble;
  const auto t = widen ? table.to(torch::kFloat) : table.contiguous();
  c10::optional<torch::Tensor> w;
  if (weight.defined()) w = weight.to(t.scalar_type()).contiguous();
  const auto offsets = torch::arange(0, index.size(0), bag, index.options());
  auto out = std::get<0>(at::_embedding_bag_forward_only(t, index, offsets, /*scale_grad_by_freq=*/false,
                                                         /*mode=sum*/ 0, /*sparse=*/false, w,
                                                         /*include_last_offset=*/false,
                                                         /*padding_idx=*/-1));
  return widen ? out.to(table.scalar_type()) : out;
}

torch::Tensor bag_sums_gathered(const torch::Tensor& table, const torch::Tensor& index,
                                int64_t bag, const torch::Tensor& weight) {
  const int64_t bags = index.size(0) / bag, d = table.size(1);
  auto rows = table.index_select(0, index);
  if (bag == 1) return weight.defined() ? rows.mul_(weight.to(rows.scalar_type()).unsqueeze(1)) : rows;
  const auto grouped = rows.view({bags, bag, d});
  if (!weight.defined()) return grouped.sum(1);
  // [bags, 1, bag] x [bags, bag, d]: the products summed in float by the GEMM.
  return torch::bmm(weight.to(rows.scalar_type()).reshape({bags, 1, bag}), grouped).view({bags, d});
}

}  // namespace detail

RoutePermutation::RoutePermutation(const torch::Tensor& row, int64_t k) : k_(k) {
  const int64_t R = row.size(0);
  if (row.dim() != 1 || k < 1 || R % k != 0)
    throw Error(fmt::format("moe::RoutePermutation: rows {} for k = {}; need k * S routes",
                            c10::str(row.sizes()), k));
  const int64_t S = R / k;
  by_token_ = row.to(torch::kLong).view({k, S}).t().reshape({R});
  const auto entries = torch::arange(R, by_token_.options());
  entry_of_row_ = torch::empty_like(by_token_).scatter_(0, by_token_, entries);
  token_of_row_ = entry_of_row_.div(k, "floor");
}

torch::Tensor RoutePermutation::gather(const torch::Tensor& x) const {
  return GatherRoutes::apply(x, token_of_row_, by_token_, k_);
}

torch::Tensor RoutePermutation::combine(const torch::Tensor& rows, const torch::Tensor& weight) const {
  const int64_t S = by_token_.size(0) / k_;
  const auto by_token_weight = weight.view({k_, S}).t().reshape({S * k_});
  return CombineRoutes::apply(rows, by_token_weight, by_token_, token_of_row_, entry_of_row_, k_);
}

torch::Tensor gather_unique_rows(const torch::Tensor& src, const torch::Tensor& index) {
  if (src.dim() != 2 || index.dim() != 1)
    throw Error(fmt::format("moe::gather_unique_rows: src {} must be 2-d and index {} 1-d",
                            c10::str(src.sizes()), c10::str(index.sizes())));
  return GatherUniqueRows::apply(src, index);
}

torch::Tensor route_inputs(const torch::Tensor& x, int64_t k) {
  return x.unsqueeze(0).expand({k, x.size(0), x.size(1)}).reshape({k * x.size(0), x.size(1)});
}

torch::Tensor sum_routes(const torch::Tensor& routed, int64_t k) {
  return routed.view({k, routed.size(0) / k, routed.size(1)}).sum(0);
}

torch::Tensor dispatch_tokens(const torch::Tensor& x, int64_t k, const torch::Tensor& position,
                              int64_t rows) {
  // Row `rows` is the dropped routes' scratch (several may write it): cut off, so its gradient,
  // the dropped routes', is zero.
  return torch::zeros({rows + 1, x.size(1)}, x.options())
      .index_copy(0, position, route_inputs(x, k))
      .narrow(0, 0, rows);
}

torch::Tensor combine_tokens(const torch::Tensor& expert_out, int64_t k,
                             const torch::Tensor& position, const torch::Tensor& weight,
                             const torch::Tensor& kept) {
  // A dropped route reads the zero row past the end (its weight's gradient is then 0).
  const int64_t n = expert_out.size(0);
  const auto where = kept.defined() ? position.masked_fill(kept.logical_not(), n) : position;
  auto routed = gather_unique_rows(expert_out, where);
  routed = routed * weight.to(expert_out.scalar_type()).unsqueeze(1);
  return sum_routes(routed, k);
}

}  // namespace strata::moe
