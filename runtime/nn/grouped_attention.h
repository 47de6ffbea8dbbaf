// Causal attention run one group of kv heads at a time, for long sequences on a GPU.
//
//   auto out = strata::nn::grouped_attention(q, k, v, kv_per_call);  // [b, heads, t, d] each
//
// The attention kernels' backward allocates, per call, an fp32 accumulator for dq ([b, t, heads, d]:
// 8 KB per token for 32 heads of 64) and, under grouped-query attention, dk and dv expanded to
// every query head (2 x 4 KB per token in bf16) before summing them per kv head. At 128K tokens
// that is 16 KB per token of the layer's backward peak, more than q, k and v themselves. Called
// for `kv_per_call` kv heads (and their query heads) at a time, forward and backward each hold one
// group's buffers: heads / kv_per_call times less. The outputs, the log-sum-exp and the gradients
// are the whole call's, each group's written into its slice (the kernels compute every head on its
// own; tests/runtime/nn/test_fused_layers_gpu.cpp holds them to SDPA's one call).
//
// One autograd node; forward keeps q, k, v, the output and the log-sum-exp, as SDPA does. On a CUDA
// device with LibTorch 2.2 or later, for fp16/bf16 and head dims flash attention takes; elsewhere
// (and for one group) SDPA's own call (is_causal, enable_gqa where LibTorch has it). Each group runs
// cuDNN's attention kernels (LibTorch 2.6+, what SDPA itself picks on Hopper: about 1.4x flash's
// speed) unless a first small forward + backward with them fails; then flash attention's.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace strata::nn {

// Whether grouped_attention runs grouped for these tensors (else it is one SDPA call).
bool grouped_attention_runs(const torch::Tensor& q, const torch::Tensor& k, int64_t kv_per_call);

torch::Tensor grouped_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                int64_t kv_per_call);

}  // namespace strata::nn
