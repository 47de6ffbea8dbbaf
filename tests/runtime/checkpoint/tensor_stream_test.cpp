// Version-2 tensor files (tensor_stream.h): tensors written in tiles and read back by range bit
// for bit; every flipped byte and every truncation refused before a range is handed out; a
// tensor whose bytes do not match its own CRC refused by name; version-1 files (checkpoints
// before version 2) still read, whole and by range; an unknown version refused naming it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/tensor_stream.h"
#include "runtime/error.h"
#include "tests/runtime/checkpoint/hostile_util.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/runtime/checkpoint/test_util.h"

namespace ckpt = strata::checkpoint;
using json = nlohmann::json;
using strata::test::error_of;
using strata::test::same_bits;
using strata::test::ScratchDir;
using strata::test::TensorFileParts;
using strata::test::write_bytes;

namespace {

// "big" written 1000 bytes at a time (250 floats), "half" and "ids" whole.
ckpt::NamedTensors write_sample(const std::string& path, int64_t numel = 10007) {
  torch::manual_seed(3);
  ckpt::NamedTensors t = {{"big", torch::randn({numel})},
                          {"half", torch::randn({7, 3}).to(torch::kBFloat16)},
                          {"ids", torch::arange(12, torch::kLong).view({3, 4})}};
  ckpt::TensorFileWriter out(path);
  out.add("half", t[1].second);
  const auto& big = t[0].second;
  out.begin({"big", torch::kFloat, {numel}});
  const auto* p = static_cast<const char*>(big.data_ptr());
  const size_t bytes = size_t(numel) * 4;
  for (size_t at = 0; at < bytes; at += 1000) out.write(p + at, std::min<size_t>(1000, bytes - at));
  out.end();
  out.add("ids", t[2].second.t());  // a strided view: saved as its values
  t[2].second = t[2].second.t().contiguous();
  out.commit({{"step", 5}}, {"big", "half", "ids"});
  return t;
}

}  // namespace

TEST(TensorStream, TilesWrittenAndRangesReadBackBitForBit) {
  ScratchDir dir;
  const std::string path = dir.str() + "/v2.ckpt";
  const auto saved = write_sample(path);
  const ckpt::TensorFileReader file(path);
  EXPECT_EQ(file.info().version, 2);
  EXPECT_EQ(file.scalars().at("step"), 5);
  ASSERT_EQ(file.info().tensors.size(), 3u);
  EXPECT_EQ(file.info().tensors[0].name, "big");  // the order commit() was given
  for (const auto& [name, t] : saved) EXPECT_TRUE(same_bits(file.at(name), t)) << name;
  const auto& big = saved[0].second;
  for (auto [begin, n] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {0, 10007}, {249, 2}, {5000, 3333}, {10006, 1}, {10007, 0}}) {
    auto part = torch::full({n}, -1.f);
    file.read("big", begin, n, part.data_ptr());
    EXPECT_TRUE(same_bits(part, big.narrow(0, begin, n))) << begin << "+" << n;
  }
  float one = 0;
  EXPECT_NE(error_of([&] { file.read("big", 10000, 8, &one); }).find("lie outside"),
            std::string::npos);
  EXPECT_NE(error_of([&] { file.at("ghost"); }).find("'ghost' is missing"), std::string::npos);
  // load_tensor_file reads version 2 whole, with the expected specs.
  const auto whole = ckpt::load_tensor_file(path, ckpt::specs_of(saved));
  for (const auto& [name, t] : saved) EXPECT_TRUE(same_bits(whole.at(name), t)) << name;
}

TEST(TensorStream, WriterRefusesWrongSizesAndNames) {
  ScratchDir dir;
  ckpt::TensorFileWriter out(dir.str() + "/bad.ckpt");
  out.begin({"a", torch::kFloat, {4}});
  float v[5] = {};
  EXPECT_NE(error_of([&] { out.write(v, 20); }).find("more than its 16 bytes"), std::string::npos);
  out.write(v, 8);
  EXPECT_NE(error_of([&] { out.end(); }).find("got 8 of its 16 bytes"), std::string::npos);
  out.write(v, 8);
  out.end();
  EXPECT_NE(error_of([&] { out.begin({"a", torch::kFloat, {1}}); }).find("two tensors"),
            std::string::npos);
  EXPECT_NE(error_of([&] { out.commit(json::object(), {"b"}); }).find("not written"),
            std::string::npos);
}

TEST(TensorStream, EveryFlipAndTruncationIsRefusedBeforeARangeIsRead) {
  ScratchDir dir;
  const std::string good_path = dir.str() + "/good.ckpt";
  write_sample(good_path, 33);
  const std::string good = ckpt::read_file(good_path);
  const std::string path = dir.str() + "/bad.ckpt";
  int refused = 0, cases = 0;
  strata::test::for_each_cut_and_flip(good, [&](const std::string& label,
                                               const std::string& bytes, int64_t) {
    write_bytes(path, bytes);
    ++cases;
    try {
      ckpt::TensorFileReader file(path);
      ADD_FAILURE() << label << ": opened";
    } catch (const strata::Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << label << ": " << e.what();
    }
    // Opened without the checksum pass, verify() refuses it before any use.
    EXPECT_NE(error_of([&] { ckpt::TensorFileReader(path, false).verify(); }), "(no error)")
        << label;
  });
  EXPECT_EQ(refused, cases);
}

TEST(TensorStream, ATensorThatDoesNotMatchItsOwnChecksumIsRefused) {
  ScratchDir dir;
  const std::string good_path = dir.str() + "/good.ckpt";
  write_sample(good_path, 33);
  // A payload byte changed and the file's checksum recomputed (a crafted or buggy file): the
  // file passes, the tensor's own CRC32C does not.
  auto parts = TensorFileParts::of(ckpt::read_file(good_path));
  parts.payload[5] = char(parts.payload[5] ^ 0x10);
  const std::string path = dir.str() + "/crafted.ckpt";
  write_bytes(path, parts.sealed());
  const ckpt::TensorFileReader file(path);
  // Payload byte 5 is in "half", written first.
  EXPECT_TRUE(same_bits(file.at("big"), ckpt::load_tensor_file(good_path).at("big")));
  const auto msg = error_of([&] { file.at("half"); });
  EXPECT_NE(msg.find("tensor 'half' has CRC32C"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { ckpt::load_tensor_file(path); }).find("CRC32C"), std::string::npos);
  // Offsets that overlap or leave the payload are refused when the footer is parsed.
  json meta = json::parse(parts.meta);
  for (const json& offset : {json(1), json(parts.payload.size()), json(-4), json("0")}) {
    auto p = TensorFileParts::of(ckpt::read_file(good_path));
    json m = meta;
    m["tensors"][1]["offset"] = offset;
    p.meta = m.dump();
    write_bytes(path, p.sealed());
    EXPECT_NE(error_of([&] { ckpt::TensorFileReader{path}; }), "(no error)") << offset;
  }
  // A version this build does not know is refused naming it.
  auto p = TensorFileParts::of(ckpt::read_file(good_path));
  json m = meta;
  m["version"] = 3;
  p.meta = m.dump();
  write_bytes(path, p.sealed());
  const auto version = error_of([&] { ckpt::TensorFileReader{path}; });
  EXPECT_NE(version.find("version 3"), std::string::npos) << version;
}

TEST(TensorStream, VersionOneFilesStillReadWholeAndByRange) {
  ScratchDir dir;
  const std::string path = dir.str() + "/v1.ckpt";
  torch::manual_seed(4);
  const ckpt::NamedTensors saved = {{"m", torch::randn({100})}, {"b", torch::ones({2, 2})}};
  const auto info = ckpt::save_tensor_file(path, saved, {{"x", 1}});
  EXPECT_EQ(info.version, 1);
  const ckpt::TensorFileReader file(path);
  EXPECT_EQ(file.info().version, 1);
  EXPECT_TRUE(same_bits(file.at("m"), saved[0].second));
  auto part = torch::empty({10});
  file.read("m", 45, 10, part.data_ptr());
  EXPECT_TRUE(same_bits(part, saved[0].second.narrow(0, 45, 10)));
  EXPECT_TRUE(same_bits(ckpt::load_tensor_file(path).at("b"), saved[1].second));
}
