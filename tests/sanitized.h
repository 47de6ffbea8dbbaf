// Whether this test binary is built under a sanitizer (scripts/test.sh's build-asan/ and
// build-tsan/, at -O0: code runs 3-25x slower there). The exhaustive fuzz loops then take a
// sample (every kSanitizedStride-th case), so that the sanitized suite stays inside CI's time;
// the Release build runs every case (STRATA_TEST_STAGES="build suite" scripts/test.sh).
#pragma once

#include <cstddef>

namespace strata::test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
// A prime, so that the sampled bytes fall at every offset within JSON tokens and 4-byte fields.
inline constexpr size_t kSanitizedStride = kSanitized ? 7 : 1;

}  // namespace strata::test
