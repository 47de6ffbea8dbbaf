// A decoder-only model's shape, read from a Hugging Face `config.json` with Hugging Face's own key
// names: Llama (Llama-3, 3.1, 3.2, 3.3: model_type "llama"), Qwen3 (model_type "qwen3"), and the
// mixtures of experts Qwen3-MoE ("qwen3_moe") and Mixtral ("mixtral").
//
//   auto config = strata::models::read_hf_config("Llama-3.2-1B/config.json");
//   config.checkpointing = "every";            // Strata's choices, not in config.json
//   strata::models::CausalLM model(config);
//
// Strict as Strata's own config: every key of the file is either used, or known not to change
// training (architectures, transformers_version, torch_dtype / dtype, the token ids, use_cache,
// ...); an unknown key is an error naming it and the nearest known one, and a known key whose value
// would need what is not built (a RoPE scaling other than llama3's, sliding-window attention,
// attention dropout, an activation other than SiLU) is an error naming the key and the value.
// Both spellings of RoPE are read: transformers 4's top-level rope_theta + rope_scaling, and
// transformers 5's rope_parameters {rope_theta, rope_type, ...}.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::models {

enum class Family { kLlama, kQwen3, kQwen3Moe, kMixtral };

// Llama-3's rope_scaling of type "llama3" (transformers' _compute_llama3_parameters): wavelengths
// above original_max_position_embeddings / low_freq_factor are stretched by `factor`, those below
// original / high_freq_factor kept, the band between interpolated.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct DecoderConfig {
  Family family = Family::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // grouped-query attention: heads / kv heads queries per kv head
  int64_t head_dim = 0;             // Qwen3's may differ from hidden_size / heads
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool rope_llama3 = false;  // rope_scaling of type llama3 (then `llama3` holds it)
  Llama3RopeScaling llama3;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q, k, v and o projections
  bool mlp_bias = false;        // gate, up and down projections (Llama's key)
  bool qk_norm = false;         // Qwen3: RMSNorm over each head of q and k before RoPE
  double initializer_range = 0.02;  // N(0, this) for a model built without weights

  // Mixture of experts (qwen3_moe, mixtral; num_experts 0 for the dense families): softmax over
  // the experts, the top num_experts_per_tok, their weights renormalised when norm_topk_prob
  // (always for Mixtral), SwiGLU experts of moe_intermediate_size (Mixtral's intermediate_size),
  // no capacity. A layer is sparse unless listed in mlp_only_layers, when (layer + 1) is a
  // multiple of decoder_sparse_step (Qwen3-MoE's rule; Mixtral's layers are all sparse).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // Hugging Face's load-balancing loss (moe/balance.h), weighed by router_aux_loss_coef, joins
  // the loss when output_router_logits (transformers adds it only then).
  double router_aux_loss_coef = 0.0;
  bool output_router_logits = false;
  bool is_moe_layer(int64_t layer) const;

  // Strata's choices (not in config.json).
  // Activation checkpointing of the decoder layers: "" / "none", "every", "every:K"
  // (runtime/checkpointing/checkpoint.h's policies; "selective" is the example GPT's only).
  std::string checkpointing;
  // Tiled MLP (runtime/util/tiled.h, ALST's TiledMLP): each dense layer's
  // post-attention norm and MLP run over tiles of the sequence, recomputed tile by tile in
  // backward. -1: untiled; 0: ceil(seq / hidden_size) tiles (ALST's count); N > 0: N tiles.
  // The sparse layers' MoE layers tile their experts' rows instead (moe::MoEOptions::tiles).
  int64_t mlp_tiles = -1;
  // The fused head + loss's rows at once (runtime/nn). A micro-batch of up to 8192 rows (4 x
  // 2048) is one chunk: its logits are no larger than the float32 sum of W's gradient that more
  // chunks need (at vocab 128k: 2.1 GB in bf16 against 1 GB for the sum plus 0.5 GB per chunk),
  // and W's gradient is one product, not a float32 sum added chunk by chunk.
  int64_t loss_chunk_rows = 8192;
  // One matrix product for q, k and v (layers without q/k norms) and one for gate and up (untiled
  // MLPs), over the weights concatenated at each forward: fewer, wider products (k's and v's alone
  // are narrow) and one input gradient each. The parameters stay Hugging Face's, one per projection.
  bool fused_projections = true;
  // Grouped kv heads read in place by SDPA's enable_gqa (CUDA, LibTorch >= 2.5); false: copied for
  // each query head first (transformers' repeat_kv), which leaves SDPA every backend, cuDNN's
  // included, at the copies' memory (2 x 2 bytes x q heads x head_dim per token, and gradients).
  bool sdpa_gqa = true;
  // Draw transformers' initial weights (normal(0, initializer_range)). false: LibTorch's own
  // initialisation stays, for a model whose weights are all loaded next (import_weights checks
  // that every one is): inside a PartitionedInit each tensor is then partitioned once, never
  // gathered back to be drawn again.
  bool init_weights = true;

  // Checks the shape (positive sizes, heads divisible by kv heads, an even head_dim, ...);
  // throws strata::Error naming `source` and the key.
  void validate(const std::string& source) const;
};

// From the parsed file; `source` names it in errors.
DecoderConfig parse_hf_config(const nlohmann::json& config, const std::string& source);
// Reads `path` (a config.json, or a folder holding one) strictly: duplicate keys, bad JSON and
// the checks of parse_hf_config are errors naming the file and line.
DecoderConfig read_hf_config(const std::string& path);

const char* family_name(Family family);

}  // namespace strata::models
