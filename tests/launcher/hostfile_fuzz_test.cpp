// Hostile hostfiles, --include/--exclude specs and --world-info: every truncation and flipped bit
// of a real hostfile, random bytes and tokens, and crafted files (huge slot counts, a 100 kB
// host name, 50000 hosts, a file past the size limit, a FIFO, a folder, /dev/zero). Each parse
// returns or throws strata::Error naming the file (or the option), within 64x its size + 4 MiB
// of heap (tests/alloc_meter.h) and 5 s; the counts are printed.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "launcher/hostfile.h"
#include "tests/fuzz_tally.h"
#include "tests/scratch_folder.h"

namespace {

using strata::launcher::filter_resources;
using strata::launcher::parse_world_info;
using strata::launcher::read_hostfile;
using strata::test::FuzzTally;

const std::string kHostfile =
    "# the cluster\n"
    "worker-0 slots=4\n"
    "alice@worker-1 slots=2   # a user\n"
    "[fe80::1] slots=8\n"
    "\n"
    "10.0.0.5\tslots=1\r\n";

void write(const std::string& path, const std::string& bytes) {
  ::unlink(path.c_str());
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

TEST(HostfileFuzz, TruncationsFlipsAndRandomBytes) {
  strata::test::ScratchFolder dir("hostfile_fuzz");
  const std::string path = dir.file("hosts");
  FuzzTally tally("hostfile");
  auto run = [&](const std::string& label, const std::string& text) {
    write(path, text);
    tally.run(label, path, text.size(), true, [&] { read_hostfile(path); });
  };
  run("as written", kHostfile);
  for (size_t n = 0; n < kHostfile.size(); ++n)
    run("cut at " + std::to_string(n), kHostfile.substr(0, n));
  for (size_t i = 0; i < kHostfile.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = kHostfile;
      bad[i] = char(bad[i] ^ (1 << bit));
      run("byte " + std::to_string(i) + " bit " + std::to_string(bit), bad);
    }
  std::mt19937 rng(17);
  static const char* const words[] = {"node", "a@b", "[::1]", "[", "]", "slots=", "slots=1",
                                      "slots=0", "slots=-1", "slots=4096", "slots=4097", "=",
                                      "#", " ", "\t", "\n", "\r", "-x", "@", ":", "%eth0", "\xff",
                                      "999999999", "fe80::1"};
  for (int c = 0; c < 3000; ++c) {
    std::string text;
    if (c % 2) {
      text.resize(rng() % 200);
      for (char& ch : text) ch = char(rng());
    } else {
      for (int k = rng() % 30; k > 0; --k) text += words[rng() % (sizeof words / sizeof *words)];
    }
    run("random " + std::to_string(c), text);
  }
  EXPECT_GT(tally.refused(), 3000);
}

TEST(HostfileFuzz, CraftedFilesAreRefusedWithinBounds) {
  strata::test::ScratchFolder dir("hostfile_fuzz");
  const std::string path = dir.file("hosts");
  FuzzTally tally("hostfile, crafted");
  auto run = [&](const std::string& label, const std::string& text, bool may_accept) {
    write(path, text);
    tally.run(label, path, text.size(), may_accept, [&] { read_hostfile(path); });
  };
  // A slot count that once allocated 4 GB of slot numbers; the largest accepted one.
  run("slots=999999999", "node slots=999999999\n", false);
  run("slots=4097", "node slots=4097\n", false);
  run("slots=4096", "node slots=4096\n", true);
  // libstdc++'s regex recursed once per character of a host name: 100 kB overflowed the stack.
  run("a 100 kB host name", std::string(100000, 'a') + " slots=1\n", false);
  run("a 1024-character host name", std::string(1024, 'a') + " slots=1\n", true);
  run("a 1 MB line", std::string(1 << 20, 'x'), false);
  // 50000 hosts: the duplicate check was quadratic.
  std::string many;
  for (int k = 0; k < 50000; ++k) many += "h" + std::to_string(k) + " slots=1\n";
  run("50000 hosts", many, true);
  run("50000 hosts, the last twice", many + "h49999 slots=2\n", false);
  run("past 16 MiB", std::string((16 << 20) + 1, '#'), false);
  run("NUL bytes", std::string("node\0 slots=1\n", 14), false);

  const std::string fifo = dir.file("fifo"), zero = dir.file("zero"), sub = dir.file("sub");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", zero.c_str()), 0);
  ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0);
  for (const auto& special : {fifo, zero, sub, dir.file("missing")})
    tally.run(special, special, 0, false, [&] { read_hostfile(special); });
}

// The option texts that name hosts and slots, against a pool of three hosts.
TEST(HostfileFuzz, IncludeExcludeAndWorldInfo) {
  const auto pool = strata::launcher::parse_hostfile_text(kHostfile, "hostfile");
  FuzzTally include("--include/--exclude"), world("--world-info");
  std::mt19937 rng(23);
  static const char* const words[] = {"worker-0", "worker-1", "[fe80::1]", "10.0.0.5", "nobody",
                                      ":",        ",",        "@",         "[",        "]",
                                      "0",        "1",        "7",         "999999999", "-1",
                                      "fe80::1",  "alice@worker-1", " ", "\xff"};
  for (int c = 0; c < 5000; ++c) {
    std::string spec;
    for (int k = 1 + rng() % 12; k > 0; --k)
      spec += words[rng() % (sizeof words / sizeof *words)];
    const bool inc = rng() % 2;
    include.run(spec, inc ? "--include" : "--exclude", spec.size(), true,
                [&] { filter_resources(pool, inc ? spec : "", inc ? "" : spec); });
    world.run(spec, "--world-info", spec.size(), true, [&] { parse_world_info(spec); });
  }
  EXPECT_GT(include.refused(), 1000);
  EXPECT_GT(world.refused(), 1000);
}
