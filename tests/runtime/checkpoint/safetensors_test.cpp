// safetensors: round trips, the byte layout read back by hand, a file assembled by hand read by
// Strata, and the reader's checks. (read_safetensors.py checks both directions against the
// reference Python package.)
#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/error.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/runtime/checkpoint/test_util.h"

namespace ckpt = strata::checkpoint;
namespace fs = std::filesystem;
using strata::test::ScratchDir;
using strata::test::error_of;
using strata::test::same_bits;
using strata::test::write_bytes;

namespace {

std::string le64(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(char((v >> (8 * i)) & 0xff));
  return s;
}

template <class T>
std::string raw(std::initializer_list<T> values) {
  std::string s(values.size() * sizeof(T), '\0');
  std::memcpy(s.data(), values.begin(), s.size());
  return s;
}


}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  ScratchDir dir;
  const std::string path = (dir.path() / "model.safetensors").string();
  torch::manual_seed(5);
  const ckpt::NamedTensors tensors = {
      {"bool", torch::rand({3}) > 0.5},
      {"u8", torch::randint(0, 256, {4}, torch::kByte)},
      {"i8", torch::randint(-128, 128, {4}, torch::kChar)},
      {"i16", torch::randint(-999, 999, {2, 2}, torch::kShort)},
      {"i32", torch::randint(-99999, 99999, {3}, torch::kInt)},
      {"i64", torch::tensor({int64_t(1) << 50, int64_t(-3)})},
      {"f16", torch::randn({5}).to(torch::kHalf)},
      {"bf16", torch::randn({2, 3}).to(torch::kBFloat16)},
      {"f32", torch::randn({3, 1, 2})},
      {"f64", torch::randn({3}, torch::kDouble)},
      {"c64", torch::randn({2}, torch::kComplexFloat)},
      {"scalar", torch::tensor(1.5f)},
      {"empty", torch::zeros({0})},
      {"h.0.attn.c_attn.weight", torch::randn({4, 3}).t()},  // non-contiguous
  };
  const ckpt::Metadata metadata{{"format", "pt"}, {"step", "100"}};
  ckpt::save_safetensors(path, tensors, metadata);
  const auto file = ckpt::load_safetensors(path);
  EXPECT_EQ(file.metadata, metadata);
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) EXPECT_TRUE(same_bits(file.at(name), t)) << name;
}

TEST(Safetensors, ByteLayoutIsTheSpecs) {
  ScratchDir dir;
  const std::string path = (dir.path() / "x.safetensors").string();
  const auto a = torch::tensor({1.0f, 2.0f, 3.0f});           // 12 bytes
  const auto b = torch::tensor({int64_t(7), int64_t(-1)});    // 16 bytes
  const auto c = torch::tensor({1.0, 2.0}).to(torch::kHalf);  // 4 bytes
  ckpt::save_safetensors(path, {{"c", c}, {"a", a}, {"b", b}}, {{"k", "v"}});
  const std::string bytes = ckpt::read_file(path);

  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.find_first_not_of(' ', header.rfind('}') + 1), std::string::npos);  // padding
  const auto j = ckpt::json::parse(header);
  EXPECT_EQ(j.at("__metadata__"), (ckpt::json{{"k", "v"}}));
  // Largest elements first, then by name: b (8-byte), a (4-byte), c (2-byte).
  EXPECT_EQ(j.at("b"), (ckpt::json{{"dtype", "I64"}, {"shape", {2}}, {"data_offsets", {0, 16}}}));
  EXPECT_EQ(j.at("a"), (ckpt::json{{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {16, 28}}}));
  EXPECT_EQ(j.at("c"), (ckpt::json{{"dtype", "F16"}, {"shape", {2}}, {"data_offsets", {28, 32}}}));
  EXPECT_EQ(bytes.size(), 8 + n + 32);
  const std::string data = bytes.substr(8 + n);
  EXPECT_EQ(data.substr(0, 16), raw<int64_t>({7, -1}));
  EXPECT_EQ(data.substr(16, 12), raw<float>({1.0f, 2.0f, 3.0f}));
  EXPECT_EQ(data.substr(28, 4), raw<uint16_t>({0x3c00, 0x4000}));  // IEEE half 1.0, 2.0
}

// A file assembled by hand, in an order Strata never writes (data of "z" before "a", an
// unpadded header): the reader follows the offsets.
TEST(Safetensors, ReadsAHandAssembledFile) {
  ScratchDir dir;
  const auto path = dir.path() / "hand.safetensors";
  const std::string header =
      R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},)"
      R"("z":{"dtype":"I32","shape":[1,2],"data_offsets":[0,8]}})";
  const std::string data = raw<int32_t>({-5, 6}) + raw<uint16_t>({0x3f80, 0xc000});  // bf16 1, -2
  write_bytes(path, le64(header.size()) + header + data);
  const auto file = ckpt::load_safetensors(path.string());
  EXPECT_TRUE(file.metadata.empty());
  ASSERT_EQ(file.tensors.size(), 2u);
  EXPECT_EQ(file.tensors[0].first, "z");  // data order
  EXPECT_TRUE(torch::equal(file.at("z"), torch::tensor({{-5, 6}}, torch::kInt)));
  EXPECT_TRUE(torch::equal(file.at("a"), torch::tensor({1.0f, -2.0f}).to(torch::kBFloat16)));
}

TEST(Safetensors, ReaderRejectsMalformedFilesNamingThem) {
  ScratchDir dir;
  const auto path = dir.path() / "bad.safetensors";
  const std::string p = path.string();
  const auto expect_error = [&](const std::string& bytes, const std::string& what) {
    write_bytes(path, bytes);
    const auto msg = error_of([&] { ckpt::load_safetensors(p); });
    EXPECT_NE(msg.find("'" + p + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  };
  const std::string h = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data(8, '\0');
  ASSERT_NO_THROW((write_bytes(path, le64(h.size()) + h + data), ckpt::load_safetensors(p)));
  expect_error("abc", "too short");
  expect_error(le64(1000) + h, "does not fit");
  expect_error(le64(h.size()) + h + data.substr(0, 7), "outside the 7 data bytes");
  expect_error(le64(h.size()) + h + data + "x", "cover 8 data bytes but the file holds 9");
  expect_error(le64(5) + "{nope", "does not parse");
  const std::string gap = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_error(le64(gap.size()) + gap + data, "starts at data byte 4, expected 0");
  const std::string wrong = R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})";
  expect_error(le64(wrong.size()) + wrong + data, "F64 [2] needs 16 bytes but data_offsets give 8");
  const std::string unknown = R"({"w":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}})";
  expect_error(le64(unknown.size()) + unknown + data, "unknown dtype \"F8_E4M3\"");
}

TEST(Safetensors, WriterRejectsWhatTheFormatCannotHold) {
  ScratchDir dir;
  const std::string p = (dir.path() / "w.safetensors").string();
  auto msg = error_of([&] { ckpt::save_safetensors(p, {{"c", torch::zeros({2}, torch::kComplexDouble)}}); });
  EXPECT_NE(msg.find("complex128"), std::string::npos) << msg;
  msg = error_of([&] { ckpt::save_safetensors(p, {{"__metadata__", torch::zeros({1})}}); });
  EXPECT_NE(msg.find("__metadata__"), std::string::npos) << msg;
  msg = error_of([&] { ckpt::save_safetensors(p, {{"x", torch::zeros({1})}, {"x", torch::zeros({1})}}); });
  EXPECT_NE(msg.find("two tensors are named 'x'"), std::string::npos) << msg;
  EXPECT_TRUE(fs::is_empty(dir.path()));
}
