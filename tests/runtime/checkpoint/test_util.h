// Small helpers the checkpoint suites share.
#pragma once

#include <cstring>
#include <string>

#include <torch/torch.h>

#include "runtime/error.h"

namespace strata::test {

// The message of the strata::Error that f() throws, or "(no error)".
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const strata::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Equal bit for bit (NaN-safe, and the same for every dtype).
inline bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ca = a.contiguous(), cb = b.contiguous();
  const size_t bytes = ca.numel() * ca.element_size();  // empty: data_ptr() may be null
  return bytes == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), bytes) == 0;
}

}  // namespace strata::test
