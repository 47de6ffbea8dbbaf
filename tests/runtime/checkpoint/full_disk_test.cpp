// Disk trouble while the engine saves a checkpoint: the error names the file being written and
// the disk's complaint, and `latest` still loads the previous checkpoint. A full file system
// (a 1 MiB tmpfs, filled to leave 0, 4, 8 ... KiB; where mounting is not allowed the test
// skips) and a file-size limit (RLIMIT_FSIZE, in every environment).
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/error.h"
#include "tests/runtime/checkpoint/child_process.h"
#include "tests/runtime/checkpoint/engine_model.h"
#include "tests/runtime/checkpoint/scratch_dir.h"

namespace {

using strata::test::ScratchDir;

// Runs `checkpoint_tool full-disk-sweep MNT` in a mount namespace of its own with a 1 MiB tmpfs
// on MNT; its output, or nothing when no tmpfs could be mounted.
std::string sweep_on_small_tmpfs(const std::string& mnt, int* rc) {
  int out[2];
  if (::pipe(out) != 0) throw std::runtime_error("pipe failed");
  const std::string tool = strata::test::checkpoint_tool();
  const pid_t pid = ::fork();
  if (pid == 0) {  // only system calls until exec: this process holds LibTorch's threads
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=1m") != 0)
      ::_exit(77);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::execl(tool.c_str(), tool.c_str(), "full-disk-sweep", mnt.c_str(), nullptr);
    ::_exit(127);
  }
  ::close(out[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) text.append(buf, size_t(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return text;
}

}  // namespace

TEST(FullDisk, EveryPointOfASaveThatRunsOutOfSpaceLeavesThePreviousCheckpoint) {
  ScratchDir tmp;
  const std::string mnt = tmp.str() + "/small";
  ASSERT_EQ(::mkdir(mnt.c_str(), 0700), 0);
  int rc = 0;
  const std::string output = sweep_on_small_tmpfs(mnt, &rc);
  if (rc == 77) GTEST_SKIP() << "cannot mount a small tmpfs here (needs CAP_SYS_ADMIN)";
  ASSERT_EQ(rc, 0) << output;
  std::istringstream lines(output);
  std::set<std::string> failed_files;
  int failed = 0, completed = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("free ", 0) != 0) continue;
    const bool ok = line.find(": ok |") != std::string::npos;
    // A failed save leaves `latest` at step 2; a completed one moved it to step 3.
    EXPECT_NE(line.find(ok ? "loads step 3" : "loads step 2"), std::string::npos) << line;
    if (ok) {
      ++completed;
      continue;
    }
    ++failed;
    EXPECT_NE(line.find("No space left on device"), std::string::npos) << line;
    for (const char* file : {"model_states.ckpt", "optim_states.ckpt", "manifest.json", "latest"})
      if (line.find(std::string("/") + file + "'") != std::string::npos) failed_files.insert(file);
    EXPECT_NE(line.find("cannot write '" + mnt + "/ck"), std::string::npos) << line;
  }
  std::string named;
  for (const auto& f : failed_files) named += " " + f;
  std::printf("[full disk] %d saves ran out of space (in%s), %d completed; each failure left "
              "the previous checkpoint loadable\n",
              failed, named.c_str(), completed);
  EXPECT_GE(failed_files.size(), 3u) << output;
  EXPECT_GE(completed, 1) << output;
}

// A file-size limit makes write(2) fail with EFBIG (SIGXFSZ ignored), at the first tensor file or
// the second: the error names it, and the previous checkpoint loads.
TEST(FullDisk, AFileSizeLimitFailsTheSaveNamingTheFile) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  torch::manual_seed(1);
  strata::test::TinyNet model;
  auto engine = strata::initialize(model, strata::test::tiny_config(1));
  strata::test::train_tiny(engine, 2);
  engine->save_checkpoint(dir);
  const auto model_bytes =
      strata::checkpoint::FileReader(dir + "/global_step2/model_states.ckpt").size();
  strata::test::train_tiny(engine, 1);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  for (const auto& [limit, file] : {std::pair{rlim_t(100), "model_states.ckpt"},
                                    std::pair{rlim_t(model_bytes + 64), "optim_states.ckpt"}}) {
    rlimit small = saved;
    small.rlim_cur = limit;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    std::string error = "(no error)";
    try {
      engine->save_checkpoint(dir);
    } catch (const strata::Error& e) {
      error = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    EXPECT_NE(error.find("cannot write '" + dir + "/.global_step3.partial/" + file + "'"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("File too large"), std::string::npos) << error;
    strata::test::TinyNet fresh;
    auto resumed = strata::initialize(fresh, strata::test::tiny_config(1));
    resumed->load_checkpoint(dir);
    EXPECT_EQ(resumed->global_steps(), 2);
  }
  ::signal(SIGXFSZ, old_handler);
  engine->save_checkpoint(dir);  // with room again, the same tag saves over what was left
  strata::test::TinyNet fresh;
  auto resumed = strata::initialize(fresh, strata::test::tiny_config(1));
  resumed->load_checkpoint(dir);
  EXPECT_EQ(resumed->global_steps(), 3);
}
