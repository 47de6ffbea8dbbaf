#include "models/causal_lm.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "models/rope.h"
#include "moe/balance.h"
#include "runtime/checkpointing/checkpoint.h"
#include "runtime/sequence/ulysses.h"
#include "runtime/util/tiled.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/nn/linear_cross_entropy.h"
#include "runtime/nn/grouped_attention.h"
#include "runtime/nn/rms_norm.h"
#include "runtime/nn/rotary.h"
#include "runtime/nn/swiglu.h"

namespace strata::models {
namespace {

namespace F = torch::nn::functional;
namespace ckpt = strata::checkpointing;

// transformers' _init_weights (std < 0: not drawn, DecoderConfig::init_weights), applied to each tensor as soon as it is built: weights
// normal(0, initializer_range), biases zero (norms are built as ones). Not in a pass over the
// finished model: inside a PartitionedInit that pass would gather every tensor back whole at once
// (the construction has moved past them), the model the scope exists to never hold.
torch::nn::Linear linear(int64_t in, int64_t out, bool bias, double std) {
  torch::nn::Linear l(torch::nn::LinearOptions(in, out).bias(bias));
  if (std < 0) return l;  // DecoderConfig::init_weights false
  torch::NoGradGuard no_grad;
  l->weight.normal_(0.0, std);
  if (bias) l->bias.zero_();
  return l;
}

// One product over several projections of x: their weights (and biases) concatenated along the
// output, the outputs side by side in the order given (DecoderConfig::fused_projections).
torch::Tensor fused_linear(const torch::Tensor& x, std::initializer_list<torch::nn::Linear> parts) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto& l : parts) {
    weights.push_back(l->weight);
    if (l->bias.defined()) biases.push_back(l->bias);
  }
  return F::linear(x, torch::cat(weights), biases.empty() ? torch::Tensor() : torch::cat(biases));
}

// Causal attention over q [b, heads, t, d] and k, v [b, heads, t, d], scaled by 1/sqrt(d).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if STRATA_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  const auto t = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  const auto above = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
  scores = scores.masked_fill(above, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
#endif
}

// transformers' repeat_kv: kv head j serves query heads j * n .. j * n + n - 1.
torch::Tensor repeat_kv(const torch::Tensor& x, int64_t n) {
  if (n == 1) return x;
  const auto b = x.size(0), kv = x.size(1), t = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kv, n, t, d}).reshape({b, kv * n, t, d});
}

// Causal attention of q's heads over k's and v's fewer, grouped heads (q's head h reads kv head
// h / (q heads / kv heads)). On a GPU with LibTorch 2.5 or later, SDPA's enable_gqa reads each kv
// head in place for its group (transformers' way on CUDA): no copies of k and v for every query
// head, nor of their gradients (at long sequences, 2 x 8 KB per token of a 1B Llama's layer).
torch::Tensor grouped_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, bool sdpa_gqa, bool by_kv_head) {
  const auto n = q.size(1) / k.size(1);
  // Long sequences: one kv head's group per attention call, so that the backward's dq accumulator and
  // expanded dk/dv exist for one group at a time (runtime/nn/grouped_attention.h).
  if (by_kv_head && nn::grouped_attention_runs(q, k, 1)) return nn::grouped_attention(q, k, v, 1);
#if STRATA_TORCH_AT_LEAST(2, 5)
  if (n > 1 && q.is_cuda() && sdpa_gqa)
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true, /*scale=*/std::nullopt,
                                            /*enable_gqa=*/true);
#endif
  return causal_attention(q, repeat_kv(k, n), repeat_kv(v, n));
}

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return nn::rms_norm(x, weight, eps_);
}

AttentionImpl::AttentionImpl(const DecoderConfig& c)
    : heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      fused_(c.fused_projections && !c.qk_norm && c.mlp_tiles < 0),
      tiles_(c.mlp_tiles >= 0),
      sdpa_gqa_(c.sdpa_gqa) {
  const double std = c.init_weights ? c.initializer_range : -1;
  q_proj = register_module("q_proj", linear(c.hidden_size, heads_ * head_dim_, c.attention_bias, std));
  k_proj = register_module("k_proj", linear(c.hidden_size, kv_heads_ * head_dim_, c.attention_bias, std));
  v_proj = register_module("v_proj", linear(c.hidden_size, kv_heads_ * head_dim_, c.attention_bias, std));
  o_proj = register_module("o_proj", linear(heads_ * head_dim_, c.hidden_size, c.attention_bias, std));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, c.rms_norm_eps));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, c.rms_norm_eps));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  const auto [q, k, v] = heads(x, cos, sin);
  return o_proj(attend(q, k, v));
}

std::vector<torch::Tensor> AttentionImpl::head_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto* m : {&q_proj, &k_proj, &v_proj})
    for (const auto& p : (*m)->parameters()) out.push_back(p);
  if (q_norm)
    for (const auto& n : {q_norm, k_norm}) out.push_back(n->weight);
  return out;
}

std::array<torch::Tensor, 3> AttentionImpl::heads(const torch::Tensor& x, const torch::Tensor& cos,
                                                  const torch::Tensor& sin) {
  const auto b = x.size(0), t = x.size(1);
  const int64_t qw = heads_ * head_dim_, kw = kv_heads_ * head_dim_;
  torch::Tensor q, k, v;
  if (fused_) {
    // [q | k | v] in one product. split's gradient is one cat of the three (three narrows would
    // each zero-fill the whole width); q and k stay views (rotary takes their strides and writes
    // new tensors), v is copied out so that attention keeps v for backward, not the whole product
    // (a 1B Llama's is 6 KB per token and layer, v 1 KB).
    const auto parts = fused_linear(x, {q_proj, k_proj, v_proj}).split_with_sizes({qw, kw, kw}, -1);
    q = parts[0].view({b, t, heads_, head_dim_});
    k = parts[1].view({b, t, kv_heads_, head_dim_});
    v = parts[2].contiguous().view({b, t, kv_heads_, head_dim_});
  } else {
    q = q_proj(x).view({b, t, heads_, head_dim_});
    k = k_proj(x).view({b, t, kv_heads_, head_dim_});
    v = v_proj(x).view({b, t, kv_heads_, head_dim_});
  }
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  return {nn::rotary(q.transpose(1, 2), cos, sin), nn::rotary(k.transpose(1, 2), cos, sin),
          v.transpose(1, 2)};
}

torch::Tensor AttentionImpl::attend(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v) {
  const auto b = q.size(0), t = q.size(2);
  // Under Ulysses a rank holds fewer query heads (and kv heads, or one replica): the same
  // grouping, from the shapes it is given.
  // Tiled layers at long sequences (the whole sequence's length, as attention sees it): one kv
  // head per call (DecoderConfig::mlp_tiles).
  const bool by_kv_head = tiles_ && q.size(2) * (sequence_group ? sequence_group->size() : 1) >= kLongAttention;
  const auto attend = [this, by_kv_head](const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v) {
    return grouped_causal_attention(q, k, v, sdpa_gqa_, by_kv_head);
  };
  const auto out = sequence::ulysses_attention(q, k, v, sequence_group, attend);
  return out.transpose(1, 2).reshape({b, t, heads_ * head_dim_});
}

MLPImpl::MLPImpl(const DecoderConfig& c) : fused_(c.fused_projections && c.mlp_tiles < 0) {
  const double std = c.init_weights ? c.initializer_range : -1;
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias, std));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias, std));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias, std));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  if (!fused_) return down_proj(nn::swiglu(gate_proj(x), up_proj(x)));
  // [gate | up] in one product (not per tile: a tiled MLP would concatenate once per tile).
  return down_proj(nn::swiglu(fused_linear(x, {gate_proj, up_proj})));
}

moe::MoEOptions moe_layer_options(const DecoderConfig& c, int64_t layer,
                                  const MoEPlacement& placement) {
  auto o = placement.value_or(moe::MoEOptions{});
  if (!placement) o.drop_tokens = false;  // transformers' experts take every route
  if (c.num_experts_per_tok == 1)
    throw Error(fmt::format("{} model: num_experts_per_tok 1 is not built (its weight would be 1 "
                            "under renormalisation, DeepSpeed's top-1 keeps the probability)",
                            family_name(c.family)));
  // config.json's architecture.
  o.hidden_size = c.hidden_size;
  o.ffn_size = c.moe_intermediate_size;
  o.num_experts = c.num_experts;
  o.k = c.num_experts_per_tok;
  o.score_func = moe::ScoreFunc::Softmax;
  o.norm_topk_prob = c.norm_topk_prob;
  o.expert_activation = moe::ExpertActivation::SwiGLU;
  o.expert_bias = false;
  o.expert_factory = nullptr;
  o.noisy_gate_policy = moe::NoisyGatePolicy::None;
  o.top2_2nd_expert_sampling = false;  // the plain top-k of the probabilities
  o.aux_loss_coef = 0.0;  // the balance loss is the model's, over every layer (moe/balance.h)
  o.router_probs_sum = true;
  o.use_residual = false;
  o.n_shared_experts = 0;
  o.layer_id = layer;
  o.tiles = c.mlp_tiles;  // the experts over tiles of their rows (the dense layers tile norm + MLP)
  return o;
}

DecoderLayerImpl::DecoderLayerImpl(const DecoderConfig& c, int64_t layer,
                                   const MoEPlacement& placement)
    : mlp_tiles_(c.mlp_tiles) {
  self_attn = register_module("self_attn", Attention(c));
  if (c.is_moe_layer(layer))
    moe = register_module(c.family == Family::kMixtral ? "block_sparse_moe" : "mlp",
                          moe::MoE(moe_layer_options(c, layer, placement)));
  else
    mlp = register_module("mlp", MLP(c));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                        const torch::Tensor& sin) {
  if (!moe && mlp_tiles_ >= 0) return tiled_forward(x, cos, sin);
  const auto h = x + self_attn(input_layernorm(x), cos, sin);
  const auto normed = post_attention_layernorm(h);
  return h + (moe ? moe(normed) : mlp(normed));
}

// ALST's TiledMLP and more: everything of the layer but attention itself is position-wise, so it
// runs over tiles of the sequence and is recomputed tile by tile in backward (runtime/util/tiled.h).
// Before attention, the norm, the q/k/v products and the rotation: the normed input (kept for the
// products' weight gradients, d per token) and the products' gradients exist for one tile at a
// time. After it, o_proj, the residual, the second norm and the MLP: the residual stream's middle
// value h (d per token) is not kept at all. What stays whole is what attention needs (q, k, v,
// its output) and the layer's input and output.
torch::Tensor DecoderLayerImpl::tiled_forward(const torch::Tensor& x, const torch::Tensor& cos,
                                              const torch::Tensor& sin) {
  const auto b = x.size(0), t = x.size(1);
  ckpt::TileOptions options;
  options.tiles = mlp_tiles_;
  options.name = name() + ".q/k/v (tiled)";
  auto params = input_layernorm->parameters();
  for (const auto& p : self_attn->head_parameters()) params.push_back(p);
  // Tiles hold [batch, positions, heads x head_dim]; attention takes [batch, heads, seq, head_dim].
  const auto rows = [](const torch::Tensor& h) {
    return h.transpose(1, 2).reshape({h.size(0), h.size(2), h.size(1) * h.size(3)});
  };
  const auto qkv = ckpt::tiled_tensors(
      [this, cos, sin, rows](const std::vector<torch::Tensor>& tile, int64_t start, int64_t length) {
        const auto [q, k, v] = self_attn->heads(input_layernorm(tile[0]), cos.narrow(0, start, length),
                                                sin.narrow(0, start, length));
        return std::vector<torch::Tensor>{rows(q), rows(k), rows(v)};
      },
      {x}, params, options);
  const auto split = [b, t](const torch::Tensor& r, int64_t dim) {
    return r.view({b, t, r.size(2) / dim, dim}).transpose(1, 2);
  };
  const int64_t dim = self_attn->head_dim();
  const auto attn = self_attn->attend(split(qkv[0], dim), split(qkv[1], dim), split(qkv[2], dim));
  options.name = name() + ".o_proj + mlp (tiled)";
  params = self_attn->o_proj->parameters();
  for (const auto& p : post_attention_layernorm->parameters()) params.push_back(p);
  for (const auto& p : mlp->parameters()) params.push_back(p);
  return ckpt::tiled_tensors(
             [this](const std::vector<torch::Tensor>& tile, int64_t, int64_t) {
               const auto h = tile[0] + self_attn->o_proj(tile[1]);
               return std::vector<torch::Tensor>{h + mlp(post_attention_layernorm(h))};
             },
             {x, attn}, params, options)
      .at(0);
}

DecoderModelImpl::DecoderModelImpl(const DecoderConfig& c, const MoEPlacement& placement)
    : config_(c) {
  c.validate("model config");
  const auto policy = ckpt::CheckpointPolicy::parse(c.checkpointing);
  if (policy.selective())
    throw Error(fmt::format("{} model: activation checkpointing \"selective\" is the example GPT's "
                            "only; use \"every\" or \"every:K\"", family_name(c.family)));
  if (policy.kind == ckpt::CheckpointPolicy::Kind::kEvery) checkpoint_every_ = policy.every;
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  if (c.init_weights) {
    torch::NoGradGuard no_grad;
    embed_tokens->weight.normal_(0.0, c.initializer_range);
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(DecoderLayer(c, i, placement));
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  inverse_frequencies_ = rope_inverse_frequencies(c);
}

torch::Tensor DecoderModelImpl::forward(const torch::Tensor& input_ids) {
  if (input_ids.dim() != 2 || input_ids.scalar_type() != torch::kLong)
    throw Error(fmt::format("{} model: input_ids are {} of {}: need [batch, seq] int64",
                            family_name(config_.family), c10::str(input_ids.sizes()),
                            c10::toString(input_ids.scalar_type())));
  auto x = embed_tokens(input_ids);
  // Under Ulysses the shard's positions start at rank x its length.
  const int64_t shards = sequence_group_ ? sequence_group_->size() : 1;
  const int64_t shard = input_ids.size(1);
  const int64_t first = sequence_group_ ? sequence_group_->rank() * shard : 0;
  const auto& whole = rope(shard * shards, x.device(), x.scalar_type());
  const auto cos = whole.first.narrow(0, first, shard), sin = whole.second.narrow(0, first, shard);
  for (size_t i = 0; i < layers->size(); ++i) {
    auto layer = layers->ptr<DecoderLayerImpl>(i);
    const bool checkpointed = checkpoint_every_ > 0 && (int64_t(i) + 1) % checkpoint_every_ == 0;
    x = checkpointed ? ckpt::checkpoint(layer, x, cos, sin) : layer->forward(x, cos, sin);
  }
  return norm(x);
}

const std::pair<torch::Tensor, torch::Tensor>& DecoderModelImpl::rope(int64_t seq,
                                                                      torch::Device device,
                                                                      torch::ScalarType dtype) {
  auto& c = rope_cache_;
  if (c.seq != seq || c.device != device || c.dtype != dtype) {
    // Computed on the host, where the frequencies are, and moved once.
    auto [cos, sin] = rope_cos_sin(inverse_frequencies_, seq, torch::kCPU, dtype);
    c = {seq, device, dtype, {cos.to(device), sin.to(device)}};
  }
  return c.cos_sin;
}

CausalLMImpl::CausalLMImpl(const DecoderConfig& c, const MoEPlacement& placement) : config_(c) {
  model = register_module("model", DecoderModel(c, placement));
  for (size_t i = 0; i < model->layers->size(); ++i)
    if (auto m = model->layers->ptr<DecoderLayerImpl>(i)->moe) moe_layers_.push_back(m.get());
  if (!c.tie_word_embeddings)
    lm_head = register_module("lm_head", linear(c.hidden_size, c.vocab_size, false,
                                                 c.init_weights ? c.initializer_range : -1));
}

const torch::Tensor& CausalLMImpl::head_weight() const {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

torch::Tensor CausalLMImpl::logits(const torch::Tensor& input_ids) {
  return F::linear(model(input_ids), head_weight());
}

torch::Tensor CausalLMImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& labels,
                                    double num_items_in_batch) {
  if (labels.sizes() != input_ids.sizes() || labels.scalar_type() != torch::kLong)
    throw Error(fmt::format("{} model: labels are {} of {} for input_ids {}: need the same shape, "
                            "int64 (-100 where not counted)", family_name(config_.family),
                            c10::str(labels.sizes()), c10::toString(labels.scalar_type()),
                            c10::str(input_ids.sizes())));
  const auto h = model(input_ids);
  // transformers' shift: the target of position t is labels[:, t + 1], the last one -100.
  const auto t = labels.size(1);
  const auto targets = torch::cat({labels.narrow(1, 1, t - 1), next_shard_labels(labels)}, 1);
  nn::LinearCrossEntropyOptions options;
  options.chunk_rows = config_.loss_chunk_rows;
  const auto rows = h.reshape({-1, h.size(-1)});
  const auto flat_targets = targets.reshape({-1});
  torch::Tensor loss;
  if (num_items_in_batch > 0) {
    loss = nn::linear_cross_entropy_sum(rows, head_weight(), flat_targets, options) /
           num_items_in_batch;
  } else if (sequence_group_) {
    // The mean over the whole sequence's counted tokens: each rank's sum over that count (a
    // tensor: no wait for the host).
    auto counted = targets.ne(-100).sum().to(torch::kFloat).reshape({1});
    sequence_group_->all_reduce(counted, comm::ReduceOp::Sum);
    loss = nn::linear_cross_entropy_sum(rows, head_weight(), flat_targets, options) /
           counted.clamp_min(1).squeeze(0);
  } else {
    loss = nn::linear_cross_entropy(rows, head_weight(), flat_targets, options);
  }
  // transformers adds the load-balancing loss only when the config asks for router logits.
  if (config_.output_router_logits && !moe_layers_.empty())
    loss = loss + aux_loss() * config_.router_aux_loss_coef;
  return loss;
}

void CausalLMImpl::set_sequence_parallel(comm::GroupPtr group) {
  if (group && group->size() == 1) group = nullptr;
  if (group && !moe_layers_.empty())
    throw Error(fmt::format("{} model: sequence parallelism of MoE layers is not built yet (their "
                            "balance loss and expert exchange assume whole sequences)",
                            family_name(config_.family)));
  if (group) {
    const int64_t P = group->size(), H = config_.num_attention_heads,
                  KV = config_.num_key_value_heads;
    if (H % P != 0 || (KV % P != 0 && P % KV != 0))
      throw Error(fmt::format("{} model: {} attention heads and {} kv heads do not split over "
                              "sequence_parallel_size {} (the heads must be a multiple of it, and "
                              "the kv heads a multiple or a divisor of it)",
                              family_name(config_.family), H, KV, P));
  }
  sequence_group_ = group;
  model->sequence_group_ = group;
  for (size_t i = 0; i < model->layers->size(); ++i)
    model->layers->ptr<DecoderLayerImpl>(i)->self_attn->sequence_group = group;
}

torch::Tensor CausalLMImpl::next_shard_labels(const torch::Tensor& labels) const {
  auto none = torch::full({labels.size(0), 1}, -100, labels.options());
  if (!sequence_group_) return none;
  // Every rank's first column; rank r's last target is rank r + 1's first label.
  const int64_t P = sequence_group_->size(), r = sequence_group_->rank();
  auto firsts = torch::empty({P, labels.size(0)}, labels.options());
  sequence_group_->all_gather(firsts, labels.select(1, 0).contiguous());
  return r + 1 < P ? firsts[r + 1].unsqueeze(1) : none;
}

torch::Tensor CausalLMImpl::aux_loss() const {
  if (moe_layers_.empty())
    throw Error(fmt::format("{} model: no MoE layer, no load-balancing loss",
                            family_name(config_.family)));
  return moe::hf_load_balancing_loss(moe_layers_, balance_group_);
}

namespace {

// The experts' maps of every sparse layer, for experts [first, first + local) of each.
std::vector<checkpoint::FusedWeight> expert_maps(const DecoderConfig& c, int64_t first,
                                                 int64_t local) {
  std::vector<checkpoint::FusedWeight> maps;
  // Sparse layers: this rank's experts from the files' per-expert weights (HF Linear layout,
  // [out, in]) into the stacked in x out tensors, gate's columns before up's.
  const bool mixtral = c.family == Family::kMixtral;
  const std::string block = mixtral ? "block_sparse_moe" : "mlp";
  const std::string gate = mixtral ? "w1" : "gate_proj", up = mixtral ? "w3" : "up_proj",
                    down = mixtral ? "w2" : "down_proj";
  const int64_t d = c.hidden_size, f = c.moe_intermediate_size;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (!c.is_moe_layer(i)) continue;
    const auto prefix = fmt::format("model.layers.{}.{}.experts.", i, block);
    checkpoint::FusedWeight w1{prefix + "w1", {}, {}, nullptr, nullptr};
    checkpoint::FusedWeight w2{prefix + "w2", {}, {}, nullptr, nullptr};
    for (int64_t e = first; e < first + local; ++e) {
      const auto name = [&](const std::string& proj) {
        return fmt::format("{}{}.{}.weight", prefix, e, proj);
      };
      w1.sources.push_back(name(gate));
      w1.sources.push_back(name(up));
      w1.shapes.push_back({f, d});
      w1.shapes.push_back({f, d});
      w2.sources.push_back(name(down));
      w2.shapes.push_back({d, f});
    }
    // [gate_e, up_e]... -> [E, d, 2f]: each expert's gate and up transposed, side by side.
    w1.combine = [](const std::vector<torch::Tensor>& parts) {
      std::vector<torch::Tensor> experts;
      for (size_t k = 0; k < parts.size(); k += 2)
        experts.push_back(torch::cat({parts[k].t(), parts[k + 1].t()}, 1));
      return torch::stack(experts);
    };
    w1.split = [f](const torch::Tensor& w) {
      std::vector<torch::Tensor> parts;
      for (int64_t e = 0; e < w.size(0); ++e) {
        parts.push_back(w[e].narrow(1, 0, f).t());
        parts.push_back(w[e].narrow(1, f, f).t());
      }
      return parts;
    };
    w2.combine = [](const std::vector<torch::Tensor>& parts) {
      std::vector<torch::Tensor> experts;
      for (const auto& p : parts) experts.push_back(p.t());
      return torch::stack(experts);
    };
    w2.split = [](const torch::Tensor& w) {
      std::vector<torch::Tensor> parts;
      for (int64_t e = 0; e < w.size(0); ++e) parts.push_back(w[e].t());
      return parts;
    };
    maps.push_back(std::move(w1));
    maps.push_back(std::move(w2));
  }
  return maps;
}

}  // namespace

checkpoint::ImportOptions hf_import_options(CausalLMImpl& model) {
  const auto& c = model.config();
  checkpoint::ImportOptions options;
  if (c.tie_word_embeddings) options.ignored.push_back("lm_head.weight");
  if (model.moe_layers().empty()) return options;
  const auto* layer = model.moe_layers().front();
  for (const auto* m : model.moe_layers())
    if (m->experts->streamed())
      throw Error(fmt::format("{} model: importing streamed experts (moe.expert_unit_size) is not "
                              "built; import with expert_unit_size 0", family_name(c.family)));
  const int64_t first = layer->first_expert(), local = layer->num_local_experts();
  options.fused = expert_maps(c, first, local);
  // Expert parallelism: the other ranks' experts are in the files too; this rank leaves them.
  for (const auto& f : expert_maps(c, 0, c.num_experts))
    for (size_t k = 0; k < f.sources.size(); ++k) {
      const int64_t expert = f.target.back() == '1' ? int64_t(k / 2) : int64_t(k);  // w1: 2 each
      if (expert < first || expert >= first + local) options.ignored.push_back(f.sources[k]);
    }
  return options;
}

checkpoint::HfExportOptions hf_export_options(const DecoderConfig& config) {
  checkpoint::HfExportOptions options;
  if (config.num_experts > 0) options.fused = expert_maps(config, 0, config.num_experts);
  return options;
}

}  // namespace strata::models
