// Hugging Face's load-balancing loss (transformers' load_balancing_loss_func, Qwen3-MoE and
// Mixtral), beside DeepSpeed's per-layer l_aux (moe/gate.h): one loss over every MoE layer's
// router together, as if their rows were one batch of R = (layers x tokens) rows:
//
//   aux = E * sum_e (routes to e / R) * (sum of p_e over the rows / R)
//
// with p the softmax of the router logits and the routes each row's k choices before any drop
// (so the first factor sums to k). The gradient flows through the probabilities only. It is not
// the mean of per-layer losses (a model whose layers are balanced differently gives another
// value). Computed from each layer's last forward (MoEStats::exp_counts, probs_sum, tokens), so
// call it after the model's forward. Under data parallelism each rank computes it over its own
// tokens, as transformers does on each device; given the data-parallel `group`, the routes and
// the token count are summed over its ranks first (one small all-reduce), so that the loss the
// ranks' gradients average to is the one a single process would compute over every rank's
// tokens: rank r returns world x E x sum_e (routes to e / R) x (its own sum of p_e / R), whose
// mean over the ranks is that loss and whose gradients, averaged as the engine averages them,
// are its gradients.
#pragma once

#include <vector>

#include <torch/torch.h>

#include "moe/layer.h"

namespace strata::moe {

// The softmax-router layers' loss (strata::Error for a sigmoid router's layer or layers with
// different numbers of experts); 0 (still a function of the routers) when no token was routed.
torch::Tensor hf_load_balancing_loss(const std::vector<MoEImpl*>& layers,
                                     const comm::GroupPtr& group = nullptr);

}  // namespace strata::moe
