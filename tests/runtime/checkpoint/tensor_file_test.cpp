// Tensor files: every dtype and odd shape round-trips bit for bit; every flipped byte and every
// truncation is an error naming the file; expected shapes and dtypes are enforced by name.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/tensor_file.h"
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

ckpt::NamedTensors every_dtype() {
  torch::manual_seed(1);
  ckpt::NamedTensors t;
  t.emplace_back("bool", torch::rand({3, 4}) > 0.5);
  t.emplace_back("u8", torch::randint(0, 256, {17}, torch::kByte));
  t.emplace_back("i8", torch::randint(-128, 128, {2, 3}, torch::kChar));
  t.emplace_back("i16", torch::randint(-30000, 30000, {5}, torch::kShort));
  t.emplace_back("i32", torch::randint(-(1 << 30), 1 << 30, {4, 1}, torch::kInt));
  t.emplace_back("i64", torch::tensor({int64_t(1) << 62, -(int64_t(1) << 60), int64_t(7)}));
  t.emplace_back("f16", torch::randn({3, 3}).to(torch::kHalf));
  t.emplace_back("bf16", torch::randn({2, 5}).to(torch::kBFloat16));
  t.emplace_back("f32", torch::tensor({1.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(),
                                       std::numeric_limits<float>::infinity(), 1e-40f}));
  t.emplace_back("f64", torch::randn({2, 2, 2}, torch::kDouble));
  t.emplace_back("c64", torch::randn({4}, torch::kComplexFloat));
  t.emplace_back("c128", torch::randn({3}, torch::kComplexDouble));
  t.emplace_back("scalar_0d", torch::tensor(2.5));
  t.emplace_back("empty", torch::zeros({0, 7}, torch::kBFloat16));
  t.emplace_back("transposed", torch::arange(12, torch::kFloat).reshape({3, 4}).t());
  t.emplace_back("layers.0.attn.q_proj.weight", torch::randn({4, 4}));
  t.emplace_back("", torch::ones({1}));
  t.emplace_back("ünïcödé / name with spaces", torch::ones({2}, torch::kLong));
  return t;
}

std::string saved_small_file(const ScratchDir& dir) {
  const std::string path = (dir.path() / "small.ckpt").string();
  ckpt::save_tensor_file(path, {{"a", torch::arange(6, torch::kFloat).reshape({2, 3})},
                                {"b", torch::tensor({int64_t(5)})}},
                         {{"step", 3}});
  return path;
}

}  // namespace

TEST(TensorFile, RoundTripsEveryDtypeShapeAndNameBitForBit) {
  ScratchDir dir;
  const std::string path = (dir.path() / "all.ckpt").string();
  const auto tensors = every_dtype();
  const ckpt::json scalars = {{"global_steps", 1234},
                              {"lr", 3e-4},
                              {"name", "run-7"},
                              {"nested", {{"skipped", {1, 2, 3}}, {"scale", 65536.0}}}};
  const auto info = ckpt::save_tensor_file(path, tensors, scalars);
  EXPECT_EQ(info.bytes, fs::file_size(path));
  EXPECT_EQ(info.tensors, ckpt::specs_of(tensors));

  const auto file = ckpt::load_tensor_file(path);
  EXPECT_EQ(file.crc32c, info.crc32c);
  EXPECT_EQ(file.scalars, scalars);
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(file.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(same_bits(file.tensors[i].second, tensors[i].second)) << tensors[i].first;
    EXPECT_EQ(file.tensors[i].second.device(), torch::Device(torch::kCPU));
    EXPECT_FALSE(file.tensors[i].second.requires_grad());
  }
  // The footer alone says the same, and agrees with the full check.
  const auto footer = ckpt::read_tensor_file_info(path);
  EXPECT_EQ(footer.tensors, info.tensors);
  EXPECT_EQ(footer.crc32c, info.crc32c);
  EXPECT_EQ(ckpt::verify_tensor_file(path).crc32c, info.crc32c);
  // The stored CRC is the CRC32C of everything before its field (16 bytes from the end).
  EXPECT_EQ(ckpt::FileReader(path).crc32c(0, info.bytes - 16), info.crc32c);
}

TEST(TensorFile, SavesParametersThatRequireGradAndEmptyLists) {
  ScratchDir dir;
  const std::string path = (dir.path() / "p.ckpt").string();
  auto p = torch::randn({3, 2}, torch::requires_grad());
  ckpt::save_tensor_file(path, {{"p", p}});
  EXPECT_TRUE(torch::equal(ckpt::load_tensor_file(path).at("p"), p.detach()));

  ckpt::save_tensor_file(path, {}, {{"only", "scalars"}});
  const auto empty = ckpt::load_tensor_file(path);
  EXPECT_TRUE(empty.tensors.empty());
  EXPECT_EQ(empty.scalars.at("only"), "scalars");
}

// A shard that is a view into a large flat buffer is saved as its own bytes.
TEST(TensorFile, ViewOfALargeBufferIsSavedAsItsOwnBytes) {
  ScratchDir dir;
  const std::string path = (dir.path() / "view.ckpt").string();
  const auto flat = torch::randn({4 << 20});  // 16 MiB
  const auto shard = flat.narrow(0, 1000, 256);
  ckpt::save_tensor_file(path, {{"shard", shard}});
  EXPECT_LT(fs::file_size(path), 64u << 10);
  EXPECT_TRUE(torch::equal(ckpt::load_tensor_file(path).at("shard"), shard));
}

TEST(TensorFile, EveryFlippedByteIsAnErrorNamingTheFile) {
  ScratchDir dir;
  const std::string path = saved_small_file(dir);
  const std::string good = ckpt::read_file(path);
  const std::string copy = (dir.path() / "flipped.ckpt").string();
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = char(bad[i] ^ (1 << (i % 8)));
    write_bytes(copy, bad);
    const auto msg = error_of([&] { ckpt::load_tensor_file(copy); });
    ASSERT_NE(msg.find("'" + copy + "'"), std::string::npos) << "byte " << i << ": " << msg;
    ASSERT_NE(msg.find("corrupt"), std::string::npos) << "byte " << i << ": " << msg;
    ASSERT_NE(error_of([&] { ckpt::verify_tensor_file(copy); }), "(no error)") << "byte " << i;
  }
}

TEST(TensorFile, EveryTruncationAndAnyAppendedBytesAreErrors) {
  ScratchDir dir;
  const std::string path = saved_small_file(dir);
  const std::string good = ckpt::read_file(path);
  const std::string copy = (dir.path() / "cut.ckpt").string();
  for (size_t n = 0; n < good.size(); ++n) {
    write_bytes(copy, good.substr(0, n));
    const auto msg = error_of([&] { ckpt::load_tensor_file(copy); });
    ASSERT_NE(msg.find("'" + copy + "'"), std::string::npos) << n << " bytes: " << msg;
    ASSERT_NE(error_of([&] { ckpt::read_tensor_file_info(copy); }), "(no error)") << n;
  }
  write_bytes(copy, good + "extra");
  EXPECT_NE(error_of([&] { ckpt::load_tensor_file(copy); }).find(copy), std::string::npos);
  write_bytes(copy, good);
  EXPECT_NO_THROW(ckpt::load_tensor_file(copy));
}

TEST(TensorFile, ExpectedSpecsAreEnforcedByNameShapeAndDtype) {
  ScratchDir dir;
  const std::string path = saved_small_file(dir);
  using Spec = ckpt::TensorSpec;
  const std::vector<Spec> right{{"b", torch::kLong, {1}}, {"a", torch::kFloat, {2, 3}}};
  EXPECT_NO_THROW(ckpt::load_tensor_file(path, right));

  auto msg = error_of([&] {
    ckpt::load_tensor_file(path, {{"a", torch::kFloat, {3, 2}}, {"b", torch::kLong, {1}}});
  });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("'a'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 2]"), std::string::npos) << msg;

  msg = error_of([&] {
    ckpt::load_tensor_file(path, {{"a", torch::kBFloat16, {2, 3}}, {"b", torch::kLong, {1}}});
  });
  EXPECT_NE(msg.find("'a' is F32 in the file but BF16"), std::string::npos) << msg;

  msg = error_of([&] { ckpt::load_tensor_file(path, {{"a", torch::kFloat, {2, 3}}}); });
  EXPECT_NE(msg.find("'b', which is not expected"), std::string::npos) << msg;

  msg = error_of([&] {
    ckpt::load_tensor_file(path, {{"a", torch::kFloat, {2, 3}}, {"b", torch::kLong, {1}},
                                  {"c", torch::kFloat, {1}}});
  });
  EXPECT_NE(msg.find("'c' is missing"), std::string::npos) << msg;
}

TEST(TensorFile, CopiesIntoAModelAndRefusesAMismatchedOne) {
  ScratchDir dir;
  const std::string path = (dir.path() / "model.ckpt").string();
  torch::manual_seed(0);
  torch::nn::Sequential saved(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  ckpt::NamedTensors state;
  for (const auto& p : saved->named_parameters()) state.emplace_back(p.key(), p.value());
  ckpt::save_tensor_file(path, state);

  torch::manual_seed(1);
  torch::nn::Sequential fresh(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  ckpt::NamedTensors targets;
  for (const auto& p : fresh->named_parameters()) targets.emplace_back(p.key(), p.value());
  ckpt::load_tensor_file(path).copy_to(targets);
  const auto x = torch::randn({5, 4});
  EXPECT_TRUE(torch::equal(fresh->forward(x), saved->forward(x)));
  EXPECT_TRUE(fresh->named_parameters()["0.weight"].requires_grad());

  torch::nn::Sequential wider(torch::nn::Linear(4, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  ckpt::NamedTensors wrong;
  for (const auto& p : wider->named_parameters()) wrong.emplace_back(p.key(), p.value());
  const auto before = wider->named_parameters()["2.bias"].clone();
  const auto msg = error_of([&] { ckpt::load_tensor_file(path).copy_to(wrong); });
  EXPECT_NE(msg.find("tensor '0.weight' has shape [8, 4] in the file but [16, 4]"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(torch::equal(wider->named_parameters()["2.bias"], before));  // nothing copied
}

TEST(TensorFile, RejectsDuplicateNamesUndefinedTensorsAndMissingFiles) {
  ScratchDir dir;
  const std::string path = (dir.path() / "x.ckpt").string();
  auto msg = error_of([&] {
    ckpt::save_tensor_file(path, {{"w", torch::ones({1})}, {"w", torch::ones({2})}});
  });
  EXPECT_NE(msg.find("two tensors are named 'w'"), std::string::npos) << msg;
  msg = error_of([&] { ckpt::save_tensor_file(path, {{"u", torch::Tensor()}}); });
  EXPECT_NE(msg.find("'u' is undefined"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path));
  msg = error_of([&] { ckpt::load_tensor_file(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(TensorFile, DtypeNamesRoundTrip) {
  for (auto d : {torch::kBool, torch::kByte, torch::kChar, torch::kShort, torch::kInt, torch::kLong,
                 torch::kHalf, torch::kBFloat16, torch::kFloat, torch::kDouble,
                 torch::kComplexFloat, torch::kComplexDouble})
    EXPECT_EQ(ckpt::dtype_from_name(ckpt::dtype_name(d), "test"), d);
  EXPECT_EQ(ckpt::dtype_name(torch::kBFloat16), "BF16");
  const auto msg = error_of([] { ckpt::dtype_from_name("float32", "manifest.json"); });
  EXPECT_NE(msg.find("manifest.json: unknown dtype \"float32\""), std::string::npos) << msg;
}
