// strata::Error: the one exception type for bad input. It says what was wrong, where (file, JSON
// path, rank) and what to do; it never replaces a crash with silence.
#pragma once

#include <stdexcept>
#include <string>

namespace strata {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace strata
