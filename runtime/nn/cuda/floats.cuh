// Device helpers for runtime/nn's kernels: fp32/bf16/fp16 element access in float, rounding to an
// element type (so a kernel reproduces, product by product, what LibTorch's composite ops round),
// packed loads of N elements, and a warp's sum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/nn/cuda/launch.h"

namespace strata::nn::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// x rounded to T and read back: LibTorch's 16-bit ops compute in float and round each result.
template <class T> __device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

template <class T, int N> struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, class T> __device__ __forceinline__ void load(const T* p, float (&f)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) f[k] = to_float(pack.v[k]);
}

template <int N, class T> __device__ __forceinline__ void store(T* p, const float (&f)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int k = 0; k < N; ++k) pack.v[k] = from_float<T>(f[k]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % uint64_t(bytes) == 0;
}

inline const char* error_text(cudaError_t e) {
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Calls f with a null pointer of the C++ type of t (float, __nv_bfloat16, __half).
template <class F> cudaError_t with_type(FloatType t, F&& f) {
  switch (t) {
    case FloatType::kFloat32: return f(static_cast<float*>(nullptr));
    case FloatType::kBFloat16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case FloatType::kFloat16: return f(static_cast<__half*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

}  // namespace strata::nn::cuda
