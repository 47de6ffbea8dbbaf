// Rotary position embedding, rotate-half form, one thread per pair (i, i + D/2) of a row. Each
// product and the sum rounded to the element type as LibTorch's composite
// x * cos + cat(-x2, x1) * sin rounds them, so the result is the composite's bit for bit (and the
// backward the composite's autograd gradient, g * cos + cat(g2 * sin2, -(g1 * sin1))).
#include <type_traits>

#include "runtime/nn/cuda/floats.cuh"

namespace strata::nn::cuda {
namespace {

template <class T, bool kBackward>
__global__ void __launch_bounds__(256)
    rotary_kernel(const T* __restrict__ x, T* __restrict__ out, const T* __restrict__ cos,
                  const T* __restrict__ sin, int64_t B, int64_t H, int64_t S, int64_t half,
                  int64_t xb, int64_t xh, int64_t xs, int64_t ob, int64_t oh, int64_t os,
                  int64_t cos_stride, int64_t sin_stride) {
  const int64_t total = B * H * S * half;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    int64_t rest = idx / half;
    const int64_t s = rest % S;
    rest /= S;
    const int64_t h = rest % H;
    const int64_t b = rest / H;
    const T* xr = x + b * xb + h * xh + s * xs;
    T* o = out + b * ob + h * oh + s * os;
    const float x1 = to_float(xr[i]), x2 = to_float(xr[i + half]);
    const float c1 = to_float(cos[s * cos_stride + i]), c2 = to_float(cos[s * cos_stride + i + half]);
    const float s1 = to_float(sin[s * sin_stride + i]), s2 = to_float(sin[s * sin_stride + i + half]);
    float y1, y2;
    if constexpr (kBackward) {
      y1 = round_to<T>(x1 * c1) + round_to<T>(x2 * s2);
      y2 = round_to<T>(x2 * c2) - round_to<T>(x1 * s1);
    } else {
      y1 = round_to<T>(x1 * c1) + round_to<T>(-x2 * s1);
      y2 = round_to<T>(x2 * c2) + round_to<T>(x1 * s2);
    }
    o[i] = from_float<T>(y1);
    o[i + half] = from_float<T>(y2);
  }
}

template <class T> cudaError_t run(const Rotary& a) {
  const int64_t half = a.sizes[3] / 2;
  const int64_t total = a.sizes[0] * a.sizes[1] * a.sizes[2] * half;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  int64_t blocks = (total + threads - 1) / threads;
  if (blocks > 65535 * 8) blocks = 65535 * 8;  // grid-stride beyond
  auto stream = static_cast<cudaStream_t>(a.stream);
  auto* x = static_cast<const T*>(a.x);
  auto* out = static_cast<T*>(a.out);
  auto* cos = static_cast<const T*>(a.cos);
  auto* sin = static_cast<const T*>(a.sin);
  const auto& xs = a.x_strides;
  const auto& os = a.out_strides;
  if (a.backward)
    rotary_kernel<T, true><<<unsigned(blocks), threads, 0, stream>>>(
        x, out, cos, sin, a.sizes[0], a.sizes[1], a.sizes[2], half, xs[0], xs[1], xs[2], os[0],
        os[1], os[2], a.cos_stride, a.sin_stride);
  else
    rotary_kernel<T, false><<<unsigned(blocks), threads, 0, stream>>>(
        x, out, cos, sin, a.sizes[0], a.sizes[1], a.sizes[2], half, xs[0], xs[1], xs[2], os[0],
        os[1], os[2], a.cos_stride, a.sin_stride);
  return cudaGetLastError();
}

}  // namespace

const char* launch_rotary(const Rotary& a) {
  return error_text(with_type(a.type, [&](auto* tag) {
    return run<std::remove_pointer_t<decltype(tag)>>(a);
  }));
}

}  // namespace strata::nn::cuda
