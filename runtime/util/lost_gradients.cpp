#include "runtime/util/lost_gradients.h"

#include <unordered_set>

#include <fmt/format.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "runtime/error.h"

namespace strata::recompute {

void check_leaves(const std::vector<torch::Tensor>& outputs,
                  const std::vector<torch::Tensor>& targets, const std::string& what,
                  const std::string& name, const std::string& hint) {
  std::unordered_set<const void*> known;
  for (const auto& t : targets) known.insert(t.unsafeGetTensorImpl());
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& o : outputs)
    if (auto fn = o.grad_fn()) stack.push_back(fn.get());
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const auto& v = acc->variable;
      if (v.defined() && !known.count(v.unsafeGetTensorImpl()))
        throw Error(fmt::format("{}: {} reads a tensor of shape {} ({}) that requires grad but is "
                                "neither one of its arguments nor one of its parameters; its "
                                "gradient would be lost. {}",
                                what, name, c10::str(v.sizes()), c10::toString(v.scalar_type()),
                                hint));
      continue;
    }
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
}

}  // namespace strata::recompute
