// A GPT written as plain LibTorch modules: nothing in it knows about Strata but the activation
// checkpointing and tiling calls in gpt.cpp (Strata's checkpoint and tiled, as a DeepSpeed model
// calls deepspeed.checkpointing.checkpoint and ALST's TiledMLP). The architecture is the
// benchmark peer's (../shared/bench/peer_torch_gpt.py): token embedding, pre-LayerNorm blocks of
// causal attention and a GELU MLP, linear layers without bias, untied output head (tied in the
// -tied variants).
#pragma once

#include <functional>
#include <string>

#include <torch/torch.h>

#include "comm/process_group.h"

namespace strata::examples {

struct GPTConfig {
  std::string name;
  int64_t vocab = 256;
  int64_t d_model = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t ffn = 256;
  int64_t seq_len = 64;
  // Mixture of experts in every block's FFN when experts > 0 (examples/gpt_moe.h): top-k
  // gating with a capacity limit, tokens past capacity dropped (the peer's MoE).
  int64_t experts = 0;
  int64_t top_k = 2;
  double capacity_factor = 1.25;
  double aux_loss_coef = 0.01;
  // The built-in experts' biases; moe-8x has none, as every other linear layer here and the peers'
  // experts (peer_torch_gpt.py, peer_deepspeed_gpt.py).
  bool expert_bias = true;
  // DeepSeek-V3-style MoE (moe-ds, the peer's --deepseek): the sigmoid router with its balancing
  // bias (no auxiliary loss), dropless, and shared_experts always-on experts of the expert FFN.
  bool deepseek = false;
  int64_t shared_experts = 0;
  // The output head is the token embedding's weight (the usual C++ tie: one tensor registered
  // under a second name, "head_weight"), initialised N(0, 0.02) as GPT-2's.
  bool tied = false;
  // tiny-zoo: the shapes a user's model has and the GPT lacks, for the differential matrix
  // (docs/matrix.md): a frozen parameter ("frozen_scale", used in forward), a parameter never
  // used ("unused.weight": no gradient), block 0 applied twice (its gradients from two uses), and
  // a parameter of an odd size, 131073 = 2^17 + 1 elements ("odd", a small L2 term of the loss).
  bool zoo = false;
  // GPT-2's attn_pdrop and resid_pdrop: dropout on the attention probabilities and on each
  // block's two residual branches, while training. 0 in every named size; "-dropout" after a
  // name (tiny-dropout, tiny-moe-dropout, ...) makes it 0.1.
  double dropout = 0.0;
  // An explicit attention mask: the model builds the additive causal mask [t, t] (0 on and
  // below the diagonal, -inf above, in the activations' dtype) once per forward and hands it to
  // every block as a second tensor, so that a checkpointed block keeps two inputs (the
  // differential matrix's masked variant). The same math as the causal model's. "-masked" after
  // a name (tiny-masked, tiny-moe-masked-dropout, ...) sets it.
  bool masked = false;
  // The last moe_padding positions of every sequence are padding for the feed-forward: it is
  // called as ffn(h, used) with used [batch, seq] 0 there, 1 elsewhere (DeepSpeed MoE's
  // used_token; models with experts and top-1 gating only). 0: ffn(h).
  int64_t moe_padding = 0;
  // Activation checkpointing of the blocks (runtime/checkpointing/checkpoint.h's policies): ""
  // or "none", "every", "every:K" (every K-th block), "selective" (inside each block, the linear
  // layers' outputs kept, the norms, GELU, attention core and its dropout recomputed).
  std::string checkpointing;
  // Tiled feed-forward (runtime/util/tiled.h, ALST's TiledMLP): each block's norm and
  // MLP run over tiles of the sequence, recomputed tile by tile in backward, so that one tile's
  // [tile, ffn] intermediates exist at a time. -1: untiled; 0: ceil(seq / d_model) tiles (ALST's
  // count); N > 0: N tiles. A block checkpointed by the "every" policies is then checkpointed
  // whole (its recomputation tiles); "selective" tiles the feed-forward instead of keeping the
  // MLP's products. With experts, the MoE layers tile their experts' rows instead
  // (moe::MoEOptions::tiles: routing and the balance loss see the whole sequence).
  int64_t mlp_tiles = -1;
  // Sizes by name: tiny, small, tiny-moe, dense-350M, dense-1.3B, moe-8x, moe-ds
  // (../shared/bench/README.md);
  // "-tied" after tiny or small ties the head to the embedding; tiny-zoo (above); "-dropout"
  // and "-masked" after any of them, in either order (above).
  // Unknown name: Error listing the known ones.
  static GPTConfig by_name(const std::string& name);
};

// Causal self-attention over q, k, v [batch, heads, seq, head_dim] (LibTorch 2.x's fused kernel,
// the textbook formula on 1.13); `dropout` on the attention probabilities.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double dropout);
// The same with an explicit additive mask [t, t] (GPTConfig::masked) in place of the causal flag;
// an undefined mask is causal_attention.
torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& mask, double dropout);
// The additive causal mask [t, t] in `options`' dtype and device: 0 on and below the diagonal,
// -inf above.
torch::Tensor causal_mask(int64_t t, const torch::TensorOptions& options);

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(int64_t d_model, int64_t heads, double dropout = 0.0);
  // mask: an additive [t, t] mask (GPTConfig::masked); undefined: causal.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask = {});
  // The part between the two linear layers: qkv_(x) [b, t, 3d] -> [b, t, d] (softmax, dropout).
  torch::Tensor core(const torch::Tensor& qkv, const torch::Tensor& mask = {});

  torch::nn::Linear qkv{nullptr}, out{nullptr};
  // Ulysses: this rank holds a shard of the sequence; the core attends over the whole sequence
  // for heads / P heads (runtime/sequence/ulysses.h). Null: off.
  comm::GroupPtr sequence_group;

 private:
  int64_t heads_;
  double dropout_;
};
TORCH_MODULE(Attention);

class MLPImpl : public torch::nn::Module {
 public:
  MLPImpl(int64_t d_model, int64_t ffn);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(MLP);

// What a block's feed-forward is: the GPT's MLP unless a program gives another module for it
// (examples/gpt_moe.h puts a mixture of experts there). make(layer) returns block `layer`'s
// module, [batch, seq, d] -> [batch, seq, d], registered under `name`; aux_loss(), when given,
// is the loss the blocks add to the model's (a load-balancing loss), its coefficients applied.
struct FeedForward {
  std::function<torch::nn::AnyModule(int64_t layer)> make;
  std::string name = "mlp";
  std::function<torch::Tensor()> aux_loss;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GPTConfig& config, torch::nn::AnyModule ffn, const std::string& ffn_name);
  // mask: the masked model's attention mask (GPTConfig::masked), undefined otherwise.
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask = {});
  // The block checkpointed (the "every" policies): only x is kept for backward, and the mask
  // beside it when there is one (the block is then checkpointed whole, with two inputs).
  torch::Tensor forward_checkpointed(torch::Tensor x, const torch::Tensor& mask = {});
  // GPTImpl::set_sequence_parallel's, for this block's attention.
  void set_sequence_group(comm::GroupPtr group) { attn_->sequence_group = std::move(group); }

 private:
  torch::Tensor dropout(const torch::Tensor& x);
  torch::Tensor forward_selective(torch::Tensor x, const torch::Tensor& mask);
  torch::Tensor feed_forward(const torch::Tensor& h);  // with moe_padding's mask when set
  // norm2 and the feed-forward of x: over tiles when mlp_tiles_ >= 0.
  torch::Tensor norm_feed_forward(const torch::Tensor& x);

  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  Attention attn_{nullptr};
  torch::nn::AnyModule ffn_;
  double dropout_ = 0.0;
  bool selective_ = false;
  int64_t moe_padding_ = 0;
  int64_t mlp_tiles_ = -1;
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  // A config with experts needs a FeedForward that makes them (examples/gpt_moe.h).
  explicit GPTImpl(const GPTConfig& config, FeedForward ffn = {});
  // Logits [batch, seq, vocab] for tokens [batch, seq].
  torch::Tensor logits(const torch::Tensor& tokens);
  // Mean next-token cross-entropy (computed in fp32) of tokens against targets. The head and the
  // loss run fused in chunks of kLossChunk tokens (runtime/nn/linear_cross_entropy.h), so that the
  // logits and their gradient never exist whole (at 8 x 2048 tokens and a 32k vocabulary, 1 GiB
  // in bf16 and 2 GiB each in fp32: the largest activations of a step).
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& targets);
  static constexpr int64_t kLossChunk = 2048;
  const GPTConfig& config() const { return config_; }
  // Ulysses sequence parallelism (DeepSpeed's sequence_parallel_size): tokens and targets are
  // this rank's contiguous shard of each sample's positions, in the group's rank order
  // (sequence::shard_sequence); attention exchanges heads for the sequence (the masked model's
  // mask covers the whole sequence) and the loss is this shard's part of the whole sequence's
  // mean, so the group's losses sum to it. Dropout draws differ from one rank's (compare runs
  // without it). MoE models are refused. Null: off.
  void set_sequence_parallel(comm::GroupPtr group);

 private:
  GPTConfig config_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::Tensor hidden(const torch::Tensor& tokens);  // the last norm's output
  torch::Tensor head(const torch::Tensor& h);
  const torch::Tensor& head_weight() const;  // the tied embedding or the head's own
  int64_t checkpoint_every_ = 0;  // > 0: blocks checkpointed by that policy (gpt.cpp)
  comm::GroupPtr sequence_group_;  // set_sequence_parallel
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};  // untied
  // zoo only (else undefined / null)
  torch::Tensor frozen_scale_, odd_;
  torch::nn::Linear unused_{nullptr};
  std::function<torch::Tensor()> aux_loss_;
};
TORCH_MODULE(GPT);

}  // namespace strata::examples
