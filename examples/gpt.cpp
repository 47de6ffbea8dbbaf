#include "examples/gpt.h"

#include <torch/version.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

namespace strata::examples {
namespace F = torch::nn::functional;

// Causal self-attention over [batch, heads, seq, head_dim]: LibTorch 2.x's fused kernel, or the
// textbook formula on 1.13.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  const auto t = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  auto mask = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
#endif
}

GPTConfig GPTConfig::by_name(const std::string& name) {
  const std::string suffix = "-tied";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const std::string base = name.substr(0, name.size() - suffix.size());
    if (base == "tiny" || base == "small") {
      GPTConfig c = by_name(base);
      c.name = name;
      c.tied = true;
      return c;
    }
  }
  GPTConfig c;
  c.name = name;
  if (name == "tiny") {  // a step in well under a second on 2 CPU cores
    c.vocab = 256, c.d_model = 64, c.layers = 2, c.heads = 4, c.ffn = 256, c.seq_len = 64;
  } else if (name == "small") {
    c.vocab = 256, c.d_model = 256, c.layers = 4, c.heads = 8, c.ffn = 1024, c.seq_len = 128;
  } else if (name == "tiny-zoo") {
    c = by_name("tiny");
    c.name = name;
    c.zoo = true;
  } else if (name == "tiny-moe") {
    c.vocab = 256, c.d_model = 64, c.layers = 2, c.heads = 4, c.ffn = 128, c.seq_len = 64;
    c.experts = 4;
  } else if (name == "dense-350M") {
    c.vocab = 32000, c.d_model = 1024, c.layers = 24, c.heads = 16, c.ffn = 4096;
    c.seq_len = 2048;
  } else if (name == "dense-1.3B") {  // the peers' --dense-1.3b
    c.vocab = 32000, c.d_model = 2048, c.layers = 24, c.heads = 16, c.ffn = 8192;
    c.seq_len = 2048;
  } else if (name == "moe-8x") {
    c.vocab = 32000, c.d_model = 1024, c.layers = 12, c.heads = 16, c.ffn = 4096;
    c.seq_len = 2048, c.experts = 8, c.expert_bias = false;
  } else if (name == "moe-ds") {  // the peer's --deepseek: 64 routed experts of FFN 512, top-6,
    // 2 shared experts, sigmoid + bias, dropless
    c.vocab = 32000, c.d_model = 1024, c.layers = 12, c.heads = 16, c.ffn = 512;
    c.seq_len = 2048, c.experts = 64, c.top_k = 6, c.expert_bias = false;
    c.deepseek = true, c.shared_experts = 2, c.aux_loss_coef = 0.0;
  } else {
    throw std::invalid_argument(fmt::format(
        "unknown model '{}': known models are tiny, small, tiny-tied, small-tied, tiny-zoo, tiny-moe, "
        "dense-350M, dense-1.3B, moe-8x, moe-ds",
        name));
  }
  return c;
}

AttentionImpl::AttentionImpl(int64_t d_model, int64_t heads) : heads_(heads) {
  if (d_model % heads != 0)
    throw std::invalid_argument(fmt::format("d_model {} is not a multiple of heads {}", d_model, heads));
  qkv_ = register_module("qkv", torch::nn::Linear(
                                    torch::nn::LinearOptions(d_model, 3 * d_model).bias(false)));
  out_ = register_module("out",
                         torch::nn::Linear(torch::nn::LinearOptions(d_model, d_model).bias(false)));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x) {
  const auto b = x.size(0), t = x.size(1), c = x.size(2);
  // [b, t, 3, h, d] -> [3, b, h, t, d]
  // unbind, as the peer's `q, k, v = ...`: one gradient for the three (indexing each would
  // give three full-size zero-filled gradients).
  const auto qkv = qkv_(x).view({b, t, 3, heads_, c / heads_}).permute({2, 0, 3, 1, 4}).unbind(0);
  auto y = causal_attention(qkv[0], qkv[1], qkv[2]);
  return out_(y.transpose(1, 2).reshape({b, t, c}));
}

MLPImpl::MLPImpl(int64_t d_model, int64_t ffn) {
  fc_ = register_module("fc",
                        torch::nn::Linear(torch::nn::LinearOptions(d_model, ffn).bias(false)));
  proj_ = register_module("proj",
                          torch::nn::Linear(torch::nn::LinearOptions(ffn, d_model).bias(false)));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) { return proj_(F::gelu(fc_(x))); }

BlockImpl::BlockImpl(const GPTConfig& config, torch::nn::AnyModule ffn, const std::string& ffn_name)
    : ffn_(std::move(ffn)) {
  const auto d = config.d_model;
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  attn_ = register_module("attn", Attention(d, config.heads));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  register_module(ffn_name, ffn_.ptr());
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  x = x + attn_(norm1_(x));
  return x + ffn_.forward<torch::Tensor>(norm2_(x));
}

GPTImpl::GPTImpl(const GPTConfig& config, FeedForward ffn)
    : config_(config), aux_loss_(std::move(ffn.aux_loss)) {
  if (config.experts > 0 && !ffn.make)
    throw std::invalid_argument(fmt::format(
        "model '{}' has {} experts per block: build it with examples::make_moe_gpt "
        "(examples/gpt_moe.h), which gives the blocks their mixture of experts",
        config.name, config.experts));
  embed_ = register_module("embed", torch::nn::Embedding(config.vocab, config.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i)
    blocks_->push_back(Block(config, ffn.make ? ffn.make(i) : torch::nn::AnyModule(MLP(config.d_model, config.ffn)),
                             ffn.name));
  norm_ = register_module("norm",
                          torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
  if (config.tied) {
    // GPT-2's initialisation: with N(0, 1) embeddings the tied head's logits would start huge.
    torch::NoGradGuard no_grad;
    embed_->weight.normal_(0.0, 0.02);
    register_parameter("head_weight", embed_->weight);
  }
  else
    head_ = register_module("head", torch::nn::Linear(
                                        torch::nn::LinearOptions(config.d_model, config.vocab).bias(false)));
  if (config.zoo) {
    frozen_scale_ = register_parameter("frozen_scale", torch::linspace(0.9, 1.1, config.d_model),
                                       /*requires_grad=*/false);
    unused_ = register_module("unused", torch::nn::Linear(config.d_model, config.d_model));
    odd_ = register_parameter("odd", torch::randn({131073}) * 0.1);
  }
}

torch::Tensor GPTImpl::logits(const torch::Tensor& tokens) {
  auto x = embed_(tokens);
  if (config_.zoo) x = x * frozen_scale_;
  for (auto& block : *blocks_) x = block->as<Block>()->forward(x);
  if (config_.zoo) x = blocks_[0]->as<Block>()->forward(x);  // block 0 used twice
  return config_.tied ? F::linear(norm_(x), embed_->weight) : head_(norm_(x));
}

torch::Tensor GPTImpl::forward(const torch::Tensor& tokens, const torch::Tensor& targets) {
  auto out = logits(tokens).to(torch::kFloat);
  auto loss = F::cross_entropy(out.view({-1, config_.vocab}), targets.reshape({-1}));
  if (config_.zoo) loss = loss + 1e-2 * odd_.to(torch::kFloat).square().mean();
  if (aux_loss_) {
    const auto aux = aux_loss_();
    if (aux.defined()) loss = loss + aux.to(torch::kFloat);
  }
  return loss;
}

}  // namespace strata::examples
