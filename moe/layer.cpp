#include "moe/layer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "comm/topology.h"
#include "moe/dispatch.h"
#include "moe/exchange.h"
#include "moe/keys.h"
#include "runtime/error.h"
#include "runtime/util/recompute.h"

namespace strata::moe {
namespace {

constexpr double kJitterEps = 1e-2;  // DeepSpeed's multiplicative_jitter default

uint64_t layer_key(const MoEOptions& o, KeyTag tag, uint64_t c) {
  return key({o.seed, static_cast<uint64_t>(tag), static_cast<uint64_t>(o.layer_id), c});
}

void check(const MoEOptions& o) {
  if (o.hidden_size < 1) {
    throw Error(fmt::format("moe::MoE: hidden_size = {}; set it to the model width d (>= 1)",
                            o.hidden_size));
  }
  if (o.num_experts < 1 || o.k < 1 || o.k > o.num_experts) {
    throw Error(fmt::format("moe::MoE: num_experts = {}, k = {}; need num_experts >= 1 and "
                            "1 <= k <= num_experts", o.num_experts, o.k));
  }
  if (o.ep_size < 1 || o.num_experts % o.ep_size != 0) {
    throw Error(fmt::format("moe::MoE: num_experts = {} does not split over ep_size = {} ranks; "
                            "choose an ep_size that divides num_experts (E % ep_size == 0)",
                            o.num_experts, o.ep_size));
  }
  if (!std::isfinite(o.aux_loss_coef) || o.aux_loss_coef < 0) {
    throw Error(fmt::format("moe::MoE: aux_loss_coef = {}; it must be a finite number >= 0",
                            o.aux_loss_coef));
  }
  if (!std::isfinite(o.bias_update_speed) || o.bias_update_speed < 0 || o.n_shared_experts < 0) {
    throw Error(fmt::format("moe::MoE: bias_update_speed = {}, n_shared_experts = {}; both must "
                            "be >= 0", o.bias_update_speed, o.n_shared_experts));
  }
  if (o.exchange_chunks < 1) {
    throw Error(fmt::format("moe::MoE: exchange_chunks = {}; give the number of exchanges the local "
                            "experts' rows are cut into (>= 1)", o.exchange_chunks));
  }
  if (o.tiles < -1 || (o.tiles >= 0 && o.expert_factory)) {
    throw Error(fmt::format("moe::MoE: tiles = {}; give -1 (untiled), 0 (derived from the rows) or "
                            "a count, for the built-in experts only (a user's expert modules are "
                            "not tiled)",
                            o.tiles));
  }
  if (o.expert_unit_size < 0) {
    throw Error(fmt::format("moe::MoE: expert_unit_size = {}; give the experts per streamed unit "
                            "(>= 1), or 0 to keep a layer's local experts in one unit",
                            o.expert_unit_size));
  }
  if (o.bias_update_speed > 0 && o.score_func != ScoreFunc::Sigmoid) {
    throw Error(fmt::format("moe::MoE: bias_update_speed = {} balances the sigmoid router; set "
                            "score_func = ScoreFunc::Sigmoid or leave it 0", o.bias_update_speed));
  }
  if (o.ep_group && o.ep_group->size() != o.ep_size) {
    throw Error(fmt::format("moe::MoE: ep_size = {} but the expert-parallel group {} has {} ranks; "
                            "pass comm::create_expert_groups(world, ep_size).expert_parallel",
                            o.ep_size, o.ep_group->name(), o.ep_group->size()));
  }
  if (!o.ep_group && o.ep_size > 1) {
    throw Error(fmt::format("moe::MoE: ep_size = {} needs its expert-parallel group: pass "
                            "comm::create_expert_groups(world, {}).expert_parallel as ep_group",
                            o.ep_size, o.ep_size));
  }
}

// The router's logits in float32, in @ weight^T, from inputs of any dtype (DeepSpeed's TopKGate
// casts both). Backward casts them again rather than keep float32 copies: what it saves is `in`
// itself, which the layer's input already holds at the model's width (the float32 copy of a
// 16-bit input would be 2 S d bytes per layer, kept until backward).
struct RouterLogits : torch::autograd::Function<RouterLogits> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& in,
                               const torch::Tensor& weight) {
    ctx->save_for_backward({in, weight});
    return torch::mm(in.to(torch::kFloat), weight.to(torch::kFloat).t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &in = saved[0], &weight = saved[1];
    const auto g = grads[0].to(torch::kFloat);
    torch::Tensor grad_in, grad_weight;
    if (ctx->needs_input_grad(0)) grad_in = g.mm(weight.to(torch::kFloat)).to(in.scalar_type());
    if (ctx->needs_input_grad(1))
      grad_weight = g.t().mm(in.to(torch::kFloat)).to(weight.scalar_type());
    return {grad_in, grad_weight};
  }
};

// Linear's own init bounds (kaiming_uniform, a = sqrt(5): U(+-1/sqrt(fan_in))), weight then bias,
// from a named generator.
void init_linear(torch::nn::Linear& l, at::Generator& gen) {
  torch::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(double(l->weight.size(1)));
  l->weight.copy_(torch::rand(l->weight.sizes(), gen, torch::kFloat) * (2 * bound) - bound);
  if (l->bias.defined())
    l->bias.copy_(torch::rand(l->bias.sizes(), gen, torch::kFloat) * (2 * bound) - bound);
}

// use_residual's built-in dense MLP, one expert's shape: Linear(d, ffn) -> GELU -> Linear(ffn, d).
struct DenseMlpImpl : torch::nn::Module {
  DenseMlpImpl(int64_t d, int64_t ffn, bool bias) {
    fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(d, ffn).bias(bias)));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(ffn, d).bias(bias)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(DenseMlp);

// A dense MLP beside the experts (use_residual's, the shared experts'): expert_factory(index)
// under a generator seeded with `key`, or the built-in MLP of `width` drawn from it.
torch::nn::AnyModule dense_mlp(const MoEOptions& o, int64_t index, int64_t width, uint64_t key,
                               const char* what) {
  if (o.expert_factory) return build_seeded(o.expert_factory, index, key);
  if (o.ffn_size < 1)
    throw Error(fmt::format("moe::MoE: {} with the built-in MLP needs ffn_size >= 1 (it is {})",
                            what, o.ffn_size));
  DenseMlp dense(o.hidden_size, width, o.expert_bias);
  auto gen = at::detail::createCPUGenerator(key);
  init_linear(dense->fc1, gen);
  init_linear(dense->fc2, gen);
  return torch::nn::AnyModule(dense);
}

}  // namespace

MoEOptions::MoEOptions(int64_t hidden, int64_t ffn, int64_t experts, const GateOptions& g)
    : hidden_size(hidden),
      ffn_size(ffn),
      num_experts(experts),
      k(g.k),
      capacity_factor(g.capacity_factor),
      eval_capacity_factor(g.eval_capacity_factor),
      min_capacity(g.min_capacity),
      drop_tokens(g.drop_tokens),
      use_rts(g.use_rts),
      noisy_gate_policy(g.noisy_gate_policy),
      top2_2nd_expert_sampling(g.top2_2nd_expert_sampling),
      drop_policy(g.drop_policy),
      router_z_loss_coef(g.z_loss_coef),
      seed(g.seed) {}

GateOptions MoEOptions::gate_options() const {
  GateOptions g;
  g.k = k;
  g.capacity_factor = capacity_factor;
  g.eval_capacity_factor = eval_capacity_factor;
  g.min_capacity = min_capacity;
  g.drop_tokens = drop_tokens;
  g.use_rts = use_rts;
  g.noisy_gate_policy = noisy_gate_policy;
  g.top2_2nd_expert_sampling = top2_2nd_expert_sampling;
  g.drop_policy = drop_policy;
  g.z_loss_coef = router_z_loss_coef;
  g.seed = seed;
  g.score_func = score_func;
  g.n_group = n_group;
  g.topk_group = topk_group;
  g.norm_topk_prob = norm_topk_prob;
  g.route_scale = route_scale;
  g.probs_sum = router_probs_sum;
  return g;
}

MoEOptions MoEOptions::from_config(const MoeConfig& c, int64_t hidden, int64_t ffn,
                                   int64_t layer_id, uint64_t seed, const comm::GroupPtr& world) {
  MoEOptions o;
  o.hidden_size = hidden;
  o.ffn_size = ffn;
  o.num_experts = c.num_experts;
  o.k = c.top_k;
  o.capacity_factor = c.capacity_factor;
  o.eval_capacity_factor = c.eval_capacity_factor;
  o.min_capacity = c.min_capacity;
  o.drop_tokens = c.drop_tokens;
  o.use_rts = c.use_rts;
  o.noisy_gate_policy = c.noisy_gate_policy == "Jitter"    ? NoisyGatePolicy::Jitter
                        : c.noisy_gate_policy == "RSample" ? NoisyGatePolicy::RSample
                                                           : NoisyGatePolicy::None;
  o.top2_2nd_expert_sampling = c.top2_2nd_expert_sampling;
  o.drop_policy = c.drop_policy == "position" ? DropPolicy::Position : DropPolicy::Probs;
  o.router_z_loss_coef = c.router_z_loss_coef;
  o.aux_loss_coef = c.aux_loss_coef;
  o.seed = seed;
  o.layer_id = layer_id;
  o.use_residual = c.use_residual;
  o.score_func = c.score_func == "sigmoid" ? ScoreFunc::Sigmoid : ScoreFunc::Softmax;
  o.bias_update_speed = c.bias_update_speed;
  o.n_group = c.n_group;
  o.topk_group = c.topk_group;
  o.norm_topk_prob = c.norm_topk_prob;
  o.route_scale = c.route_scale;
  o.n_shared_experts = c.n_shared_experts;
  o.expert_unit_size = c.expert_unit_size;
  o.exchange_chunks = c.exchange_chunks;
  o.ep_size = c.ep_size;
  // comm's expert layout refuses an ep_size that does not divide the world, naming both.
  o.ep_group = comm::expert_groups(world, static_cast<int>(c.ep_size)).expert_parallel;
  return o;
}

std::string MoEOptions::differs_from(const MoeConfig& c) const {
  auto policy = [](NoisyGatePolicy p) {
    return p == NoisyGatePolicy::Jitter ? "Jitter" : p == NoisyGatePolicy::RSample ? "RSample" : "None";
  };
  // Each key as the config writes it, beside these options' value in the same form.
  const std::vector<std::tuple<const char*, json, json>> keys = {
      {"num_experts", c.num_experts, num_experts},
      {"ep_size", c.ep_size, ep_size},
      {"top_k", c.top_k, k},
      {"capacity_factor", c.capacity_factor, capacity_factor},
      {"eval_capacity_factor", c.eval_capacity_factor, eval_capacity_factor},
      {"min_capacity", c.min_capacity, min_capacity},
      {"drop_tokens", c.drop_tokens, drop_tokens},
      {"use_rts", c.use_rts, use_rts},
      {"noisy_gate_policy", c.noisy_gate_policy, policy(noisy_gate_policy)},
      {"top2_2nd_expert_sampling", c.top2_2nd_expert_sampling, top2_2nd_expert_sampling},
      {"drop_policy", c.drop_policy, drop_policy == DropPolicy::Position ? "position" : "probs"},
      {"router_z_loss_coef", c.router_z_loss_coef, router_z_loss_coef},
      {"aux_loss_coef", c.aux_loss_coef, aux_loss_coef},
      {"use_residual", c.use_residual, use_residual},
      {"score_func", c.score_func, score_func == ScoreFunc::Sigmoid ? "sigmoid" : "softmax"},
      {"bias_update_speed", c.bias_update_speed, bias_update_speed},
      {"n_group", c.n_group, n_group},
      {"topk_group", c.topk_group, topk_group},
      {"norm_topk_prob", c.norm_topk_prob, norm_topk_prob},
      {"route_scale", c.route_scale, route_scale},
      {"n_shared_experts", c.n_shared_experts, n_shared_experts},
      {"expert_unit_size", c.expert_unit_size, expert_unit_size},
      {"exchange_chunks", c.exchange_chunks, exchange_chunks},
  };
  for (const auto& [key, in_config, here] : keys)
    if (c.given.count(key) && in_config != here)
      return fmt::format("moe.{} is {} in the config, the layer's is {}", key, in_config.dump(),
                         here.dump());
  return {};
}

MoEImpl::MoEImpl(MoEOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  check(o);
  ep_rank_ = o.ep_group ? o.ep_group->rank() : 0;
  gate = register_module(
      "gate", torch::nn::Linear(torch::nn::LinearOptions(o.hidden_size, o.num_experts).bias(false)));
  {
    auto gen = at::detail::createCPUGenerator(layer_key(o, KeyTag::GateInit, 0));
    init_linear(gate, gen);
  }
  ExpertsOptions eo;
  eo.hidden_size = o.hidden_size;
  eo.ffn_size = o.ffn_size;
  eo.bias = o.expert_bias;
  eo.activation = o.expert_activation;
  eo.first_expert = first_expert();
  eo.local_experts = num_local_experts();
  eo.seed = o.seed;
  eo.layer_id = o.layer_id;
  eo.factory = o.expert_factory;
  eo.unit_experts = o.expert_unit_size;
  eo.tiles = o.tiles;
  experts = register_module("experts", Experts(std::move(eo)));
  if (o.score_func == ScoreFunc::Sigmoid)  // a buffer of the gate: every export carries it
    expert_bias_ = gate->register_buffer(kExpertBiasBuffer, torch::zeros({o.num_experts}, torch::kFloat));
  if (o.n_shared_experts > 0) {
    // Named draws, as the experts': the same at any ep_size.
    shared_experts = dense_mlp(o, kSharedExperts, o.n_shared_experts * o.ffn_size,
                               layer_key(o, KeyTag::SharedInit, 0), "n_shared_experts");
    register_module("shared_experts", shared_experts.ptr());
  }
  if (!o.use_residual) return;
  // Residual MoE, drawn from named keys as the experts are: Linear's init bounds for the built-in
  // MLP and the coefficient; a factory's MLP under a seeded default generator (build_seeded).
  namespace nn = torch::nn;
  mlp = dense_mlp(o, kResidualMLP, o.ffn_size, layer_key(o, KeyTag::ResidualInit, 0),
                  "use_residual");
  register_module("mlp", mlp.ptr());
  coefficient = register_module("coefficient", nn::Linear(o.hidden_size, 2));
  auto gen = at::detail::createCPUGenerator(layer_key(o, KeyTag::ResidualInit, 1));
  init_linear(coefficient, gen);
}

torch::Tensor MoEImpl::mix_residual(const torch::Tensor& x, const torch::Tensor& y) {
  if (!options_.use_residual) return y;
  // DeepSpeed's MoE.forward: softmax over the two, in the model's dtype.
  const auto dense = mlp.forward<torch::Tensor>(x);
  const auto coef = torch::softmax(coefficient->forward(x), -1);
  return y * coef.narrow(-1, 0, 1) + dense * coef.narrow(-1, 1, 1);
}

torch::Tensor MoEImpl::add_shared(const torch::Tensor& x, const torch::Tensor& y) {
  if (shared_experts.is_empty()) return y;
  return y + shared_experts.forward<torch::Tensor>(x);
}

int64_t MoEStats::dropped_count() const {
  if (!dropped.defined()) {
    throw Error("moe::MoEStats::dropped_count: no forward has run yet; call it after forward()");
  }
  return dropped.item<int64_t>();
}

torch::Tensor MoEImpl::loss() const {
  if (!last_.l_aux.defined()) {
    throw Error("moe::MoE::loss: no forward has run yet; call it after forward()");
  }
  // Each term under its own coefficient (z_loss has router_z_loss_coef applied by the gate). A
  // zero coefficient (DeepSeek-V3's bias-only balancing) adds no graph for backward to walk.
  const auto aux = options_.aux_loss_coef == 0.0 ? torch::zeros_like(last_.l_aux.detach())
                                                 : last_.l_aux * options_.aux_loss_coef;
  return last_.z_loss.defined() ? aux + last_.z_loss : aux;
}

void MoEImpl::set_expert_bias(const torch::Tensor& bias) {
  if (options_.score_func != ScoreFunc::Sigmoid)
    throw Error(fmt::format("moe::MoE (layer {}): set_expert_bias on a softmax router; the bias "
                            "belongs to score_func Sigmoid", options_.layer_id));
  if (!bias.defined() || bias.dim() != 1 || bias.size(0) != options_.num_experts ||
      !bias.is_floating_point() || !torch::isfinite(bias).all().item<bool>())
    throw Error(fmt::format("moe::MoE (layer {}): expert bias {}; it must be [{}] finite numbers",
                            options_.layer_id, bias.defined() ? c10::str(bias.sizes()) : "undefined",
                            options_.num_experts));
  torch::NoGradGuard no_grad;
  expert_bias_.copy_(bias.detach().to(expert_bias_.device(), torch::kFloat));  // the buffer itself
  bias_on_device_ = torch::Tensor();
}

torch::Tensor MoEImpl::take_expert_load() {
  auto load = load_.defined() ? load_ : torch::zeros({options_.num_experts}, torch::kLong);
  load_ = torch::Tensor();
  return load;
}

void MoEImpl::update_expert_bias(const torch::Tensor& load) {
  if (options_.bias_update_speed <= 0) return;
  if (!load.defined() || load.numel() != options_.num_experts)
    throw Error(fmt::format("moe::MoE (layer {}): update_expert_bias takes [{}] expert loads",
                            options_.layer_id, options_.num_experts));
  torch::NoGradGuard no_grad;
  keep_bias_float32();
  const auto l = load.detach().to(torch::kCPU, torch::kDouble).reshape({-1});
  // DeepSeek-V3: up for an expert loaded below the mean, down above it, unchanged at the mean.
  const auto direction = torch::sign(l.mean() - l).to(torch::kFloat);
  expert_bias_.add_(direction.to(expert_bias_.device()) * static_cast<float>(options_.bias_update_speed));
  bias_on_device_ = torch::Tensor();
}

void MoEImpl::keep_bias_float32() {
  // Module::to(kBFloat16) casts every floating-point buffer; the bias moves by steps below bf16's
  // spacing, so it goes back to float32 (the engine's own cast leaves it alone).
  if (expert_bias_.scalar_type() == torch::kFloat) return;
  torch::NoGradGuard no_grad;
  expert_bias_.set_data(expert_bias_.to(torch::kFloat));
  bias_on_device_ = torch::Tensor();
}

void MoEImpl::begin_micro_batch(int64_t index) {
  call_ = index;
  calls_in_micro_batch_ = 0;
  keyed_by_micro_batch_ = true;
}

uint64_t MoEImpl::next_noise_index() {
  if (!keyed_by_micro_batch_) return static_cast<uint64_t>(call_++);
  // The first call of a micro-batch draws what set_call_index(index) would; a layer called
  // again in the same forward (shared weights) draws a stream of its own, not the next
  // micro-batch's.
  const int64_t repeat = calls_in_micro_batch_++;
  const auto c = static_cast<uint64_t>(call_);
  return repeat == 0 ? c : key({c, static_cast<uint64_t>(repeat)});
}

torch::Tensor MoEImpl::forward(const torch::Tensor& input, const torch::Tensor& used_token) {
  const auto& o = options_;
  const int64_t d = o.hidden_size, E = o.num_experts, ep = o.ep_size;
  if (input.dim() < 1 || input.size(-1) != d) {
    throw Error(fmt::format("moe::MoE (layer {}): input {} but hidden_size = {}; the last "
                            "dimension must be the model width", o.layer_id,
                            c10::str(input.sizes()), d));
  }
  const auto x = input.reshape({-1, d});
  const int64_t S = x.size(0);
  if (used_token.defined() && used_token.numel() != S) {
    throw Error(fmt::format("moe::MoE (layer {}): used_token {} but the input has {} tokens "
                            "({}); give one 0/1 entry per token", o.layer_id,
                            c10::str(used_token.sizes()), S, c10::str(input.sizes())));
  }
  // Activation checkpointing: the call counter advances once per real forward; a recomputation
  // replays the real forward's c, so its gate draws the same noise and routes the same tokens.
  const uint64_t c = recompute::remember([this] { return next_noise_index(); });

  // 1. Gate, in float32 (DeepSpeed's TopKGate casts input and weight), autocast off: autocast
  // would recast the product to 16 bits (Megatron runs its router in fp32 too).
  GateOptions go = o.gate_options();
  go.training = is_training();
  go.seed = layer_key(o, KeyTag::GateNoise, c);
  if (used_token.defined()) go.used_token = used_token.reshape({-1});  // the gate refuses k > 1
  if (expert_bias_.defined()) {
    keep_bias_float32();
    if (!bias_on_device_.defined() || bias_on_device_.device() != x.device())
      bias_on_device_ = host_to_device(expert_bias_, x.device());
    go.expert_bias = bias_on_device_;
    if (input.dim() >= 3) go.sequence_length = input.size(-2);  // [..., T, d]: sequences of T
  }
  // All experts here and the grouped kernel, or expert parallelism's variable-split exchange: no
  // capacity-padded buffer, so dropless needs no capacity either (no host sync for it).
  const bool packed_routes = ep == 1 && experts->grouped(x);
  go.uncapped = (packed_routes || ep > 1) && !o.drop_tokens;
  if (o.ep_group && ep > 1) {
    // One capacity over the group (drop_tokens), also where the ranks' token counts differ: the
    // token count's maximum in one all-reduce, on the host (no device sync). Dropless, the count
    // alone (for min_capacity's check, on every rank alike).
    const auto group = o.ep_group;
    go.agree_over_group = [group](GroupCounts local) {
      auto t = torch::tensor({local.tokens, local.load}, torch::kLong);
      group->all_reduce(t, comm::ReduceOp::Max);
      return GroupCounts{t[0].item<int64_t>(), t[1].item<int64_t>()};
    };
  }
  GateRoutes g;
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    auto gate_in = x;
    // DeepSpeed's TopKGate jitters the gate's input for every k while training.
    if (o.noisy_gate_policy == NoisyGatePolicy::Jitter && is_training()) {
      auto gen = noise_generator(layer_key(o, KeyTag::Jitter, c), x.device());
      const auto u = torch::rand({S, d}, gen, x.options().dtype(torch::kFloat));
      gate_in = x.to(torch::kFloat) * (u * (2 * kJitterEps) + (1 - kJitterEps));
    }
    const auto logits = RouterLogits::apply(gate_in, gate->weight);
    // Fixed size (all S*k routes, a kept mask): no host sync with drop_tokens (moe/gate.h).
    g = gate_routes(logits, go);
  }
  const int64_t C = g.capacity;
  // The step's loads, for the bias (no sync); once per real forward, not again when activation
  // checkpointing recomputes it.
  if (expert_bias_.defined() && is_training() && !recompute::recomputing()) {
    torch::NoGradGuard no_grad;
    load_ = load_.defined() ? load_ + g.exp_counts : g.exp_counts.clone();
  }

  if (packed_routes) {
    // All experts here and the grouped kernel: the routes go straight into its packed rows (no
    // capacity-padded buffer, which exists for the equal-split exchange).
    // Dropless (uncapped) without padding: every route is kept, and the rows are a permutation
    // of the routes. Padding (used_token 0) takes no row: the kept mask places the rest.
    const bool every_route = go.uncapped && !go.used_token.defined();
    const auto out = experts->forward_routes(x, o.k, g.expert, g.slot,
                                             every_route ? torch::Tensor() : g.kept, g.kept_counts);
    const auto y = out.permutation ? out.permutation->combine(out.rows, g.weight)
                                   : combine_tokens(out.rows, o.k, out.position, g.weight, g.kept);
    record(g, C, {E, C, d}, {});
    return add_shared(x, mix_residual(x, y)).view(input.sizes());
  }

  if (ep > 1) {
    // 2-3. Exactly the kept routes' rows to the experts' ranks and back (moe/exchange.h).
    const auto ex = exchange_with_experts(x, o.k, g, *experts, o.ep_group, o.exchange_chunks);
    // 4. Combine with the gate's weights (routes not sent add nothing).
    const auto y = combine_tokens(ex.rows_back, o.k, ex.position, g.weight, g.kept);
    record(g, C, {ex.sent_rows, d}, {ex.received_rows, d});
    if (!recompute::recomputing()) {
      last_.sent_to = ex.sent_to;
      last_.received_from = ex.received_from;
    }
    return add_shared(x, mix_residual(x, y)).view(input.sizes());
  }

  // 2. Dispatch into [E * C, d] (rows expert * C + slot; dropped routes to scratch row E * C).
  const auto position = (g.expert * C + g.slot).masked_fill(g.kept.logical_not(), E * C);
  const auto sent = dispatch_tokens(x, o.k, position, E * C);

  // 3. One rank holds every expert: [E, C, d] is the experts' input.
  auto expert_in = sent.view({E, C, d});
  torch::Tensor filled;  // [E, 1] rows filled per expert
  if (experts->grouped(expert_in) || experts->streamed()) {
    // Slots are dense from 0: expert e's first kept_counts[e] rows are filled. (The grouped
    // kernel packs the filled rows; streamed experts leave the units that receive none unread.)
    filled = g.kept_counts.view({E, 1});
  }
  const auto expert_out = experts->forward(expert_in, filled).reshape({E * C, d});

  // 4. Combine with the gate's weights (dropped routes add nothing).
  const auto y = combine_tokens(expert_out, o.k, position, g.weight, g.kept);

  record(g, C, {E, C, d}, expert_in.sizes().vec());
  return add_shared(x, mix_residual(x, y)).view(input.sizes());
}

void MoEImpl::record(const GateRoutes& g, int64_t capacity, std::vector<int64_t> dispatch_shape,
                     std::vector<int64_t> expert_input_shape) {
  // In a checkpointed region, the losses the model reads through loss() are the region's side
  // outputs (their gradient flows through the recomputation); a recomputation leaves the real
  // forward's statistics (expert loads, drops) as they were.
  recompute::side_output(g.l_aux, [this](const torch::Tensor& t) { last_.l_aux = t; });
  recompute::side_output(g.z_loss, [this](const torch::Tensor& t) { last_.z_loss = t; });
  recompute::side_output(g.probs_sum, [this](const torch::Tensor& t) { last_.probs_sum = t; });
  if (recompute::recomputing()) return;
  last_.probs_sum = g.probs_sum;
  last_.tokens = g.token.numel() / std::max<int64_t>(1, options_.k);
  last_.l_aux = g.l_aux;
  last_.z_loss = g.z_loss;
  last_.exp_counts = g.exp_counts;
  last_.dropped = g.dropped;
  last_.capacity = capacity;
  last_.dispatch_shape = std::move(dispatch_shape);
  last_.sent_to.clear();
  last_.received_from.clear();
  last_.expert_input_shape = std::move(expert_input_shape);
}

}  // namespace strata::moe
