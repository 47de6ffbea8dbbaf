// The NVMe tier's io_uring file store (offload/nvme_store.h): bytes come back as written (sizes off
// the block grid, many requests at once, every aio setting), a flipped byte on disk is an error
// naming file and offset, bad places (missing, read-only, full, no O_DIRECT) fail before anything
// is written, and the folder's life (0600 files, fresh at start, gone at the end).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "offload/aligned_buffer.h"
#include "offload/nvme_store.h"
#include "runtime/error.h"
#include "tests/offload/build_fs_dir.h"

namespace {

namespace fs = std::filesystem;
using strata::offload::AlignedBuffer;
using strata::offload::NvmeOptions;
using strata::offload::NvmeStore;
using strata::offload::NvmeTicket;

// A folder on the build's file system (ext4 or the like: O_DIRECT works there; /tmp may be tmpfs).
class NvmeStoreTest : public strata::test_support::BuildFsDirTest {
 protected:
  NvmeStoreTest() : BuildFsDirTest("nvme-test") {}
};

void fill_random(std::byte* p, size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  for (size_t i = 0; i < n; ++i) p[i] = std::byte(gen() & 0xff);
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const strata::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST_F(NvmeStoreTest, RoundTripSizesOffTheBlockGrid) {
  NvmeOptions o;
  o.block_size = 64 << 10;  // many pieces per request
  o.queue_depth = 4;
  NvmeStore store(dir_.string(), "job1", 0, o);
  const uint64_t bs = uint64_t(o.block_size);
  const std::vector<uint64_t> sizes = {1, 100, 4095, 4096, 4097, bs - 1, bs, bs + 1,
                                       3 * bs + 5000, 17 * bs + 4096 * 3};
  for (size_t k = 0; k < sizes.size(); ++k) {
    for (uint64_t offset : {uint64_t(0), uint64_t(8192), bs - 4096}) {
      const uint64_t n = sizes[k];
      const std::string name = "f" + std::to_string(k) + "-" + std::to_string(offset);
      auto f = store.create(name, offset + n);
      AlignedBuffer out(n), in(n);
      fill_random(out.data(), n, uint32_t(k * 7 + offset));
      store.wait(store.write(f, offset, out.data(), n));
      std::memset(in.data(), 0xab, n);
      store.wait(store.read(f, offset, in.data(), n));
      ASSERT_EQ(std::memcmp(in.data(), out.data(), n), 0) << "size " << n << " offset " << offset;
      if (offset > 0) {  // never written: zeros, which check as such
        AlignedBuffer head(offset);
        store.wait(store.read(f, 0, head.data(), offset));
        for (uint64_t i = 0; i < offset; ++i) ASSERT_EQ(head.data()[i], std::byte(0));
      }
    }
  }
}

// Every combination of the aio settings, with far more requests than queue slots.
TEST_F(NvmeStoreTest, ManyConcurrentRequests) {
  for (int mode = 0; mode < 8; ++mode) {
    NvmeOptions o;
    o.block_size = 16 << 10;
    o.queue_depth = 3;
    o.intra_op_parallelism = (mode & 1) ? 2 : 1;
    o.single_submit = (mode & 2) != 0;
    o.overlap_events = (mode & 4) == 0;
    NvmeStore store(dir_.string(), "many", mode, o);
    const int requests = 64;
    const uint64_t each = 100'000;  // not a page multiple: every request has a tail page
    const uint64_t stride = strata::offload::round_up_io(each);
    auto f = store.create("data", stride * requests);
    auto g = store.create("other", stride * requests);
    AlignedBuffer out(stride * requests), in(stride * requests), in2(stride * requests);
    fill_random(out.data(), stride * requests, uint32_t(mode));
    std::vector<NvmeTicket> tickets;
    for (int r = 0; r < requests; ++r) {
      tickets.push_back(store.write(f, r * stride, out.data() + r * stride, each));
      tickets.push_back(store.write(g, r * stride, out.data() + r * stride, each));
    }
    store.wait_all();
    for (auto& t : tickets) EXPECT_TRUE(t.done());
    for (int r = requests - 1; r >= 0; --r) {
      store.read(f, r * stride, in.data() + r * stride, each);
      store.read(g, r * stride, in2.data() + r * stride, each);
    }
    store.wait_all();
    for (int r = 0; r < requests; ++r) {
      ASSERT_EQ(std::memcmp(in.data() + r * stride, out.data() + r * stride, each), 0)
          << "mode " << mode << " request " << r;
      ASSERT_EQ(std::memcmp(in2.data() + r * stride, out.data() + r * stride, each), 0);
    }
  }
}

TEST_F(NvmeStoreTest, FlippedByteIsNamedWithFileAndOffset) {
  NvmeOptions o;
  o.block_size = 256 << 10;
  NvmeStore store(dir_.string(), "flip", 0, o);
  const uint64_t n = 2 << 20;
  auto f = store.create("state", n);
  AlignedBuffer out(n), in(n);
  fill_random(out.data(), n, 5);
  store.wait(store.write(f, 0, out.data(), n));
  {  // another writer changes one byte behind the store's back
    const int fd = open(store.path(f).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const char x = char(~char(out.data()[1'000'000]));
    ASSERT_EQ(pwrite(fd, &x, 1, 1'000'000), 1);
    fsync(fd);
    close(fd);
  }
  const std::string err = error_of([&] { store.wait(store.read(f, 0, in.data(), n)); });
  EXPECT_NE(err.find("checksum mismatch"), std::string::npos) << err;
  EXPECT_NE(err.find(store.path(f)), std::string::npos) << err;
  EXPECT_NE(err.find("offset 999424"), std::string::npos) << err;  // the page holding the byte
  // The pages around it still read back; wait_all does not report the error twice.
  EXPECT_NO_THROW(store.wait(store.read(f, 0, in.data(), 999424)));
  EXPECT_NO_THROW(store.wait_all());
  EXPECT_EQ(std::memcmp(in.data(), out.data(), 999424), 0);
}

TEST_F(NvmeStoreTest, IoErrorNamesFileOffsetAndErrno) {
  NvmeStore store(dir_.string(), "short", 0);
  auto f = store.create("gone", 1 << 20);
  AlignedBuffer buf(1 << 20);
  ASSERT_EQ(truncate(store.path(f).c_str(), 0), 0);  // reads now end early: no progress
  const std::string err = error_of([&] { store.wait(store.read(f, 0, buf.data(), 1 << 20)); });
  EXPECT_NE(err.find("read of file '" + store.path(f) + "' at offset 0"), std::string::npos) << err;
  EXPECT_NE(err.find("(61)"), std::string::npos) << err;  // ENODATA
}

TEST_F(NvmeStoreTest, BadRequestsAreRefused) {
  NvmeStore store(dir_.string(), "bad", 0);
  auto f = store.create("x", 10000);
  AlignedBuffer buf(20000);
  EXPECT_NE(error_of([&] { store.write(f, 100, buf.data(), 10); }).find("multiples of 4096"),
            std::string::npos);
  EXPECT_NE(error_of([&] { store.write(f, 4096, buf.data(), 9000); }).find("runs past"),
            std::string::npos);
  EXPECT_NE(error_of([&] { store.read(f, 0, buf.data() + 8, 10); }).find("4096-aligned"),
            std::string::npos);
  EXPECT_NE(error_of([&] { store.create("x", 1); }).find("exists already"), std::string::npos);
  EXPECT_NE(error_of([&] { store.create("../y", 1); }).find("plain name"), std::string::npos);
  EXPECT_NE(error_of([&] { store.file("nope"); }).find("no file 'nope'"), std::string::npos);
  EXPECT_NE(error_of([&] { NvmeStore s(dir_.string(), "a/b", 0); }).find("job id"),
            std::string::npos);
  NvmeOptions o;
  o.block_size = 1000;
  EXPECT_NE(error_of([&] { NvmeStore s(dir_.string(), "j", 0, o); }).find("block_size 1000"),
            std::string::npos);
  store.wait(store.write(f, 0, buf.data(), 0));  // nothing to do, done at once
}

TEST_F(NvmeStoreTest, MissingDirectoryIsRefused) {
  const std::string missing = (dir_ / "not-there").string();
  const std::string err = error_of([&] { NvmeStore s(missing, "job", 0); });
  EXPECT_NE(err.find("nvme_path '" + missing + "'"), std::string::npos) << err;
  EXPECT_NE(err.find("No such file"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(missing));  // not created behind the user's back
}

// Root writes anywhere, so a read-only folder is tried as nobody (a child process) when root.
TEST_F(NvmeStoreTest, ReadOnlyDirectoryIsRefusedBeforeWriting) {
  char tmpl[] = "/tmp/strata-ro-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string ro = tmpl;
  ASSERT_EQ(chmod(ro.c_str(), 0555), 0);
  auto attempt = [&]() -> std::string { return error_of([&] { NvmeStore s(ro, "job", 0); }); };
  if (geteuid() != 0) {
    const std::string err = attempt();
    EXPECT_NE(err.find("is not writable"), std::string::npos) << err;
  } else {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
      _exit(attempt().find("is not writable") != std::string::npos ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  EXPECT_TRUE(fs::is_empty(ro));
  chmod(ro.c_str(), 0700);
  fs::remove_all(ro);
}

TEST_F(NvmeStoreTest, FreeSpaceIsCheckedWithBytesNamed) {
  const uint64_t absurd = 1ull << 60;
  std::string err = error_of([&] { NvmeStore s(dir_.string(), "big", 0, {}, absurd); });
  EXPECT_NE(err.find("needs " + std::to_string(absurd) + " bytes"), std::string::npos) << err;
  EXPECT_NE(err.find("available"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(NvmeStore::folder_for(dir_.string(), "big", 0)));  // cleaned up
  NvmeStore store(dir_.string(), "big", 0);
  err = error_of([&] { store.create("huge", absurd); });
  EXPECT_NE(err.find("file 'huge' needs"), std::string::npos) << err;
}

TEST_F(NvmeStoreTest, FolderPerJobAndRankFilesPrivateRemovedAtEnd) {
  std::string folder, path;
  // Declared before the store: a write's buffer must outlive its ticket (nvme_store.h), and the
  // store's destructor is what waits for the write below (AddressSanitizer caught the buffer
  // freed first while the worker still read it).
  AlignedBuffer buf(5000);
  {
    NvmeStore a(dir_.string(), "job7", 3);
    NvmeStore b(dir_.string(), "job7", 4);  // ranks of one node share nvme_path
    folder = a.folder();
    EXPECT_EQ(folder, (dir_ / "strata-job7-rank3").string());
    EXPECT_NE(a.folder(), b.folder());
    auto f = a.create("m", 5000);
    path = a.path(f);
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    ASSERT_EQ(stat(folder.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    EXPECT_TRUE(a.direct());
    a.write(f, 0, buf.data(), 5000);  // still in flight at destruction: waited for
  }
  EXPECT_FALSE(fs::exists(folder));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(NvmeStoreTest, StaleFolderIsReplacedByAFreshOne) {
  const std::string folder = NvmeStore::folder_for(dir_.string(), "again", 0);
  fs::create_directories(folder + "/sub");
  std::ofstream(folder + "/m") << "stale bytes of a dead run";
  NvmeStore store(dir_.string(), "again", 0);
  EXPECT_FALSE(fs::exists(folder + "/sub"));
  auto f = store.create("m", 4096);
  AlignedBuffer buf(4096);
  store.wait(store.read(f, 0, buf.data(), 4096));
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(buf.data()[i], std::byte(0));
}

// A process SIGKILLed in the middle of writing its swap file leaves its folder behind, locked by
// nobody: the next store of any job removes it, the same job starts afresh (never reading the
// dead run's bytes), and live stores are neither removed nor shared.
TEST_F(NvmeStoreTest, FolderOfAKilledRunIsRemovedAndNeverRead) {
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    NvmeStore store(dir_.string(), "killed", 0);
    const uint64_t bytes = 8 << 20;
    auto f = store.create("state", bytes);
    AlignedBuffer buf(bytes);
    std::memset(buf.data(), 0x5a, bytes);
    store.wait(store.write(f, 0, buf.data(), bytes));
    if (write(ready[1], "x", 1) != 1) _exit(2);
    for (;;) store.wait(store.write(f, 0, buf.data(), bytes));  // swapping when the kill comes
  }
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  close(ready[0]);
  close(ready[1]);
  const std::string dead = NvmeStore::folder_for(dir_.string(), "killed", 0);
  ASSERT_TRUE(fs::exists(dead + "/state"));  // what SIGKILL leaves
  // The kernel releases a dead process's files once its io_uring rings are torn down, which it
  // does asynchronously: wait for the lock to come free (a new run starts later than this).
  const int lock = open((dead + "/.lock").c_str(), O_RDWR);
  ASSERT_GE(lock, 0);
  bool free = false;
  for (int i = 0; i < 200 && !free; ++i) {
    free = flock(lock, LOCK_EX | LOCK_NB) == 0;
    if (!free) usleep(50 * 1000);
  }
  close(lock);
  ASSERT_TRUE(free) << "the killed process's lock was not released within 10 s";

  {
    // Another job's store removes the dead run's folder; the next one leaves the live one's.
    NvmeStore live(dir_.string(), "live", 0);
    ASSERT_EQ(live.removed_abandoned(), std::vector<std::string>{dead});
    EXPECT_FALSE(fs::exists(dead));
    NvmeStore next(dir_.string(), "next", 0);
    EXPECT_TRUE(next.removed_abandoned().empty());
    EXPECT_TRUE(fs::exists(live.folder()));
    // The same job and rank while the first lives: refused, nothing removed.
    const std::string err = error_of([&] { NvmeStore twin(dir_.string(), "live", 0); });
    EXPECT_NE(err.find("in use by another live process"), std::string::npos) << err;
    EXPECT_TRUE(fs::exists(live.folder() + "/.lock"));
  }
  EXPECT_TRUE(fs::is_empty(dir_));

  // Killed again, then the same job comes back: a fresh folder whose pages read as zeros.
  const pid_t again = fork();
  ASSERT_GE(again, 0);
  if (again == 0) {
    NvmeStore store(dir_.string(), "killed", 0);
    auto f = store.create("state", 4096);
    AlignedBuffer buf(4096);
    std::memset(buf.data(), 0x5a, 4096);
    store.wait(store.write(f, 0, buf.data(), 4096));
    raise(SIGKILL);
  }
  ASSERT_EQ(waitpid(again, &status, 0), again);
  ASSERT_TRUE(fs::exists(dead + "/state"));
  NvmeStore store(dir_.string(), "killed", 0);
  auto f = store.create("state", 4096);
  AlignedBuffer buf(4096);
  store.wait(store.read(f, 0, buf.data(), 4096));
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(buf.data()[i], std::byte(0));
}

// A file system without O_DIRECT (tmpfs before Linux 6.6): a clear error, or buffered I/O when
// allowed. Tried on /dev/shm where it refuses O_DIRECT, and through the test hook everywhere.
void no_direct_case(const std::string& dir) {
  const std::string err = error_of([&] { NvmeStore s(dir, "job", 0); });
  EXPECT_NE(err.find("does not support O_DIRECT"), std::string::npos) << err;
  EXPECT_NE(err.find(dir), std::string::npos) << err;
  EXPECT_TRUE(fs::is_empty(dir));
  NvmeOptions o;
  o.allow_buffered = true;
  {
    NvmeStore store(dir, "job", 0, o);
    EXPECT_FALSE(store.direct());
    auto f = store.create("b", 300'000);
    std::vector<std::byte> out(300'000), in(300'000);  // any buffer will do without O_DIRECT
    fill_random(out.data(), out.size(), 9);
    store.wait(store.write(f, 0, out.data(), out.size()));
    store.wait(store.read(f, 0, in.data(), in.size()));
    EXPECT_EQ(in, out);
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST_F(NvmeStoreTest, NoDirectIoIsRefusedOrBuffered) {
  NvmeStore::pretend_no_direct_for_tests(true);
  no_direct_case(dir_.string());
  NvmeStore::pretend_no_direct_for_tests(false);
}

TEST_F(NvmeStoreTest, TmpfsWithoutDirectIoIsRefusedOrBuffered) {
  struct statfs sf {};
  if (statfs("/dev/shm", &sf) != 0 || sf.f_type != 0x01021994 /* TMPFS_MAGIC */)
    GTEST_SKIP() << "/dev/shm is not tmpfs here";
  char tmpl[] = "/dev/shm/strata-nvme-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string shm = tmpl;
  const int fd = open((shm + "/p").c_str(), O_CREAT | O_RDWR | O_DIRECT, 0600);
  if (fd >= 0) {
    close(fd);
    fs::remove_all(shm);
    GTEST_SKIP() << "tmpfs has O_DIRECT on this kernel (Linux >= 6.6): the hook covered it";
  }
  no_direct_case(shm);
  fs::remove_all(shm);
}

}  // namespace
