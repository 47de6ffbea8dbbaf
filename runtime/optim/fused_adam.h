// Adam's step over one flat fp32 tensor in one pass: the master weights and both moments are
// read and written once, the gradient is read in its own dtype times a scale (unscaling and
// clipping without an fp32 copy), and the new weights can be written out in a second dtype at
// the same time (the 16-bit model copy). A CUDA kernel on GPUs (cuda/fused_adam.cu), the
// host tier's SIMD Adam on CPUs (offload/cpu_adam.h); both run adam_math.h's adam_update().
#pragma once

#include <torch/torch.h>

#include "offload/adam_math.h"

namespace strata::optim {

// master, exp_avg, exp_avg_sq: contiguous fp32 of one length on one device; grad: the same
// length in fp32, bf16 or fp16; out: undefined, or the same length in fp32, bf16 or fp16.
void fused_adam_step(const torch::Tensor& master, const torch::Tensor& exp_avg,
                     const torch::Tensor& exp_avg_sq, const torch::Tensor& grad,
                     const torch::Tensor& out, const AdamScalars& scalars);

}  // namespace strata::optim
