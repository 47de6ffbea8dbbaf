// Softmax cross-entropy of one chunk of logits, in place, one block per row: a pass that keeps a
// running maximum and sum of exponentials (online softmax), then, for the gradient, a pass that
// overwrites each logit with softmax - one_hot, rounded once to the logits' type. Reads the 16-bit
// logits twice and writes them once, where LibTorch's ops (the float copy, log_softmax, exp, the
// scatter) move about five times as many bytes.
#include <cmath>
#include <type_traits>

#include "runtime/nn/cuda/floats.cuh"

namespace strata::nn::cuda {
namespace {

constexpr int kThreads = 512;

struct MaxSum {
  float max;
  float sum;  // of exp(x - max)
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ MaxSum block_max_sum(MaxSum v) {
  __shared__ MaxSum warps[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset),
                       __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    v = combine(v, other);
  }
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? warps[threadIdx.x] : MaxSum{-INFINITY, 0.0f};
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset),
                         __shfl_xor_sync(0xffffffffu, v.sum, offset)};
      v = combine(v, other);
    }
    if (threadIdx.x == 0) warps[0] = v;
  }
  __syncthreads();
  v = warps[0];
  __syncthreads();  // warps[] is reused by the next row
  return v;
}

template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    softmax_cross_entropy(T* __restrict__ logits, const int64_t* __restrict__ targets,
                          float* __restrict__ row_loss, int64_t rows, int64_t vocab,
                          int64_t ignore_index, bool write_grad) {
  __shared__ float target_logit;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* l = logits + row * vocab;
    const int64_t t = targets[row];
    const bool ignored = t == ignore_index;
    const bool valid = ignored || (t >= 0 && t < vocab);
    if (threadIdx.x == 0) target_logit = valid && !ignored ? to_float(l[t]) : 0.0f;
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t j = int64_t(threadIdx.x) * N; j < vocab; j += int64_t(kThreads) * N) {
      float v[N];
      load<N>(l + j, v);
      float m = v[0];
#pragma unroll
      for (int k = 1; k < N; ++k) m = fmaxf(m, v[k]);
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < N; ++k) s += expf(v[k] - m);
      acc = combine(acc, MaxSum{m, s});
    }
    const MaxSum total = block_max_sum(acc);  // its barriers order target_logit's write too
    const float lse = total.max + logf(total.sum);
    if (threadIdx.x == 0)
      row_loss[row] = !valid ? NAN : ignored ? 0.0f : lse - target_logit;
    if (!write_grad) continue;
    for (int64_t j = int64_t(threadIdx.x) * N; j < vocab; j += int64_t(kThreads) * N) {
      float v[N];
      load<N>(l + j, v);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        v[k] = ignored ? 0.0f : expf(v[k] - lse);
        if (j + k == t) v[k] -= 1.0f;
      }
      store<N>(l + j, v);
    }
  }
}

template <class T> cudaError_t run(const SoftmaxCrossEntropy& a) {
  if (a.rows == 0) return cudaSuccess;
  auto* logits = static_cast<T*>(a.logits);
  constexpr int n = 16 / sizeof(T);
  const int64_t cap = int64_t(a.multiprocessors > 0 ? a.multiprocessors : 132) * 4;
  const unsigned blocks = unsigned(a.rows < cap ? a.rows : cap);
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (a.vocab % n == 0 && aligned(logits, 16))
    softmax_cross_entropy<T, n><<<blocks, kThreads, 0, stream>>>(
        logits, a.targets, a.row_loss, a.rows, a.vocab, a.ignore_index, a.write_grad);
  else
    softmax_cross_entropy<T, 1><<<blocks, kThreads, 0, stream>>>(
        logits, a.targets, a.row_loss, a.rows, a.vocab, a.ignore_index, a.write_grad);
  return cudaGetLastError();
}

}  // namespace

const char* launch_softmax_cross_entropy(const SoftmaxCrossEntropy& a) {
  return error_text(with_type(a.type, [&](auto* tag) {
    return run<std::remove_pointer_t<decltype(tag)>>(a);
  }));
}

}  // namespace strata::nn::cuda
