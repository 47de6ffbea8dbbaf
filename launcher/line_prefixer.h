// Turns a child's byte stream into whole lines with a prefix ("[rank 3] "), so lines from many
// ranks interleave only at line boundaries. A partial last line is completed by flush().
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace strata::launcher {

class LinePrefixer {
 public:
  explicit LinePrefixer(std::string prefix) : prefix_(std::move(prefix)) {}
  // Lines that start with `unmarked_start` keep no prefix (a remote node's: its ranks' lines and
  // its launcher's messages carry their own; ssh's and the remote shell's get the host).
  LinePrefixer(std::string prefix, std::vector<std::string> unmarked_start)
      : prefix_(std::move(prefix)), unmarked_(std::move(unmarked_start)) {}

  // Returns the complete lines in `data` (with what was held back before), each prefixed.
  // A line longer than kMaxLine is cut there, so a rank that never writes '\n' cannot grow the
  // buffer without bound.
  std::string feed(std::string_view data);
  // The held-back partial line, prefixed and ended with '\n'; empty if none.
  std::string flush();

  static constexpr size_t kMaxLine = 64 * 1024;

 private:
  const std::string& prefix_for(std::string_view line) const;

  std::string prefix_;
  std::vector<std::string> unmarked_;
  std::string pending_;
};

}  // namespace strata::launcher
