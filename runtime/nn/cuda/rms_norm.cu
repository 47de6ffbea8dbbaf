// RMSNorm on the GPU. Forward writes weight * round_T(x * rstd) and keeps rstd per row; backward
// writes dx = rstd * (g - xhat * mean(g * xhat)), g = round_T(dy * w), and each block's fp32 sums
// of dy * round_T(xhat) for the weight (the caller sums the blocks).
// Rows whose packs of 16 bytes fit 256 threads x 4 run the row-group kernels: P threads per row
// (a power of two, P * kChunks packs covering it), 256 / P rows per block at a time, each thread's
// packs of x and dy in registers (one pass over memory), its columns' weight loaded once and its
// sums of the weight's gradient kept in registers across the rows it visits: no atomics per
// element. Other rows (unaligned, or wider) run the warp-per-row kernels, which read a row twice
// and gather the weight's sums with shared-memory atomics.
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

// The sum of v over the P threads of a row (consecutive threads; P a power of two up to kThreads).
// Every thread of the block calls it the same number of times (P > 32 meets at __syncthreads).
__device__ __forceinline__ float row_sum(float v, int p, float* scratch) {
  const int width = p < 32 ? p : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (p <= 32) return v;
  const int warp = threadIdx.x / 32, warps = p / 32;
  __syncthreads();  // the previous row's reads of scratch are done
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  float s = 0;
  for (int w = warp / warps * warps; w < (warp / warps + 1) * warps; ++w) s += scratch[w];
  return s;
}

constexpr int kMaxChunks = 4;

template <class T, class W, int C>
__global__ void __launch_bounds__(kThreads)
    rms_norm_forward_rows(const T* __restrict__ x, const W* __restrict__ weight,
                          OutOf<T, W>* __restrict__ out, float* __restrict__ rstd, int64_t rows,
                          int64_t cols, float eps, int p) {
  constexpr int N = 16 / sizeof(T);
  __shared__ float scratch[kWarps];
  const int groups = kThreads / p, t = threadIdx.x % p;
  for (int64_t base = int64_t(blockIdx.x) * groups; base < rows; base += int64_t(gridDim.x) * groups) {
    const int64_t row = base + threadIdx.x / p;
    const bool live = row < rows;
    float v[C][N];
    float squares = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t j = (int64_t(c) * p + t) * N;
      if (live && j < cols) {
        load<N>(x + row * cols + j, v[c]);
#pragma unroll
        for (int k = 0; k < N; ++k) squares += v[c][k] * v[c][k];
      }
    }
    const float r = rsqrtf(row_sum(squares, p, scratch) / float(cols) + eps);
    if (!live) continue;
    if (t == 0) rstd[row] = r;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t j = (int64_t(c) * p + t) * N;
      if (j >= cols) continue;
      float w[N];
      load<N>(weight + j, w);
#pragma unroll
      for (int k = 0; k < N; ++k) v[c][k] = w[k] * round_to<T>(v[c][k] * r);
      store<N>(out + row * cols + j, v[c]);
    }
  }
}

template <class T, class W, int C>
__global__ void __launch_bounds__(kThreads)
    rms_norm_backward_rows(const OutOf<T, W>* __restrict__ grad_out, const T* __restrict__ x,
                           const W* __restrict__ weight, const float* __restrict__ rstd,
                           T* __restrict__ grad_x, float* __restrict__ grad_weight_partial,
                           int64_t rows, int64_t cols, int p) {
  constexpr int N = 16 / sizeof(T);
  extern __shared__ float shared[];  // kWarps floats of scratch, then cols weight sums
  float* scratch = shared;
  float* weight_sums = shared + kWarps;
  const bool want_weight = grad_weight_partial != nullptr;
  if (want_weight) {
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) weight_sums[j] = 0;
  }
  const int groups = kThreads / p, t = threadIdx.x % p;
  float w[C][N], sums[C][N];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int64_t j = (int64_t(c) * p + t) * N;
#pragma unroll
    for (int k = 0; k < N; ++k) sums[c][k] = w[c][k] = 0;
    if (j < cols) load<N>(weight + j, w[c]);
  }
  for (int64_t base = int64_t(blockIdx.x) * groups; base < rows; base += int64_t(gridDim.x) * groups) {
    const int64_t row = base + threadIdx.x / p;
    const bool live = row < rows;
    const float r = live ? rstd[row] : 0.f;
    float v[C][N], g[C][N];
    float dot = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t j = (int64_t(c) * p + t) * N;
      if (!live || j >= cols) continue;
      load<N>(x + row * cols + j, v[c]);
      load<N>(grad_out + row * cols + j, g[c]);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float xhat = v[c][k] * r;
        dot += round_to<T>(g[c][k] * w[c][k]) * xhat;
        sums[c][k] += g[c][k] * round_to<T>(xhat);
      }
    }
    if (grad_x == nullptr) continue;  // the same for every thread: no row_sum skipped by some
    const float mean = row_sum(dot, p, scratch) / float(cols);
    if (!live) continue;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t j = (int64_t(c) * p + t) * N;
      if (j >= cols) continue;
#pragma unroll
      for (int k = 0; k < N; ++k)
        v[c][k] = (round_to<T>(g[c][k] * w[c][k]) - v[c][k] * r * mean) * r;
      store<N>(grad_x + row * cols + j, v[c]);
    }
  }
  if (!want_weight) return;
  __syncthreads();  // weight_sums zeroed
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int64_t j = (int64_t(c) * p + t) * N;
    if (j >= cols) continue;
#pragma unroll
    for (int k = 0; k < N; ++k) atomicAdd(&weight_sums[j + k], sums[c][k]);  // once per block
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < cols; j += kThreads)
    grad_weight_partial[int64_t(blockIdx.x) * cols + j] = weight_sums[j];
}

// The row-group shape of a row of `cols` elements of `element_bytes`: P threads per row and the
// packs per thread, or chunks 0 when the row is too wide for them.
struct RowShape {
  int p = 0;
  int chunks = 0;
};
RowShape row_shape(int64_t cols, int element_bytes) {
  const int64_t n = 16 / element_bytes;
  const int64_t packs = (cols + n - 1) / n;
  int p = 1;
  while (p < kThreads && p < packs) p *= 2;
  const int64_t chunks = (packs + p - 1) / p;
  if (chunks > kMaxChunks) return {};
  return {p, chunks <= 1 ? 1 : chunks <= 2 ? 2 : 4};
}

int element_bytes(FloatType t) { return t == FloatType::kFloat32 ? 4 : 2; }

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
  const bool packed = packs<T>(a.cols, {{x, sizeof(T)}, {w, sizeof(W)}, {out, sizeof(*out)}});
  const RowShape shape = row_shape(a.cols, sizeof(T));
  if (packed && shape.chunks > 0) {
    const int64_t groups = kThreads / shape.p;
    const int64_t want = (a.rows + groups - 1) / groups;
    const int64_t cap = int64_t(a.multiprocessors > 0 ? a.multiprocessors : 132) * 16;
    const int grid = int(want < cap ? want : cap);
    auto launch = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, stream>>>(x, w, out, a.rstd, a.rows, a.cols, a.eps, shape.p);
    };
    if (shape.chunks == 1) launch(rms_norm_forward_rows<T, W, 1>);
    else if (shape.chunks == 2) launch(rms_norm_forward_rows<T, W, 2>);
    else launch(rms_norm_forward_rows<T, W, 4>);
  } else if (packed)
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
  const bool packed =
      packs<T>(a.cols, {{gy, sizeof(*gy)}, {x, sizeof(T)}, {w, sizeof(W)}, {gx, sizeof(T)}});
  const RowShape shape = row_shape(a.cols, sizeof(T));
  if (packed && shape.chunks > 0) {
    const size_t bytes = (kWarps + (a.grad_weight_partial != nullptr ? size_t(a.cols) : 0)) * sizeof(float);
    auto launch = [&](auto kernel) {
      kernel<<<a.blocks, kThreads, bytes, stream>>>(gy, x, w, a.rstd, gx, a.grad_weight_partial,
                                                    a.rows, a.cols, shape.p);
    };
    if (shape.chunks == 1) launch(rms_norm_backward_rows<T, W, 1>);
    else if (shape.chunks == 2) launch(rms_norm_backward_rows<T, W, 2>);
    else launch(rms_norm_backward_rows<T, W, 4>);
  } else if (packed)
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

int rms_norm_backward_blocks(int64_t rows, int64_t cols, FloatType x_type, int multiprocessors) {
  // Fewer blocks than forward: each writes a row of partial sums of the weight's gradient. The
  // row-group kernel keeps its sums in registers, so it can use more blocks (about what the GPU
  // holds at once) than the atomics of the warp-per-row kernel, which pay per element.
  const RowShape shape = row_shape(cols, element_bytes(x_type));
  const int64_t per_block = shape.chunks > 0 ? kThreads / shape.p : kWarps;
  const int64_t want = (rows + per_block - 1) / per_block;
  const int64_t cap = int64_t(multiprocessors > 0 ? multiprocessors : 132) * (shape.chunks > 0 ? 8 : 2);
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
