// The fused Adam step on the GPU: one pass over the flat fp32 master weights and both moments,
// reading the gradient in its own dtype (fp32, bf16 or fp16, unscaled and clipped on the fly) and
// writing the updated weights again in the model's dtype (DeepSpeed's FusedAdam + the 16-bit
// copy of its FP16/BF16 optimizers, in one kernel). Memory-bound: 4 elements per thread per
// iteration with 16-byte loads of the fp32 streams when every pointer allows it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "offload/adam_math.h"
#include "runtime/optim/cuda/fused_adam_launch.h"

namespace strata::optim::cuda {
namespace {

template <class T> __device__ __forceinline__ float load(const T* p, int64_t i);
template <> __device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
template <> __device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <> __device__ __forceinline__ float load(const __half* p, int64_t i) {
  return __half2float(p[i]);
}

template <class T> __device__ __forceinline__ void store(T* p, int64_t i, float x);
template <> __device__ __forceinline__ void store(float* p, int64_t i, float x) { p[i] = x; }
template <> __device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ void store(__half* p, int64_t i, float x) {
  p[i] = __float2half_rn(x);
}

// Out = void: no 16-bit copy to write.
template <class G, class Out, bool kVector>
__global__ void __launch_bounds__(256) fused_adam_kernel(float* __restrict__ master,
                                                         float* __restrict__ exp_avg,
                                                         float* __restrict__ exp_avg_sq,
                                                         const G* __restrict__ grad,
                                                         Out* __restrict__ out, int64_t n,
                                                         AdamScalars s) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * 4;
  for (int64_t base = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; base < n;
       base += stride) {
    float p[4], m[4], v[4], g[4];
    const bool whole = kVector && base + 4 <= n;
    if (whole) {
      const float4 p4 = *reinterpret_cast<const float4*>(master + base);
      const float4 m4 = *reinterpret_cast<const float4*>(exp_avg + base);
      const float4 v4 = *reinterpret_cast<const float4*>(exp_avg_sq + base);
      p[0] = p4.x, p[1] = p4.y, p[2] = p4.z, p[3] = p4.w;
      m[0] = m4.x, m[1] = m4.y, m[2] = m4.z, m[3] = m4.w;
      v[0] = v4.x, v[1] = v4.y, v[2] = v4.z, v[3] = v4.w;
#pragma unroll
      for (int k = 0; k < 4; ++k) g[k] = load(grad, base + k);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t i = base + k;
        if (i < n) p[k] = master[i], m[k] = exp_avg[i], v[k] = exp_avg_sq[i], g[k] = load(grad, i);
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) adam_update(p[k], m[k], v[k], g[k], s);
    if (whole) {
      *reinterpret_cast<float4*>(master + base) = make_float4(p[0], p[1], p[2], p[3]);
      *reinterpret_cast<float4*>(exp_avg + base) = make_float4(m[0], m[1], m[2], m[3]);
      *reinterpret_cast<float4*>(exp_avg_sq + base) = make_float4(v[0], v[1], v[2], v[3]);
      if constexpr (!std::is_void_v<Out>) {
#pragma unroll
        for (int k = 0; k < 4; ++k) store(out, base + k, p[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t i = base + k;
        if (i >= n) break;
        master[i] = p[k], exp_avg[i] = m[k], exp_avg_sq[i] = v[k];
        if constexpr (!std::is_void_v<Out>) store(out, i, p[k]);
      }
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <class G, class Out>
cudaError_t launch_typed(const FusedAdamLaunch& a) {
  const int threads = 256;
  const int64_t per_block = threads * 4;
  int64_t blocks = (a.n + per_block - 1) / per_block;
  // Enough blocks to fill the device several times over; the grid-stride loop does the rest.
  const int64_t cap = int64_t(a.multiprocessors > 0 ? a.multiprocessors : 132) * 8;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  auto* grad = static_cast<const G*>(a.grad);
  auto* out = static_cast<Out*>(a.out);
  auto stream = static_cast<cudaStream_t>(a.stream);
  const bool vector = aligned16(a.master) && aligned16(a.exp_avg) && aligned16(a.exp_avg_sq);
  if (vector)
    fused_adam_kernel<G, Out, true><<<unsigned(blocks), threads, 0, stream>>>(
        a.master, a.exp_avg, a.exp_avg_sq, grad, out, a.n, a.scalars);
  else
    fused_adam_kernel<G, Out, false><<<unsigned(blocks), threads, 0, stream>>>(
        a.master, a.exp_avg, a.exp_avg_sq, grad, out, a.n, a.scalars);
  return cudaGetLastError();
}

template <class G>
cudaError_t launch_out(const FusedAdamLaunch& a) {
  if (a.out == nullptr) return launch_typed<G, void>(a);
  switch (a.out_type) {
    case FloatType::kFloat32: return launch_typed<G, float>(a);
    case FloatType::kBFloat16: return launch_typed<G, __nv_bfloat16>(a);
    case FloatType::kFloat16: return launch_typed<G, __half>(a);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

const char* launch_fused_adam(const FusedAdamLaunch& a) {
  if (a.n == 0) return nullptr;
  cudaError_t e = cudaErrorInvalidValue;
  switch (a.grad_type) {
    case FloatType::kFloat32: e = launch_out<float>(a); break;
    case FloatType::kBFloat16: e = launch_out<__nv_bfloat16>(a); break;
    case FloatType::kFloat16: e = launch_out<__half>(a); break;
  }
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace strata::optim::cuda
