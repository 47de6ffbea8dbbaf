#include "moe/dispatch.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels in the autograd context as a capsule (saved_data holds IValues only).
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(comm::GroupPtr g) : group(std::move(g)) {}
  comm::GroupPtr group;
};

torch::Tensor exchange_equal(const torch::Tensor& x, const comm::GroupPtr& group) {
  const auto in = x.contiguous();
  auto out = torch::empty_like(in);
  group->all_to_all_single(out, in);
  return out;
}

struct AllToAll : torch::autograd::Function<AllToAll> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const comm::GroupPtr& group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
    return exchange_equal(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto capsule = ctx->saved_data["group"].toCapsule();
    const auto& group = static_cast<GroupCapsule*>(capsule.get())->group;
    // Equal splits: chunk p went to rank p and came from rank p, so the reverse is the same call.
    return {exchange_equal(grads[0], group), torch::Tensor()};
  }
};

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

}  // namespace

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

torch::Tensor all_to_all(const torch::Tensor& x, const comm::GroupPtr& group) {
  if (!group || group->size() == 1) return x;
  if (x.dim() < 1 || x.size(0) % group->size() != 0) {
    throw Error(fmt::format("moe::all_to_all: dim 0 of {} does not split equally over the {} ranks "
                            "of group {}", c10::str(x.sizes()), group->size(), group->name()));
  }
  return AllToAll::apply(x, group);
}

}  // namespace strata::moe
