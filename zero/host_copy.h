// Device-to-host copies that leave the compute stream free (optimizer offload's gradients):
// a CUDA source is copied into page-locked memory on a side stream that first waits for
// the compute stream, and the source's memory is kept from reuse until the copy is done; the
// caller waits with torch::cuda::synchronize() (or any device-wide wait) before reading the
// host buffer. Anything else is an ordinary copy_.
#pragma once

#include <torch/torch.h>

namespace strata::zero {

void copy_to_host_async(const torch::Tensor& host, const torch::Tensor& source);

}  // namespace strata::zero
