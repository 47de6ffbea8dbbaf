// RMSNorm on the GPU: one warp per row, in two passes over the row (the second from cache). Forward
// writes weight * round_T(x * rstd) and keeps rstd per row; backward writes
// dx = rstd * (g - xhat * mean(g * xhat)), g = round_T(dy * w), and each block's fp32 sums of
// dy * round_T(xhat) for the weight, gathered in shared memory (the caller sums the blocks).
#include <initializer_list>
#include <type_traits>

#include "runtime/nn/cuda/floats.cuh"

namespace strata::nn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The output's type: the weight's when it is fp32, else x's.
template <class T, class W> using OutOf = std::conditional_t<std::is_same_v<W, float>, float, T>;

template <class T, class W, int N>
__global__ void __launch_bounds__(kThreads)
    rms_norm_forward(const T* __restrict__ x, const W* __restrict__ weight,
                     OutOf<T, W>* __restrict__ out, float* __restrict__ rstd, int64_t rows,
                     int64_t cols, float eps) {
  const int lane = threadIdx.x % 32;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += int64_t(gridDim.x) * kWarps) {
    const T* xr = x + row * cols;
    float squares = 0;
    for (int64_t j = lane * N; j < cols; j += 32 * N) {
      float v[N];
      load<N>(xr + j, v);
#pragma unroll
      for (int k = 0; k < N; ++k) squares += v[k] * v[k];
    }
    const float r = rsqrtf(warp_sum(squares) / float(cols) + eps);
    if (lane == 0) rstd[row] = r;
    auto* o = out + row * cols;
    for (int64_t j = lane * N; j < cols; j += 32 * N) {
      float v[N], w[N];
      load<N>(xr + j, v);
      load<N>(weight + j, w);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = w[k] * round_to<T>(v[k] * r);
      store<N>(o + j, v);
    }
  }
}

template <class T, class W, int N>
__global__ void __launch_bounds__(kThreads)
    rms_norm_backward(const OutOf<T, W>* __restrict__ grad_out, const T* __restrict__ x,
                      const W* __restrict__ weight, const float* __restrict__ rstd,
                      T* __restrict__ grad_x, float* __restrict__ grad_weight_partial,
                      int64_t rows, int64_t cols) {
  extern __shared__ float weight_sums[];  // cols floats when grad_weight_partial
  if (grad_weight_partial != nullptr) {
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) weight_sums[j] = 0;
    __syncthreads();
  }
  const int lane = threadIdx.x % 32;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += int64_t(gridDim.x) * kWarps) {
    const T* xr = x + row * cols;
    const auto* gr = grad_out + row * cols;
    const float r = rstd[row];
    float dot = 0;
    for (int64_t j = lane * N; j < cols; j += 32 * N) {
      float v[N], g[N], w[N];
      load<N>(xr + j, v);
      load<N>(gr + j, g);
      load<N>(weight + j, w);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float xhat = v[k] * r;
        dot += round_to<T>(g[k] * w[k]) * xhat;
        if (grad_weight_partial != nullptr) atomicAdd(&weight_sums[j + k], g[k] * round_to<T>(xhat));
      }
    }
    if (grad_x == nullptr) continue;
    const float mean = warp_sum(dot) / float(cols);
    for (int64_t j = lane * N; j < cols; j += 32 * N) {
      float v[N], g[N], w[N];
      load<N>(xr + j, v);
      load<N>(gr + j, g);
      load<N>(weight + j, w);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float xhat = v[k] * r;
        v[k] = (round_to<T>(g[k] * w[k]) - xhat * mean) * r;
      }
      store<N>(grad_x + row * cols + j, v);
    }
  }
  if (grad_weight_partial != nullptr) {
    __syncthreads();
    for (int64_t j = threadIdx.x; j < cols; j += kThreads)
      grad_weight_partial[int64_t(blockIdx.x) * cols + j] = weight_sums[j];
  }
}

// N elements per lane per step (16 bytes of x) when the row length and every pointer allow it:
// each pointer aligned to N of its own elements.
struct Stream {
  const void* p;
  int64_t element_bytes;
};
template <class T> bool packs(int64_t cols, std::initializer_list<Stream> streams) {
  constexpr int n = 16 / sizeof(T);
  if (cols % n != 0) return false;
  for (const auto& s : streams)
    if (s.p != nullptr && !aligned(s.p, s.element_bytes * n)) return false;
  return true;
}

int forward_blocks(int64_t rows, int multiprocessors) {
  const int64_t want = (rows + kWarps - 1) / kWarps;
  const int64_t cap = int64_t(multiprocessors > 0 ? multiprocessors : 132) * 16;
  return int(want < 1 ? 1 : want > cap ? cap : want);
}

template <class T, class W> cudaError_t forward_typed(const RmsNormForward& a) {
  auto* x = static_cast<const T*>(a.x);
  auto* w = static_cast<const W*>(a.weight);
  auto* out = static_cast<OutOf<T, W>*>(a.out);
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int blocks = forward_blocks(a.rows, a.multiprocessors);
  constexpr int n = 16 / sizeof(T);
  if (packs<T>(a.cols, {{x, sizeof(T)}, {w, sizeof(W)}, {out, sizeof(*out)}}))
    rms_norm_forward<T, W, n><<<blocks, kThreads, 0, stream>>>(x, w, out, a.rstd, a.rows, a.cols, a.eps);
  else
    rms_norm_forward<T, W, 1><<<blocks, kThreads, 0, stream>>>(x, w, out, a.rstd, a.rows, a.cols, a.eps);
  return cudaGetLastError();
}

template <class T, class W> cudaError_t backward_typed(const RmsNormBackward& a) {
  auto* gy = static_cast<const OutOf<T, W>*>(a.grad_out);
  auto* x = static_cast<const T*>(a.x);
  auto* w = static_cast<const W*>(a.weight);
  auto* gx = static_cast<T*>(a.grad_x);
  auto stream = static_cast<cudaStream_t>(a.stream);
  const size_t shared = a.grad_weight_partial != nullptr ? size_t(a.cols) * sizeof(float) : 0;
  constexpr int n = 16 / sizeof(T);
  if (packs<T>(a.cols, {{gy, sizeof(*gy)}, {x, sizeof(T)}, {w, sizeof(W)}, {gx, sizeof(T)}}))
    rms_norm_backward<T, W, n><<<a.blocks, kThreads, shared, stream>>>(
        gy, x, w, a.rstd, gx, a.grad_weight_partial, a.rows, a.cols);
  else
    rms_norm_backward<T, W, 1><<<a.blocks, kThreads, shared, stream>>>(
        gy, x, w, a.rstd, gx, a.grad_weight_partial, a.rows, a.cols);
  return cudaGetLastError();
}

template <class T, class W> struct Forward {
  static cudaError_t run(const RmsNormForward& a) { return forward_typed<T, W>(a); }
};
template <class T, class W> struct Backward {
  static cudaError_t run(const RmsNormBackward& a) { return backward_typed<T, W>(a); }
};

// The (x, weight) type pairs: the weight of x's type, or fp32.
template <template <class, class> class Launch, class A>
cudaError_t dispatch(const A& a) {
  const bool fp32_weight = a.weight_type == FloatType::kFloat32;
  if (!fp32_weight && a.weight_type != a.x_type) return cudaErrorInvalidValue;
  switch (a.x_type) {
    case FloatType::kFloat32: return Launch<float, float>::run(a);
    case FloatType::kBFloat16:
      return fp32_weight ? Launch<__nv_bfloat16, float>::run(a)
                         : Launch<__nv_bfloat16, __nv_bfloat16>::run(a);
    case FloatType::kFloat16:
      return fp32_weight ? Launch<__half, float>::run(a) : Launch<__half, __half>::run(a);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

int rms_norm_backward_blocks(int64_t rows, int multiprocessors) {
  // Fewer blocks than forward: each writes a row of partial sums of the weight's gradient.
  const int64_t want = (rows + kWarps - 1) / kWarps;
  const int64_t cap = int64_t(multiprocessors > 0 ? multiprocessors : 132) * 2;
  return int(want < 1 ? 1 : want > cap ? cap : want);
}

const char* launch_rms_norm_forward(const RmsNormForward& a) {
  if (a.rows == 0) return nullptr;
  return error_text(dispatch<Forward>(a));
}

const char* launch_rms_norm_backward(const RmsNormBackward& a) {
  if (a.rows == 0) return nullptr;
  return error_text(dispatch<Backward>(a));
}

}  // namespace strata::nn::cuda
