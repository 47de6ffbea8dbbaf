// The CPU side of a rank: which BLAS LibTorch's fp32 matrix products run on, and how many threads
// each rank may use. Several ranks on one machine each get their share of the cores for
// LibTorch's intra-op pool and OpenBLAS's own pool (as torchrun sets OMP_NUM_THREADS), unless the
// user chose (OMP_NUM_THREADS, or a count set before).
#pragma once

#include <string>

namespace strata {

// The library that provides sgemm_ in this process and what it is, e.g.
// "OpenBLAS 0.3.21 (/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3)" or
// "reference BLAS (netlib) (/usr/lib/x86_64-linux-gnu/blas/libblas.so.3): fp32 matrix products
// are slow; install libopenblas0-pthread".
std::string describe_cpu_blas();

// Whether this CPU has the AVX-512 subsets (BW, VL, DQ) that oneDNN's bf16 matrix products need.
// Without them LibTorch multiplies bf16 in a reference loop: 1.13's took 30x the fp32 time.
bool cpu_has_onednn_bf16();

struct CpuThreads {
  int threads = 0;          // per rank
  int cores = 0;            // this process may run on
  bool user_chosen = false;  // OMP_NUM_THREADS was set: left alone
};

// Once per process: when `local_ranks` > 1 and OMP_NUM_THREADS is unset, gives LibTorch and
// OpenBLAS max(1, cores / local_ranks) threads each. Returns what holds afterwards.
CpuThreads configure_cpu_threads(int local_ranks);

}  // namespace strata
