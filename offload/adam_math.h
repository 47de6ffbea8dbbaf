// One element of the fused Adam step, shared by the CPU Adam (offload/cpu_adam.cpp) and the CUDA kernel
// (runtime/optim/cuda/fused_adam.cu), so both compute the same thing in the same order as the per-tensor
// reference in optimizers.cpp (strata::optim::Adam::step): decoupled decay or L2, the moments,
// then p += -step_size * m / (sqrt(v) / sqrt(c2) + eps). Torch-free: nvcc compiles it alone.
#pragma once

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define STRATA_HOST_DEVICE inline
#endif

#include <cmath>

namespace strata::optim {

// Per-step scalars, computed once on the host in double and rounded to float once.
struct AdamScalars {
  float grad_scale = 1.f;    // the gradient is read times this (1 / loss scale x clip coefficient)
  float lr = 0.f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
  // 1 - beta in double, then rounded: 1.f - 0.999f is 1.3e-5 off 0.001 (LibTorch passes the
  // double difference too).
  float one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
  float decay_factor = 1.f;  // AdamW: 1 - lr * weight_decay
  float step_size = 0.f;     // lr / (1 - beta1^t), or lr without bias correction
  float sqrt_c2 = 1.f;       // sqrt(1 - beta2^t), or 1
  bool adam_w_mode = true;
};

STRATA_HOST_DEVICE void adam_update(float& p, float& m, float& v, float g, const AdamScalars& s) {
  g *= s.grad_scale;
  if (s.weight_decay != 0.f) {
    if (s.adam_w_mode)
      p *= s.decay_factor;
    else
      g += s.weight_decay * p;
  }
  m = m * s.beta1 + g * s.one_minus_beta1;
  v = v * s.beta2 + s.one_minus_beta2 * (g * g);
  const float denom = sqrtf(v) / s.sqrt_c2 + s.eps;
  p += -s.step_size * (m / denom);
}

}  // namespace strata::optim
