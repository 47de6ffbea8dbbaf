// A GPT written as plain LibTorch modules: nothing in it knows about Strata. The architecture is
// the benchmark peer's (../shared/bench/peer_torch_gpt.py): token embedding, pre-LayerNorm
// blocks of causal attention and a GELU MLP, linear layers without bias, untied output head
// (tied in the -tied variants).
#pragma once

#include <string>

#include <torch/torch.h>

namespace strata::examples {

struct GPTConfig {
  std::string name;
  int64_t vocab = 256;
  int64_t d_model = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t ffn = 256;
  int64_t seq_len = 64;
  // Mixture of experts in every block's FFN when experts > 0: top-k gating with a capacity
  // limit, tokens past capacity dropped (the peer's MoE).
  int64_t experts = 0;
  int64_t top_k = 2;
  double capacity_factor = 1.25;
  double aux_loss_coef = 0.01;
  // The output head is the token embedding's weight (the usual C++ tie: one tensor registered
  // under a second name, "head_weight"), initialised N(0, 0.02) as GPT-2's.
  bool tied = false;
  // Sizes by name: tiny, small, tiny-moe, dense-350M, moe-8x (../shared/bench/README.md);
  // "-tied" after tiny or small ties the head to the embedding.
  // Unknown name: Error listing the known ones.
  static GPTConfig by_name(const std::string& name);
};

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(int64_t d_model, int64_t heads);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  int64_t heads_;
  torch::nn::Linear qkv_{nullptr}, out_{nullptr};
};
TORCH_MODULE(Attention);

class MLPImpl : public torch::nn::Module {
 public:
  MLPImpl(int64_t d_model, int64_t ffn);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Linear fc_{nullptr}, proj_{nullptr};
};
TORCH_MODULE(MLP);

// A plain LibTorch mixture of experts, the peer's: softmax gate, top-k, capacity
// ceil(k * tokens / experts * capacity_factor) per expert, tokens past it dropped, a loop over
// experts. Strata's own MoE layer (moe/) will replace it with dispatch across ranks.
class MoEImpl : public torch::nn::Module {
 public:
  MoEImpl(int64_t d_model, int64_t ffn, int64_t experts, int64_t top_k, double capacity_factor);
  torch::Tensor forward(const torch::Tensor& x);
  // The load-balancing loss of the last forward (Switch Transformer's: E * sum(me * ce)).
  torch::Tensor aux_loss() const { return aux_; }

 private:
  int64_t experts_, top_k_;
  double capacity_factor_;
  torch::nn::Linear gate_{nullptr};
  torch::nn::ModuleList mlps_{nullptr};
  torch::Tensor aux_;
};
TORCH_MODULE(MoE);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& config);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  Attention attn_{nullptr};
  MLP mlp_{nullptr};  // one of mlp_ / moe_
  MoE moe_{nullptr};

 public:
  torch::Tensor aux_loss() const { return moe_ ? moe_->aux_loss() : torch::Tensor(); }
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTConfig& config);
  // Logits [batch, seq, vocab] for tokens [batch, seq].
  torch::Tensor logits(const torch::Tensor& tokens);
  // Mean next-token cross-entropy (computed in fp32) of tokens against targets.
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& targets);
  const GPTConfig& config() const { return config_; }

 private:
  GPTConfig config_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};  // untied
};
TORCH_MODULE(GPT);

}  // namespace strata::examples
