// DeepSpeed-MoE's top1/top2/topk gating as per-route lists (see gate.h). A route is one (token,
// choice) pair; routes are numbered choice-major, r = choice * S + token, DeepSpeed's [k, S].
#include "moe/gate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iostream>
#include <limits>
#include <mutex>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::moe {
namespace {

using torch::indexing::Slice;

void check(const torch::Tensor& logits, const GateOptions& o) {
  if (!logits.defined() || logits.dim() != 2) {
    throw Error("moe::gate: logits must be a [tokens, experts] tensor; flatten the batch and "
                "sequence dimensions first");
  }
  if (logits.scalar_type() != torch::kFloat && logits.scalar_type() != torch::kDouble) {
    throw Error(fmt::format("moe::gate: logits are {}; the gate computes in float32 as DeepSpeed "
                            "does, cast them with .to(torch::kFloat)",
                            std::string(c10::toString(logits.scalar_type()))));
  }
  // No tokens is legitimate (an empty last micro-batch): the rank routes nothing and still
  // joins its expert-parallel group's collectives.
  const int64_t S = logits.size(0), E = logits.size(1);
  if (E < 1) {
    throw Error(fmt::format("moe::gate: logits are [{}, {}]; the gate needs at least one expert",
                            S, E));
  }
  if (o.k < 1 || o.k > E) {
    throw Error(fmt::format("moe::gate: k = {} but there are {} experts; k must be in [1, {}] "
                            "(lower k or add experts)", o.k, E, E));
  }
  const std::pair<const char*, double> reals[] = {{"capacity_factor", o.capacity_factor},
                                                  {"eval_capacity_factor", o.eval_capacity_factor},
                                                  {"z_loss_coef", o.z_loss_coef}};
  for (const auto& [name, v] : reals) {
    if (!std::isfinite(v) || v < 0) {
      throw Error(fmt::format("moe::gate: {} = {}; it must be a finite number >= 0", name, v));
    }
  }
  if (o.min_capacity < 0) {
    throw Error(fmt::format("moe::gate: min_capacity = {}; it must be >= 0", o.min_capacity));
  }
  if (o.used_token.defined()) {
    if (o.k != 1) {
      throw Error(fmt::format("moe::gate: used_token is only applied by top-1 gating (as in "
                              "DeepSpeed) but k = {}; leave it undefined", o.k));
    }
    if (o.used_token.dim() != 1 || o.used_token.size(0) != S) {
      throw Error(fmt::format("moe::gate: used_token must be a [{}] mask (one entry per token), "
                              "got {}", S, c10::str(o.used_token.sizes())));
    }
  }
  if (o.score_func == ScoreFunc::Sigmoid) {
    if (o.expert_bias.defined() &&
        (o.expert_bias.dim() != 1 || o.expert_bias.size(0) != E ||
         o.expert_bias.scalar_type() != torch::kFloat))
      throw Error(fmt::format("moe::gate: expert_bias is {} {}; it must be a [{}] float32 tensor",
                              c10::str(o.expert_bias.sizes()),
                              std::string(c10::toString(o.expert_bias.scalar_type())), E));
    if (o.n_group < 1 || E % o.n_group != 0 || o.topk_group < 1 || o.topk_group > o.n_group ||
        (o.n_group > 1 && E / o.n_group < 2) ||
        (o.n_group > 1 && o.k > o.topk_group * (E / o.n_group)))
      throw Error(fmt::format("moe::gate: n_group = {}, topk_group = {} for {} experts and k = {}; "
                              "n_group must divide the experts into groups of at least 2, "
                              "1 <= topk_group <= n_group, and k fit in topk_group groups",
                              o.n_group, o.topk_group, E, o.k));
    if (!std::isfinite(o.route_scale) || o.route_scale <= 0)
      throw Error(fmt::format("moe::gate: route_scale = {}; it must be a finite number > 0",
                              o.route_scale));
    if (o.sequence_length < 0 || (o.sequence_length > 0 && S % o.sequence_length != 0))
      throw Error(fmt::format("moe::gate: sequence_length = {} does not divide the {} tokens",
                              o.sequence_length, S));
  }
  if (o.k >= 2 && o.noisy_gate_policy == NoisyGatePolicy::RSample &&
      o.score_func == ScoreFunc::Softmax) {
    // DeepSpeed ignores RSample silently beyond top-1 (Jitter, the layer's, applies at every k);
    // say so once per process.
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      std::cerr << fmt::format("strata: warning: moe noisy_gate_policy RSample is only applied "
                               "with k = 1 (as in DeepSpeed); ignored with k = {}\n", o.k);
    }
  }
}

// Gumbel(0, 1) noise as torch.distributions.Gumbel samples it: -log(-log(u)), u uniform in
// [tiny, 1 - eps], drawn from `gen` (noise_generator: on the logits' device) in float32.
torch::Tensor gumbel(at::Generator& gen, int64_t S, int64_t E, const torch::Tensor& like) {
  using lim = std::numeric_limits<float>;
  const auto u = torch::rand({S, E}, gen, torch::dtype(torch::kFloat).device(like.device()))
                     .clamp(lim::min(), 1.0 - lim::epsilon());
  return (-torch::log(-torch::log(u))).to(like.scalar_type());
}

// Routes per expert: bincount without its host sync on CUDA (it reads the maximum to size its
// output). `bins` counts every value of `expert`, which lies in [0, bins).
torch::Tensor count_per_expert(const torch::Tensor& expert, int64_t bins) {
  return torch::zeros({bins}, expert.options()).scatter_add_(0, expert, torch::ones_like(expert));
}

// Place of each route when sorted by `priority` descending, ties to the lower token.
torch::Tensor priority_place(const torch::Tensor& priority, const torch::Tensor& token) {
  const auto by_token = std::get<1>(token.sort(/*stable=*/true, 0, false));
  const auto by_prio = std::get<1>(priority.index_select(0, by_token).sort(true, 0, true));
  const auto order = by_token.index_select(0, by_prio);
  return torch::empty_like(order).scatter_(0, order, torch::arange(order.size(0), order.options()));
}

// Rank of each route among the routes to the same expert, in increasing `key` (keys are unique
// within an expert and lie in [0, key_bound); experts lie in [0, bins)).
torch::Tensor rank_within_expert(const torch::Tensor& expert, const torch::Tensor& key,
                                 int64_t key_bound, int64_t bins) {
  const int64_t R = expert.size(0);
  const auto perm = std::get<1>((expert * key_bound + key).sort());
  const auto counts = count_per_expert(expert, bins);
  const auto starts = counts.cumsum(0) - counts;
  return torch::empty_like(expert).scatter_(
      0, perm, torch::arange(R, expert.options()) -
                   starts.index_select(0, expert.index_select(0, perm)));
}

// The sigmoid router's choice (gate.h): top-k of scores + bias, within each token's topk_group
// best groups. Stable sorts: ties go to the lower group / expert.
torch::Tensor choose_biased(const torch::Tensor& scores, const GateOptions& o) {
  const int64_t S = scores.size(0), E = scores.size(1);
  auto chooser = o.expert_bias.defined()
                     ? scores + o.expert_bias.to(scores.device(), scores.scalar_type()).view({1, E})
                     : scores;
  if (o.n_group > 1) {
    const int64_t G = o.n_group, per = E / G;
    const auto grouped = chooser.view({S, G, per});
    const auto group_score =
        std::get<0>(grouped.sort(/*stable=*/true, 2, true)).narrow(2, 0, 2).sum(2);  // [S, G]
    const auto best = std::get<1>(group_score.sort(true, 1, true)).narrow(1, 0, o.topk_group);
    const auto allowed = torch::zeros({S, G}, scores.options().dtype(torch::kBool))
                             .scatter_(1, best, true);
    chooser = chooser.masked_fill(allowed.logical_not().unsqueeze(2).expand({S, G, per}).reshape({S, E}),
                                  -std::numeric_limits<double>::infinity());
  }
  return std::get<1>(chooser.sort(/*stable=*/true, 1, true)).narrow(1, 0, o.k);
}

// DeepSeek-V3's sequence-wise balance loss (gate.h), differentiable through `scores`.
torch::Tensor sequence_balance_loss(const torch::Tensor& scores, const torch::Tensor& idx,
                                    const GateOptions& o) {
  const int64_t S = scores.size(0), E = scores.size(1), k = idx.size(1);
  const int64_t T = o.sequence_length > 0 ? o.sequence_length : S, B = S / T;
  const auto share = scores / scores.sum(1, true);
  const auto P = share.view({B, T, E}).mean(1);
  const auto chosen = torch::zeros({S, E}, scores.options()).scatter_(1, idx, 1.0);
  const auto f = chosen.view({B, T, E}).sum(1) * (static_cast<double>(E) / double(k * T));
  return (f * P).sum(1).mean();
}

}  // namespace

int64_t gate_capacity(int64_t num_tokens, int64_t num_experts, double factor,
                      int64_t min_capacity) {
  // DeepSpeed: ceil((S / E) * torch.tensor(factor)): a double quotient times a float32 tensor,
  // so both are rounded to float32 and multiplied in float32.
  const float per_expert = static_cast<float>(static_cast<double>(num_tokens) / num_experts);
  const float product = per_expert * static_cast<float>(factor);
  const auto capacity = static_cast<int64_t>(std::ceil(product));
  return capacity < min_capacity ? min_capacity : capacity;
}

torch::Tensor host_to_device(const torch::Tensor& host, const torch::Device& device) {
  if (device.is_cpu() || !host.device().is_cpu()) return host.to(device);
  // A blocking copy from pageable memory waits for the device; from page-locked memory the copy
  // is queued on the current stream (the host allocator keeps the buffer until it is done).
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

at::Generator noise_generator(uint64_t seed, const torch::Device& device) {
  if (device.is_cpu()) return at::detail::createCPUGenerator(seed);
  at::Generator global = at::globalContext().defaultGenerator(device);  // shares its state
  at::Generator gen;
  {
    std::lock_guard<std::mutex> lock(global.mutex());
    gen = global.clone();
  }
  gen.set_current_seed(seed);  // also rewinds the Philox offset to 0
  return gen;
}

GateRoutes gate_routes(const torch::Tensor& logits, const GateOptions& o) {
  check(logits, o);
  const int64_t S = logits.size(0), E = logits.size(1), k = o.k, R = S * k;
  const auto dev = logits.device();
  const auto i64 = torch::TensorOptions().dtype(torch::kLong).device(dev);
  auto gen = noise_generator(o.seed, dev);

  const bool sigmoid = o.score_func == ScoreFunc::Sigmoid;
  const auto gates = sigmoid ? torch::sigmoid(logits) : torch::softmax(logits, 1);
  const auto plain = logits.detach();

  // Each token's k experts: idx [S, k].
  torch::Tensor idx;
  if (sigmoid) {
    idx = choose_biased(gates.detach(), o);
  } else if (k == 1) {
    const bool rsample = o.training && o.noisy_gate_policy == NoisyGatePolicy::RSample;
    idx = (rsample ? plain + gumbel(gen, S, E, plain) : gates.detach()).argmax(1, true);
  } else if (k == 2) {
    const auto first = gates.detach().argmax(1, true);
    auto second = o.top2_2nd_expert_sampling ? plain + gumbel(gen, S, E, plain) : plain.clone();
    second.scatter_(1, first, -std::numeric_limits<double>::infinity());
    idx = torch::cat({first, second.argmax(1, true)}, 1);
  } else {
    // torch.topk leaves ties unordered; a stable sort puts the lower expert first.
    idx = std::get<1>(gates.detach().sort(/*stable=*/true, 1, true)).index({Slice(), Slice(0, k)});
  }

  // Routes, choice-major. Unused tokens (used_token, k = 1) take no route: they are ranked under
  // a virtual expert E that has no capacity, so nothing of them is counted or kept.
  const auto expert = idx.t().reshape(-1);
  const auto token = torch::arange(S, i64).repeat({k});
  torch::Tensor used, ranked_expert = expert;
  if (o.used_token.defined()) {
    used = host_to_device(o.used_token, dev).ne(0);
    ranked_expert = expert.masked_fill(used.logical_not(), E);
  }
  const auto exp_counts = count_per_expert(ranked_expert, E + 1).narrow(0, 0, E);

  // l_aux from the choices before drops; DeepSpeed's ce counts 1st choices for k <= 2. No
  // tokens: nothing to balance, 0 (a mean over none would be NaN), still a function of the
  // logits so that backward reaches the router as on the other ranks.
  torch::Tensor l_aux;
  if (S == 0) {
    l_aux = logits.sum() * 0.0;
  } else if (sigmoid) {
    l_aux = sequence_balance_loss(gates, idx, o);
  } else {
    const auto ce_counts = k == 2 ? count_per_expert(expert.narrow(0, 0, S), E) : exp_counts;
    const auto me = gates.mean(0);
    const auto ce = ce_counts.to(gates.scalar_type()) / static_cast<double>(S);
    l_aux = k == 1 ? (me * ce).sum() * E : (me * ce).mean() * E * E;
    if (k > 2) l_aux = l_aux / k;
  }

  // Capacity, from the expert-parallel group's counts: one shape on every rank.
  const double factor = o.training ? o.capacity_factor : o.eval_capacity_factor;
  // Without drop_tokens, reading the largest load is the one host sync.
  if (o.uncapped && o.drop_tokens)
    throw Error("moe::gate: uncapped is for drop_tokens = false (with drop_tokens every route is "
                "held to the capacity)");
  const GroupCounts local{S, o.drop_tokens || o.uncapped ? 0 : exp_counts.max().item<int64_t>()};
  const GroupCounts group = o.agree_over_group ? o.agree_over_group(local) : local;
  if (group.tokens < local.tokens || group.load < local.load) {
    throw Error(fmt::format("moe::gate: agree_over_group returned {} tokens and a load of {} for "
                            "this rank's {} and {}; it must return the maxima over the "
                            "expert-parallel group (at least its arguments)",
                            group.tokens, group.load, local.tokens, local.load));
  }
  // DeepSpeed's top1gating asserts this (its topk over tokens would fail otherwise). Checked on
  // the group's count, so that every rank of the group throws, or none (one rank's short batch
  // would leave the others waiting in their next collective).
  if (k == 1 && !sigmoid && group.tokens < o.min_capacity) {
    throw Error(fmt::format("moe::gate: {} tokens but min_capacity = {}; top-1 gating needs at "
                            "least min_capacity tokens (as DeepSpeed): lower min_capacity (0 is "
                            "allowed) or route a larger batch", group.tokens, o.min_capacity));
  }
  int64_t capacity;
  if (o.drop_tokens) {
    capacity = gate_capacity(group.tokens, E, factor * k, o.min_capacity);
  } else if (o.uncapped) {
    capacity = R;  // every route kept: no expert takes more than all of them
  } else {
    capacity = group.load;
    if (k == 1) capacity = std::min(capacity, group.tokens);  // top1gating caps it at the tokens
  }

  // Who survives: the first `capacity` routes of each expert in priority order.
  //   k = 1: random priority (use_rts) or token order; k = 2: choice-major position;
  //   k >= 3: probability (Probs) or token order (Position).
  torch::Tensor place;
  int64_t place_bound = R;
  bool place_is_slot_order = true;  // the survivors' order is the slots' order
  if (o.uncapped) {
    // Every route survives: any order will do, and token order costs no sort of priorities.
    place = token;
    place_bound = S;
  } else if (k == 1 && o.use_rts && !sigmoid) {
    const auto prio = torch::rand({S}, gen, torch::dtype(torch::kFloat).device(dev));
    place = priority_place(prio.index_select(0, token), token);
    place_is_slot_order = false;
  } else if (k == 2 && !sigmoid) {
    place = torch::arange(R, i64);
  } else if ((k >= 3 || sigmoid) && o.drop_policy == DropPolicy::Probs) {
    place = priority_place(gates.detach().gather(1, idx).t().reshape(-1), token);
    place_is_slot_order = false;
  } else {
    place = token;
    place_bound = S;
  }
  const auto rank = rank_within_expert(ranked_expert, place, place_bound, E + 1);
  auto kept = rank.lt(capacity);
  if (used.defined()) kept = kept.logical_and(used);

  GateRoutes out;
  out.num_experts = E;
  out.capacity = capacity;
  out.l_aux = l_aux;
  out.exp_counts = exp_counts;
  out.token = token;
  out.expert = expert;
  out.kept = kept;
  // Uncapped, every route chosen is kept: the counts are exp_counts and nothing is dropped.
  const auto kept_expert =
      o.uncapped ? ranked_expert : expert.masked_fill(kept.logical_not(), E);  // dropped: E
  out.kept_counts = o.uncapped ? exp_counts : count_per_expert(kept_expert, E + 1).narrow(0, 0, E);
  // Routes that reach no expert: over capacity, or a padding token's (used_token 0).
  out.dropped = o.uncapped && !used.defined() ? torch::zeros({}, i64)
                                              : torch::full({}, R, i64) - kept.sum();

  // Slots are DeepSpeed's locations: cumsum over tokens of the kept mask (k = 1, Probs), which is
  // the pre-drop position for the positional policies (kept routes are a prefix there).
  out.slot = place_is_slot_order ? rank : rank_within_expert(kept_expert, token, S, E + 1);

  // Combine weights, with DeepSpeed's arithmetic: top1 raw; top2 g / clamp(g1 + g2, eps); topk
  // over the kept [S, E] mask, g / clamp(sum_e, eps).
  const double eps = logits.scalar_type() == torch::kFloat ? std::numeric_limits<float>::epsilon()
                                                           : std::numeric_limits<double>::epsilon();
  if (sigmoid) {
    // The chosen unbiased scores, normalised over the k chosen before any drop (the routers of
    // DeepSeek-V3, torchtitan and Megatron-Core drop after weighing).
    auto w = gates.gather(1, idx);
    if (o.norm_topk_prob) w = w / (w.sum(1, true) + 1e-20);
    out.weight = (w * o.route_scale).t().reshape(-1);
  } else if (k == 1) {
    out.weight = gates.gather(1, idx).squeeze(1);
  } else if (!o.norm_topk_prob) {
    // Qwen3-MoE's norm_topk_prob false: the chosen probabilities as they are (a dropped route's
    // weight is never used).
    out.weight = gates.gather(1, idx).t().reshape(-1);
  } else if (k == 2) {
    const auto kept_sk = kept.view({2, S}).t().to(gates.scalar_type());
    const auto g = gates.gather(1, idx) * kept_sk;
    const auto g1 = g.select(1, 0), g2 = g.select(1, 1);
    const auto denom = (g1 + g2).clamp_min(eps);
    out.weight = torch::cat({g1 / denom, g2 / denom});
  } else {
    auto mask = torch::zeros({S, E}, gates.options());
    mask.index_put_({token, expert}, kept.to(gates.scalar_type()));
    const auto masked = gates * mask;
    const auto normed = masked / masked.sum(-1, true).clamp_min(eps);
    out.weight = normed.gather(1, idx).t().reshape(-1);
  }

  // Hugging Face's load-balancing loss needs each expert's probability summed over the tokens
  // (moe/balance.h); differentiable, [E] in the gates' dtype.
  if (o.probs_sum && !sigmoid) out.probs_sum = gates.sum(0);
  if (o.z_loss_coef > 0) {
    out.z_loss = S == 0 ? logits.sum() * 0.0
                        : torch::logsumexp(logits, 1).pow(2).mean() * o.z_loss_coef;
  }
  return out;
}

GateOutput gate(const torch::Tensor& logits, const GateOptions& o) {
  const GateRoutes r = gate_routes(logits, o);
  const auto kept_routes = r.kept.nonzero().squeeze(1);  // variable length: a host sync on CUDA
  GateOutput out;
  out.num_experts = r.num_experts;
  out.capacity = r.capacity;
  out.l_aux = r.l_aux;
  out.z_loss = r.z_loss;
  out.exp_counts = r.exp_counts;
  out.token = r.token.index_select(0, kept_routes);
  out.expert = r.expert.index_select(0, kept_routes);
  out.slot = r.slot.index_select(0, kept_routes);
  out.weight = r.weight.index_select(0, kept_routes);
  out.dropped = r.dropped.item<int64_t>();
  return out;
}

}  // namespace strata::moe
