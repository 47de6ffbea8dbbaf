// The chaos test (issue 15): the real train_gpt (--model tiny, CPU, Gloo) on 4 ranks, one of them
// SIGKILLed at a random moment.
//
// - Under strata-run, at ZeRO stage 2 and stage 3, checkpointing every 2 of 8 steps: for each
//   seed of a fixed list a random rank is killed at start-up, during a checkpoint save, or at any
//   moment of the run (the seed picks which, and the random delay). The job must end within 15 s of
//   the kill with a non-zero code and the dead rank named, with no process of the run left; then
//   the run resumed from `latest` (from scratch when no checkpoint was committed) must reach the
//   losses of an uninterrupted run, bit for bit (train_gpt's --metrics-jsonl writes each loss as
//   a round-trip double).
// - As bare processes (the variables strata-run would set, no launcher): the launcher cannot stop
//   the others, so the engine must: Gloo sees the dead peer's sockets close and the heartbeats
//   name it, or, when it dies before the rendezvous, STRATA_TIMEOUT ends the wait. Each survivor
//   must exit non-zero within 15 s with an error naming the dead rank.
//
// Every process is started here in its own process group and found again by a marker (the run's
// folder, in its command line), never by a global name. STRATA_CHAOS_RUNS=N runs N seeds per
// stage instead of 10 (3 under a sanitizer). A table per test goes to stdout: kill_s (the kill,
// seconds after the launch), phase (the last progress line seen then), end_s (from the kill to
// the end of the run's last process), code (strata-run's exit code; bare: a survivor's), named,
// left (processes of the run left over), latest (`latest` after the kill), torn (save folders the
// kill cut short), resume (where the resumed run started), exact (its losses and learning rates
// bit for bit).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/examples/train_gpt_runs.h"
#include "tests/launcher/launcher_process.h"
#include "tests/sanitized.h"

extern char** environ;

namespace {

using nlohmann::json;
using Env = std::vector<std::pair<std::string, std::string>>;

constexpr int kRanks = 4;
constexpr int kSteps = 8;
constexpr int kSaveEvery = 2;
constexpr double kEndLimit = 15;  // seconds from the kill to the end of every process of the run

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A child in its own process group; its stdout and stderr go into one pipe that a thread reads,
// keeping each line with the time it arrived.
class Job {
 public:
  Job(const std::vector<std::string>& argv, const Env& env) {
    // Everything execve needs is built before fork: other jobs' reader threads run meanwhile,
    // and the child may call only async-signal-safe functions.
    for (char** e = environ; *e; ++e) {
      const std::string var = *e;
      const std::string name = var.substr(0, var.find('='));
      if (std::none_of(env.begin(), env.end(), [&](const auto& kv) { return kv.first == name; }))
        env_.push_back(var);
    }
    for (const auto& [name, value] : env) env_.push_back(name + "=" + value);
    argv_ = argv;
    std::vector<char*> args, envp;
    for (auto& a : argv_) args.push_back(a.data());
    args.push_back(nullptr);
    for (auto& e : env_) envp.push_back(e.data());
    envp.push_back(nullptr);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) std::abort();
    started_ = now();
    pid_ = ::fork();
    if (pid_ < 0) std::abort();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      const int null = ::open("/dev/null", O_RDONLY);
      if (null >= 0) ::dup2(null, STDIN_FILENO);
      ::execve(args[0], args.data(), envp.data());
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);
    ::close(fds[1]);
    fd_ = fds[0];
    reader_ = std::thread([this] { read_loop(); });
  }

  ~Job() {
    if (!reaped_) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    stop_ = true;
    reader_.join();
    ::close(fd_);
  }

  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  pid_t pid() const { return pid_; }
  double started() const { return started_; }

  // Its exit code (128 + signal when killed) once it has exited, reaping it; nullopt before.
  std::optional<int> exited() {
    if (!reaped_) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
      reaped_ = true;
      ended_ = now();
      code_ = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
    }
    return code_;
  }
  double ended() const { return ended_; }

  // Waits for the exit; nullopt when `timeout_s` passed first (the job is left running).
  std::optional<int> wait(double timeout_s) {
    const double deadline = now() + timeout_s;
    while (!exited() && now() < deadline) sleep_ms(2);
    return exited();
  }

  // Waits for the pipe's end (every writer gone), at most `timeout_s`.
  bool wait_eof(double timeout_s) {
    const double deadline = now() + timeout_s;
    while (!eof_ && now() < deadline) sleep_ms(5);
    return eof_;
  }

  std::string output() const {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }

  // When the first line containing `what` arrived (complete lines only), if one has.
  std::optional<double> when(const std::string& what) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [t, line] : lines_)
      if (line.find(what) != std::string::npos) return t;
    return std::nullopt;
  }

  // The last complete line containing `what`, or "".
  std::string last_line(const std::string& what) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = lines_.rbegin(); it != lines_.rend(); ++it)
      if (it->second.find(what) != std::string::npos) return it->second;
    return "";
  }

 private:
  void read_loop() {
    std::string partial;
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      char buf[65536];
      const ssize_t n = ::read(fd_, buf, sizeof buf);
      if (n <= 0) {
        eof_ = true;
        return;
      }
      const double t = now();
      std::lock_guard<std::mutex> lock(mu_);
      text_.append(buf, static_cast<size_t>(n));
      partial.append(buf, static_cast<size_t>(n));
      for (size_t end; (end = partial.find('\n')) != std::string::npos;) {
        lines_.emplace_back(t, partial.substr(0, end));
        partial.erase(0, end + 1);
      }
    }
  }

  std::vector<std::string> argv_, env_;
  pid_t pid_ = -1;
  int fd_ = -1;
  double started_ = 0, ended_ = 0;
  bool reaped_ = false;
  int code_ = -1;
  std::atomic<bool> stop_{false}, eof_{false};
  mutable std::mutex mu_;
  std::string text_;
  std::vector<std::pair<double, std::string>> lines_;
  std::thread reader_;
};

// The command line of a process, NULs as spaces; "" for a zombie or a process gone.
std::string cmdline_of(pid_t pid) {
  std::string text = slurp("/proc/" + std::to_string(pid) + "/cmdline");
  for (char& c : text) c = c == '\0' ? ' ' : c;
  return text;
}

std::vector<pid_t> all_pids() {
  std::vector<pid_t> pids;
  DIR* proc = ::opendir("/proc");
  while (dirent* e = proc ? ::readdir(proc) : nullptr) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (*end == '\0' && end != e->d_name && pid != ::getpid()) pids.push_back(pid_t(pid));
  }
  if (proc) ::closedir(proc);
  return pids;
}

// The train_gpt process of the run `marker` whose environment says RANK=rank, or -1.
pid_t find_rank(const std::string& marker, int rank) {
  const std::string train_gpt = std::string(STRATA_BIN_DIR) + "/train_gpt ";
  const std::string want = std::string("RANK=") + std::to_string(rank);
  for (pid_t pid : all_pids()) {
    const std::string cmdline = cmdline_of(pid);
    if (cmdline.rfind(train_gpt, 0) != 0 || cmdline.find(marker) == std::string::npos) continue;
    const std::string env = slurp("/proc/" + std::to_string(pid) + "/environ");
    for (size_t at = 0; at < env.size();) {
      const size_t end = std::min(env.find('\0', at), env.size());
      if (env.compare(at, end - at, want) == 0) return pid;
      at = end + 1;
    }
  }
  return -1;
}

// SIGKILLs what is left of the run `marker` (processes this test started), returning how many.
int kill_leftovers(const std::string& marker) {
  int n = 0;
  for (pid_t pid : all_pids())
    if (cmdline_of(pid).find(marker) != std::string::npos) n += ::kill(pid, SIGKILL) == 0;
  return n;
}

std::string step_text(int step) {  // train_gpt's progress line: "step 3/8 | loss ..."
  char text[64];
  std::snprintf(text, sizeof text, "step %*d/%d |", int(std::to_string(kSteps).size()), step,
                kSteps);
  return text;
}

// The last step whose progress line has arrived ("start-up" before the first).
std::string phase_of(const Job& job) {
  for (int s = kSteps; s >= 1; --s)
    if (job.when(step_text(s))) return "after step " + std::to_string(s);
  return "start-up";
}

struct Paths {
  std::string root;  // every run's folder is below it: the marker of its processes
  Paths() {
    root = testing::TempDir() + "/strata_chaos_" + std::to_string(::getpid());
    ::mkdir(root.c_str(), 0755);
  }
  ~Paths() {  // kept when the test failed, to be looked at
    std::error_code ignored;
    if (!testing::Test::HasFailure()) std::filesystem::remove_all(root, ignored);
  }
  std::string config(int stage) const {
    const std::string path = root + "/stage" + std::to_string(stage) + ".json";
    json config;
    std::ifstream(std::string(STRATA_SOURCE_DIR) + "/configs/gpt_tiny_dp.json") >> config;
    config.erase("launcher");
    if (stage == 3) {  // units really released: gathers and releases on every step
      config["zero_optimization"] = {{"stage", 3},
                                     {"stage3_param_persistence_threshold", 0},
                                     {"stage3_prefetch_bucket_size", 50000},
                                     {"stage3_max_live_parameters", 100000},
                                     {"stage3_max_reuse_distance", 0}};
    } else {
      config["zero_optimization"] = {{"stage", stage}, {"reduce_bucket_size", 20000}};
    }
    std::ofstream(path) << config.dump(1);
    return path;
  }
  std::string run(const std::string& name) const {  // a fresh folder; "/" at the end
    const std::string dir = root + "/" + name + "/";
    ::mkdir(dir.c_str(), 0755);
    return dir;
  }
};

std::vector<std::string> train_args(const std::string& config, const std::string& run,
                                    const std::string& metrics, bool resume) {
  std::vector<std::string> args = {std::string(STRATA_BIN_DIR) + "/train_gpt",
                                   "--device", "cpu", "--model", "tiny", "--config", config,
                                   "--steps", std::to_string(kSteps),
                                   "--save-dir", run + "ckpt",
                                   "--save-every", std::to_string(kSaveEvery),
                                   "--metrics-jsonl", run + metrics};
  if (resume) {
    args.push_back("--resume");
    args.push_back(run + "ckpt");
  }
  return args;
}

std::vector<std::string> launched(const std::vector<std::string>& args) {
  std::vector<std::string> all = {strata::test::launcher_path(), "--nproc-per-node",
                                  std::to_string(kRanks), "--"};
  all.insert(all.end(), args.begin(), args.end());
  return all;
}

// The uninterrupted run: its losses, and when things happened (seconds from the launch).
struct Reference {
  std::vector<json> rows;
  double first_step = 0;  // the first progress line
  double last_but_one = 0;  // the progress line of step kSteps-1
  double save = 0;        // the longest save: a progress line to its "saved checkpoint"
  double total = 0;
};

Reference reference_run(const Paths& paths, int stage) {
  const std::string run = paths.run("reference_stage" + std::to_string(stage));
  Job job(launched(train_args(paths.config(stage), run, "metrics.jsonl", false)), {});
  const auto code = job.wait(300);
  EXPECT_EQ(code, 0) << job.output();
  job.wait_eof(5);
  Reference ref;
  ref.rows = train_gpt_runs::read_jsonl(run + "metrics.jsonl");
  EXPECT_EQ(ref.rows.size(), size_t(kSteps)) << job.output();
  ref.total = job.ended() - job.started();
  ref.first_step = job.when(step_text(1)).value_or(now()) - job.started();
  ref.last_but_one = job.when(step_text(kSteps - 1)).value_or(now()) - job.started();
  for (int s = kSaveEvery; s <= kSteps; s += kSaveEvery) {
    const auto begin = job.when(step_text(s));
    const auto end = job.when("saved checkpoint " + run + "ckpt/step" + std::to_string(s));
    if (begin && end) ref.save = std::max(ref.save, *end - *begin);
  }
  std::printf("chaos: reference at stage %d: %zu steps in %.2f s (first step at %.2f s, saves up "
              "to %.0f ms)\n",
              stage, ref.rows.size(), ref.total, ref.first_step, ref.save * 1e3);
  return ref;
}

// How a seed kills: the mode (seed % 3, so that each appears), the rank and the delay (drawn).
struct Plan {
  std::string mode;  // "start-up", "save", "any"
  int rank = 0;
  int after_step = 0;  // "save", "any": the progress line the delay counts from
  double delay = 0;    // seconds after the launch ("start-up") or that line
};

Plan plan_for(uint64_t seed, const Reference& ref, bool rank0_ok = true) {
  std::mt19937_64 rng(seed);
  Plan p;
  p.mode = seed % 3 == 0 ? "start-up" : seed % 3 == 1 ? "save" : "any";
  p.rank = static_cast<int>(rng() % kRanks);
  if (!rank0_ok && p.rank == 0) p.rank = 1 + static_cast<int>(rng() % (kRanks - 1));
  std::uniform_real_distribution<double> unit(0, 1);
  if (p.mode == "start-up") {  // loading, rendezvous, building the model and the engine
    p.delay = unit(rng) * ref.first_step;
  } else if (p.mode == "save") {  // a save but the last: its line comes just before the save
    p.after_step = kSaveEvery * (1 + static_cast<int>(rng() % (kSteps / kSaveEvery - 1)));
    p.delay = unit(rng) * std::max(1.5 * ref.save, 0.02);
  } else {  // any moment of a training step (a save included) but the last two
    p.after_step = 1 + static_cast<int>(rng() % (kSteps - 2));
    p.delay = unit(rng) * (ref.last_but_one - ref.first_step) / (kSteps - 2);
  }
  return p;
}

struct Killed {
  bool done = false;
  double at = 0;  // when, seconds after the launch
  std::string phase;
};

// Kills rank `plan.rank` as the plan says; `pid_of` finds its process (-1: not there yet).
// Never later than the progress line of step kSteps-1, so that it lands before the run's end (a
// start-up kill: than the first step's).
template <class PidOf>
Killed kill_as_planned(const Plan& plan, const Job& watched, PidOf pid_of,
                       const std::function<bool()>& over) {
  Killed k;
  const double start = watched.started();
  while (!over()) {
    std::optional<double> due;
    if (plan.after_step > 0) {
      if (auto line = watched.when(step_text(plan.after_step))) due = *line + plan.delay;
    } else {  // start-up: at the latest when the first step's line comes
      due = watched.when(step_text(1)) ? now() : start + plan.delay;
    }
    if (watched.when(step_text(kSteps - 1))) due = now();
    if (due && now() >= *due) {
      const pid_t pid = pid_of();
      if (pid > 0) {
        k.phase = phase_of(watched);
        if (::kill(pid, SIGKILL) == 0) {
          k.done = true;
          k.at = now() - start;
          return k;
        }
      }
    }
    sleep_ms(1);
  }
  return k;
}

// The checkpoints in DIR: `latest`'s text ("" without one) and the save folders a kill left
// unfinished (".TAG.partial", ".TAG.next-...", ".TAG.old").
std::pair<std::string, std::string> checkpoint_state(const std::string& dir) {
  const std::string latest = slurp(dir + "/latest");
  std::string torn;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() > 2 && name[0] == '.' && name != "..")
        torn += (torn.empty() ? "" : ",") + name;
    }
    ::closedir(d);
  }
  return {latest, torn.empty() ? "-" : torn};
}

struct Row {
  std::string what;
  uint64_t seed = 0;
  Plan plan;
  Killed killed;
  double end_s = -1;  // kill to the last process's end
  int code = -1;
  bool named = false;
  int leftovers = 0;
  std::string latest, torn;
  int resumed_at = -1;  // the step the resume started from (0: from scratch)
  bool exact = false;
};

void print_table(const std::string& title, const std::vector<Row>& rows) {
  std::printf("\nchaos: %s\n", title.c_str());
  std::printf("%-8s %4s %-8s %4s %8s %-12s %8s %4s %5s %4s %-8s %-26s %7s %5s\n", "run", "seed",
              "mode", "rank", "kill_s", "phase", "end_s", "code", "named", "left", "latest",
              "torn", "resume", "exact");
  double worst = 0;
  int exact = 0;
  for (const Row& r : rows) {
    std::printf("%-8s %4llu %-8s %4d %8.3f %-12s %8.3f %4d %5s %4d %-8s %-26s %7s %5s\n",
                r.what.c_str(), static_cast<unsigned long long>(r.seed), r.plan.mode.c_str(),
                r.plan.rank, r.killed.at, r.killed.phase.c_str(), r.end_s, r.code,
                r.named ? "yes" : "NO", r.leftovers, r.latest.empty() ? "-" : r.latest.c_str(),
                r.torn.c_str(),
                r.resumed_at < 0 ? "-" : r.resumed_at == 0 ? "scratch" : ("step" + std::to_string(r.resumed_at)).c_str(),
                r.resumed_at < 0 ? "-" : r.exact ? "yes" : "NO");
    worst = std::max(worst, r.end_s);
    exact += r.exact;
  }
  std::printf("chaos: %s: %zu runs, the slowest ended %.2f s after its kill (limit %.0f s)",
              title.c_str(), rows.size(), worst, kEndLimit);
  if (!rows.empty() && rows.front().resumed_at >= 0)
    std::printf(", %d of %zu resumes exact", exact, rows.size());
  std::printf("\n\n");
  std::fflush(stdout);
}

int runs_per_stage() {
  const char* env = std::getenv("STRATA_CHAOS_RUNS");
  // Under a sanitizer (tests/sanitized.h) 2: each run's five processes start at -O0 there.
  return env && std::atoi(env) > 0 ? std::atoi(env) : strata::test::kSanitized ? 2 : 10;
}

// Under strata-run: kill, check the end, resume, compare.
void launcher_chaos(int stage, uint64_t first_seed) {
  Paths paths;
  const std::string config = paths.config(stage);
  const Reference ref = reference_run(paths, stage);
  ASSERT_EQ(ref.rows.size(), size_t(kSteps));
  std::vector<Row> rows;
  for (int i = 0; i < runs_per_stage(); ++i) {
    Row r;
    r.seed = first_seed + static_cast<uint64_t>(i);
    r.what = "stage" + std::to_string(stage);
    r.plan = plan_for(r.seed, ref);
    SCOPED_TRACE("stage " + std::to_string(stage) + ", seed " + std::to_string(r.seed) + ": " +
                 r.plan.mode + ", rank " + std::to_string(r.plan.rank));
    const std::string run = paths.run("s" + std::to_string(stage) + "_seed" + std::to_string(r.seed));
    {
      Job job(launched(train_args(config, run, "killed.jsonl", false)), {});
      r.killed = kill_as_planned(
          r.plan, job, [&] { return find_rank(run, r.plan.rank); },
          [&] { return job.exited().has_value(); });
      ASSERT_TRUE(r.killed.done) << "the run ended before the kill landed\n" << job.output();
      const double kill_time = job.started() + r.killed.at;
      const auto code = job.wait(kEndLimit + 15);
      r.code = code.value_or(-1);
      r.end_s = (code ? job.ended() : now()) - kill_time;
      r.leftovers = strata::test::count_processes(run);
      if (!code || r.leftovers) kill_leftovers(run);
      job.wait_eof(5);
      r.named = job.output().find("rank " + std::to_string(r.plan.rank) +
                                  " was killed by signal 9") != std::string::npos;
      EXPECT_TRUE(code.has_value()) << "strata-run still running " << r.end_s << " s after the kill\n"
                                    << job.output();
      EXPECT_LE(r.end_s, kEndLimit) << job.output();
      EXPECT_EQ(r.code, 128 + SIGKILL) << job.output();
      EXPECT_TRUE(r.named) << job.output();
      EXPECT_EQ(r.leftovers, 0) << job.output();
    }
    std::tie(r.latest, r.torn) = checkpoint_state(run + "ckpt");
    {
      Job job(launched(train_args(config, run, "resumed.jsonl", !r.latest.empty())), {});
      const auto code = job.wait(300);
      job.wait_eof(5);
      EXPECT_EQ(code, 0) << job.output();
      const std::regex resumed("resumed from \\S+ at step ([0-9]+)");
      std::smatch m;
      const std::string out = job.output();
      r.resumed_at = std::regex_search(out, m, resumed) ? std::stoi(m[1]) : 0;
      EXPECT_EQ(r.resumed_at > 0, !r.latest.empty()) << out;
      if (!r.latest.empty()) {
        EXPECT_EQ("step" + std::to_string(r.resumed_at), r.latest) << out;
      }
      const auto got = train_gpt_runs::read_jsonl(run + "resumed.jsonl");
      r.exact = got.size() == size_t(kSteps - r.resumed_at);
      for (size_t j = 0; r.exact && j < got.size(); ++j) {
        const json& want = ref.rows.at(size_t(r.resumed_at) + j);
        r.exact = got[j].at("step") == want.at("step") &&
                  got[j].at("loss").get<double>() == want.at("loss").get<double>() &&
                  got[j].at("lr").get<double>() == want.at("lr").get<double>();
      }
      EXPECT_TRUE(r.exact) << "resumed at step " << r.resumed_at << ": " << got.size()
                           << " rows\n" << out;
      EXPECT_EQ(checkpoint_state(run + "ckpt").first, "step" + std::to_string(kSteps));
    }
    rows.push_back(r);
  }
  print_table("strata-run, ZeRO stage " + std::to_string(stage) + ", SIGKILL of one of " +
                  std::to_string(kRanks) + " ranks",
              rows);
}

TEST(Chaos, Stage2RankKilledUnderLauncherEndsFastAndResumesExactly) { launcher_chaos(2, 1); }
TEST(Chaos, Stage3RankKilledUnderLauncherEndsFastAndResumesExactly) { launcher_chaos(3, 101); }

// Bare processes: 4 train_gpt started here with torchrun's variables and STRATA_TIMEOUT=5, one
// killed. Seeds 200-204: any moment, start-up and a save (a rank other than 0), then rank 0 at any
// moment and at start-up.
TEST(Chaos, BareRanksEndThemselvesNamingTheDeadRank) {
  Paths paths;
  const std::string config = paths.config(2);
  // The timings of a bare run (no launcher): the plan's delays come from them.
  Reference ref;
  {
    const std::string run = paths.run("bare_reference");
    const int port = strata::test::free_port();
    std::vector<std::unique_ptr<Job>> ranks;
    for (int r = 0; r < kRanks; ++r)
      ranks.push_back(std::make_unique<Job>(
          train_args(config, run, "metrics.jsonl", false),
          Env{{"RANK", std::to_string(r)}, {"WORLD_SIZE", std::to_string(kRanks)},
              {"LOCAL_RANK", std::to_string(r)}, {"LOCAL_WORLD_SIZE", std::to_string(kRanks)},
              {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
              {"STRATA_TIMEOUT", "5"}}));
    for (auto& j : ranks) ASSERT_EQ(j->wait(300), 0) << j->output();
    Job& zero = *ranks[0];
    zero.wait_eof(5);
    ref.first_step = zero.when(step_text(1)).value_or(1) - zero.started();
    ref.last_but_one = zero.when(step_text(kSteps - 1)).value_or(2) - zero.started();
    for (int s = kSaveEvery; s <= kSteps; s += kSaveEvery) {
      const auto begin = zero.when(step_text(s));
      const auto end = zero.when("saved checkpoint " + run + "ckpt/step" + std::to_string(s));
      if (begin && end) ref.save = std::max(ref.save, *end - *begin);
    }
  }
  std::vector<Row> rows;
  for (uint64_t seed : {200, 201, 202, 203, 204}) {
    Row r;
    r.seed = seed;
    r.what = "bare";
    r.plan = plan_for(seed, ref, /*rank0_ok=*/false);
    // Rank 0 serves the store: its death cuts the heartbeats (203, during the run) or the
    // rendezvous itself (204, at start-up) too.
    if (seed >= 203) r.plan.rank = 0;
    SCOPED_TRACE("bare, seed " + std::to_string(seed) + ": " + r.plan.mode + ", rank " +
                 std::to_string(r.plan.rank));
    const std::string run = paths.run("bare_seed" + std::to_string(seed));
    const int port = strata::test::free_port();
    std::vector<std::unique_ptr<Job>> ranks;
    for (int k = 0; k < kRanks; ++k)
      ranks.push_back(std::make_unique<Job>(
          train_args(config, run, "killed.jsonl", false),
          Env{{"RANK", std::to_string(k)}, {"WORLD_SIZE", std::to_string(kRanks)},
              {"LOCAL_RANK", std::to_string(k)}, {"LOCAL_WORLD_SIZE", std::to_string(kRanks)},
              {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
              {"STRATA_TIMEOUT", "5"}}));
    Job& victim = *ranks[size_t(r.plan.rank)];
    r.killed = kill_as_planned(
        r.plan, *ranks[0], [&] { return victim.pid(); },
        [&] {
          return std::all_of(ranks.begin(), ranks.end(),
                             [](auto& j) { return j->exited().has_value(); });
        });
    ASSERT_TRUE(r.killed.done) << "the run ended before the kill landed";
    const double kill_time = ranks[0]->started() + r.killed.at;
    // The slowest survivor; each must fail and name the dead rank.
    const std::regex names("rank " + std::to_string(r.plan.rank) + "\\b(?! of )");
    r.named = true;
    r.code = 0;
    double last = kill_time;
    for (int k = 0; k < kRanks; ++k) {
      Job& j = *ranks[size_t(k)];
      const auto code = j.wait(std::max(0.0, kill_time + kEndLimit + 15 - now()));
      last = std::max(last, code ? j.ended() : now());
      if (k == r.plan.rank) continue;
      if (!code) kill_leftovers(run);
      j.wait_eof(5);
      const std::string out = j.output();
      EXPECT_TRUE(code.has_value()) << "rank " << k << " still running\n" << out;
      EXPECT_NE(code.value_or(0), 0) << "rank " << k << "\n" << out;
      if (code && *code != 0 && r.code == 0) r.code = *code;
      const std::string error = j.last_line("error");
      const bool named = std::regex_search(error, names);
      EXPECT_TRUE(named) << "rank " << k << "'s error does not name rank " << r.plan.rank << "\n"
                         << out;
      r.named = r.named && named;
      std::printf("chaos: bare seed %llu, rank %d: %s\n", static_cast<unsigned long long>(seed), k,
                  error.c_str());
    }
    r.end_s = last - kill_time;
    EXPECT_LE(r.end_s, kEndLimit);
    r.leftovers = strata::test::count_processes(run);
    EXPECT_EQ(r.leftovers, 0);
    kill_leftovers(run);
    std::tie(r.latest, r.torn) = checkpoint_state(run + "ckpt");
    rows.push_back(r);
  }
  print_table("bare processes (no launcher, STRATA_TIMEOUT=5), ZeRO stage 2", rows);
}

}  // namespace
