// Hostile config files through load_config_file (fuzz_test.cpp feeds texts in process; this
// goes through the file): every truncation and every flipped bit of every config in configs/,
// and crafted files (past the size limit, nested a million deep, huge numbers and lists,
// invalid UTF-8, a FIFO, a folder, /dev/zero). Each load returns or throws strata::Error
// naming the file, within 64x its size + 4 MiB of heap (tests/alloc_meter.h) and 5 s.
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/config/config.h"
#include "tests/fuzz_tally.h"
#include "tests/sanitized.h"
#include "tests/scratch_folder.h"

namespace {

using strata::test::FuzzTally;

std::vector<std::string> example_configs() {
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/configs";
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0)
      out.push_back(dir + "/" + name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// What a program does with a config file: load it, print it, list what it does not run.
void load_file(const std::string& path) {
  strata::LoadOptions options;
  options.allow_unresolved_auto = true;
  const auto config = strata::load_config_file(path, options);
  (void)strata::to_json(config).dump();
  (void)strata::pending_features(config);
}

void write(const std::string& path, const std::string& bytes) {
  ::unlink(path.c_str());  // a new file: ext4 flushes one truncated and rewritten in place
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

TEST(ConfigFileFuzz, EveryTruncationAndFlippedBitOfEveryExampleConfig) {
  const auto configs = example_configs();
  ASSERT_GE(configs.size(), 10u);
  strata::test::ScratchFolder dir("config_fuzz");
  const std::string path = dir.file("ds.json");
  FuzzTally tally("config file");
  for (const auto& config : configs) {
    const std::string good = slurp(config);
    auto run = [&](const std::string& label, const std::string& bytes) {
      write(path, bytes);
      tally.run(config + ", " + label, path, bytes.size(), true, [&] { load_file(path); });
    };
    const size_t stride = strata::test::kSanitizedStride;  // 1: every cut and every bit
    for (size_t n = 0; n < good.size(); n += stride)
      run("cut at " + std::to_string(n), good.substr(0, n));
    for (size_t i = 0; i < good.size(); i += stride)
      for (int bit = 0; bit < 8; ++bit) {
        std::string bad = good;
        bad[i] = char(bad[i] ^ (1 << bit));
        run("byte " + std::to_string(i) + " bit " + std::to_string(bit), bad);
      }
  }
  EXPECT_GT(tally.refused(), tally.cases() / 2);
}

TEST(ConfigFileFuzz, CraftedFilesAreRefusedWithinBounds) {
  strata::test::ScratchFolder dir("config_fuzz");
  const std::string path = dir.file("ds.json");
  FuzzTally tally("config file, crafted");
  auto run = [&](const std::string& label, const std::string& bytes, bool may_accept = false) {
    write(path, bytes);
    tally.run(label, path, bytes.size(), may_accept, [&] { load_file(path); });
  };
  const std::string batch = "{\"train_batch_size\": 8, ";
  run("past 64 MiB", std::string((64 << 20) + 1, ' '));
  run("nested 10^6 deep", batch + "\"x\": " + std::string(1000000, '[') +
                              std::string(1000000, ']') + "}");
  run("a list of 10^6 numbers", batch + "\"x\": [" + std::string(1000000, '1') + "]}");
  std::string list = batch + "\"x\": [0";
  for (int k = 0; k < 300000; ++k) list += ",0";
  run("a list of 300001 numbers", list + "]}");
  std::string keys = "{";
  for (int k = 0; k < 100000; ++k) keys += "\"k" + std::to_string(k) + "\": 1, ";
  run("100000 unknown keys", keys + "\"train_batch_size\": 8}");
  run("a 10^6-digit number", "{\"train_batch_size\": " + std::string(1000000, '9') + "}");
  run("1e999999", "{\"train_batch_size\": 1e999999}");
  run("invalid UTF-8", "{\"train_batch_size\": 8, \"\xc3\x28\": 1}");
  run("a byte-order mark", "\xef\xbb\xbf{\"train_batch_size\": 8}", true);  // nlohmann skips it
  run("NUL bytes", std::string("{\"train_batch_size\"\0: 8}", 24));
  run("a 10 MB string", batch + "\"x\": \"" + std::string(10 << 20, 'a') + "\"}");

  const std::string fifo = dir.file("fifo.json"), zero = dir.file("zero.json"),
                    sub = dir.file("sub.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", zero.c_str()), 0);
  ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0);
  for (const auto& special : {fifo, zero, sub, dir.file("missing.json")})
    tally.run(special, special, 0, false, [&] { load_file(special); });
}
