// Llama-3 and Qwen3 as plain LibTorch modules, built from a Hugging Face config.json
// (models/hf_config.h): RMSNorm, rotary position embedding (with Llama-3's scaling), grouped-query
// attention through scaled-dot-product attention, Qwen3's per-head q/k RMSNorm, a SwiGLU MLP, tied
// or untied embeddings. The only Strata calls in them are activation checkpointing
// (runtime/checkpointing) and the fused head + loss (runtime/nn); nothing in the runtime knows them.
//
//   auto config = strata::models::read_hf_config("Qwen3-0.6B/config.json");
//   strata::models::CausalLM model(config);   // initialised as transformers does; load weights after
//   auto engine = strata::initialize(model, "ds_config.json");
//   auto loss = engine->forward(input_ids, labels);   // Hugging Face's causal-LM loss
//
// Parameter names are Hugging Face's state-dict names (model.embed_tokens.weight,
// model.layers.0.self_attn.q_proj.weight, ..., model.norm.weight, lm_head.weight), so a
// checkpoint maps one to one. With tie_word_embeddings there is no lm_head: the head is
// model.embed_tokens.weight, as in the files save_pretrained writes.
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include <torch/torch.h>

#include <optional>
#include <vector>

#include "models/hf_config.h"
#include "moe/layer.h"
#include "runtime/checkpoint/hf_export.h"
#include "runtime/checkpoint/import_weights.h"

namespace strata::models {

// Hugging Face's LlamaRMSNorm / Qwen3RMSNorm: in float32, weight applied after the cast back.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t size, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const DecoderConfig& config);
  // x [batch, seq, hidden]; cos, sin [seq, head_dim] (models/rope.h).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  // forward's two halves around o_proj: the position-wise q, k, v (rotated; [batch, heads, seq,
  // head_dim] each), and attention over them ([batch, seq, heads x head_dim], o_proj's input).
  std::array<torch::Tensor, 3> heads(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin);
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
  // The parameters heads() reads (the projections but o_proj, the q/k norms).
  std::vector<torch::Tensor> head_parameters() const;
  int64_t head_dim() const { return head_dim_; }

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // Qwen3 only
  // Ulysses: x holds this rank's shard of the sequence; attention runs over the whole sequence
  // for this rank's heads (runtime/sequence/ulysses.h). Null: the whole sequence is here.
  comm::GroupPtr sequence_group;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  bool fused_;  // DecoderConfig::fused_projections, without q/k norms
  bool tiles_;     // DecoderConfig::mlp_tiles asked: the long-context layout
  bool sdpa_gqa_;  // DecoderConfig::sdpa_gqa
  // From this many positions on, a tiled layer's attention runs one kv head per call.
  static constexpr int64_t kLongAttention = 16384;
};
TORCH_MODULE(Attention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const DecoderConfig& config);
  torch::Tensor forward(const torch::Tensor& x);  // down(silu(gate(x)) * up(x))

  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  bool fused_;  // DecoderConfig::fused_projections, untiled
};
TORCH_MODULE(MLP);

// Where the MoE families' experts run, beyond what config.json says: expert parallelism (ep_size
// and its group), drop_tokens and capacity, streaming, the seed: moe::MoEOptions::from_config of
// the Strata config's moe block gives them. config.json's architecture (experts, k, widths,
// norm_topk_prob, SwiGLU) overrides the rest. Unset: one rank, dropless, as transformers runs.
using MoEPlacement = std::optional<moe::MoEOptions>;

// Layer `layer`'s MoE options (DecoderConfig::is_moe_layer).
moe::MoEOptions moe_layer_options(const DecoderConfig& config, int64_t layer,
                                  const MoEPlacement& placement);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const DecoderConfig& config, int64_t layer = 0,
                   const MoEPlacement& placement = std::nullopt);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

  Attention self_attn{nullptr};
  MLP mlp{nullptr};      // null in a sparse layer
  moe::MoE moe{nullptr};  // a sparse layer's: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  // mlp_tiles: every position-wise part over tiles of the sequence (the dense layers).
  torch::Tensor tiled_forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  int64_t mlp_tiles_ = -1;  // DecoderConfig::mlp_tiles
};
TORCH_MODULE(DecoderLayer);

// Hugging Face's LlamaModel / Qwen3Model: embeddings, layers, final norm.
class DecoderModelImpl : public torch::nn::Module {
 public:
  explicit DecoderModelImpl(const DecoderConfig& config,
                            const MoEPlacement& placement = std::nullopt);
  // input_ids [batch, seq] int64 -> the final norm's output [batch, seq, hidden].
  torch::Tensor forward(const torch::Tensor& input_ids);

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};

 private:
  // cos and sin for `seq` positions on `device` in `dtype`, computed once per shape (not a
  // parameter or buffer: Hugging Face saves none, and a copy per forward would wait on the host).
  const std::pair<torch::Tensor, torch::Tensor>& rope(int64_t seq, torch::Device device,
                                                      torch::ScalarType dtype);

  friend class CausalLMImpl;  // sets sequence_group_
  DecoderConfig config_;
  comm::GroupPtr sequence_group_;  // Ulysses: input_ids are this rank's shard of the positions
  torch::Tensor inverse_frequencies_;  // float32, on the host
  struct RopeCache {
    int64_t seq = -1;
    torch::Device device = torch::kCPU;
    torch::ScalarType dtype = torch::kFloat;
    std::pair<torch::Tensor, torch::Tensor> cos_sin;
  } rope_cache_;
  int64_t checkpoint_every_ = 0;  // > 0: every K-th layer checkpointed
};
TORCH_MODULE(DecoderModel);

// Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM.
class CausalLMImpl : public torch::nn::Module {
 public:
  // Weights initialised as transformers does (normal(0, initializer_range) for linear layers and
  // the embedding, zero biases, unit norms) from LibTorch's default generator.
  explicit CausalLMImpl(const DecoderConfig& config, const MoEPlacement& placement = std::nullopt);

  // Hugging Face's causal-LM loss: position t predicts labels[:, t + 1]; labels equal to -100
  // are not counted (the last position never is). The mean over the counted tokens, or, when
  // num_items_in_batch > 0, their sum divided by it (transformers' num_items_in_batch: a mean
  // over the tokens of a whole step across micro-batches and ranks, for gradient accumulation
  // and data parallelism that equal the large batch). The head and loss run fused
  // (runtime/nn/linear_cross_entropy.h): the logits never exist whole.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& labels,
                        double num_items_in_batch = 0);
  // The MoE families: the sparse layers' MoE modules, in order (empty for the dense families),
  // and Hugging Face's load-balancing loss of the last forward (moe/balance.h), unweighted.
  const std::vector<moe::MoEImpl*>& moe_layers() const { return moe_layers_; }
  torch::Tensor aux_loss() const;
  // Data parallelism: the balance loss's statistics over every rank's tokens (moe/balance.h),
  // as one process would see the whole batch. Unset: each rank's own, as transformers does.
  void set_balance_group(comm::GroupPtr group) { balance_group_ = std::move(group); }
  // Ulysses sequence parallelism (DeepSpeed's sequence_parallel_size): input_ids and labels are
  // this rank's contiguous shard of each sample's positions, in the group's rank order
  // (sequence::shard_sequence). RoPE takes the shard's global positions, attention exchanges
  // heads for the sequence, the label after a shard's last position comes from the next rank,
  // and the mean divides by the counted tokens of the whole sequence: the group's losses sum to
  // the whole sequence's and their gradients, summed over the group, are its gradients. A
  // collective over the group in every forward. Null: off.
  void set_sequence_parallel(comm::GroupPtr group);
  const comm::GroupPtr& sequence_group() const { return sequence_group_; }
  // The logits [batch, seq, vocab] (all at once: for evaluation and tests).
  torch::Tensor logits(const torch::Tensor& input_ids);
  // The output head's weight: lm_head.weight, or model.embed_tokens.weight when tied.
  const torch::Tensor& head_weight() const;
  const DecoderConfig& config() const { return config_; }

  DecoderModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tied

 private:
  DecoderConfig config_;
  // [batch, 1]: the label after this shard's last position (-100 on the last rank, or without
  // sequence parallelism).
  torch::Tensor next_shard_labels(const torch::Tensor& labels) const;

  std::vector<moe::MoEImpl*> moe_layers_;
  comm::GroupPtr balance_group_;
  comm::GroupPtr sequence_group_;
};
TORCH_MODULE(CausalLM);

// How a Hugging Face folder's tensors map onto CausalLM for checkpoint::import_weights: the names
// are the same but for the MoE families' experts, which the files hold per expert
// (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight; Mixtral's block_sparse_moe...w1, w3,
// w2) and the model stacked (experts.w1 [E_local, d, 2 * ffn]: gate's and up's columns; experts.w2
// [E_local, ffn, d]): its map reads this rank's experts only. A tied model leaves unused an
// lm_head.weight the files may hold beside the embedding (transformers reads neither copy of it
// then). Set `partitioned` before importing into a model built in shards (dense families only).
checkpoint::ImportOptions hf_import_options(CausalLMImpl& model);
// The export's map (runtime/checkpoint/hf_export.h) of a checkpoint of this config, whose experts
// are saved whole: every expert back to the files' per-expert names.
checkpoint::HfExportOptions hf_export_options(const DecoderConfig& config);

}  // namespace strata::models
