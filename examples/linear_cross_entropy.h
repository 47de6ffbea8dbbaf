// The output head and the cross-entropy fused over row chunks: sum over rows of
// cross_entropy(h W^T, target), computed kLossChunk rows at a time, without the logits [rows,
// vocab] ever existing whole (at 8 x 2048 tokens and a 32k vocabulary they are 1 GiB in bf16, and
// their float32 copy, its log-softmax and the gradient 2 GiB each: the step's largest tensors).
// Each chunk's gradients (for h and for W) are computed as its loss is, from the chunk's softmax,
// so nothing is recomputed in backward; backward scales them by the loss's incoming gradient (a
// loss scale, 1 / gradient accumulation). Plain LibTorch: a custom autograd function, as a user
// of the engine would write one (Liger-Kernel's fused linear cross-entropy does the same in
// Triton).
//
// The logits are F::linear's (autocast applies), the softmax and loss in float32. W's gradient is
// summed over the chunks in float32. Not twice differentiable.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace strata::examples {

// h [rows, d], weight [vocab, d], targets [rows] int64 in [0, vocab): the summed loss, float32.
torch::Tensor linear_cross_entropy_sum(const torch::Tensor& h, const torch::Tensor& weight,
                                       const torch::Tensor& targets, int64_t chunk_rows);

}  // namespace strata::examples
