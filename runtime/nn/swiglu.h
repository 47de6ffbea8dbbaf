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

}  // namespace strata::nn
