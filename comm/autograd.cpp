#include "comm/autograd.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::comm::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels in the autograd context as a capsule (saved_data holds IValues only).
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(GroupPtr g) : group(std::move(g)) {}
  GroupPtr group;
};

torch::Tensor exchange_equal(const torch::Tensor& x, const GroupPtr& group) {
  const auto in = x.contiguous();
  auto out = torch::empty_like(in);
  group->all_to_all_single(out, in);
  return out;
}

struct AllToAll : torch::autograd::Function<AllToAll> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const GroupPtr& group) {
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

torch::Tensor exchange_variable(const torch::Tensor& x, const GroupPtr& group,
                                const std::vector<int64_t>& send,
                                const std::vector<int64_t>& recv) {
  int64_t rows = 0;
  for (const auto r : recv) rows += r;
  auto shape = x.sizes().vec();
  shape[0] = rows;
  auto out = torch::empty(shape, x.options());
  group->all_to_all_single(out, x.contiguous(), recv, send);
  return out;
}

struct AllToAllVariable : torch::autograd::Function<AllToAllVariable> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const GroupPtr& group, const std::vector<int64_t>& send,
                               const std::vector<int64_t>& recv) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return exchange_variable(x, group, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto capsule = ctx->saved_data["group"].toCapsule();
    const auto& group = static_cast<GroupCapsule*>(capsule.get())->group;
    const auto send = ctx->saved_data["send"].toIntVector();
    const auto recv = ctx->saved_data["recv"].toIntVector();
    // The gradient of what came from rank p goes back to rank p.
    return {exchange_variable(grads[0], group, recv, send), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_to_all(const torch::Tensor& x, const GroupPtr& group) {
  if (!group || group->size() == 1) return x;
  if (x.dim() < 1 || x.size(0) % group->size() != 0) {
    throw Error(fmt::format("comm::autograd::all_to_all: dim 0 of {} does not split equally over "
                            "the {} ranks of group {}", c10::str(x.sizes()), group->size(), group->name()));
  }
  return AllToAll::apply(x, group);
}

torch::Tensor all_to_all_variable(const torch::Tensor& x, const GroupPtr& group,
                                  const std::vector<int64_t>& send,
                                const std::vector<int64_t>& recv) {
  if (!group) throw Error("comm::autograd::all_to_all_variable: no group");
  if (x.dim() < 1 || int64_t(send.size()) != group->size() || int64_t(recv.size()) != group->size())
    throw Error(fmt::format("comm::autograd::all_to_all_variable: {} with {} send and {} receive "
                            "splits over the {} ranks of group {}", c10::str(x.sizes()), send.size(),
                            recv.size(), group->size(), group->name()));
  return AllToAllVariable::apply(x, group, send, recv);
}

}  // namespace strata::comm::autograd
