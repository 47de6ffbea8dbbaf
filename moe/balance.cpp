#include "moe/balance.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::moe {

torch::Tensor hf_load_balancing_loss(const std::vector<MoEImpl*>& layers,
                                     const comm::GroupPtr& group) {
  if (layers.empty()) throw Error("moe::hf_load_balancing_loss: no MoE layer");
  const int64_t E = layers.front()->options().num_experts;
  torch::Tensor routes, probs;
  int64_t rows = 0;
  for (auto* layer : layers) {
    const auto& o = layer->options();
    const auto& last = layer->last();
    if (o.score_func != ScoreFunc::Softmax || o.num_experts != E)
      throw Error(fmt::format("moe::hf_load_balancing_loss: every layer needs the softmax router "
                              "over {} experts (layer {} has {} experts{})", E, o.layer_id,
                              o.num_experts, o.score_func != ScoreFunc::Softmax ? ", sigmoid" : ""));
    if (!last.probs_sum.defined())
      throw Error(fmt::format("moe::hf_load_balancing_loss: layer {} has not run a forward{}",
                              o.layer_id, o.router_probs_sum ? "" : " with "
                              "MoEOptions::router_probs_sum set (the probabilities' sums it needs)"));
    const auto r = last.exp_counts.to(last.probs_sum.scalar_type());
    routes = routes.defined() ? routes + r : r;
    probs = probs.defined() ? probs + last.probs_sum : last.probs_sum;
    rows += last.tokens;
  }
  double scale = 1.0;
  if (group && group->size() > 1) {
    // The routes and the rows of every rank (not differentiable); the probabilities stay this
    // rank's, scaled by the world so that the ranks' mean is the whole batch's loss.
    auto stats = torch::cat({routes.detach().to(torch::kDouble).cpu(),
                             torch::full({1}, double(rows), torch::kDouble)});
    group->all_reduce(stats, comm::ReduceOp::Sum);
    routes = stats.narrow(0, 0, E).to(probs.options());
    rows = int64_t(stats[E].item<double>());
    scale = double(group->size());
  }
  if (rows == 0) return probs.sum() * 0.0;
  return (routes / double(rows) * (probs / double(rows))).sum() * (double(E) * scale);
}

}  // namespace strata::moe
