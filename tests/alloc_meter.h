// The heap bytes a test binary holds, counted at malloc itself (alloc_meter.cpp replaces
// malloc and its kin and forwards to glibc's): operator new, nlohmann, std::string and
// LibTorch's CPU allocator all end there, so a fuzz case's peak is every byte it made the
// process hold. Link alloc_meter.cpp into the test binary. Under AddressSanitizer or
// ThreadSanitizer, which own malloc, it counts through the sanitizer's allocation hooks instead
// (the requested sizes: a sanitizer's redzones are not counted).
#pragma once

#include <cstdint>

namespace strata::test {

struct AllocMeter {
  static bool active();
  // Starts a measurement: the peak is reset to what is held now.
  static void reset_peak();
  // The most bytes held at once since reset_peak(), beyond what was held then.
  static int64_t peak_since_reset();
  // The bytes held now (from a base of its own: compare two readings).
  static int64_t live();
};

// The process's peak resident set (getrusage ru_maxrss), in bytes.
int64_t peak_rss_bytes();

}  // namespace strata::test
