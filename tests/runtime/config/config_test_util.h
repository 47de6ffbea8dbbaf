// Helpers for the config tests: load a text and get the Config or the error message.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "runtime/config/config.h"

#define EXPECT_CONTAINS(haystack, needle)                                             \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos)                    \
      << "expected to find: " << (needle) << "\nin:\n"                                \
      << (haystack)

namespace strata::test {

// The message of the ConfigError that loading `text` throws (the test fails if it loads).
inline std::string load_error(const std::string& text, const LoadOptions& options = {}) {
  try {
    parse_config_text(text, "test.json", options);
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than ConfigError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "loaded, but should have been rejected:\n" << text;
  return "";
}

inline Config load(const std::string& text, const LoadOptions& options = {}) {
  try {
    return parse_config_text(text, "test.json", options);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rejected, but should have loaded:\n" << e.what() << "\n" << text;
    return Config{};
  }
}

// A valid config: a batch size plus `members` (JSON object members, without braces).
inline std::string with(const std::string& members) {
  return members.empty() ? R"({"train_batch_size": 8})" : R"({"train_batch_size": 8, )" + members + "}";
}

inline std::string joined_warnings(const Config& c) {
  std::string s;
  for (const auto& w : c.warnings) s += w + "\n";
  return s;
}

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::string repo_path(const std::string& rel) { return std::string(STRATA_SOURCE_DIR) + "/" + rel; }

}  // namespace strata::test
