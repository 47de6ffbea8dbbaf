// SwiGLU's gate, silu(gate) * up (Llama's and Qwen's MLP between its projections).
//
//   auto h = down_proj(strata::nn::swiglu(gate_proj(x), up_proj(x)));
//
// One autograd node that keeps gate and up (autograd's graph of the composite keeps silu(gate) as
// well: a third tensor of the MLP's widest shape per layer) and recomputes silu(gate) in backward.
// On a CUDA device, for gate and up of one shape and one fp32/bf16/fp16 dtype, one kernel each way,
// rounding as the composite ops round; elsewhere the composite ops.
#pragma once

#include <torch/torch.h>

namespace strata::nn {

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

// The same of the halves of gate_up's last dimension, [gate | up] (a packed projection, as the MoE
// experts' grouped product writes it): the output has half its last dimension, and backward hands
// back one gradient for the packed tensor, with no copy of either half on the way.
torch::Tensor swiglu(const torch::Tensor& gate_up);

}  // namespace strata::nn
