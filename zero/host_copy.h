// Device-to-host copies that leave the compute stream free (optimizer offload's gradients):
// a CUDA source is copied into page-locked memory on a side stream that first waits for
// the compute stream, and the source's memory is kept from reuse until the copy is done; the
// caller waits with torch::cuda::synchronize() (or any device-wide wait) before reading the
// host buffer. Anything else is an ordinary copy_.
#pragma once

#include <torch/torch.h>

#include "offload/cpu_adam.h"

namespace strata::zero {

void copy_to_host_async(const torch::Tensor& host, const torch::Tensor& source);

// The CPU kernels' name for a host tensor's dtype (offload/cpu_adam.h): fp32, bf16 or fp16;
// another dtype is refused by name.
offload::Float host_float(torch::ScalarType type);
inline offload::Float host_float(const torch::Tensor& t) { return host_float(t.scalar_type()); }

}  // namespace strata::zero
