#include "offload/cpu_adam.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "offload/worker_pool.h"
#include "runtime/error.h"

// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_* placeholders).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace strata::offload {
namespace {

using optim::AdamScalars;
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int kNoOut = -1;

Isa hardware_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return isa;
}

Isa chosen_isa() {
  Isa isa = hardware_isa();
  if (const char* env = std::getenv("STRATA_CPU_ADAM_ISA")) {
    const std::string want = env;
    const Isa asked = want == "scalar" ? Isa::kScalar : want == "avx2" ? Isa::kAvx2 : isa;
    if (int(asked) < int(isa)) isa = asked;
  }
  return isa;
}

}  // namespace

std::vector<ThreadRange> split_for_threads(int64_t n, int threads, int64_t min_per_thread) {
  if (n <= 0) return {};
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  threads = int(std::min<int64_t>(threads, std::max<int64_t>(1, n / min_per_thread)));
  // Round ceil(n / threads) up to a cache line: rounding n / threads (floor) up fell short by
  // n % threads elements whenever n / threads was already a multiple of 64.
  const int64_t per = ((n + threads - 1) / threads + 63) / 64 * 64;
  std::vector<ThreadRange> ranges;
  for (int64_t begin = 0; begin < n; begin += per) ranges.push_back({begin, std::min(n, begin + per)});
  return ranges;
}

namespace {

// Runs fn(thread, begin, end) over split_for_threads' ranges, the first on the calling thread,
// the others on the standing pool's threads.
template <class Fn>
void split_over_threads(int64_t n, int threads, int64_t min_per_thread, const Fn& fn) {
  const auto ranges = split_for_threads(n, threads, min_per_thread);
  WorkerPool::shared().run(int(ranges.size()), [&](int t) {
    fn(t, ranges[size_t(t)].begin, ranges[size_t(t)].end);
  });
}

// --- scalar conversions (IEEE round to nearest even; NaN stays NaN) ---------------------------

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  int32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu, x;
  if (exp == 0x1f) {
    x = sign | 0x7f800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal: normalise
      exp = 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      x = sign | (uint32_t(exp + 127 - 15) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else {
    x = sign | (uint32_t(exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x7fffffu;
  const int32_t exp = int32_t((x >> 23) & 0xff);
  if (exp == 0xff) return uint16_t(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int32_t e = exp - 127 + 15;
  if (e >= 0x1f) return uint16_t(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return uint16_t(sign);
    mant |= 0x800000u;
    const uint32_t shift = uint32_t(14 - e);
    uint32_t h = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = sign | (uint32_t(e) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry rounds up the exponent
  return uint16_t(h);
}

template <int T>
inline float load_scalar(const void* g, int64_t i) {
  if constexpr (T == int(Float::kF32)) return static_cast<const float*>(g)[i];
  if constexpr (T == int(Float::kBF16)) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <int T>
inline void store_scalar(void* out, int64_t i, float value) {
  if constexpr (T == int(Float::kF32)) static_cast<float*>(out)[i] = value;
  if constexpr (T == int(Float::kBF16)) static_cast<uint16_t*>(out)[i] = f32_to_bf16(value);
  if constexpr (T == int(Float::kF16)) static_cast<uint16_t*>(out)[i] = f32_to_f16(value);
}

// The step reads p, m, v from `in` and writes them to `out` (the same arrays for a step in place;
// apart for the speculative step, zero/speculative_step.h, which keeps the old state).
struct Arrays {
  const float *pi, *mi, *vi;
  float *po, *mo, *vo;
};

template <int G, int O>
void scalar_range(const Arrays& a, const void* g, void* out, int64_t begin, int64_t end,
                  const AdamScalars& s) {
  for (int64_t i = begin; i < end; ++i) {
    float p = a.pi[i], m = a.mi[i], v = a.vi[i];
    optim::adam_update(p, m, v, load_scalar<G>(g, i), s);
    a.po[i] = p, a.mo[i] = m, a.vo[i] = v;
    if constexpr (O != kNoOut) store_scalar<O>(out, i, p);
  }
}

// The vector paths' last elements, one at a time with the vector lanes' operations (fused
// multiply-adds where they use them): an element's result does not depend on where a range
// ends, so a partition stepped in other pieces (a bucket's chunk at a time) gets the same bits.
template <int G, int O>
__attribute__((target("fma"))) void fma_range(const Arrays& a, const void* g, void* out,
                                              int64_t begin, int64_t end, const AdamScalars& s) {
  const bool decays = s.weight_decay != 0.f;
  for (int64_t i = begin; i < end; ++i) {
    float gv = load_scalar<G>(g, i) * s.grad_scale;
    float p = a.pi[i], m = a.mi[i], v = a.vi[i];
    if (decays) {
      if (s.adam_w_mode)
        p = p * s.decay_factor;
      else
        gv = __builtin_fmaf(s.weight_decay, p, gv);
    }
    m = __builtin_fmaf(m, s.beta1, gv * s.one_minus_beta1);
    v = __builtin_fmaf(v, s.beta2, s.one_minus_beta2 * (gv * gv));
    const float denom = __builtin_sqrtf(v) / s.sqrt_c2 + s.eps;
    p = __builtin_fmaf(-s.step_size, m / denom, p);
    a.po[i] = p, a.mo[i] = m, a.vo[i] = v;
    if constexpr (O != kNoOut) store_scalar<O>(out, i, p);
  }
}

// --- AVX2 + FMA: 8 elements ---------------------------------------------------------------------

template <int G, int O>
__attribute__((target("avx2,fma,f16c"))) void avx2_range(const Arrays& a, const void* g,
                                                          void* out, int64_t begin, int64_t end,
                                                          const AdamScalars& s) {
  const __m256 gs = _mm256_set1_ps(s.grad_scale), b1 = _mm256_set1_ps(s.beta1),
               omb1 = _mm256_set1_ps(s.one_minus_beta1), b2 = _mm256_set1_ps(s.beta2),
               omb2 = _mm256_set1_ps(s.one_minus_beta2), eps = _mm256_set1_ps(s.eps),
               sqc2 = _mm256_set1_ps(s.sqrt_c2), neg_step = _mm256_set1_ps(-s.step_size),
               decay = _mm256_set1_ps(s.decay_factor), wd = _mm256_set1_ps(s.weight_decay);
  const bool decays = s.weight_decay != 0.f, adam_w = s.adam_w_mode;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 gv;
    if constexpr (G == int(Float::kF32)) {
      gv = _mm256_loadu_ps(static_cast<const float*>(g) + i);
    } else {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
      if constexpr (G == int(Float::kBF16))
        gv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      else
        gv = _mm256_cvtph_ps(h);
    }
    gv = _mm256_mul_ps(gv, gs);
    __m256 pv = _mm256_loadu_ps(a.pi + i), mv = _mm256_loadu_ps(a.mi + i), vv = _mm256_loadu_ps(a.vi + i);
    if (decays) {
      if (adam_w)
        pv = _mm256_mul_ps(pv, decay);
      else
        gv = _mm256_fmadd_ps(wd, pv, gv);
    }
    mv = _mm256_fmadd_ps(mv, b1, _mm256_mul_ps(gv, omb1));
    vv = _mm256_fmadd_ps(vv, b2, _mm256_mul_ps(omb2, _mm256_mul_ps(gv, gv)));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), sqc2), eps);
    pv = _mm256_fmadd_ps(neg_step, _mm256_div_ps(mv, denom), pv);
    _mm256_storeu_ps(a.po + i, pv);
    _mm256_storeu_ps(a.mo + i, mv);
    _mm256_storeu_ps(a.vo + i, vv);
    if constexpr (O == int(Float::kF32)) {
      _mm256_storeu_ps(static_cast<float*>(out) + i, pv);
    } else if constexpr (O == int(Float::kBF16)) {
      __m256i u = _mm256_castps_si256(pv);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
      const __m256 nan = _mm256_cmp_ps(pv, pv, _CMP_UNORD_Q);
      u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                       _mm256_castsi256_si128(packed));
    } else if constexpr (O == int(Float::kF16)) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                       _mm256_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  fma_range<G, O>(a, g, out, i, end, s);
}

// --- AVX-512: 16 elements -----------------------------------------------------------------------

template <int G, int O>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void avx512_range(
    const Arrays& a, const void* g, void* out, int64_t begin, int64_t end, const AdamScalars& s) {
  const __m512 gs = _mm512_set1_ps(s.grad_scale), b1 = _mm512_set1_ps(s.beta1),
               omb1 = _mm512_set1_ps(s.one_minus_beta1), b2 = _mm512_set1_ps(s.beta2),
               omb2 = _mm512_set1_ps(s.one_minus_beta2), eps = _mm512_set1_ps(s.eps),
               sqc2 = _mm512_set1_ps(s.sqrt_c2), neg_step = _mm512_set1_ps(-s.step_size),
               decay = _mm512_set1_ps(s.decay_factor), wd = _mm512_set1_ps(s.weight_decay);
  const bool decays = s.weight_decay != 0.f, adam_w = s.adam_w_mode;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 gv;
    if constexpr (G == int(Float::kF32)) {
      gv = _mm512_loadu_ps(static_cast<const float*>(g) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
      if constexpr (G == int(Float::kBF16))
        gv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      else
        gv = _mm512_cvtph_ps(h);
    }
    gv = _mm512_mul_ps(gv, gs);
    __m512 pv = _mm512_loadu_ps(a.pi + i), mv = _mm512_loadu_ps(a.mi + i), vv = _mm512_loadu_ps(a.vi + i);
    if (decays) {
      if (adam_w)
        pv = _mm512_mul_ps(pv, decay);
      else
        gv = _mm512_fmadd_ps(wd, pv, gv);
    }
    mv = _mm512_fmadd_ps(mv, b1, _mm512_mul_ps(gv, omb1));
    vv = _mm512_fmadd_ps(vv, b2, _mm512_mul_ps(omb2, _mm512_mul_ps(gv, gv)));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), sqc2), eps);
    pv = _mm512_fmadd_ps(neg_step, _mm512_div_ps(mv, denom), pv);
    _mm512_storeu_ps(a.po + i, pv);
    _mm512_storeu_ps(a.mo + i, mv);
    _mm512_storeu_ps(a.vo + i, vv);
    if constexpr (O == int(Float::kF32)) {
      _mm512_storeu_ps(static_cast<float*>(out) + i, pv);
    } else if constexpr (O == int(Float::kBF16)) {
      __m512i u = _mm512_castps_si512(pv);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(pv, pv, _CMP_UNORD_Q);
      u = _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(0x7fc0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                          _mm512_cvtepi32_epi16(u));
    } else if constexpr (O == int(Float::kF16)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                          _mm512_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  fma_range<G, O>(a, g, out, i, end, s);
}

using RangeFn = void (*)(const Arrays&, const void*, void*, int64_t, int64_t, const AdamScalars&);

template <int G, int O>
RangeFn pick(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return &avx512_range<G, O>;
    case Isa::kAvx2: return &avx2_range<G, O>;
    default: return &scalar_range<G, O>;
  }
}

template <int G>
RangeFn pick_out(Isa isa, const void* out, Float o) {
  if (out == nullptr) return pick<G, kNoOut>(isa);
  switch (o) {
    case Float::kF32: return pick<G, int(Float::kF32)>(isa);
    case Float::kBF16: return pick<G, int(Float::kBF16)>(isa);
    default: return pick<G, int(Float::kF16)>(isa);
  }
}

}  // namespace

const char* cpu_adam_isa() {
  switch (chosen_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

int64_t cpu_adam_grain() {
  static const int64_t grain = [] {
    constexpr int64_t kDefault = int64_t(1) << 16;
    const char* env = std::getenv("STRATA_CPU_ADAM_GRAIN");
    if (env == nullptr || *env == '\0') return kDefault;
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (*end != '\0' || v < 1)
      throw Error(fmt::format("STRATA_CPU_ADAM_GRAIN='{}': give a positive number of elements "
                              "per thread (default {}), or unset it", env, kDefault));
    return int64_t(v);
  }();
  return grain;
}

void cpu_adam_step(float* p, float* m, float* v, const void* g, Float g_type, void* out,
                   Float out_type, int64_t n, const optim::AdamScalars& s, int threads) {
  cpu_adam_step_to({p, m, v}, {p, m, v}, g, g_type, out, out_type, n, s, threads);
}

void cpu_adam_step_to(const AdamArrays& in, const AdamArrays& to, const void* g, Float g_type,
                      void* out, Float out_type, int64_t n, const optim::AdamScalars& s,
                      int threads) {
  if (n <= 0) return;
  const Arrays a{in.p, in.m, in.v, to.p, to.m, to.v};
  const Isa isa = chosen_isa();
  RangeFn fn = g_type == Float::kF32    ? pick_out<int(Float::kF32)>(isa, out, out_type)
               : g_type == Float::kBF16 ? pick_out<int(Float::kBF16)>(isa, out, out_type)
                                        : pick_out<int(Float::kF16)>(isa, out, out_type);
  split_over_threads(n, threads, cpu_adam_grain(), [&](int, int64_t begin, int64_t end) {
    fn(a, g, out, begin, end, s);
  });
}

namespace {

template <class Load>
double sum_squares_range(int64_t begin, int64_t end, Load load) {
  constexpr int kLanes = 16;
  constexpr int64_t kFlush = 4096;  // fp32 lanes stay exact enough over this many elements
  double total = 0;
  for (int64_t lo = begin; lo < end; lo += kFlush) {
    const int64_t hi = std::min(end, lo + kFlush);
    float acc[kLanes] = {};
    int64_t i = lo;
    for (; i + kLanes <= hi; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float x = load(i + j);
        acc[j] += x * x;
      }
    for (; i < hi; ++i) {
      const float x = load(i);
      acc[0] += x * x;
    }
    for (float a : acc) total += a;
  }
  return total;
}

double sum_squares_range(const void* g, Float type, int64_t begin, int64_t end) {
  if (type == Float::kF32) {
    const float* f = static_cast<const float*>(g);
    return sum_squares_range(begin, end, [f](int64_t i) { return f[i]; });
  }
  const uint16_t* h = static_cast<const uint16_t*>(g);
  if (type == Float::kBF16)
    return sum_squares_range(begin, end, [h](int64_t i) { return bf16_to_f32(h[i]); });
  return sum_squares_range(begin, end, [h](int64_t i) { return f16_to_f32(h[i]); });
}

}  // namespace

double cpu_sum_squares(const void* g, Float type, int64_t n, int threads) {
  if (n <= 0) return 0;
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<double> partial(size_t(threads), 0.0);  // split_over_threads uses at most these
  split_over_threads(n, threads, int64_t(1) << 18, [&](int t, int64_t begin, int64_t end) {
    partial[size_t(t)] = sum_squares_range(g, type, begin, end);
  });
  double total = 0;
  for (double x : partial) total += x;
  return total;
}

}  // namespace strata::offload
