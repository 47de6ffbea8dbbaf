// The MoE gate: from router logits [S tokens, E experts] to the routes each token takes, each
// expert's capacity, and the auxiliary losses. It is DeepSpeed-MoE's gating
// (deepspeed/moe/sharded_moe.py), decision for decision, so that a DeepSpeed config trains the
// same model here:
//   - k = 1 follows top1gating: argmax of softmax(logits) (of logits + Gumbel noise under
//     RSample while training); capacity ceil(S/E * cf), at least min_capacity; over capacity, the
//     tokens with the highest uniform random priority survive (use_rts), otherwise the lowest
//     token indices; the combine weight is the raw softmax probability (not renormalised);
//     l_aux = sum(me * ce) * E.
//   - k = 2 follows top2gating: 1st expert argmax of softmax(logits), 2nd argmax of logits (plus
//     Gumbel noise when top2_2nd_expert_sampling, in eval too, as DeepSpeed) with the 1st masked
//     out; capacity from cf * 2; positions are first all 1st choices in token order, then all 2nd
//     choices (offset by the 1st choices' counts); a route at position >= capacity is dropped; the
//     kept weights are renormalised per token, w / max(sum kept w, eps) (norm_topk_prob false:
//     the chosen probabilities as they are, for k >= 2, Qwen3-MoE's); l_aux = mean(me*ce)*E*E
//     with ce counting 1st choices only.
//   - k >= 3 follows topkgating: the k most probable experts; capacity from cf * k; drop_policy
//     Probs keeps each expert's `capacity` most probable routes, Position the first in token
//     order; kept weights renormalised as for k = 2; l_aux = mean(me*ce)*E*E/k with ce counting
//     all k choices.
// me is the mean gate probability per expert, ce the fraction of tokens routed to it (before
// drops). exp_counts counts routes per expert BEFORE capacity drops, as DeepSpeed does. No tokens
// (S = 0) routes nothing; l_aux and z_loss are then 0 (still functions of the logits). With
// drop_tokens = false the capacity is the largest expert load, agreed over the expert-parallel
// group through `agree_over_group` (DeepSpeed's all-reduce MAX; k = 1 then caps it at the token
// count). Under expert parallelism the token count the capacity comes from is the group's
// largest (the same all-reduce), so ranks that route different numbers of tokens (a last short
// batch) still build buffers of one shape; DeepSpeed requires equal counts.
//
// Two forms of the result, both O(S*k), never DeepSpeed's dense [S,E,C] tensors:
//   - gate_routes(): fixed size, for the layer: all S*k routes with a kept mask, the dropped count
//     as a device tensor. On CUDA it never makes the host wait for the device with drop_tokens =
//     true (counts by scatter_add, ranks by sort and scatter, noise copied asynchronously); with
//     drop_tokens = false once, to read the largest expert load.
//   - gate(): the kept routes as lists, built on gate_routes() (their length is read on the host:
//     a sync on CUDA). For tests, tools and users who want to look at the routing.
// The lists are permutation-style: one entry per kept route (token, expert, slot within
// the expert's capacity buffer, combine weight), never DeepSpeed's dense [S,E,C] tensors. A slot
// is what DeepSpeed's `locations` hold: for k = 1 and drop_policy Probs, the kept routes of an
// expert in token order; for k = 2 the pre-drop position; for Position, the token-order position.
//
// Ties (where DeepSpeed's torch.topk/argmax leave the order unspecified), here fixed:
//   - between experts: the lowest expert index wins (argmax; a stable sort for k >= 3);
//   - between tokens competing for capacity at equal priority: the lowest token index survives.
//
// Randomness: all noise (RSample Gumbel, RTS priorities, 2nd-expert Gumbel) is drawn as uniform
// numbers, in that order, from one generator created from `seed` alone for the logits' device
// (noise_generator): LibTorch's CPU generator on the CPU, the device's own (Philox on CUDA) on a
// GPU, where the draws and the Gumbel transform -log(-log(u)) run as kernels on the stream (no host
// work, no copy). So the noise does not depend on how experts are spread over ranks; it depends
// on the device type: a CPU run and a GPU run draw different noise. (Drawn on the host and
// copied, the 2nd-expert Gumbel cost moe-8x 4% of its step on one H200.) The layer derives the
// seed from (seed, step, micro-batch, layer). DeepSpeed draws from the global RNG.
//
// The sigmoid router (score_func Sigmoid, DeepSeek-V3 §2.1.2, as torchtitan and Megatron-Core
// write it), for every k: scores s = sigmoid(logits); each token's k experts are the top-k of
// s + expert_bias (the bias chooses, it never weighs), within its topk_group best groups when
// n_group > 1 (a group's score: the sum of its two best s + bias; ties to the lower index); the
// combine weights are the chosen unbiased s, divided by their sum when norm_topk_prob, times
// route_scale, computed before any capacity drop (a dropped route adds nothing). Capacity and
// drops follow the k >= 3 rules (drop_policy; Probs ranks by s). l_aux is DeepSeek-V3's
// sequence-wise balance loss: per sequence of sequence_length tokens, sum_i f_i * P_i with
// f_i = E / (k T) x (the sequence's routes to i) and P_i the mean over its tokens of
// s_i / sum_j s_j; averaged over the sequences (weighed by the layer's aux_loss_coef, 0 for the
// bias-only balancing). The gate's noise (RSample, 2nd-expert sampling, RTS) does not apply.
//
// What differs from DeepSpeed, on purpose:
//   - noisy_gate_policy Jitter multiplies the gate's INPUT (before W_g), for every k, so it
//     belongs to the layer (moe/layer.h); here it is accepted and does nothing. RSample with
//     k >= 2 is ignored as in DeepSpeed (only top1gating takes it), but with a warning (DeepSpeed
//     is silent).
//   - drop_policy is an option of the gate for k >= 3 (DeepSpeed's TopKGate always uses "probs").
//   - router z-loss (ST-MoE): z_loss_coef * mean(logsumexp(logits)^2), when z_loss_coef > 0.
//   - no tensor-parallel rounding of the drop_tokens=false capacity (Strata has no TP) and no
//     Tutel path. The logits are not modified in place (DeepSpeed's top2 adds its noise in place).
//   - bad input is a strata::Error, never an assert (DeepSpeed asserts S >= min_capacity at k = 1;
//     so does this, as an Error, on the expert-parallel group's largest count so that the ranks
//     of a group throw together).
#pragma once

#include <cstdint>
#include <functional>

#include <torch/torch.h>

namespace strata::moe {

enum class NoisyGatePolicy { None, Jitter, RSample };
enum class DropPolicy { Probs, Position };
enum class ScoreFunc { Softmax, Sigmoid };

// What agree_over_group agrees on: the tokens routed, and (drop_tokens = false only, else 0:
// reading it would make the host wait for the device) the largest expert load.
struct GroupCounts {
  int64_t tokens = 0;
  int64_t load = 0;
};

struct GateOptions {
  int64_t k = 1;
  double capacity_factor = 1.0;       // while training
  double eval_capacity_factor = 1.0;  // while not training
  int64_t min_capacity = 4;           // DeepSpeed's MoE default (TopKGate's own default is 8)
  bool training = true;
  bool drop_tokens = true;
  bool use_rts = true;  // k = 1 only (random token selection), in eval too as in DeepSpeed
  // RSample: k = 1, training only; Jitter is the layer's (the gate ignores it).
  NoisyGatePolicy noisy_gate_policy = NoisyGatePolicy::None;
  bool top2_2nd_expert_sampling = true;  // k = 2 only, in eval too as in DeepSpeed
  DropPolicy drop_policy = DropPolicy::Probs;  // k >= 3 only
  double z_loss_coef = 0.0;  // 0: no z-loss
  uint64_t seed = 0;
  // Optional [S] 0/1 mask of the tokens to route (DeepSpeed's used_token; k = 1 only).
  torch::Tensor used_token;
  // DeepSeek-V3's router (score_func Sigmoid; see "The sigmoid router" above). expert_bias: [E]
  // float32, added to the scores to choose the experts only (undefined: no bias).
  ScoreFunc score_func = ScoreFunc::Softmax;
  torch::Tensor expert_bias;
  int64_t n_group = 1;     // experts in n_group equal groups; routes stay within topk_group of them
  int64_t topk_group = 1;
  bool norm_topk_prob = true;
  double route_scale = 1.0;
  // GateRoutes::probs_sum (Hugging Face's balance loss, moe/balance.h); off, no extra reduction.
  bool probs_sum = false;
  // The sequence-wise balance loss's sequences: tokens [s * T, (s + 1) * T) form one (0: all S).
  int64_t sequence_length = 0;
  // drop_tokens = false for a caller with no capacity-sized buffer (the layer's grouped kernel at
  // ep_size 1, the variable-split exchange under expert parallelism): every route is kept and the
  // largest load is not read, so no host sync for it; the capacity reported is the S * k routes'
  // bound. With agree_over_group only the token count is agreed (for min_capacity's check).
  bool uncapped = false;
  // Expert parallelism: maps this rank's counts to their maxima over the expert-parallel group
  // (one all-reduce MAX), so that every rank's capacity, and so its buffers, have one shape.
  // Empty: this rank alone. Must return at least its argument in each field.
  std::function<GroupCounts(GroupCounts)> agree_over_group;
};

struct GateOutput {
  int64_t num_experts = 0;
  int64_t capacity = 0;    // slots per expert
  torch::Tensor l_aux;     // scalar, differentiable w.r.t. logits
  torch::Tensor z_loss;    // scalar, differentiable; undefined unless z_loss_coef > 0
  torch::Tensor exp_counts;  // [E] int64: routes chosen per expert, before capacity drops
  // The kept routes, R of them, ordered by choice (all 1st choices, then all 2nd, ...) and by
  // token within a choice: DeepSpeed's [k, S] route layout without the dropped entries.
  torch::Tensor token;   // [R] int64, token index in [0, S)
  torch::Tensor expert;  // [R] int64, expert index in [0, E)
  torch::Tensor slot;    // [R] int64, position in the expert's buffer, in [0, capacity)
  torch::Tensor weight;  // [R] logits' dtype, combine weight, differentiable w.r.t. logits
  // Routes that reach no expert: dropped over capacity (counted in exp_counts), and the routes
  // of tokens used_token marks as padding (counted nowhere else).
  int64_t dropped = 0;
};

// The fixed-size form. Route r = choice * S + token, r in [0, S*k), for every route; where kept is
// false (dropped over capacity, or an unused token) slot and weight mean nothing.
struct GateRoutes {
  int64_t num_experts = 0;
  int64_t capacity = 0;
  torch::Tensor l_aux, z_loss, exp_counts;  // as in GateOutput
  torch::Tensor token;        // [S*k] int64
  torch::Tensor expert;       // [S*k] int64
  torch::Tensor slot;         // [S*k] int64, in [0, capacity) where kept
  torch::Tensor kept;         // [S*k] bool
  torch::Tensor weight;       // [S*k] logits' dtype, differentiable
  torch::Tensor kept_counts;  // [E] int64, kept routes per expert (slots 0..n-1 are filled)
  torch::Tensor dropped;      // int64 scalar on the logits' device: GateOutput::dropped
  // Softmax router with GateOptions::probs_sum: each expert's probability summed over the S
  // tokens, [E], differentiable (Hugging Face's load-balancing loss, moe/balance.h); else
  // undefined.
  torch::Tensor probs_sum;
};

// logits: [S, E], float32 (float64 accepted, e.g. for gradient checks), any device.
GateRoutes gate_routes(const torch::Tensor& logits, const GateOptions& options);
GateOutput gate(const torch::Tensor& logits, const GateOptions& options);

// `host` (a CPU tensor) on `device`; for CUDA through page-locked memory and a non-blocking copy
// on the current stream, so the host does not wait.
torch::Tensor host_to_device(const torch::Tensor& host, const torch::Device& device);

// A fresh generator for `device`'s type seeded with `seed` alone (offset 0): the CPU's mt19937,
// or a copy of the device's default generator (Philox on CUDA) reseeded, so draws from it run on
// the device and do not touch the process's global random state.
at::Generator noise_generator(uint64_t seed, const torch::Device& device);

// DeepSpeed's _capacity: ceil(S / E * factor) evaluated in float32 as DeepSpeed's scripted
// function does, raised to min_capacity.
int64_t gate_capacity(int64_t num_tokens, int64_t num_experts, double factor,
                      int64_t min_capacity);

}  // namespace strata::moe
