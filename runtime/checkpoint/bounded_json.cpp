#include "runtime/checkpoint/bounded_json.h"

#include <cstddef>
#include <iterator>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::checkpoint {
namespace {

// A plain pointer iterator of this file's own type, so that nlohmann's lexer and parser for it
// are instantiated here only (an instantiation for std::string's iterators in an unoptimised
// caller could otherwise be the one the linker keeps).
class TextIter {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  explicit TextIter(const char* p) : p_(p) {}
  reference operator*() const { return *p_; }
  TextIter& operator++() {
    ++p_;
    return *this;
  }
  TextIter operator++(int) {
    TextIter old = *this;
    ++p_;
    return old;
  }
  bool operator==(const TextIter& o) const { return p_ == o.p_; }
  bool operator!=(const TextIter& o) const { return p_ != o.p_; }

 private:
  const char* p_;
};

}  // namespace

void check_json_depth(const std::string& text, const std::string& where) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth)
        throw Error(fmt::format("{} nests deeper than {} levels (at byte {})", where,
                                kMaxJsonDepth, i));
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

nlohmann::json parse_json_bounded(const std::string& text, const std::string& where) {
  check_json_depth(text, where);
  const char* begin = text.data();
  return nlohmann::json::parse(TextIter(begin), TextIter(begin + text.size()));
}

}  // namespace strata::checkpoint
