// The tools as processes on a damaged checkpoint: train_gpt saves a tiny-model checkpoint
// (ZeRO stage 1), then one bit is flipped at a time and `strata-ckpt consolidate` and
// `train_gpt --resume` must each exit 1 with an error naming the damaged file (never 0, never
// a signal, never a hang). In process, flipped_checkpoint_test.cpp covers every byte of every
// file through the same entry points; a process costs half a second of LibTorch start-up, so by
// default this samples: every byte of `latest`, and bytes spread over the manifest, each
// file's footer (meta and tail) and payload. STRATA_HOSTILE_TOOLS=all runs every byte of
// `latest`, the manifest and the footers plus 300 payload offsets (hours on 2 cores), and
// STRATA_HOSTILE_TOOLS_JOBS=N runs N cases at once. Under a sanitizer (tests/sanitized.h: a
// process starts in 2 s there) the sampled regions take half as many offsets.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "runtime/checkpoint/atomic_file.h"
#include "tests/runtime/checkpoint/hostile_util.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/sanitized.h"

namespace ckpt = strata::checkpoint;

namespace {

struct ToolRun {
  int code = 0;  // exit code, or 128 + the signal
  std::string output;
};

// Runs argv with stdout and stderr captured; killed (and reported as 128 + 9) after 120 s.
ToolRun run(const std::vector<std::string>& argv) {
  int out[2];  // close-on-exec: another worker's child must not hold this pipe open
  if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::alarm(120);  // survives exec: a hung tool gets SIGALRM
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out[1]);
  ToolRun r;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) r.output.append(buf, size_t(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

std::string bin(const char* name) { return std::string(STRATA_BIN_DIR) + "/" + name; }

struct Case {
  std::string file;  // relative to the checkpoint folder
  std::string region;
  uint64_t offset;
};

// `count` offsets spread over [begin, end) (all of them when count covers it).
void spread(std::vector<Case>& cases, const std::string& file, const std::string& region,
            uint64_t begin, uint64_t end, uint64_t count) {
  if (end <= begin) return;
  const uint64_t n = std::min(count, end - begin);
  for (uint64_t k = 0; k < n; ++k) cases.push_back({file, region, begin + k * (end - begin) / n});
}

struct Tally {
  int runs = 0, refused = 0, signals = 0;
};

}  // namespace

TEST(CheckpointTools, DamagedCheckpointsAreRefusedByStrataCkptAndTrainGpt) {
  const char* mode = std::getenv("STRATA_HOSTILE_TOOLS");
  const bool all = mode && std::string(mode) == "all";
  const char* jobs_env = std::getenv("STRATA_HOSTILE_TOOLS_JOBS");
  const int jobs = std::max(1, jobs_env ? std::atoi(jobs_env) : 1);
  strata::test::ScratchDir tmp;
  const std::string config = tmp.str() + "/stage1.json", source = tmp.str() + "/ck";
  std::ofstream(config) << R"({"train_micro_batch_size_per_gpu": 8, "steps_per_print": 100,
      "zero_optimization": {"stage": 1},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})";
  const std::vector<std::string> train = {bin("train_gpt"), "--config", config, "--model", "tiny"};
  auto with = [](std::vector<std::string> v, std::vector<std::string> more) {
    v.insert(v.end(), more.begin(), more.end());
    return v;
  };
  const ToolRun saved = run(with(train, {"--steps", "2", "--save-dir", source}));
  ASSERT_EQ(saved.code, 0) << saved.output;

  // The cases: latest, the manifest, and each tensor file's footer and payload.
  std::vector<Case> cases;
  spread(cases, "latest", "latest", 0, ckpt::read_file(source + "/latest").size(), 1 << 20);
  const std::string tag = ckpt::read_file(source + "/latest");
  const uint64_t manifest = ckpt::FileReader(source + "/" + tag + "/manifest.json").size();
  const uint64_t fewer = strata::test::kSanitized ? 2 : 1;
  spread(cases, tag + "/manifest.json", "manifest", 0, manifest, all ? manifest : 12 / fewer);
  for (const char* name : {"model_states.ckpt", "optim_states.ckpt"}) {
    const std::string file = tag + "/" + name, bytes = ckpt::read_file(source + "/" + file);
    const uint64_t footer = 24 + strata::test::le_value(bytes, bytes.size() - 24, 8);
    const uint64_t payload = bytes.size() - footer;
    spread(cases, file, "footer", payload, bytes.size(), all ? footer : 8 / fewer);
    spread(cases, file, "payload", 0, payload, all ? 150 : fewer > 1 ? 2 : 3);
  }

  std::mutex mutex;
  std::map<std::string, Tally> tally;  // "tool region"
  std::atomic<size_t> next{0};
  auto worker = [&](int id) {
    // Each worker damages its own copy.
    const std::string dir = tmp.str() + "/w" + std::to_string(id);
    ckpt::make_directories(dir + "/" + tag);
    for (const auto& name : {std::string("latest"), tag + "/manifest.json",
                             tag + "/model_states.ckpt", tag + "/optim_states.ckpt",
                             tag + "/zero_pp_rank_0_rng_states.ckpt"})
      ckpt::write_file_atomic(dir + "/" + name, ckpt::read_file(source + "/" + name));
    for (size_t i; (i = next++) < cases.size();) {
      const Case& c = cases[i];
      const std::string path = dir + "/" + c.file, good = ckpt::read_file(path);
      std::string bad = good;
      bad[c.offset] = char(bad[c.offset] ^ (1 << (c.offset % 8)));
      strata::test::write_bytes(path, bad);
      const std::string named = c.file == "latest" ? dir : path;
      const std::vector<std::pair<std::string, ToolRun>> results = {
          {"strata-ckpt", run({bin("strata-ckpt"), "consolidate", dir, "--out", dir + "/out.pt"})},
          {"train_gpt", run(with(train, {"--steps", "3", "--resume", dir}))}};
      strata::test::write_bytes(path, good);
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto& [tool, r] : results) {
        auto& t = tally[tool + " " + c.region];
        ++t.runs;
        if (r.code > 128) ++t.signals;
        const bool ok = r.code == 1 && r.output.find("error") != std::string::npos &&
                        r.output.find(named) != std::string::npos;
        t.refused += ok;
        EXPECT_TRUE(ok) << tool << ", " << c.file << " byte " << c.offset << ": exit " << r.code
                        << "\n"
                        << r.output.substr(r.output.size() > 2000 ? r.output.size() - 2000 : 0);
      }
    }
  };
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int j = 0; j < jobs; ++j) threads.emplace_back(worker, j);
  for (auto& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& [what, t] : tally)
    std::printf("[tools] %-24s %5d runs: %5d refused with exit 1 naming the file, %d signals\n",
                what.c_str(), t.runs, t.refused, t.signals);
  std::printf("[tools] %zu damaged checkpoints, 2 tools each, %.0f s (%s)\n", cases.size(),
              seconds, all ? "every byte" : "a sample; STRATA_HOSTILE_TOOLS=all for every byte");

  // Undamaged again: both tools succeed.
  const std::string dir = tmp.str() + "/w0";
  EXPECT_EQ(run({bin("strata-ckpt"), "consolidate", dir, "--out", dir + "/out.pt"}).code, 0);
  EXPECT_EQ(run(with(train, {"--steps", "3", "--resume", dir})).code, 0);
}
