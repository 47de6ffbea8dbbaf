// A linear output head and the cross-entropy fused over row chunks, for any model with a linear
// head (tied to its embedding or not): sum over rows of cross_entropy(h W^T, target), computed
// chunk_rows rows at a time, without the logits [rows, vocab] ever existing whole (at 8 x 2048
// tokens and a 128k vocabulary they are 4 GiB in bf16, and their float32 copy, its log-softmax and
// the gradient 8 GiB each: a step's largest tensors). Each chunk's gradients (for h and for W) are
// computed as its loss is, from the chunk's softmax, so nothing is recomputed in backward; backward
// scales them by the loss's incoming gradient (a loss scale, 1 / gradient accumulation). Plain
// LibTorch: a custom autograd function (Liger-Kernel's fused linear cross-entropy does the same in
// Triton).
//
//   namespace nn = strata::nn;
//   auto loss = nn::linear_cross_entropy(h.reshape({-1, d}), lm_head->weight, targets.reshape({-1}));
//
// The logits are F::linear's (autocast applies), the softmax and loss in float32. W's gradient is
// summed over the chunks in float32 and handed back in W's dtype. Rows whose target is
// `ignore_index` (Hugging Face's -100: padding, prompt tokens) add nothing to the loss and get a
// zero gradient, without a device-to-host read. Under ZeRO-3 the weight is gathered once: every
// chunk runs inside the one forward call, and backward uses the gradients kept from it, not W.
// Not twice differentiable.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace strata::nn {

struct LinearCrossEntropyOptions {
  int64_t chunk_rows = 2048;   // rows of logits alive at once
  int64_t ignore_index = -100;  // targets equal to it are not counted
};

// h [rows, d], weight [vocab, d], targets [rows] int64 in [0, vocab) or ignore_index: the summed
// loss over the counted rows, float32, 0-d. Throws std::invalid_argument for shapes that do not
// fit or a chunk below 1.
torch::Tensor linear_cross_entropy_sum(const torch::Tensor& h, const torch::Tensor& weight,
                                       const torch::Tensor& targets,
                                       const LinearCrossEntropyOptions& options = {});

// The mean over the counted rows (torch's cross_entropy with reduction "mean" and ignore_index;
// Hugging Face's causal-LM loss on shifted labels): the sum over the number of rows whose target
// is not ignore_index, and 0 with zero gradients when there is none (torch gives NaN there).
torch::Tensor linear_cross_entropy(const torch::Tensor& h, const torch::Tensor& weight,
                                   const torch::Tensor& targets,
                                   const LinearCrossEntropyOptions& options = {});

}  // namespace strata::nn
