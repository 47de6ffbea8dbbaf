// CRC32C and atomic files: known vectors and an independent implementation; replace, abandon,
// errors that name the path and errno; kill -9 while a file is being rewritten.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/util/crc32c.h"
#include "runtime/error.h"
#include "runtime/util/crc32c.h"
#include "tests/runtime/checkpoint/child_process.h"
#include "tests/runtime/checkpoint/crash_workload.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/runtime/checkpoint/test_util.h"

namespace ckpt = strata::checkpoint;
namespace fs = std::filesystem;
using strata::test::ScratchDir;
using strata::test::error_of;
using strata::test::entries;
using strata::test::same_bits;
using strata::test::slurp;

namespace {

// Runs `body` in a forked child (no torch there) and returns its exit code.
template <class F>
int in_child(F body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

// --- CRC32C ------------------------------------------------------------------------------------

TEST(Crc32c, KnownVectors) {
  // RFC 3720 (iSCSI) B.4 and the classic check value.
  const std::string digits = "123456789";
  const std::string zeros(32, '\0'), ones(32, '\xff');
  std::string ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = char(i);
  for (auto f : {&strata::crc32c_extend, &strata::crc32c_extend_portable}) {
    EXPECT_EQ(f(0, digits.data(), digits.size()), 0xe3069283u);
    EXPECT_EQ(f(0, zeros.data(), zeros.size()), 0x8a9136aau);
    EXPECT_EQ(f(0, ones.data(), ones.size()), 0x62a8ab43u);
    EXPECT_EQ(f(0, ascending.data(), ascending.size()), 0x46dd794eu);
    EXPECT_EQ(f(0, nullptr, 0), 0u);
  }
}

TEST(Crc32c, MatchesTheByteAtATimeImplementationAtEveryAlignmentAndSplit) {
  std::mt19937 rng(3);
  std::string data(70000, '\0');
  for (auto& c : data) c = char(rng());
  for (int trial = 0; trial < 300; ++trial) {
    const size_t offset = rng() % 16, n = rng() % (trial < 100 ? 64 : data.size() - 16);
    const uint32_t want = strata::crc32c_extend_portable(0, data.data() + offset, n);
    EXPECT_EQ(strata::crc32c(data.data() + offset, n), want) << "offset " << offset << " n " << n;
    EXPECT_EQ(strata::crc32c_extend_portable(0, data.data() + offset, n), want);
    const size_t split = n ? rng() % n : 0;
    EXPECT_EQ(strata::crc32c_extend(strata::crc32c(data.data() + offset, split),
                                  data.data() + offset + split, n - split),
              want);
  }
}

// --- AtomicFile --------------------------------------------------------------------------------

TEST(AtomicFile, WritesReplacesAndLeavesNoTemporary) {
  ScratchDir dir;
  const auto path = dir.path() / "state.bin";
  ckpt::write_file_atomic(path.string(), "first version");
  EXPECT_EQ(slurp(path), "first version");
  {
    ckpt::AtomicFile f(path.string());
    f.write("second ");
    f.write(std::string(1000, 'x'));
    EXPECT_EQ(f.size(), 1007u);
    EXPECT_EQ(f.crc32c(), strata::crc32c("second " + std::string(1000, 'x')));
    EXPECT_EQ(slurp(path), "first version");  // untouched until commit
    f.commit();
  }
  EXPECT_EQ(slurp(path), "second " + std::string(1000, 'x'));
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"state.bin"});
  EXPECT_EQ(ckpt::read_file(path.string()), slurp(path));
}

TEST(AtomicFile, AbandonedWriterLeavesTheOldFile) {
  ScratchDir dir;
  const auto path = dir.path() / "state.bin";
  ckpt::write_file_atomic(path.string(), "old");
  {
    ckpt::AtomicFile f(path.string());
    f.write("new, never committed");
  }
  EXPECT_EQ(slurp(path), "old");
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"state.bin"});
}

TEST(AtomicFile, StaleTemporariesAreRecognisedAndRemoved) {
  ScratchDir dir;
  std::ofstream(dir.path() / ".a.ckpt.tmp-123-00ff") << "x";
  std::ofstream(dir.path() / ".b.ckpt.tmp-9-01") << "x";
  std::ofstream(dir.path() / "a.ckpt") << "keep";
  EXPECT_TRUE(ckpt::is_temporary_name(".a.ckpt.tmp-123-00ff"));
  EXPECT_FALSE(ckpt::is_temporary_name("a.ckpt"));
  ckpt::remove_stale_temporaries(dir.str(), "a.ckpt");
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{".b.ckpt.tmp-9-01", "a.ckpt"}));
  ckpt::remove_stale_temporaries(dir.str());
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"a.ckpt"});
}

TEST(AtomicFile, ErrorsNameThePathAndTheErrnoText) {
  ScratchDir dir;
  std::ofstream(dir.path() / "plain") << "a file";
  const std::string under_file = (dir.path() / "plain" / "x.ckpt").string();
  auto msg = error_of([&] { ckpt::write_file_atomic(under_file, "x"); });
  EXPECT_NE(msg.find(under_file), std::string::npos) << msg;
  EXPECT_NE(msg.find("Not a directory"), std::string::npos) << msg;

  const std::string missing = (dir.path() / "nope" / "x.ckpt").string();
  msg = error_of([&] { ckpt::write_file_atomic(missing, "x"); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;

  fs::create_directory(dir.path() / "a_folder");
  const std::string folder = (dir.path() / "a_folder").string();
  msg = error_of([&] { ckpt::write_file_atomic(folder, "x"); });
  EXPECT_NE(msg.find(folder), std::string::npos) << msg;
  EXPECT_NE(msg.find("Is a directory"), std::string::npos) << msg;
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"a_folder", "plain"}));

  const std::string dir_under_file = (dir.path() / "plain" / "sub").string();
  msg = error_of([&] { ckpt::make_directories(dir_under_file); });
  EXPECT_NE(msg.find((dir.path() / "plain").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a folder"), std::string::npos) << msg;

  msg = error_of([&] { ckpt::read_file(missing); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;

  if (geteuid() != 0) {  // root passes permission checks
    fs::create_directory(dir.path() / "readonly");
    fs::permissions(dir.path() / "readonly", fs::perms::owner_read | fs::perms::owner_exec);
    const std::string denied = (dir.path() / "readonly" / "x.ckpt").string();
    msg = error_of([&] { ckpt::write_file_atomic(denied, "x"); });
    EXPECT_NE(msg.find(denied), std::string::npos) << msg;
    EXPECT_NE(msg.find("Permission denied"), std::string::npos) << msg;
    fs::permissions(dir.path() / "readonly", fs::perms::owner_all);
  }
}

// A failing write (here the file-size limit: EFBIG) discards the temporary and keeps the target.
TEST(AtomicFile, FailedWriteKeepsTheOldFileAndRemovesTheTemporary) {
  ScratchDir dir;
  const std::string path = (dir.path() / "big.bin").string();
  ckpt::write_file_atomic(path, "old");
  const int rc = in_child([&] {
    signal(SIGXFSZ, SIG_IGN);
    rlimit limit{1 << 20, 1 << 20};
    setrlimit(RLIMIT_FSIZE, &limit);
    const std::string msg = error_of([&] { ckpt::write_file_atomic(path, std::string(2 << 20, 'x')); });
    if (msg.find(path) == std::string::npos || msg.find("File too large") == std::string::npos)
      return 1;
    return 0;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(slurp(path), "old");
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"big.bin"});
}

// The real ENOSPC, on a 64 KiB tmpfs in a private mount namespace (where this process may mount).
TEST(AtomicFile, FullDiskIsAnErrorNamingThePath) {
  ScratchDir dir;
  const std::string mnt = (dir.path() / "small").string();
  fs::create_directory(mnt);
  const int rc = in_child([&] {
    if (unshare(CLONE_NEWNS) != 0 || mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k") != 0)
      return 77;
    const std::string path = mnt + "/x.ckpt";
    const std::string msg = error_of([&] { ckpt::write_file_atomic(path, std::string(1 << 20, 'x')); });
    const bool ok = msg.find(path) != std::string::npos &&
                    msg.find("No space left on device") != std::string::npos &&
                    fs::is_empty(mnt);
    if (!ok) fprintf(stderr, "%s\n", msg.c_str());
    return ok ? 0 : 1;
  });
  if (rc == 77) GTEST_SKIP() << "cannot mount a small tmpfs here (needs CAP_SYS_ADMIN)";
  EXPECT_EQ(rc, 0);
}

// kill -9 a process that rewrites an 8 MiB file over and over: the file is always one whole
// version, never a mix, and versions only move forward.
TEST(AtomicFile, KillNineLeavesTheOldOrTheNewFile) {
  ScratchDir dir;
  const std::string path = (dir.path() / "versions.bin").string();
  strata::test::write_atomic_version(path, 0);
  std::mt19937 rng(std::random_device{}());
  uint64_t last = 0;
  for (int kill = 0; kill < 6; ++kill) {
    strata::test::KilledChild child({"atomic-loop", path, std::to_string(last + 1)});
    ASSERT_TRUE(child.started());
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 200));
    EXPECT_TRUE(child.kill_now());
    uint64_t now = 0;
    ASSERT_NO_THROW(now = strata::test::read_atomic_version(path)) << "after kill " << kill;
    EXPECT_GE(now, last);
    last = now;
  }
  ckpt::remove_stale_temporaries(dir.str());
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"versions.bin"});
  RecordProperty("last_version", std::to_string(last));
}

TEST(AtomicFile, ExchangeSwapsTwoFoldersInOneStep) {
  ScratchDir dir;
  fs::create_directories(dir.path() / "a");
  fs::create_directories(dir.path() / "b");
  std::ofstream(dir.path() / "a" / "from_a") << "a";
  std::ofstream(dir.path() / "b" / "from_b") << "b";
  if (!ckpt::exchange_paths((dir.path() / "a").string(), (dir.path() / "b").string()))
    GTEST_SKIP() << "no RENAME_EXCHANGE on this file system (commit() links and renames)";
  EXPECT_EQ(entries(dir.path() / "a"), std::vector<std::string>{"from_b"});
  EXPECT_EQ(entries(dir.path() / "b"), std::vector<std::string>{"from_a"});
}

// Hard links, or copies where there are none: `to` holds the same bytes, `from` stays whole.
TEST(AtomicFile, LinkFolderGivesEveryFileASecondName) {
  ScratchDir dir;
  const auto from = dir.path() / "from";
  fs::create_directories(from);
  std::ofstream(from / "a.ckpt") << "aaa";
  std::ofstream(from / "empty.ckpt");
  const std::string big(9 << 20, 'b');  // more than one copy chunk
  std::ofstream(from / "big.ckpt", std::ios::binary) << big;
  for (bool allow_link : {true, false}) {
    const auto to = dir.path() / (allow_link ? "linked" : "copied");
    ckpt::link_folder(from.string(), to.string(), allow_link);
    EXPECT_EQ(entries(to), (std::vector<std::string>{"a.ckpt", "big.ckpt", "empty.ckpt"}));
    EXPECT_EQ(slurp(to / "a.ckpt"), "aaa");
    EXPECT_EQ(slurp(to / "big.ckpt"), big);
    EXPECT_EQ(fs::hard_link_count(to / "a.ckpt"), allow_link ? 2u : 1u);
  }
  EXPECT_EQ(entries(from), (std::vector<std::string>{"a.ckpt", "big.ckpt", "empty.ckpt"}));
  const auto msg = error_of([&] {
    ckpt::link_folder(from.string(), (dir.path() / "linked").string());
  });
  EXPECT_NE(msg.find("linked"), std::string::npos) << msg;
  EXPECT_NE(msg.find("File exists"), std::string::npos) << msg;
}
