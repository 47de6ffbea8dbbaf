// The token-file dataset (runtime/data/token_dataset.h): samples cut from real files, one global
// order whatever the world size, micro-batch and accumulation, no repeat within an epoch, a new
// order each epoch, a resume that continues at its position, and bad files refused by name and
// byte offset.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "runtime/data/token_dataset.h"
#include "runtime/error.h"

namespace {

using strata::data::TokenDataset;
using strata::data::TokenDatasetOptions;

class TokenFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char t[] = "/tmp/strata-tokens-XXXXXX";
    dir_ = ::mkdtemp(t);
  }
  void TearDown() override {
    for (const auto& f : written_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  // A file of `count` ids, id i = (base + i) % modulo, `width` bytes each, little-endian.
  std::string write(const std::string& name, int64_t count, int width, int64_t base = 0,
                    int64_t modulo = 1000) {
    const auto path = dir_ + "/" + name;
    std::ofstream out(path, std::ios::binary);
    for (int64_t i = 0; i < count; ++i) {
      const uint32_t v = uint32_t((base + i) % modulo);
      for (int b = 0; b < width; ++b) out.put(char((v >> (8 * b)) & 0xff));
    }
    written_.push_back(path);
    return path;
  }
  std::string write_raw(const std::string& name, const std::string& bytes) {
    const auto path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    written_.push_back(path);
    return path;
  }
  std::string dir_;
  std::vector<std::string> written_;
};

std::string refusal(const TokenDatasetOptions& o, int64_t first = 0, int64_t count = 0) {
  try {
    TokenDataset d(o);
    d.batch(first, count);
  } catch (const strata::Error& e) {
    return e.what();
  }
  return "";
}

TEST_F(TokenFiles, SamplesAreWindowsOfEachFileWithTargetsShiftedByOne) {
  TokenDatasetOptions o;
  // 33 tokens: (33 - 1) / 8 = 4 samples; 20 tokens: 2 samples (the last 3 tokens unused).
  o.files = {write("a.bin", 33, 2, 0), write("b.bin", 20, 2, 500)};
  o.seq_len = 8;
  o.shuffle = false;
  TokenDataset d(o);
  ASSERT_EQ(d.samples_per_epoch(), 6);
  const auto b = d.batch(0, 6);
  ASSERT_EQ(b.tokens.sizes(), torch::IntArrayRef({6, 8}));
  EXPECT_EQ(b.tokens[1][0].item<int64_t>(), 8);   // a.bin's second window
  EXPECT_EQ(b.targets[1][7].item<int64_t>(), 16);  // its last target: the next window's first token
  EXPECT_EQ(b.tokens[4][0].item<int64_t>(), 500);  // b.bin's first window
  EXPECT_EQ(b.targets[5][7].item<int64_t>(), 516);
  EXPECT_TRUE(torch::equal(b.tokens.narrow(1, 1, 7), b.targets.narrow(1, 0, 7)));
  // uint32 ids past 65535.
  o.files = {write("wide.bin", 17, 4, 70000, 1 << 30)};
  o.token_bytes = 4;
  const auto w = TokenDataset(o).batch(1, 1);
  EXPECT_EQ(w.tokens[0][0].item<int64_t>(), 70008);
}

// Rank r of w at micro-step m takes positions step * B + (m * w + r) * micro: the samples of each
// global batch, laid end to end, are the same at every layout of B = 12.
TEST_F(TokenFiles, TheGlobalOrderIsTheSameAtWorldSizesOneToFour) {
  TokenDatasetOptions o;
  o.files = {write("a.bin", 4001, 2)};
  o.seq_len = 16;
  o.seed = 7;
  TokenDataset d(o);
  struct Layout {
    int64_t world, micro, gas;
  };
  std::vector<std::vector<int64_t>> orders;
  for (const auto& l : {Layout{1, 12, 1}, Layout{2, 3, 2}, Layout{3, 4, 1}, Layout{4, 1, 3},
                        Layout{1, 2, 6}}) {
    std::vector<int64_t> order(12 * 6);
    for (int64_t step = 0; step < 6; ++step)
      for (int64_t m = 0; m < l.gas; ++m)
        for (int64_t r = 0; r < l.world; ++r) {
          const auto first = TokenDataset::first_position(step, m, r, l.world, l.micro, l.gas);
          const auto b = d.batch(first, l.micro);
          for (int64_t i = 0; i < l.micro; ++i) order[size_t(first + i)] = b.ids[size_t(i)];
        }
    orders.push_back(order);
  }
  for (size_t i = 1; i < orders.size(); ++i) EXPECT_EQ(orders[i], orders[0]) << "layout " << i;
}

TEST_F(TokenFiles, EachEpochVisitsEverySampleOnceInAnOrderOfItsOwn) {
  TokenDatasetOptions o;
  o.files = {write("a.bin", 1001, 2), write("b.bin", 333, 2)};
  o.seq_len = 10;
  o.seed = 3;
  TokenDataset d(o);
  const int64_t n = d.samples_per_epoch();
  ASSERT_EQ(n, 100 + 33);
  const auto e0 = d.batch(0, n).ids, e1 = d.batch(n, n).ids;
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), size_t(n));
  EXPECT_EQ(std::set<int64_t>(e1.begin(), e1.end()).size(), size_t(n));
  EXPECT_NE(e0, e1);
  std::vector<int64_t> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted.front(), 0);
  EXPECT_EQ(sorted.back(), n - 1);
  // Another seed, another order; shuffle off, file order.
  o.seed = 4;
  EXPECT_NE(TokenDataset(o).batch(0, n).ids, e0);
  o.shuffle = false;
  EXPECT_EQ(TokenDataset(o).batch(5, 1).ids.front(), 5);
}

// A run saved after 3 steps of 12 and resumed with another layout (and then another batch size,
// counted from the saved position) reads the samples the straight run would, none twice.
TEST_F(TokenFiles, AResumeContinuesWithTheNextUnseenSample) {
  TokenDatasetOptions o;
  o.files = {write("a.bin", 5001, 2)};
  o.seq_len = 16;
  o.seed = 11;
  TokenDataset d(o);
  std::vector<int64_t> straight, resumed;
  for (int64_t step = 0; step < 6; ++step) {
    const auto b = d.batch(TokenDataset::first_position(step, 0, 0, 1, 12, 1), 12);
    straight.insert(straight.end(), b.ids.begin(), b.ids.end());
  }
  for (int64_t step = 0; step < 3; ++step)
    for (int64_t m = 0; m < 2; ++m)
      for (int64_t r = 0; r < 2; ++r) {
        const auto b = d.batch(TokenDataset::first_position(step, m, r, 2, 3, 2), 3);
        resumed.insert(resumed.end(), b.ids.begin(), b.ids.end());
      }
  const int64_t saved = 3 * 12;  // the position a checkpoint keeps
  for (int64_t step = 0; step < 3; ++step)
    for (int64_t r = 0; r < 4; ++r) {
      const auto b = d.batch(TokenDataset::first_position(step, 0, r, 4, 3, 1, saved), 3);
      resumed.insert(resumed.end(), b.ids.begin(), b.ids.end());
    }
  std::vector<int64_t> a = straight, b = resumed;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  EXPECT_EQ(b, a);  // the same samples (each micro-batch's are contiguous positions)
  EXPECT_EQ(std::set<int64_t>(resumed.begin(), resumed.end()).size(), resumed.size());
}

TEST_F(TokenFiles, BadFilesAreRefusedByNameAndOffset) {
  TokenDatasetOptions o;
  o.seq_len = 4;
  o.files = {write_raw("odd.bin", std::string(11, '\x01'))};
  auto m = refusal(o);
  EXPECT_NE(m.find("odd.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("byte offset 10"), std::string::npos) << m;
  o.files = {write("short.bin", 4, 2)};  // 4 tokens: no sample of 4 + 1
  m = refusal(o);
  EXPECT_NE(m.find("short.bin"), std::string::npos) << m;
  o.files = {dir_ + "/missing.bin"};
  EXPECT_NE(refusal(o).find("missing.bin"), std::string::npos);
  const auto fifo = dir_ + "/fifo.bin";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  written_.push_back(fifo);
  o.files = {fifo};
  EXPECT_NE(refusal(o).find("not a regular file"), std::string::npos);
  // Ids 0..99, vocabulary 50: the first bad id, 50, is token 50, at byte offset 100.
  o.files = {write("big.bin", 100, 2, 0, 100)};
  o.vocab_size = 50;
  o.shuffle = false;
  m = refusal(o, 12, 1);  // sample 12: tokens 48..52
  EXPECT_NE(m.find("big.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("token id 50 at byte offset 100"), std::string::npos) << m;
  o.token_bytes = 3;
  EXPECT_NE(refusal(o).find("token width"), std::string::npos);
}

// Megatron-LM's PREFIX.idx beside PREFIX.bin: read and held against the .bin.
std::string megatron_index(const std::vector<int32_t>& lengths, uint8_t code, int width,
                           int64_t shift_pointer = -1) {
  std::string out("MMIDIDX\0\0", 9);
  auto put = [&](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
  const uint64_t version = 1, sequences = lengths.size(), documents = lengths.size() + 1;
  put(&version, 8);
  put(&code, 1);
  put(&sequences, 8);
  put(&documents, 8);
  put(lengths.data(), lengths.size() * 4);
  int64_t at = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t p = int64_t(i) == shift_pointer ? at + width : at;
    put(&p, 8);
    at += int64_t(lengths[i]) * width;
  }
  for (uint64_t d = 0; d < documents; ++d) {
    const int64_t v = int64_t(d);
    put(&v, 8);
  }
  return out;
}

TEST_F(TokenFiles, AMegatronIndexBesideItsBinIsHeldAgainstIt) {
  TokenDatasetOptions o;
  o.seq_len = 16;
  o.files = {write("corpus.bin", 350, 2)};
  const auto idx = dir_ + "/corpus.idx";
  written_.push_back(idx);
  auto with_index = [&](const std::string& bytes) {
    std::ofstream(idx, std::ios::binary) << bytes;
    return refusal(o);
  };
  EXPECT_EQ(with_index(megatron_index({100, 200, 50}, 8, 2)), "");
  auto m = with_index(megatron_index({100, 200, 50}, 4, 4));  // int32 for uint16 data
  EXPECT_NE(m.find("corpus.idx does not match"), std::string::npos) << m;
  EXPECT_NE(m.find("4-byte tokens"), std::string::npos) << m;
  m = with_index(megatron_index({100, 200, 49}, 8, 2));  // one token short of the .bin
  EXPECT_NE(m.find("cover 698 bytes"), std::string::npos) << m;
  m = with_index(megatron_index({100, 200, 50}, 8, 2, /*shift_pointer=*/1));
  EXPECT_NE(m.find("sequence 1"), std::string::npos) << m;
  m = with_index("MMIDIDX");  // truncated
  EXPECT_NE(m.find("byte offset 0"), std::string::npos) << m;
  m = with_index(megatron_index({100, 200, 50}, 8, 2).substr(0, 60));  // arrays cut off
  EXPECT_NE(m.find("need"), std::string::npos) << m;
}

}  // namespace
