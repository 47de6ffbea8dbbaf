// Hostile tensor files and safetensors files: every truncation, every flipped bit, and crafted
// footers and headers with valid checksums (huge lengths and counts, shapes whose sizes overflow,
// offsets past the end, deep nesting). Each reader returns or throws strata::Error naming the
// file, within its memory and time bound (tests/fuzz_tally.h); the counts are printed.
#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/tensor_file.h"
#include "tests/fuzz_tally.h"
#include "tests/runtime/checkpoint/hostile_util.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/runtime/checkpoint/test_util.h"

namespace ckpt = strata::checkpoint;
using strata::test::error_of;
using strata::test::for_each_cut_and_flip;
using strata::test::FuzzTally;
using strata::test::le_bytes;
using strata::test::nested;
using strata::test::ScratchDir;
using strata::test::TensorFileParts;
using strata::test::write_bytes;
using json = nlohmann::json;

namespace {

ckpt::NamedTensors sample_tensors() {
  torch::manual_seed(7);
  return {{"w", torch::randn({3, 4})},
          {"b", torch::randn({5}).to(torch::kBFloat16)},
          {"i", torch::arange(4, torch::kLong).view({2, 2})},
          {"empty", torch::zeros({0, 3})},
          {"flag", torch::tensor({true, false, true})}};
}

// What a case may do: damaged bytes fail the checksum (only the footer-alone reader, which
// does not check it, may accept them); crafted bytes carry a valid checksum, so the footer
// readers may accept a well-formed footer, but a load, which checks the archive against it, not.
enum class Bytes { kSaved, kDamaged, kCrafted };

// The tensor-file readers, each as the checkpoint code calls it.
struct TensorReaders {
  std::vector<ckpt::TensorSpec> specs = ckpt::specs_of(sample_tensors());
  FuzzTally info{"tensor file footer"}, verify{"tensor file checksum"}, load{"tensor file load"},
      load_expected{"tensor file load+specs"};

  void run(const std::string& label, const std::string& path, uint64_t bytes, Bytes kind) {
    const bool saved = kind == Bytes::kSaved, crafted = kind == Bytes::kCrafted;
    info.run(label, path, bytes, true, [&] { ckpt::read_tensor_file_info(path); });
    verify.run(label, path, bytes, saved || crafted, [&] { ckpt::verify_tensor_file(path); });
    load.run(label, path, bytes, saved, [&] { ckpt::load_tensor_file(path); });
    load_expected.run(label, path, bytes, saved, [&] { ckpt::load_tensor_file(path, specs); });
  }
};

}  // namespace

TEST(HostileTensorFile, TruncationsAndFlippedBitsAreRefused) {
  ScratchDir dir;
  const std::string good_path = dir.str() + "/good.ckpt";
  ckpt::save_tensor_file(good_path, sample_tensors(), {{"step", 3}, {"nested", {{"a", {1, 2}}}}});
  const std::string good = ckpt::read_file(good_path);
  const std::string path = dir.str() + "/hostile.ckpt";
  TensorReaders readers;
  const size_t payload = TensorFileParts::of(good).payload.size();
  for_each_cut_and_flip(good, [&](const std::string& label, const std::string& bytes,
                                  int64_t flipped_bit0_of) {
    write_bytes(path, bytes);
    readers.run(label, path, bytes.size(), Bytes::kDamaged);
    // Damage never reaches LibTorch's parser: the checksum is verified before the payload.
    if (flipped_bit0_of >= 0 && size_t(flipped_bit0_of) < payload) {
      const auto msg = error_of([&] { ckpt::load_tensor_file(path); });
      EXPECT_NE(msg.find("CRC32C mismatch"), std::string::npos) << label << ": " << msg;
    }
  });
  EXPECT_GT(readers.load.refused(), int(good.size() * 9) - 1);
}

// Footers and tails built to get past the checksum, then to mislead the parser.
TEST(HostileTensorFile, CraftedFootersWithValidChecksumsAreRefused) {
  ScratchDir dir;
  const std::string good_path = dir.str() + "/good.ckpt";
  ckpt::save_tensor_file(good_path, sample_tensors(), {{"step", 3}});
  const auto parts = TensorFileParts::of(ckpt::read_file(good_path));
  const json meta = json::parse(parts.meta);
  const std::string path = dir.str() + "/crafted.ckpt";
  TensorReaders readers;
  auto run = [&](const std::string& label, const std::string& bytes,
                 Bytes kind = Bytes::kCrafted) {
    write_bytes(path, bytes);
    readers.run(label, path, bytes.size(), kind);
  };
  auto with_meta = [&](const std::string& label, const json& m) {
    TensorFileParts p = parts;
    p.meta = m.dump();
    run(label, p.sealed());
  };
  run("as saved", parts.sealed(), Bytes::kSaved);

  // The tail's meta length: past the file, past 1 GiB, the whole file, one byte short.
  const uint64_t size = parts.payload.size() + parts.meta.size() + 24;
  for (uint64_t length : {size, size - 23, size - 24, parts.meta.size() + 1,
                          parts.meta.size() - 1, uint64_t(1) << 30 | 1, uint64_t(1) << 63,
                          ~uint64_t(0), uint64_t(0)})
    run("meta length " + std::to_string(length), parts.sealed(length));
  std::string reserved = parts.sealed();
  reserved[reserved.size() - 12] = 1;
  run("reserved field", reserved, Bytes::kDamaged);

  // payload_bytes: off by one, huge, negative, not a number.
  for (const json& value : {json(parts.payload.size() + 1), json(parts.payload.size() - 1),
                            json(~uint64_t(0)), json(-1), json(1e30), json("12"), json(nullptr)}) {
    json m = meta;
    m["payload_bytes"] = value;
    with_meta("payload_bytes " + value.dump(), m);
  }
  // Shapes: sizes past 2^62, products that wrap to 0 or to the saved size, negative, fractional,
  // and well-formed shapes the archive does not hold.
  const std::vector<json> shapes = {
      {int64_t(1) << 40, int64_t(1) << 40}, {int64_t(1) << 62, 4}, {int64_t(1) << 61, 8, 0},
      {0, int64_t(1) << 62, int64_t(1) << 62}, {-1}, {-3, -4}, {1.5}, json("3x4"), {4, 3},
      {3, 4, 1}, json::array(), {INT64_MAX}};
  for (const auto& shape : shapes) {
    json m = meta;
    m["tensors"][0]["shape"] = shape;
    with_meta("shape " + shape.dump(), m);
  }
  for (const json& dtype : {json("F64"), json("F8"), json(""), json(3), json("f32")}) {
    json m = meta;
    m["tensors"][0]["dtype"] = dtype;
    with_meta("dtype " + dtype.dump(), m);
  }
  {
    json m = meta;  // one tensor more than the archive holds
    m["tensors"].push_back({{"name", "ghost"}, {"dtype", "U8"}, {"shape", {1}}});
    with_meta("a tensor the archive lacks", m);
    m = meta;  // one name twice
    m["tensors"][1]["name"] = "w";
    with_meta("a name twice", m);
    m = meta;  // one entry of 100000 tiny tensors
    m["tensors"] = json::array();
    for (int k = 0; k < 100000; ++k)
      m["tensors"].push_back({{"name", "t" + std::to_string(k)}, {"dtype", "U8"}, {"shape", {1}}});
    with_meta("100000 tensors", m);
    m = meta;
    m["tensors"] = json::object();
    with_meta("tensors an object", m);
  }
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"format", "strata-tensorz"}, {"version", 2}, {"scalars", json::array()},
           {"scalars", 5}, {"tensors", nullptr}}) {
    json m = meta;
    m[key] = value;
    with_meta(key + " = " + value.dump(), m);
  }
  {
    TensorFileParts p = parts;  // scalars nested a million deep: refused before any recursion
    p.meta = p.meta.substr(0, p.meta.size() - 1) + ",\"deep\":" + nested(1000000) + "}";
    run("scalars nested 10^6 deep", p.sealed());
    p.meta = "{\"deep\":\"" + std::string(1000000, '[') + "\"}";  // brackets in a string are text
    run("brackets in a string", p.sealed());
    for (const std::string& text :
         {std::string(""), std::string("{"), std::string("\xff\xfe"),
          std::string("{\"format\":\"\xc3\x28\"}"), std::string(100, '\0')}) {
      p.meta = text;
      run("meta text of " + std::to_string(text.size()) + " bytes", p.sealed());
    }
  }
  // Payloads with valid checksums that are not LibTorch archives, or another archive: these
  // reach LibTorch's parser (so do crafted archives: README, "Checkpoints").
  std::mt19937 rng(5);
  for (int k = 0; k < 20; ++k) {
    TensorFileParts p = parts;
    for (size_t i = k * 37 % p.payload.size(); i < p.payload.size(); i += 1 + rng() % 97)
      p.payload[i] = char(rng());
    json m = meta;
    m["payload_bytes"] = p.payload.size();
    p.meta = m.dump();
    run("scrambled payload " + std::to_string(k), p.sealed());
  }
  {
    const std::string other_path = dir.str() + "/other.ckpt";
    ckpt::save_tensor_file(other_path, {{"w", torch::zeros({4, 3})}});
    TensorFileParts p = parts;
    p.payload = TensorFileParts::of(ckpt::read_file(other_path)).payload;
    json m = meta;
    m["payload_bytes"] = p.payload.size();
    m["tensors"] = json::array({meta["tensors"][0]});
    p.meta = m.dump();
    run("another file's archive", p.sealed());
  }
}

TEST(HostileTensorFile, FifosFoldersAndDevicesAreRefusedWithoutBlocking) {
  ScratchDir dir;
  const std::string fifo = dir.str() + "/fifo.ckpt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string zero = dir.str() + "/zero.ckpt";
  ASSERT_EQ(::symlink("/dev/zero", zero.c_str()), 0);
  for (const auto& path : {fifo, dir.str(), zero}) {
    FuzzTally tally("tensor file " + path.substr(path.size() - 9));
    for (auto read : {+[](const std::string& p) { ckpt::read_tensor_file_info(p); },
                      +[](const std::string& p) { ckpt::load_tensor_file(p); }})
      tally.run(path, path, 0, false, [&] { read(path); });
  }
  FuzzTally st("safetensors special files");
  for (const auto& path : {fifo, dir.str(), zero})
    st.run(path, path, 0, false, [&] { ckpt::load_safetensors(path); });
}

namespace {

// A safetensors file's header and data (safetensors.h), rebuilt with any header text.
struct Safetensors {
  std::string header, data;
  static Safetensors of(const std::string& file) {
    const uint64_t n = strata::test::le_value(file, 0, 8);
    return {file.substr(8, size_t(n)), file.substr(8 + size_t(n))};
  }
  std::string bytes() const { return le_bytes(header.size(), 8) + header + data; }
};

}  // namespace

TEST(HostileSafetensors, TruncationsFlipsAndCraftedHeaders) {
  ScratchDir dir;
  const std::string good_path = dir.str() + "/good.safetensors";
  ckpt::save_safetensors(good_path, sample_tensors(), {{"format", "pt"}});
  const std::string good = ckpt::read_file(good_path);
  const std::string path = dir.str() + "/hostile.safetensors";
  FuzzTally tally("safetensors");
  auto run = [&](const std::string& label, const std::string& bytes, bool may_accept) {
    write_bytes(path, bytes);
    tally.run(label, path, bytes.size(), may_accept, [&] { ckpt::load_safetensors(path); });
  };
  // No checksum in this format: a cut file is refused; a flipped data bit is a valid file, a
  // flipped header bit mostly is not. Neither may crash.
  for_each_cut_and_flip(good, [&](const std::string& label, const std::string& bytes, int64_t) {
    run(label, bytes, label.rfind("byte ", 0) == 0);
  });

  const auto parts = Safetensors::of(good);
  const json header = json::parse(parts.header);
  for (uint64_t n : {~uint64_t(0), uint64_t(1) << 63, uint64_t(100'000'001),
                     uint64_t(good.size() - 7), uint64_t(parts.header.size() + 1)}) {
    Safetensors s = parts;
    run("header length " + std::to_string(n), le_bytes(n, 8) + s.header + s.data, false);
  }
  auto with_header = [&](const std::string& label, const json& h) {
    Safetensors s = parts;
    s.header = h.dump();
    run(label, s.bytes(), false);
  };
  const uint64_t w_bytes = 12 * 4;
  const auto w_offsets = header["w"]["data_offsets"];
  for (const json& shape :
       {json{int64_t(1) << 62, 4}, json{int64_t(1) << 31, int64_t(1) << 31, 4},
        json{0, int64_t(1) << 62, int64_t(1) << 62}, json{-1, -12}, json{12, 1, 1, 1, -1},
        json{INT64_MAX, INT64_MAX}}) {
    json h = header;
    h["w"]["shape"] = shape;
    with_header("w shape " + shape.dump(), h);
  }
  for (const json& offsets :
       {json{0, 0}, json{0, ~uint64_t(0)}, json{w_offsets[1], w_offsets[0]},
        json{w_offsets[0], w_offsets[1], 0}, json{w_offsets[0].get<uint64_t>() + 1,
        w_offsets[1].get<uint64_t>() + 1}, json{"0", "48"}, json{-48, 0},
        json{~uint64_t(0) - w_bytes + 1, 0}}) {
    json h = header;
    h["w"]["data_offsets"] = offsets;
    with_header("w data_offsets " + offsets.dump(), h);
  }
  {
    json h = header;
    h["__metadata__"] = {{"format", 5}};
    with_header("metadata not a string", h);
    h = header;
    h["__metadata__"] = json::array({1, 2});
    with_header("metadata a list", h);
    h = header;
    h["w"]["dtype"] = "F8_E4M3";
    with_header("unknown dtype", h);
    h = header;
    h["extra"] = {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {0, 1}}};
    with_header("an overlapping tensor", h);
    with_header("a list", json::array());
    with_header("no tensors", json::object());
    h = json::object();
    for (int k = 0; k < 100000; ++k)
      h["t" + std::to_string(k)] = {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
    with_header("100000 tensors, none covering the data", h);
  }
  {
    Safetensors s = parts;
    s.header = "{\"a\":" + nested(1000000) + "}";
    run("header nested 10^6 deep", s.bytes(), false);
  }
}
