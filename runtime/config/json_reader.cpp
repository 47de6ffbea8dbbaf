#include "runtime/config/json_reader.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "runtime/config/config.h"

namespace strata {
namespace {

using json = nlohmann::json;

// Where the lexer is now. The iterator below advances it, so the SAX callbacks can ask.
struct Cursor {
  size_t line = 1;
  size_t column = 1;
};

class CountingIter {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  CountingIter(const char* p, Cursor* cursor) : p_(p), cursor_(cursor) {}
  reference operator*() const { return *p_; }
  CountingIter& operator++() {
    if (*p_ == '\n') {
      ++cursor_->line;
      cursor_->column = 1;
    } else {
      ++cursor_->column;
    }
    ++p_;
    return *this;
  }
  CountingIter operator++(int) {
    CountingIter old = *this;
    ++*this;
    return old;
  }
  bool operator==(const CountingIter& o) const { return p_ == o.p_; }
  bool operator!=(const CountingIter& o) const { return p_ != o.p_; }

 private:
  const char* p_;
  Cursor* cursor_;
};

// Control characters and non-ASCII bytes of garbage input stay out of messages.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  if (out.size() > 200) out = out.substr(0, 200) + "...";
  return out;
}

// Builds the DOM like nlohmann's json_sax_dom_parser, plus duplicate keys, depth, positions.
class StrictHandler : public nlohmann::json_sax<json> {
 public:
  StrictHandler(const std::string& source, const Cursor& cursor, int max_depth)
      : source_(source), cursor_(cursor), max_depth_(max_depth) {}

  bool null() override { return value(json()); }
  bool boolean(bool b) override { return value(json(b)); }
  bool number_integer(number_integer_t v) override { return value(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return value(json(v)); }
  bool number_float(number_float_t v, const string_t& text) override {
    if (!std::isfinite(v)) {
      problem(fmt::format("{}: the number {} is too large (beyond a double's range)",
                          shown(next_path()), printable(text)));
      return value(json());
    }
    return value(json(v));
  }
  bool string(string_t& s) override { return value(json(std::move(s))); }
  bool binary(binary_t&) override { return value(json()); }  // not produced by JSON text

  bool start_object(std::size_t) override { return open(json::object()); }
  bool start_array(std::size_t) override { return open(json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

  bool key(string_t& k) override {
    Frame& top = frames_.back();
    top.key_path = top.path.empty() ? k : top.path + "." + k;
    TextPos pos{cursor_.line, cursor_.column > k.size() + 2 ? cursor_.column - k.size() - 2 : 1};
    if (top.node->contains(k)) {
      const TextPos first = positions_[top.key_path];
      problem(fmt::format("duplicate key '{}' (first written at line {}); keep one", top.key_path,
                          first.line),
              pos);
    } else if (positions_.size() < kMaxPositions) {
      positions_[top.key_path] = pos;
    }
    // A duplicate's value overwrites the first: the file is rejected anyway.
    slot_ = &(*top.node)[k];
    return true;
  }

  bool parse_error(std::size_t, const std::string& last_token,
                   const nlohmann::detail::exception& ex) override {
    if (ex.id == 406) {  // nlohmann's lexer: "number overflow" (1e400 does not fit a double)
      problem(fmt::format("{}: the number {} is too large (beyond a double's range)", shown(next_path()),
                          printable(last_token)));
    } else {
      syntax_error(ex.what(), last_token);
    }
    return false;
  }

  std::vector<std::string>& problems() { return problems_; }
  json& root() { return root_; }
  PositionMap& positions() { return positions_; }

 private:
  // Positions only serve messages; a huge hostile file need not cost a map entry per key.
  static constexpr size_t kMaxPositions = 100000;

  struct Frame {
    json* node;
    std::string path;
    std::string key_path;  // objects: the path of the value being read
    size_t index = 0;      // arrays: the index of the next element
  };

  std::string next_path() const {
    if (frames_.empty()) return "";
    const Frame& top = frames_.back();
    if (top.node->is_array()) return fmt::format("{}[{}]", top.path, top.index);
    return top.key_path;
  }
  static std::string shown(const std::string& path) { return path.empty() ? "(top level)" : path; }

  json* place(json&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& top = frames_.back();
    if (top.node->is_array()) {
      if (positions_.size() < kMaxPositions)
        positions_.emplace(fmt::format("{}[{}]", top.path, top.index), TextPos{cursor_.line, cursor_.column});
      ++top.index;
      top.node->push_back(std::move(v));
      return &top.node->back();
    }
    *slot_ = std::move(v);
    return slot_;
  }
  bool value(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& container) {
    const std::string path = next_path();
    if (static_cast<int>(frames_.size()) >= max_depth_) {
      problem(fmt::format("{}: nesting deeper than {} levels; a config is a few levels deep",
                          shown(path), max_depth_));
      return false;  // stops the parse: no deeper recursion, no huge DOM
    }
    json* node = place(std::move(container));
    frames_.push_back(Frame{node, path, "", 0});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return true;
  }

  void problem(const std::string& text, TextPos pos = {}) {
    if (pos.line == 0) pos = TextPos{cursor_.line, cursor_.column};
    problems_.push_back(fmt::format("{}:{}:{}: {}", source_, pos.line, pos.column, text));
  }

  // nlohmann: "[json.exception.parse_error.101] parse error at line 3, column 5: <what>".
  void syntax_error(const std::string& what, const std::string& last_token) {
    std::string detail = what;
    size_t line = cursor_.line, column = cursor_.column;
    const std::string marker = "parse error at line ";
    if (const size_t at = detail.find(marker); at != std::string::npos) {
      size_t l = 0, c = 0;
      if (std::sscanf(detail.c_str() + at + marker.size(), "%zu, column %zu", &l, &c) == 2) {
        line = l;
        column = c;
      }
      if (const size_t colon = detail.find(": ", at); colon != std::string::npos) {
        detail = detail.substr(colon + 2);
      }
    }
    // The letters the lexer stopped in: "N" of NaN, "I" of Infinity, "na" of nan, ...
    size_t word = last_token.size();
    while (word > 0 && std::isalpha(static_cast<unsigned char>(last_token[word - 1]))) --word;
    std::string letters = last_token.substr(word);
    for (char& c : letters) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string hint;
    if (!letters.empty() && (std::string("nan").rfind(letters, 0) == 0 || std::string("infinity").rfind(letters, 0) == 0)) {
      hint = "; NaN and Infinity are not JSON numbers: write a finite number";
    } else if (last_token.find('\'') != std::string::npos) {
      hint = "; JSON strings and keys use double quotes";
    }
    problems_.push_back(
        fmt::format("{}:{}:{}: invalid JSON: {}{}", source_, line, column, printable(detail), hint));
  }

  const std::string& source_;
  const Cursor& cursor_;
  const int max_depth_;
  json root_;
  json* slot_ = nullptr;
  std::vector<Frame> frames_;
  std::vector<std::string> problems_;
  PositionMap positions_;
};

}  // namespace

ReadJson read_json_strict(const std::string& text, const std::string& source, int max_depth) {
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw ConfigError(source, {fmt::format("{}: the file is empty; a config is a JSON object {{ ... }}",
                                           source)});
  }
  Cursor cursor;
  StrictHandler handler(source, cursor, max_depth);
  const char* begin = text.data();
  CountingIter first(begin, &cursor), last(begin + text.size(), &cursor);
  json::sax_parse(first, last, &handler, nlohmann::json::input_format_t::json, /*strict=*/true,
                  /*ignore_comments=*/true);
  if (!handler.problems().empty()) throw ConfigError(source, std::move(handler.problems()));
  return ReadJson{std::move(handler.root()), std::move(handler.positions())};
}

}  // namespace strata
