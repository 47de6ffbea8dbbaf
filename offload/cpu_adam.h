// The CPU Adam/AdamW step of the host tier (ZeRO-Offload's optimizer, and the engine's fused CPU
// step): one pass over memory per tile, each element read and written once (p, g, m, v in; p,
// m, v and the 16-bit copy out), SIMD chosen at run time (AVX-512, AVX2 + FMA, or scalar),
// split over threads. It computes adam_math.h's adam_update() (the element the CUDA kernel and
// the per-tensor reference compute), so results equal LibTorch's AdamW to float tolerance;
// fused multiply-adds round differently from the scalar path in the last bit.
// Torch-free: plain pointers, so that it serves pinned host buffers and swapped-in sub-groups.
#pragma once

#include <cstdint>
#include <vector>

#include "offload/adam_math.h"

namespace strata::offload {

enum class Float { kF32, kBF16, kF16 };

// The instruction set the step uses on this CPU: "avx512", "avx2" or "scalar". The environment
// variable STRATA_CPU_ADAM_ISA (same names) lowers it (tests compare the paths).
const char* cpu_adam_isa();

// p, m, v: fp32, n elements. g: n elements of `g_type`, read times s.grad_scale. out (may be
// null): n elements of `out_type` that receive the new p. `threads` <= 0: as many as the CPU has.
// Each thread takes at least cpu_adam_grain() elements (below that a thread costs more than it
// saves).
void cpu_adam_step(float* p, float* m, float* v, const void* g, Float g_type, void* out,
                   Float out_type, int64_t n, const optim::AdamScalars& s, int threads);

// The same step reading p, m, v from `in` and writing the new values to `to` (arrays of n fp32
// each; `to` may be `in`): the speculative step keeps the state it started from
// (zero/speculative_step.h). An element's result does not depend on n or the threads: the vector
// paths' last elements take the vector lanes' operations, so a partition stepped in other pieces
// gets the same bits.
struct AdamArrays {
  float *p, *m, *v;
};
void cpu_adam_step_to(const AdamArrays& in, const AdamArrays& to, const void* g, Float g_type,
                      void* out, Float out_type, int64_t n, const optim::AdamScalars& s,
                      int threads);

// The least elements per thread of cpu_adam_step: 65536, or the environment variable
// STRATA_CPU_ADAM_GRAIN (a positive integer, read once), which tests lower so that small models
// take the threaded split too (the differential matrix draws it, docs/matrix.md).
int64_t cpu_adam_grain();

// The sum of squares of n elements of `type` (a gradient's, for its norm), accumulated in fp32
// lanes flushed to double every few thousand elements, split over threads as the step is: one
// read of the gradient, at memory bandwidth.
double cpu_sum_squares(const void* g, Float type, int64_t n, int threads);

// How both passes cut [0, n) over threads: contiguous ranges that cover it exactly, each but the
// last a multiple of 64 elements (cache lines), at most `threads` of them (<= 0: as many as the
// CPU has) and fewer where one would get less than `min_per_thread` elements.
struct ThreadRange {
  int64_t begin, end;
};
std::vector<ThreadRange> split_for_threads(int64_t n, int threads, int64_t min_per_thread);

}  // namespace strata::offload
