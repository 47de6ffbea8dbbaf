// Rotary position embedding in the rotate-half form of Llama and Qwen (Hugging Face's
// apply_rotary_pos_emb): x * cos + cat(-x2, x1) * sin, x2 and x1 the halves of the last dimension.
//
//   q = strata::nn::rotary(q, cos, sin);  // q [batch, heads, seq, head_dim], cos/sin [seq, head_dim]
//
// cos and sin broadcast against x's last two dimensions. On a CUDA device, for x of 4 dimensions
// whose last is contiguous (any strides else: a transposed [batch, seq, heads, head_dim] projection
// needs no copy) and cos/sin [seq, head_dim] of x's dtype, one kernel each way that writes the
// composite's result bit for bit, in x's memory layout; elsewhere the composite ops. cos and sin get
// no gradient (they are position tables): when either requires one, the composite ops run under
// autograd instead.
#pragma once

#include <torch/torch.h>

namespace strata::nn {

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

}  // namespace strata::nn
