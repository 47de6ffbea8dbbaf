#include "models/causal_lm.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "models/rope.h"
#include "runtime/checkpointing/checkpoint.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/nn/linear_cross_entropy.h"

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

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  const auto xf = x.to(torch::kFloat);
  const auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const DecoderConfig& c)
    : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim) {
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
  const auto b = x.size(0), t = x.size(1);
  auto q = q_proj(x).view({b, t, heads_, head_dim_});
  auto k = k_proj(x).view({b, t, kv_heads_, head_dim_});
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = apply_rope(q.transpose(1, 2), cos, sin);
  k = apply_rope(k.transpose(1, 2), cos, sin);
  const auto v = v_proj(x).view({b, t, kv_heads_, head_dim_}).transpose(1, 2);
  const auto n = heads_ / kv_heads_;
  const auto out = causal_attention(q, repeat_kv(k, n), repeat_kv(v, n));
  return o_proj(out.transpose(1, 2).reshape({b, t, heads_ * head_dim_}));
}

MLPImpl::MLPImpl(const DecoderConfig& c) {
  const double std = c.init_weights ? c.initializer_range : -1;
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias, std));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias, std));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias, std));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  return down_proj(F::silu(gate_proj(x)) * up_proj(x));
}

DecoderLayerImpl::DecoderLayerImpl(const DecoderConfig& c) {
  self_attn = register_module("self_attn", Attention(c));
  mlp = register_module("mlp", MLP(c));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                        const torch::Tensor& sin) {
  const auto h = x + self_attn(input_layernorm(x), cos, sin);
  return h + mlp(post_attention_layernorm(h));
}

DecoderModelImpl::DecoderModelImpl(const DecoderConfig& c) : config_(c) {
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
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(DecoderLayer(c));
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  inverse_frequencies_ = rope_inverse_frequencies(c);
}

torch::Tensor DecoderModelImpl::forward(const torch::Tensor& input_ids) {
  if (input_ids.dim() != 2 || input_ids.scalar_type() != torch::kLong)
    throw Error(fmt::format("{} model: input_ids are {} of {}: need [batch, seq] int64",
                            family_name(config_.family), c10::str(input_ids.sizes()),
                            c10::toString(input_ids.scalar_type())));
  auto x = embed_tokens(input_ids);
  const auto [cos, sin] = rope(input_ids.size(1), x.device(), x.scalar_type());
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

CausalLMImpl::CausalLMImpl(const DecoderConfig& c) : config_(c) {
  model = register_module("model", DecoderModel(c));
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
  const auto targets = torch::cat({labels.narrow(1, 1, t - 1),
                                   torch::full({labels.size(0), 1}, -100, labels.options())},
                                  1);
  nn::LinearCrossEntropyOptions options;
  options.chunk_rows = config_.loss_chunk_rows;
  const auto rows = h.reshape({-1, h.size(-1)});
  if (num_items_in_batch > 0)
    return nn::linear_cross_entropy_sum(rows, head_weight(), targets.reshape({-1}), options) /
           num_items_in_batch;
  return nn::linear_cross_entropy(rows, head_weight(), targets.reshape({-1}), options);
}

checkpoint::ImportOptions hf_import_options(const DecoderConfig& config) {
  checkpoint::ImportOptions options;
  if (config.tie_word_embeddings) options.ignored.push_back("lm_head.weight");
  return options;
}

}  // namespace strata::models
