// strata::moe::MoE: DeepSpeed-MoE's layer (deepspeed/moe/layer.py, sharded_moe.py MOELayer), a
// torch::nn::Module to put in a model where an MLP was: y = MoE(x), same shape, x [..., d].
//
// One forward:
//   1. gate: logits = x.float() @ W_g^T (W_g: Linear(d, E, no bias), computed in float32 as
//      DeepSpeed's TopKGate, with autocast off, as Megatron's router: under torch_autocast the
//      routes are those of float32; Jitter multiplies the gate's input by uniform(1 +- 0.01)
//      noise at every k while training, DeepSpeed's multiplicative_jitter); moe::gate_routes()
//      gives the capacity C, all S*k routes with a kept mask, l_aux, z_loss, exp_counts
//      (moe/gate.h).
//   2. dispatch: the kept routes are written into a zero-padded [E * C, d] buffer at rows
//      expert * C + slot, the dropped ones to a scratch row that is cut off (moe/dispatch.h).
//      Memory O(S * k * d + E * C * d), never [S, E, C]. With ep_size 1 and the experts'
//      grouped kernel there is no padded buffer: the routes go straight into the kernel's packed
//      rows (Experts::forward_routes), and steps 3 and the padding are skipped.
//   3. expert parallelism (ep_size > 1): no padded buffer either. The variable-split exchange
//      (moe/exchange.h) sends exactly the kept routes' rows to the ranks that hold their experts
//      (counts first, one small exchange and one host read of them per layer), the experts run
//      on exactly the rows they received as one grouped computation, and the outputs come back
//      the same way (autograd flows through both). moe.exchange_chunks cuts it into chunks of
//      local experts whose exchanges overlap the other chunks' experts on a GPU.
//   4. combine: each kept route's output row times its combine weight, summed into its token
//      over the k choices (route r = choice * S + token: a reduction, no index_add); dropped
//      routes add nothing.
// drop_tokens = false: at ep_size 1 with the batched kernel, C is the largest expert load (read
// on the host) and the same padded layout; with the grouped kernel, and under expert parallelism,
// there is no padded buffer and no capacity: every route is kept, sorted by expert, and one
// grouped product runs over the variable group sizes (MoEStats::capacity then reports the S * k
// bound).
// The ranks of an EP group may route different numbers of tokens per call (a last short batch;
// DeepSpeed needs equal counts): an all-reduce, one per forward with ep_size > 1 (on the host),
// agrees on the largest count, and drop_tokens' capacity is computed from it, so every rank drops
// alike. A rank may route none (an empty micro-batch): it joins every
// collective with empty buffers, its output is empty and its l_aux and z-loss are 0.
//
// Host synchronisations on CUDA, forward and backward together (tests/moe/test_layer_gpu.cpp
// counts them with LibTorch's sync debug mode): none with drop_tokens = true, for every k and
// noise policy: routes have a fixed size, counts are scatter_adds, the number dropped stays on
// the device (MoEStats::dropped; dropped_count() reads it), and the gate's CPU-drawn noise is
// copied through page-locked memory without a wait. With drop_tokens = false one: reading the
// largest expert load for the capacity, none at ep_size 1 with the grouped kernel (no capacity
// needed). Under expert parallelism one per forward, either way: the exchange's counts (NCCL
// takes split sizes on the host). Streamed experts (expert_unit_size)
// add one per forward: the routed rows per local expert, read so that unreached units are left
// alone (moe/experts.h).
//
// Randomness is named, never positional (moe/keys.h), so runs at different ep_size draw the same:
//   - W_g from key(seed, GateInit, layer_id): uniform(+-1/sqrt(d)), identical on every rank;
//   - expert g from key(seed, ExpertInit, layer_id, g) (moe/experts.h);
//   - call c's gate noise (RSample, RTS, 2nd-expert sampling) from key(seed, GateNoise,
//     layer_id, c), its Jitter from key(seed, Jitter, layer_id, c). Under the engine, c is the
//     global micro-batch: engine->forward calls begin_micro_batch((micro_step * world) + rank)
//     on every layer, so any world size, accumulation or resume draws the same noise for the
//     same samples, when micro-batch m of rank r holds the global batch's chunk m * world + r
//     (a second call of a layer in one forward draws a stream of its own). Used alone, c is the
//     layer's call counter: 0 at construction, +1 per forward (training or not);
//     set_call_index() sets it. The engine's checkpoints keep it.
//
// For the engine (expert parameters are reduced over the expert-DP group, kept in their own
// optimizer group and checkpointed per expert): the experts live in a submodule registered as
// "experts", so their full names contain the component "experts" (is_expert_parameter_name), and
// expert_parameters(model) lists them with the global experts each one holds. Everything else
// (the gate's "gate.weight") is an ordinary data-parallel parameter.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "runtime/config/config.h"
#include "moe/experts.h"
#include "moe/expert_params.h"
#include "moe/gate.h"

namespace strata::moe {

struct MoEOptions {
  MoEOptions() = default;
  // The gate's values from GateOptions (k, capacity factors, min_capacity, drop_tokens, use_rts,
  // noisy_gate_policy, top2_2nd_expert_sampling, drop_policy, z_loss_coef, seed); its training,
  // used_token and agree_over_group are the layer's business and are ignored.
  MoEOptions(int64_t hidden_size, int64_t ffn_size, int64_t num_experts,
             const GateOptions& gate = {});

  int64_t hidden_size = 0;  // d
  int64_t ffn_size = 0;     // the built-in MLP's hidden width (ignored with expert_factory)
  int64_t num_experts = 1;  // E, over the whole EP group
  int64_t k = 1;
  double capacity_factor = 1.0;
  double eval_capacity_factor = 1.0;
  int64_t min_capacity = 4;
  bool drop_tokens = true;
  bool use_rts = true;
  NoisyGatePolicy noisy_gate_policy = NoisyGatePolicy::None;
  bool top2_2nd_expert_sampling = true;
  DropPolicy drop_policy = DropPolicy::Probs;
  double router_z_loss_coef = 0.0;
  // Weighs l_aux in loss() (DeepSpeed programs' aux_loss_coef; the config's moe.aux_loss_coef).
  // The z-loss has its own coefficient, router_z_loss_coef: each acts alone.
  double aux_loss_coef = 0.01;
  uint64_t seed = 0;
  int64_t layer_id = 0;  // tells layers' random streams apart: give each MoE layer its own
  // Expert parallelism: ep_size ranks split the experts. ep_group: this rank's EP group
  // (comm::create_expert_groups(world, ep_size).expert_parallel); null only with ep_size 1.
  int64_t ep_size = 1;
  comm::GroupPtr ep_group;
  ExpertFactory expert_factory;  // empty: the built-in MLP (d -> ffn -> GELU -> d)
  bool expert_bias = true;       // the built-in MLP's biases (DeepSpeed's Linear default)
  // Keep each expert's probability summed over the tokens (MoEStats::probs_sum), for Hugging
  // Face's load-balancing loss (moe/balance.h); off, the gate does no extra reduction.
  bool router_probs_sum = false;
  // The built-in MLP's activation: GELU (DeepSpeed's), or SwiGLU (moe/experts.h).
  ExpertActivation expert_activation = ExpertActivation::Gelu;
  // DeepSpeed's Residual MoE (use_residual, PR-MoE): a dense MLP of the experts' shape ("mlp":
  // the built-in MLP, or expert_factory(kResidualMLP)) runs on every token beside the experts,
  // and y = moe(x) * c0 + mlp(x) * c1 with [c0, c1] = softmax(coefficient(x)), coefficient a
  // Linear(d, 2) ("coefficient"). Both are ordinary data-parallel parameters.
  bool use_residual = false;
  // DeepSeek-V3's MoE (moe/gate.h, "The sigmoid router"): sigmoid scores chosen with a balancing
  // bias, group-limited routing, and shared experts. The bias ([E] float32, not a parameter: no
  // optimizer, no weight decay) moves by bias_update_speed toward balance after each optimizer
  // step (update_expert_bias; the engine calls it with the step's loads summed over every rank
  // and micro-batch); 0 keeps it at zero.
  ScoreFunc score_func = ScoreFunc::Softmax;
  double bias_update_speed = 0.0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = true;
  double route_scale = 1.0;
  // Shared experts: "shared_experts", one dense MLP of n_shared_experts x ffn_size (the built-in
  // MLP, or expert_factory(kSharedExperts)) on every token, added to the routed output; an
  // ordinary data-parallel parameter under expert parallelism.
  int64_t n_shared_experts = 0;
  // Streamed experts (moe/experts.h): the local experts' weights in units of this many experts,
  // which ZeRO-3 gathers, offloads and releases one at a time; a unit no route reaches is not
  // read. 0: one unit of all local experts. The config's moe.expert_unit_size.
  int64_t expert_unit_size = 0;
  // Expert parallelism: the local experts' rows travel in this many exchanges, each overlapping
  // the other chunks' experts on a GPU (moe/exchange.h); 1: one exchange each way. The config's
  // moe.exchange_chunks.
  int64_t exchange_chunks = 1;
  // Tiled experts (runtime/util/tiled.h): the built-in experts' two products run over tiles of
  // their rows (the routed tokens, packed or capacity slots), each tile's [rows, ffn]
  // intermediates recomputed in backward. -1: untiled; 0: ceil(rows / hidden_size) tiles (ALST's
  // rule on the experts' rows); N: N tiles. Routing, the balance losses and the exchange see the
  // whole call, so the layer computes what it computes untiled. The models set it from their
  // mlp_tiles; built-in experts only.
  int64_t tiles = -1;

  // The gate's options for one call (training flag and seed filled by the layer).
  GateOptions gate_options() const;

  // Layer `layer_id`'s options from a config's `moe` block (DeepSpeed's MoE arguments, Strata's
  // gate keys), its expert-parallel group from comm::expert_groups(world, ep_size): the groups
  // the engine uses for the same ep_size. A collective the first time an ep_size is seen.
  static MoEOptions from_config(const MoeConfig& config, int64_t hidden_size, int64_t ffn_size,
                                int64_t layer_id, uint64_t seed, const comm::GroupPtr& world);
  // The first key the config's moe block gives (MoeConfig::given) with another value than these
  // options, as "moe.KEY is A in the config, the layer's is B"; empty when they all agree.
  std::string differs_from(const MoeConfig& config) const;
};

// The index expert_factory is called with for use_residual's dense MLP, and for the shared
// experts (one module of n_shared_experts x the expert's FFN width).
inline constexpr int64_t kResidualMLP = -1;
inline constexpr int64_t kSharedExperts = -2;

// What the last forward did, for losses and monitoring.
struct MoEStats {
  torch::Tensor l_aux;       // scalar, differentiable, no coefficient (loss() applies it)
  torch::Tensor z_loss;      // scalar, differentiable, coefficient applied; undefined if coef 0
  torch::Tensor exp_counts;  // [E] int64, routes per expert before capacity drops (this rank)
  // Softmax router: each expert's probability summed over this forward's tokens ([E],
  // differentiable), and the tokens: Hugging Face's load-balancing loss (moe/balance.h).
  torch::Tensor probs_sum;
  int64_t tokens = 0;
  // Routes that reached no expert (this rank): dropped over capacity, or padding under
  // used_token (GateOutput::dropped). An int64 scalar on the layer's device, so that forward
  // never waits for the device; dropped_count() reads it (a host sync on CUDA).
  torch::Tensor dropped;
  int64_t capacity = 0;      // C
  // ep_size 1: [E, C, d], the padded buffer, and what the experts saw ([E, C, d]; empty on the
  // packed-routes path). Expert parallelism: [rows sent, d] (the kept routes) and [rows the
  // local experts received, d].
  std::vector<int64_t> dispatch_shape;
  std::vector<int64_t> expert_input_shape;
  // Expert parallelism: the rows this rank sent to and received from each rank of its group
  // (itself included) in the last forward's exchange; empty at ep_size 1.
  std::vector<int64_t> sent_to, received_from;

  int64_t dropped_count() const;
};

class MoEImpl : public torch::nn::Module {
 public:
  explicit MoEImpl(MoEOptions options);

  // x [..., d] -> [..., d]. used_token (optional, k = 1 only, DeepSpeed's): a 0/1 mask of x's
  // leading shape [...]; the tokens it marks 0 (padding) take no expert capacity, are not
  // counted in l_aux's ce or exp_counts, and get no expert output.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& used_token = {});

  const MoEOptions& options() const { return options_; }
  const MoEStats& last() const { return last_; }
  // What the last forward adds to the model's loss: aux_loss_coef * l_aux + z_loss (the latter
  // with router_z_loss_coef applied, when enabled). Add it as it is: each coefficient is here.
  torch::Tensor loss() const;

  int64_t call_index() const { return call_; }
  void set_call_index(int64_t c) { call_ = c; }
  // The engine's keying (see the header comment): this forward's noise is that of global
  // micro-batch `index`; from now on the layer no longer counts calls itself.
  void begin_micro_batch(int64_t index);

  // The sigmoid router's balancing (MoEOptions::bias_update_speed). The bias ([E] float32: the
  // buffer "gate.e_score_correction_bias", moe/expert_params.h, which set_expert_bias copies
  // into; where it is not on the logits' device the gate moves a copy there); the routes each
  // expert was chosen for (before capacity drops) summed over this rank's training forwards
  // since the last take, [E] int64 on the layer's device (zeros before the first forward); and
  // the update: bias += bias_update_speed * sign(mean(load) - load), from loads every rank
  // agrees on.
  const torch::Tensor& expert_bias() const { return expert_bias_; }
  void set_expert_bias(const torch::Tensor& bias);
  torch::Tensor take_expert_load();
  void update_expert_bias(const torch::Tensor& load);

  int64_t num_local_experts() const { return options_.num_experts / options_.ep_size; }
  int64_t first_expert() const { return ep_rank_ * num_local_experts(); }

  torch::nn::Linear gate{nullptr};  // "gate.weight" [E, d]
  Experts experts{nullptr};         // "experts.*"
  // use_residual only (else empty / null): "mlp.*" and "coefficient.{weight,bias}".
  torch::nn::AnyModule mlp;
  torch::nn::Linear coefficient{nullptr};
  torch::nn::AnyModule shared_experts;  // n_shared_experts > 0 only: "shared_experts.*"

 protected:
  // forward(x) through torch::nn::AnyModule (used_token left out).
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())})

 private:
  // use_residual: the experts' output y [S, d] mixed with the dense MLP's on x [S, d].
  torch::Tensor mix_residual(const torch::Tensor& x, const torch::Tensor& y);
  // n_shared_experts: y plus the shared experts' output on x.
  torch::Tensor add_shared(const torch::Tensor& x, const torch::Tensor& y);
  // Keeps what the last forward did (expert_input_shape empty: no padded buffer was built).
  void record(const GateRoutes& g, int64_t capacity, std::vector<int64_t> dispatch_shape,
              std::vector<int64_t> expert_input_shape);
  // The bias back to float32 after a Module::to(dtype) cast it.
  void keep_bias_float32();
  // The c of this call's noise keys (and the counting that goes with it).
  uint64_t next_noise_index();

  MoEOptions options_;
  int64_t ep_rank_ = 0;
  int64_t call_ = 0;
  int64_t calls_in_micro_batch_ = 0;
  bool keyed_by_micro_batch_ = false;
  MoEStats last_;
  torch::Tensor expert_bias_;  // [E] float32 (sigmoid router): the gate's buffer
  torch::Tensor bias_on_device_;  // its copy on the logits' device, refreshed when it moves
  torch::Tensor load_;         // [E] int64, routes chosen since take_expert_load()
};
TORCH_MODULE(MoE);

}  // namespace strata::moe
