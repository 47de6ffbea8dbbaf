// Whether this test binary is built under a sanitizer (scripts/test.sh's build-asan/, at -O0:
// code runs 3-25x slower there). The exhaustive fuzz loops then take a sample (every
// kSanitizedStride-th case), so that the sanitized suite stays inside CI's time; the Release
// build runs every case (STRATA_TEST_STAGES="build suite" scripts/test.sh).
#pragma once

#include <cstddef>

// GCC defines __SANITIZE_*__; Clang answers __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STRATA_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define STRATA_TEST_SANITIZED 1
#endif
#endif
#ifndef STRATA_TEST_SANITIZED
#define STRATA_TEST_SANITIZED 0
#endif

namespace strata::test {

inline constexpr bool kSanitized = STRATA_TEST_SANITIZED != 0;
// A prime, so that the sampled bytes fall at every offset within JSON tokens and 4-byte fields.
inline constexpr size_t kSanitizedStride = kSanitized ? 7 : 1;
// Added to a time bound that includes starting torch-linked processes: under a sanitizer each
// starts 1.5-3 s later (LibTorch's static initializers through the sanitizer's allocator), and 3
// ranks beside another test's ranks on CI's 2 cores took up to 10 s more than plain (CI at
// 13e5054: 26.5 s for a run whose ranks wait 16.5 s). Such bounds only tell an ended job from a
// hung one; the ranks time their own errors (tests/comm/scenarios.cpp).
inline constexpr double kSanitizedStartupSeconds = kSanitized ? 15.0 : 0.0;

}  // namespace strata::test
