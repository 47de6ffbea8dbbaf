#include "examples/gpt.h"
#include "runtime/nn/linear_cross_entropy.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

// The one Strata call of the model: activation checkpointing (deepspeed.checkpointing's).
#include "runtime/checkpointing/checkpoint.h"
#include "runtime/util/tiled.h"
// Ulysses: attention over the exchanged heads when the sequence is split over ranks.
#include "runtime/sequence/ulysses.h"

namespace strata::examples {
namespace F = torch::nn::functional;
namespace ckpt = strata::checkpointing;

// Causal self-attention over [batch, heads, seq, head_dim]: LibTorch 2.x's fused kernel, or the
// textbook formula on 1.13; `dropout` on the attention probabilities (0 outside training).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double dropout) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/dropout,
                                          /*is_causal=*/true);
#else
  const auto t = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  auto mask = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(scores, -1);
  if (dropout > 0) probs = F::dropout(probs, F::DropoutFuncOptions().p(dropout).training(true));
  return torch::matmul(probs, v);
#endif
}

torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& mask, double dropout) {
  if (!mask.defined()) return causal_attention(q, k, v, dropout);
  // The mask in the scores' dtype (a no-op but where a caller built it in another, or under
  // autocast on 1.13): adding 0 or -inf is exact, so the scores equal the causal path's.
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, mask.to(q.scalar_type()), /*dropout_p=*/dropout,
                                          /*is_causal=*/false);
#else
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  auto probs = torch::softmax(scores + mask.to(scores.scalar_type()), -1);
  if (dropout > 0) probs = F::dropout(probs, F::DropoutFuncOptions().p(dropout).training(true));
  return torch::matmul(probs, v);
#endif
}

torch::Tensor causal_mask(int64_t t, const torch::TensorOptions& options) {
  // Built in fp32 (triu of every dtype on every LibTorch), then cast: 0 and -inf are exact.
  return torch::full({t, t}, -std::numeric_limits<float>::infinity(),
                     options.dtype(torch::kFloat))
      .triu(1)
      .to(torch::typeMetaToScalarType(options.dtype()));
}

GPTConfig GPTConfig::by_name(const std::string& name) {
  // The variants' suffixes, in any order after a base name.
  for (const std::string suffix : {"-dropout", "-masked"}) {
    if (name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      GPTConfig c = by_name(name.substr(0, name.size() - suffix.size()));
      c.name = name;
      if (suffix == "-dropout") c.dropout = 0.1;
      else c.masked = true;
      return c;
    }
  }
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
        "dense-350M, dense-1.3B, moe-8x, moe-ds; '-dropout' after a name adds dropout 0.1, "
        "'-masked' an explicit attention mask",
        name));
  }
  return c;
}

AttentionImpl::AttentionImpl(int64_t d_model, int64_t heads, double dropout)
    : heads_(heads), dropout_(dropout) {
  if (d_model % heads != 0)
    throw std::invalid_argument(fmt::format("d_model {} is not a multiple of heads {}", d_model, heads));
  qkv = register_module("qkv", torch::nn::Linear(
                                   torch::nn::LinearOptions(d_model, 3 * d_model).bias(false)));
  out = register_module("out",
                        torch::nn::Linear(torch::nn::LinearOptions(d_model, d_model).bias(false)));
}

namespace {

std::vector<torch::Tensor> concat(std::vector<torch::Tensor> a, const std::vector<torch::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// projected [b, t, 3 * h * d] -> q, k, v [b, h, t, d]: views, no copy. Backward writes the three
// gradients straight into one [b, t, 3, h, d] gradient of `projected`: a view's gradient by
// autograd would be stacked into [3, b, h, t, d] (unbind's backward), then copied again into
// projected's layout (the permute's view backward): two strided copies of 3 * b * t * h * d
// elements where one does.
struct SplitHeads : torch::autograd::Function<SplitHeads> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const torch::Tensor& projected, int64_t heads) {
    const auto b = projected.size(0), t = projected.size(1), c = projected.size(2) / 3;
    ctx->saved_data["shape"] = std::vector<int64_t>{b, t, 3, heads, c / heads};
    return projected.view({b, t, 3, heads, c / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const auto defined = std::find_if(grads.begin(), grads.end(),
                                      [](const torch::Tensor& g) { return g.defined(); });
    if (defined == grads.end()) return {torch::Tensor(), torch::Tensor()};
    const bool all = std::all_of(grads.begin(), grads.end(),
                                 [](const torch::Tensor& g) { return g.defined(); });
    auto out = all ? torch::empty(shape, defined->options()) : torch::zeros(shape, defined->options());
    for (int64_t i = 0; i < 3; ++i)
      if (grads[i].defined()) out.select(2, i).copy_(grads[i].transpose(1, 2));
    return {out.view({shape[0], shape[1], -1}), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor AttentionImpl::core(const torch::Tensor& projected, const torch::Tensor& mask) {
  const auto b = projected.size(0), t = projected.size(1), c = projected.size(2) / 3;
  const auto qkv = SplitHeads::apply(projected, heads_);
  const double p = is_training() ? dropout_ : 0.0;
  auto y = sequence::ulysses_attention(
      qkv[0], qkv[1], qkv[2], sequence_group,
      [&mask, p](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        return masked_attention(q, k, v, mask, p);
      });
  return y.transpose(1, 2).reshape({b, t, c});
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
  return out(core(qkv(x), mask));
}

MLPImpl::MLPImpl(int64_t d_model, int64_t ffn) {
  fc = register_module("fc",
                       torch::nn::Linear(torch::nn::LinearOptions(d_model, ffn).bias(false)));
  proj = register_module("proj",
                         torch::nn::Linear(torch::nn::LinearOptions(ffn, d_model).bias(false)));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) { return proj(F::gelu(fc(x))); }

BlockImpl::BlockImpl(const GPTConfig& config, torch::nn::AnyModule ffn, const std::string& ffn_name)
    : ffn_(std::move(ffn)),
      dropout_(config.dropout),
      selective_(ckpt::CheckpointPolicy::parse(config.checkpointing).selective()),
      moe_padding_(config.moe_padding),
      mlp_tiles_(config.mlp_tiles) {
  const auto d = config.d_model;
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  attn_ = register_module("attn", Attention(d, config.heads, config.dropout));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  register_module(ffn_name, ffn_.ptr());
}

torch::Tensor BlockImpl::dropout(const torch::Tensor& x) {
  if (dropout_ <= 0 || !is_training()) return x;
  return F::dropout(x, F::DropoutFuncOptions().p(dropout_).training(true));
}

// DeepSpeed MoE's used_token: the last moe_padding positions of each sequence take no expert.
// Built again by a recomputation, the same.
torch::Tensor BlockImpl::feed_forward(const torch::Tensor& h) {
  if (moe_padding_ <= 0) return ffn_.forward<torch::Tensor>(h);
  const auto t = h.size(1), pad = std::min(moe_padding_, t);
  auto used = torch::ones({h.size(0), t}, h.options().dtype(torch::kFloat));
  used.narrow(1, t - pad, pad).zero_();
  return ffn_.forward<torch::Tensor>(h, used);
}

torch::Tensor BlockImpl::norm_feed_forward(const torch::Tensor& x) {
  // An MoE feed-forward tiles its experts itself (MoEOptions::tiles, set from mlp_tiles): its
  // routing and balance loss see the whole sequence.
  if (mlp_tiles_ < 0 || !std::dynamic_pointer_cast<MLPImpl>(ffn_.ptr()))
    return feed_forward(norm2_(x));
  ckpt::TileOptions options;
  options.tiles = mlp_tiles_;
  options.name = name() + ".mlp (tiled)";
  return ckpt::tiled_function([this](const torch::Tensor& h) { return feed_forward(norm2_(h)); },
                              concat(norm2_->parameters(), ffn_.ptr()->parameters()), x, options);
}

torch::Tensor BlockImpl::forward(torch::Tensor x, const torch::Tensor& mask) {
  if (selective_ && torch::GradMode::is_enabled()) return forward_selective(x, mask);
  x = x + dropout(attn_(norm1_(x), mask));
  return x + dropout(norm_feed_forward(x));
}

// A plain MLP block is checkpointed as its two residual branches, each keeping its input and
// leaving its last product out of the recomputation (backward needs that product's input,
// recomputed, and its weight, never its output): the attention's output projection and the
// MLP's second product, 5 of the block's 12 d^2 multiply-adds per token, are not recomputed, for
// one more [b, t, d] kept per block (the stream between the branches). With dropout after the
// branches (while training), an MoE feed-forward or a mask the block is checkpointed whole; a
// mask is the checkpoint's second input (every store then keeps two per checkpoint).
torch::Tensor BlockImpl::forward_checkpointed(torch::Tensor x, const torch::Tensor& mask) {
  auto mlp = std::dynamic_pointer_cast<MLPImpl>(ffn_.ptr());
  auto self = std::dynamic_pointer_cast<BlockImpl>(shared_from_this());
  if (mask.defined()) return ckpt::checkpoint(self, x, mask);
  if (!mlp || (dropout_ > 0 && is_training()) || mlp_tiles_ >= 0) return ckpt::checkpoint(self, x);
  auto& attn = *attn_;
  const auto h = x + ckpt::checkpoint_into_linear(
                         [this, &attn](const torch::Tensor& in) { return attn.core(attn.qkv(norm1_(in))); },
                         concat(norm1_->parameters(), attn.qkv->parameters()), x, attn.out,
                         name() + ".attn");
  return h + ckpt::checkpoint_into_linear(
                 [this, mlp](const torch::Tensor& in) { return F::gelu(mlp->fc(norm2_(in))); },
                 concat(norm2_->parameters(), mlp->fc->parameters()), h, mlp->proj, name() + ".mlp");
}

// Selective activation checkpointing: the same computation, with the outputs of the linear
// layers kept and what lies between them (norms, the attention core and its dropout, GELU)
// recomputed in backward. An MoE feed-forward runs as it is. The mask (no gradient) is held by
// the attention core's closure, by value: the closure lives until backward.
torch::Tensor BlockImpl::forward_selective(torch::Tensor x, const torch::Tensor& mask) {
  auto& attn = *attn_;
  const auto qkv = ckpt::checkpoint_into_linear([this](const torch::Tensor& h) { return norm1_(h); },
                                                norm1_->parameters(), x, attn.qkv);
  const auto a = ckpt::checkpoint_into_linear(
      [&attn, mask](const torch::Tensor& p) { return attn.core(p, mask); }, {}, qkv, attn.out);
  x = x + dropout(a);
  if (mlp_tiles_ >= 0) return x + dropout(norm_feed_forward(x));
  if (auto mlp = std::dynamic_pointer_cast<MLPImpl>(ffn_.ptr())) {
    const auto f = ckpt::checkpoint_into_linear([this](const torch::Tensor& h) { return norm2_(h); },
                                                norm2_->parameters(), x, mlp->fc);
    const auto p = ckpt::checkpoint_into_linear([](const torch::Tensor& h) { return F::gelu(h); },
                                                {}, f, mlp->proj);
    return x + dropout(p);
  }
  return x + dropout(feed_forward(norm2_(x)));
}

GPTImpl::GPTImpl(const GPTConfig& config, FeedForward ffn)
    : config_(config), aux_loss_(std::move(ffn.aux_loss)) {
  if (config.experts > 0 && !ffn.make)
    throw std::invalid_argument(fmt::format(
        "model '{}' has {} experts per block: build it with examples::make_moe_gpt "
        "(examples/gpt_moe.h), which gives the blocks their mixture of experts",
        config.name, config.experts));
  if (config.moe_padding < 0 || (config.moe_padding > 0 && config.experts == 0))
    throw std::invalid_argument(fmt::format(
        "model '{}': padding of {} positions for the mixture of experts needs a model with "
        "experts (tiny-moe, moe-8x, ...) and a count >= 0",
        config.name, config.moe_padding));
  if (config.mlp_tiles < -1)
    throw std::invalid_argument(fmt::format(
        "model '{}': mlp_tiles = {}; give -1 (untiled), 0 (derived) or a count of tiles",
        config.name, config.mlp_tiles));
  embed_ = register_module("embed", torch::nn::Embedding(config.vocab, config.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i)
    blocks_->push_back(Block(config, ffn.make ? ffn.make(i) : torch::nn::AnyModule(MLP(config.d_model, config.ffn)),
                             ffn.name));
  norm_ = register_module("norm",
                          torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
  const auto policy = ckpt::CheckpointPolicy::parse(config.checkpointing);
  if (policy.kind == ckpt::CheckpointPolicy::Kind::kEvery) checkpoint_every_ = policy.every;
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

torch::Tensor GPTImpl::hidden(const torch::Tensor& tokens) {
  auto x = embed_(tokens);
  if (config_.zoo) x = x * frozen_scale_;
  // The masked model's one mask per forward, shared by every block: over the whole sequence
  // under Ulysses (attention sees it whole).
  const int64_t whole = x.size(1) * (sequence_group_ ? sequence_group_->size() : 1);
  const auto mask = config_.masked ? causal_mask(whole, x.options()) : torch::Tensor();
  for (size_t i = 0; i < blocks_->size(); ++i) {
    auto* block = blocks_[i]->as<Block>();
    const bool checkpointed = checkpoint_every_ > 0 && (int64_t(i) + 1) % checkpoint_every_ == 0;
    x = checkpointed ? block->forward_checkpointed(x, mask) : block->forward(x, mask);
  }
  if (config_.zoo) x = blocks_[0]->as<Block>()->forward(x, mask);  // block 0 used twice
  return norm_(x);
}

void GPTImpl::set_sequence_parallel(comm::GroupPtr group) {
  if (group && group->size() == 1) group = nullptr;
  if (group && (aux_loss_ || config_.experts > 0))
    throw std::invalid_argument(fmt::format(
        "model '{}': sequence parallelism of MoE layers is not built yet (their balance loss and "
        "expert exchange assume whole sequences)",
        config_.name));
  if (group && config_.heads % group->size() != 0)
    throw std::invalid_argument(fmt::format(
        "model '{}': {} attention heads do not split over sequence_parallel_size {}; choose a "
        "size that divides the heads",
        config_.name, config_.heads, group->size()));
  sequence_group_ = group;
  for (size_t i = 0; i < blocks_->size(); ++i) blocks_[i]->as<Block>()->set_sequence_group(group);
}

const torch::Tensor& GPTImpl::head_weight() const {
  return config_.tied ? embed_->weight : head_->weight;
}

torch::Tensor GPTImpl::head(const torch::Tensor& h) { return F::linear(h, head_weight()); }

torch::Tensor GPTImpl::logits(const torch::Tensor& tokens) { return head(hidden(tokens)); }

torch::Tensor GPTImpl::forward(const torch::Tensor& tokens, const torch::Tensor& targets) {
  const auto rows = hidden(tokens).reshape({-1, config_.d_model});
  nn::LinearCrossEntropyOptions chunked;
  chunked.chunk_rows = kLossChunk;
  // Ulysses: every position has a target, so the whole sequence's count is P times this shard's;
  // the group's parts sum to the mean (and the zoo's extra term, added once per sample).
  const double shards = sequence_group_ ? double(sequence_group_->size()) : 1.0;
  auto loss = nn::linear_cross_entropy_sum(rows, head_weight(), targets.reshape({-1}), chunked) /
              (double(rows.size(0)) * shards);
  if (config_.zoo) loss = loss + 1e-2 * odd_.to(torch::kFloat).square().mean() / shards;
  if (aux_loss_) {
    const auto aux = aux_loss_();
    if (aux.defined()) loss = loss + aux.to(torch::kFloat);
  }
  return loss;
}

}  // namespace strata::examples
