// Strict JSON reading for config files. nlohmann's plain parse silently keeps the last of two
// duplicate keys and builds arbitrarily deep values; this reader (a SAX handler) rejects
// duplicates at any depth naming their path, stops at a nesting limit instead of exhausting the
// stack, rejects numbers that do not fit a double (1e400), and reports line:column. It also
// records where each key was written, so later errors can point at it.
#pragma once

#include <cstddef>
#include <string>
#include <unordered_map>

#include <nlohmann/json.hpp>

namespace strata {

struct TextPos {
  size_t line = 0;    // 1-based; 0 = unknown
  size_t column = 0;  // 1-based
};

// JSON path ("zero_optimization.offload_param.device", "optimizer.params.betas[1]") -> where its
// key (or array element) was written.
using PositionMap = std::unordered_map<std::string, TextPos>;

struct ReadJson {
  nlohmann::json value;
  PositionMap positions;
};

constexpr int kMaxJsonDepth = 64;

// Throws ConfigError (one or more problems, each "source:line:col: ...") on any defect.
// Comments (// and /* */) are accepted, as DeepSpeed's hjson reader accepts them.
ReadJson read_json_strict(const std::string& text, const std::string& source,
                          int max_depth = kMaxJsonDepth);

}  // namespace strata
