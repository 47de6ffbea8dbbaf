// SwiGLU, silu(gate) * up, elementwise. Rounded as LibTorch's composite F::silu(gate) * up rounds:
// s = round_T(silu(g)), out = round_T(s * u); backward du = round_T(dy * s),
// dg = round_T(round_T(dy * u) * sigmoid(g) * (1 + g * (1 - sigmoid(g)))). Saves gate and up only
// (autograd's graph keeps silu(gate) too: a third tensor of the MLP's widest shape per layer).
#include <initializer_list>
#include <type_traits>

#include "runtime/nn/cuda/floats.cuh"

namespace strata::nn::cuda {
namespace {

// LibTorch's silu and silu_backward in float (expf, their association), so results round alike.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// Element j of the output (rows x cols, contiguous) reads its inputs at row * stride + col: N
// elements at a time never cross a row (cols is a multiple of N).
__device__ __forceinline__ int64_t strided(int64_t j, int64_t cols, int64_t stride) {
  return (j / cols) * stride + j % cols;
}

template <class T, int N>
__global__ void __launch_bounds__(256)
    swiglu_forward(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                   int64_t n, int64_t cols, int64_t in_stride) {
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N; j < n;
       j += int64_t(gridDim.x) * blockDim.x * N) {
    const int64_t i = strided(j, cols, in_stride);
    float g[N], u[N];
    load<N>(gate + i, g);
    load<N>(up + i, u);
#pragma unroll
    for (int k = 0; k < N; ++k) g[k] = round_to<T>(silu(g[k])) * u[k];
    store<N>(out + j, g);
  }
}

template <class T, int N>
__global__ void __launch_bounds__(256)
    swiglu_backward(const T* __restrict__ grad_out, const T* __restrict__ gate,
                    const T* __restrict__ up, T* __restrict__ grad_gate, T* __restrict__ grad_up,
                    int64_t n, int64_t cols, int64_t in_stride, int64_t grad_stride) {
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N; j < n;
       j += int64_t(gridDim.x) * blockDim.x * N) {
    const int64_t i = strided(j, cols, in_stride), o = strided(j, cols, grad_stride);
    float dy[N], g[N], u[N];
    load<N>(grad_out + j, dy);
    load<N>(gate + i, g);
    load<N>(up + i, u);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float sig = sigmoid(g[k]);
      const float s = round_to<T>(silu(g[k]));
      const float ds = round_to<T>(dy[k] * u[k]);
      u[k] = dy[k] * s;                                // up's gradient
      g[k] = ds * sig * (1.0f + g[k] * (1.0f - sig));  // gate's
    }
    store<N>(grad_up + o, u);
    store<N>(grad_gate + o, g);
  }
}

template <class T> cudaError_t run(const SwiGlu& a, bool backward) {
  const int64_t total = a.rows * a.cols;
  if (total == 0) return cudaSuccess;
  constexpr int n = 16 / sizeof(T);
  bool packed = a.cols % n == 0 && a.in_stride % n == 0 && a.grad_stride % n == 0;
  for (const void* p : std::initializer_list<const void*>{a.gate, a.up, a.out, a.grad_out,
                                                        a.grad_gate, a.grad_up})
    if (p != nullptr && !aligned(p, 16)) packed = false;
  const int per_thread = packed ? n : 1;
  const int threads = 256;
  int64_t blocks = (total / per_thread + threads - 1) / threads;
  const int64_t cap = int64_t(a.multiprocessors > 0 ? a.multiprocessors : 132) * 16;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  auto stream = static_cast<cudaStream_t>(a.stream);
  auto* gate = static_cast<const T*>(a.gate);
  auto* up = static_cast<const T*>(a.up);
  if (!backward) {
    auto* out = static_cast<T*>(a.out);
    if (packed)
      swiglu_forward<T, n><<<unsigned(blocks), threads, 0, stream>>>(gate, up, out, total, a.cols, a.in_stride);
    else
      swiglu_forward<T, 1><<<unsigned(blocks), threads, 0, stream>>>(gate, up, out, total, a.cols, a.in_stride);
  } else {
    auto* dy = static_cast<const T*>(a.grad_out);
    auto* dg = static_cast<T*>(a.grad_gate);
    auto* du = static_cast<T*>(a.grad_up);
    if (packed)
      swiglu_backward<T, n><<<unsigned(blocks), threads, 0, stream>>>(dy, gate, up, dg, du, total, a.cols,
                                                                       a.in_stride, a.grad_stride);
    else
      swiglu_backward<T, 1><<<unsigned(blocks), threads, 0, stream>>>(dy, gate, up, dg, du, total, a.cols,
                                                                       a.in_stride, a.grad_stride);
  }
  return cudaGetLastError();
}

}  // namespace

const char* launch_swiglu_forward(const SwiGlu& a) {
  return error_text(with_type(a.type, [&](auto* tag) {
    return run<std::remove_pointer_t<decltype(tag)>>(a, false);
  }));
}

const char* launch_swiglu_backward(const SwiGlu& a) {
  return error_text(with_type(a.type, [&](auto* tag) {
    return run<std::remove_pointer_t<decltype(tag)>>(a, true);
  }));
}

}  // namespace strata::nn::cuda
