// Turns a child's byte stream into whole lines with a prefix ("[rank 3] "), so lines from many
// ranks interleave only at line boundaries. A partial last line is completed by flush().
#pragma once

#include <string>
#include <string_view>

namespace strata::launcher {

class LinePrefixer {
 public:
  explicit LinePrefixer(std::string prefix) : prefix_(std::move(prefix)) {}

  // Returns the complete lines in `data` (with what was held back before), each prefixed.
  // A line longer than kMaxLine is cut there, so a rank that never writes '\n' cannot grow the
  // buffer without bound.
  std::string feed(std::string_view data);
  // The held-back partial line, prefixed and ended with '\n'; empty if none.
  std::string flush();

  static constexpr size_t kMaxLine = 64 * 1024;

 private:
  std::string prefix_;
  std::string pending_;
};

}  // namespace strata::launcher
