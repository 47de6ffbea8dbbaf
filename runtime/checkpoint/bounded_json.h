// JSON read from a checkpoint file (manifest, tensor-file footer, safetensors header): parsed
// only after its nesting is bounded, because nlohmann copies and prints recursively and a
// hostile "[[[[..." would overflow the stack. Torch-free, in a translation unit of its own: the
// sanitized builds compile it optimised (runtime/CMakeLists.txt), since the hostile-checkpoint
// suites parse hundreds of thousands of damaged documents there.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace strata::checkpoint {

constexpr int kMaxJsonDepth = 128;

// Throws strata::Error naming `where` when `text` nests deeper than kMaxJsonDepth (brackets
// outside strings: exact for valid JSON; invalid JSON fails to parse anyway).
void check_json_depth(const std::string& text, const std::string& where);

// json::parse (its parse_error as is) after check_json_depth.
nlohmann::json parse_json_bounded(const std::string& text, const std::string& where);

}  // namespace strata::checkpoint
