// The strict reader on its own: duplicates, depth, numbers, positions, garbage.
#include <random>

#include "runtime/config/json_reader.h"
#include "tests/runtime/config/config_test_util.h"

namespace strata::test {
namespace {

std::string read_error(const std::string& text) {
  try {
    read_json_strict(text, "r.json");
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "read, but should not have: " << text.substr(0, 200);
  return "";
}

TEST(JsonReader, ReadsValuesAndRecordsKeyPositions) {
  const ReadJson r = read_json_strict("{\n  \"a\": {\"b\": [1, {\"c\": true}]},\n  \"d\": 2.5\n}", "r.json");
  EXPECT_EQ(r.value.at("a").at("b").at(1).at("c"), true);
  EXPECT_DOUBLE_EQ(r.value.at("d").get<double>(), 2.5);
  ASSERT_TRUE(r.positions.count("a.b[1].c"));
  EXPECT_EQ(r.positions.at("a").line, 2u);
  EXPECT_EQ(r.positions.at("a").column, 3u);
  EXPECT_EQ(r.positions.at("d").line, 3u);
}

TEST(JsonReader, DuplicatesAtAnyDepthNameTheirPath) {
  EXPECT_CONTAINS(read_error(R"({"a": 1, "a": 1})"), "duplicate key 'a'");
  EXPECT_CONTAINS(read_error(R"({"a": {"b": {"c": 1, "c": 2}}})"), "duplicate key 'a.b.c'");
  EXPECT_CONTAINS(read_error(R"({"a": [[{"x": 1, "x": {}}]]})"), "duplicate key 'a[0][0].x'");
  // Every duplicate of the file, not just the first.
  const std::string both = read_error("{\"a\": 1, \"a\": 2,\n \"b\": {\"c\": 1, \"c\": 2}}");
  EXPECT_CONTAINS(both, "duplicate key 'a'");
  EXPECT_CONTAINS(both, "r.json:2:");
}

TEST(JsonReader, DepthLimitWithoutRecursion) {
  EXPECT_NO_THROW(read_json_strict(std::string(63, '[') + std::string(63, ']'), "ok"));
  EXPECT_NO_THROW(read_json_strict(std::string(64, '[') + std::string(64, ']'), "ok"));
  EXPECT_CONTAINS(read_error(std::string(65, '[') + std::string(65, ']')), "nesting deeper than 64 levels");
  EXPECT_CONTAINS(read_error(std::string(10 << 20, '[')), "nesting deeper than 64 levels");
  std::string objects;
  for (int i = 0; i < 100000; ++i) objects += "{\"k\":";
  EXPECT_CONTAINS(read_error(objects), "nesting deeper than 64 levels");
}

TEST(JsonReader, SyntaxErrorsReportLineAndColumn) {
  const std::string m = read_error("{\n  \"a\": 1,\n  \"b\": ,\n}");
  EXPECT_CONTAINS(m, "r.json:3:");
  EXPECT_CONTAINS(m, "invalid JSON");
  EXPECT_CONTAINS(read_error("{\"a\": 1,}"), "invalid JSON");  // trailing comma
  EXPECT_CONTAINS(read_error("{'a': 1}"), "double quotes");
  EXPECT_CONTAINS(read_error("{\"a\": 1} x"), "invalid JSON");  // trailing garbage
  EXPECT_CONTAINS(read_error("{\"a\": Infinity}"), "NaN and Infinity are not JSON numbers");
  EXPECT_CONTAINS(read_error("{\"a\": -Infinity}"), "invalid JSON");
}

TEST(JsonReader, NumbersBeyondADouble) {
  EXPECT_CONTAINS(read_error(R"({"a": 1e400})"), "a: the number 1e400 is too large");
  EXPECT_CONTAINS(read_error(R"({"a": [-1e999]})"), "a[0]: the number -1e999 is too large");
  EXPECT_NO_THROW(read_json_strict(R"({"a": 1e-400})", "underflow is zero"));
}

TEST(JsonReader, EmptyAndBinaryInput) {
  EXPECT_CONTAINS(read_error(""), "the file is empty");
  EXPECT_CONTAINS(read_error(" \n\t "), "the file is empty");
  EXPECT_CONTAINS(read_error(std::string("\0\0\0", 3)), "invalid JSON");
  EXPECT_CONTAINS(read_error("\x89PNG\r\n\x1a\n"), "invalid JSON");
  EXPECT_CONTAINS(read_error("{\"a\": \"\xff\xfe\"}"), "invalid JSON");  // not UTF-8
  std::mt19937 rng(7);
  std::string garbage(4096, '\0');
  for (char& c : garbage) c = static_cast<char>(rng());
  const std::string m = read_error(garbage);
  for (unsigned char c : m) EXPECT_TRUE(c == '\n' || (c >= 0x20 && c < 0x7f)) << "unprintable byte in message";
}

}  // namespace
}  // namespace strata::test
