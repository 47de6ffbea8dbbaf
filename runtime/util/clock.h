// Milliseconds since a steady-clock time point: the offload's and checkpointing's timings.
#pragma once

#include <chrono>

namespace strata {

inline double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace strata
