// Rotary position embedding as Hugging Face's Llama and Qwen3 compute it (modeling_rope_utils.py,
// apply_rotary_pos_emb): inverse frequencies theta^(-2i/head_dim) in float32, Llama-3's scaling
// applied to them when configured, cos and sin of position x frequency over the two halves of
// each head (rotate_half pairs element i with element i + head_dim/2, not neighbours).
#pragma once

#include <utility>

#include <torch/torch.h>

#include "models/hf_config.h"

namespace strata::models {

// The inverse frequencies [head_dim / 2], float32 on the CPU (Llama-3's scaling applied).
torch::Tensor rope_inverse_frequencies(const DecoderConfig& config);

// cos and sin [seq, head_dim] for positions 0..seq-1, computed in float32 and cast to `dtype`.
std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& inverse_frequencies,
                                                     int64_t seq, torch::Device device,
                                                     torch::ScalarType dtype);

// x [batch, heads, seq, head_dim] is rotated by cos, sin with strata::nn::rotary (runtime/nn/rotary.h).

}  // namespace strata::models
