#include "runtime/cpu_threads.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>

#include <ATen/Parallel.h>
#include <fmt/format.h>

namespace strata {
namespace {

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

// OpenBLAS keeps its own thread pool; it is reached through its C API when it is the BLAS.
void set_openblas_threads(int n) {
  using SetThreads = void (*)(int);
  if (auto* set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    set(n);
}

}  // namespace

std::string describe_cpu_blas() {
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (!sgemm || !dladdr(sgemm, &info) || !info.dli_fname)
    return "no Fortran BLAS symbol (LibTorch's own or MKL's kernels)";
  char real[PATH_MAX];
  const std::string path = realpath(info.dli_fname, real) ? real : info.dli_fname;
  using Config = char* (*)();
  if (auto* config = reinterpret_cast<Config>(dlsym(RTLD_DEFAULT, "openblas_get_config")))
    return fmt::format("OpenBLAS ({}; {})", config(), path);
  if (path.find("mkl") != std::string::npos) return fmt::format("MKL ({})", path);
  if (path.find("blis") != std::string::npos) return fmt::format("BLIS ({})", path);
  if (path.find("/blas/libblas") != std::string::npos)
    return fmt::format("reference BLAS, netlib ({}): fp32 matrix products on CPU are slow; "
                       "install libopenblas0-pthread (scripts/bootstrap.sh does)",
                       path);
  return fmt::format("BLAS in {}", path);
}

bool cpu_has_onednn_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return true;  // ARM's bf16 path is chosen by LibTorch itself; nothing known to warn of
#endif
}

CpuThreads configure_cpu_threads(int local_ranks) {
  static std::once_flag once;
  static CpuThreads result;
  std::call_once(once, [&] {
    result.cores = usable_cores();
    result.user_chosen = std::getenv("OMP_NUM_THREADS") != nullptr;
    if (!result.user_chosen && local_ranks > 1) {
      const int n = std::max(1, result.cores / local_ranks);
      at::set_num_threads(n);
      set_openblas_threads(n);
    }
    result.threads = at::get_num_threads();
  });
  return result;
}

}  // namespace strata
