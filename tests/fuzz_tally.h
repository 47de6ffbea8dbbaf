// One fuzzed reader's cases: each must return (where the case allows it) or throw strata::Error
// naming the file; any other exception fails the test, a crash ends it. Each case's heap peak
// (alloc_meter.h) must stay within kBytesPerFileByte times the file's size plus kSlackBytes, and
// each case must end within kCaseSeconds. The destructor prints the reader's numbers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "runtime/error.h"
#include "tests/alloc_meter.h"
#include "tests/sanitized.h"

namespace strata::test {

class FuzzTally {
 public:
  static constexpr int64_t kBytesPerFileByte = 64;  // JSON's DOM is ~10-40x its text
  static constexpr int64_t kSlackBytes = 4 << 20;   // LibTorch's zip reader, gtest, fmt
  // Under a sanitizer (scripts/test.sh builds them at -O0) code runs several times slower.
  static constexpr double kCaseSeconds = kSanitized ? 20.0 : 5.0;
  static constexpr uint64_t kRatioFrom = 64 << 10;

  explicit FuzzTally(std::string reader) : reader_(std::move(reader)) {}
  ~FuzzTally() {
    std::printf("[fuzz] %-26s %6d cases: %6d refused, %5d accepted, %d failed; heap peak %lld "
                "bytes (file of %llu bytes), largest peak/size %.1f (files >= 64 KiB); slowest "
                "%.1f ms\n",
                reader_.c_str(), cases_, refused_, accepted_, failed_,
                static_cast<long long>(peak_), static_cast<unsigned long long>(peak_file_),
                worst_ratio_, slowest_s_ * 1e3);
  }

  // f() reads a file of `file_bytes` bytes; a strata::Error must contain `names` (the file's
  // path); returning is a failure unless `may_accept`.
  template <class F>
  void run(const std::string& label, const std::string& names, uint64_t file_bytes,
           bool may_accept, F&& f) {
    if (failed_ >= 20) return;  // the first twenty say enough
    ++cases_;
    AllocMeter::reset_peak();
    const auto start = std::chrono::steady_clock::now();
    std::string problem;
    try {
      f();
      ++accepted_;
      if (!may_accept) problem = "accepted";
      if (std::getenv("STRATA_FUZZ_VERBOSE")) std::printf("[fuzz] accepted: %s\n", label.c_str());
    } catch (const Error& e) {
      ++refused_;
      if (std::string(e.what()).find(names) == std::string::npos)
        problem = "error does not name '" + names + "': " + e.what();
    } catch (const std::exception& e) {
      problem = std::string("non-strata exception: ") + e.what();
    } catch (...) {
      problem = "unknown exception";
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    slowest_s_ = std::max(slowest_s_, seconds);
    if (seconds > kCaseSeconds) problem += " (took " + std::to_string(seconds) + " s)";
    if (AllocMeter::active()) {
      const int64_t peak = AllocMeter::peak_since_reset();
      const int64_t bound = kBytesPerFileByte * int64_t(file_bytes) + kSlackBytes;
      if (peak > peak_) {
        peak_ = peak;
        peak_file_ = file_bytes;
      }
      if (file_bytes >= kRatioFrom)  // below, the constant slack is all there is to see
        worst_ratio_ = std::max(worst_ratio_, double(peak) / double(file_bytes));
      if (peak > bound)
        problem += " (held " + std::to_string(peak) + " bytes for a file of " +
                   std::to_string(file_bytes) + ")";
    }
    if (!problem.empty()) {
      ++failed_;
      ADD_FAILURE() << reader_ << ", " << label << ": " << problem;
    }
  }

  int cases() const { return cases_; }
  int refused() const { return refused_; }
  int accepted() const { return accepted_; }

 private:
  std::string reader_;
  int cases_ = 0, refused_ = 0, accepted_ = 0, failed_ = 0;
  int64_t peak_ = 0;
  uint64_t peak_file_ = 0;
  double worst_ratio_ = 0, slowest_s_ = 0;
};

}  // namespace strata::test
