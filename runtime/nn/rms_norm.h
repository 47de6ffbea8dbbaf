// RMSNorm as Llama, Qwen and Mixtral define it (Hugging Face's LlamaRMSNorm):
// weight * (x32 * rsqrt(mean(x32^2, last dim) + eps)).to(x's dtype), the output in the promotion of
// the weight's and x's dtypes.
//
//   auto y = strata::nn::rms_norm(x, norm->weight, 1e-5);
//
// One autograd node that keeps x and one fp32 reciprocal norm per row (autograd's graph of the same
// ops keeps x's fp32 copy and the normed rows besides: 3x x's bytes in bf16). On a CUDA device, for
// contiguous rows of at most 12,288 elements of fp32/bf16/fp16 (the weight of x's dtype or fp32),
// one kernel each way, rounding as the composite ops round; elsewhere the composite ops. Under
// ZeRO-3 the weight is gathered as for any op (the kernel reports itself to the op callbacks).
#pragma once

#include <torch/torch.h>

namespace strata::nn {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

}  // namespace strata::nn
