// strata-matrix: the differential test matrix (issue 30, docs/matrix.md).
//
//   strata-matrix --bin DIR --work DIR [--seed S] [--count N] [--max-world W] [--budget-s T]
//                 [--report FILE.md] [--jsonl FILE] [--no-shrink] [--keep] [--tools DIR]
// --tools: the folder of the strata-ckpt that compares the final checkpoints (default --bin;
// another when --bin holds an older build, whose strata-ckpt has no compare). --first-failure:
// stop after the first failing description (the seeded-fault runs, tests/matrix/seeded_faults.py).
//   strata-matrix --bin DIR --work DIR --ci          # the CI sample (fixed seed, stated budget)
//   strata-matrix --bin DIR --work DIR --replay JSON # one description (a failure's reproduction)
//   strata-matrix --list [--seed S] [--count N]      # the descriptions a seed draws, run nothing
//
// Each description runs black-box (train_gpt, strata-run, the metrics JSONL) beside its oracle;
// a failure is shrunk and printed as the command that reproduces it. Exit 1 if any failed.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>

#include "description.h"
#include "runner.h"
#include "tests/sanitized.h"

namespace {

using namespace matrix;

struct Args {
  std::string bin, tools, work, report, jsonl, replay, self = "strata-matrix";
  uint64_t seed = 30;
  int count = 10;
  int max_world = 4;
  double budget_s = 0;  // 0: none
  bool ci = false, do_shrink = true, keep = false, shrink_replay = false, first_failure = false;
  bool list = false;  // print the drawn descriptions (JSON lines, with the predicted refusal); run nothing
  int shrink_trials = 40;
};

// The CI sample: descriptions on at most 2 ranks (CI's 2 cores), a fixed seed. Release: 10
// descriptions, measured 3-4 minutes on 2 cores; under ASan (CI's suite, about 3x slower to start
// and run) 3, to stay inside CI's hour with the rest of the suite. Stopped early at the budget.
constexpr int kCiCount = strata::test::kSanitized ? 9 : 40;
constexpr double kCiBudgetS = strata::test::kSanitized ? 360 : 300;

int usage(const char* why) {
  std::fprintf(stderr, "strata-matrix: %s\nusage: strata-matrix --bin DIR --work DIR [--ci] [--seed S] "
               "[--count N] [--max-world W] [--budget-s T] [--report FILE] [--jsonl FILE] "
               "[--replay JSON|@FILE [--shrink]] [--no-shrink] [--keep] [--tools DIR] [--first-failure]\n"
               "       strata-matrix --list [--seed S] [--count N] [--max-world W]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  a.self = argv[0];
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(f + ": missing value");
      return argv[++i];
    };
    try {
      if (f == "--bin") a.bin = value();
      else if (f == "--tools") a.tools = value();
      else if (f == "--first-failure") a.first_failure = true;
      else if (f == "--list") a.list = true;
      else if (f == "--work") a.work = value();
      else if (f == "--seed") a.seed = std::stoull(value());
      else if (f == "--count") a.count = std::stoi(value());
      else if (f == "--max-world") a.max_world = std::stoi(value());
      else if (f == "--budget-s") a.budget_s = std::stod(value());
      else if (f == "--report") a.report = value();
      else if (f == "--jsonl") a.jsonl = value();
      else if (f == "--replay") a.replay = value();
      else if (f == "--shrink-trials") a.shrink_trials = std::stoi(value());
      else if (f == "--ci") a.ci = true;
      else if (f == "--no-shrink") a.do_shrink = false;
      else if (f == "--shrink") a.shrink_replay = true;
      else if (f == "--keep") a.keep = true;
      else return usage(("unknown option " + f).c_str());
    } catch (const std::exception& e) {
      return usage(e.what());
    }
  }
  if (a.list) {  // what a seed draws (for looking at the feature space's coverage); runs nothing
    for (int i = 0; i < a.count; ++i) {
      const uint64_t s = a.seed * 1000003ull + uint64_t(i);
      const Description d = generate(s, a.max_world);
      const auto refusal = predict_refusal(d);
      std::printf("%s\n", nlohmann::json({{"generator_seed", s}, {"description", to_json(d)},
                                          {"refused", refusal ? refusal->key : ""}})
                               .dump()
                               .c_str());
    }
    return 0;
  }
  if (a.bin.empty() || a.work.empty()) return usage("--bin and --work are required");
  // CI shrinks with 12 trials at most: a failure there is reproduced in full by its printed command.
  if (a.ci) a.count = kCiCount, a.max_world = 2, a.budget_s = kCiBudgetS, a.shrink_trials = 12;

  RunnerOptions options;
  options.bin = a.bin, options.tools = a.tools, options.work = a.work, options.keep = a.keep;
  Runner runner(options);
  const bool fp16 = runner.probe_cpu_fp16();
  set_cpu_fp16_trains(fp16);
  std::cerr << "strata-matrix: fp16 on the CPU " << (fp16 ? "trains" : "is refused (GPU only)") << "\n";

  std::vector<std::pair<uint64_t, Description>> todo;
  if (!a.replay.empty()) {
    std::string text = a.replay;
    if (text[0] == '@') {
      std::ifstream in(text.substr(1));
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    todo.push_back({0, from_json(nlohmann::json::parse(text))});
  } else {
    for (int i = 0; i < a.count; ++i) {
      const uint64_t s = a.seed * 1000003ull + uint64_t(i);
      todo.push_back({s, generate(s, a.max_world)});
    }
  }

  std::ofstream jsonl;
  if (!a.jsonl.empty()) jsonl.open(a.jsonl, std::ios::app);
  std::map<std::string, int> counts;
  std::vector<std::string> failures;
  const auto start = std::chrono::steady_clock::now();
  int ran = 0;
  for (const auto& [seed, d] : todo) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (a.budget_s > 0 && elapsed > a.budget_s) {
      std::cerr << "strata-matrix: budget of " << a.budget_s << " s spent after " << ran << " descriptions\n";
      break;
    }
    ++ran;
    const Verdict v = runner.run(d);
    counts[outcome_name(v.outcome)]++;
    std::fprintf(stderr, "[%d/%zu] %-20s %6.1f s  %s\n", ran, todo.size(), outcome_name(v.outcome),
                 v.seconds, summary(d).c_str());
    nlohmann::json row = {{"generator_seed", seed}, {"outcome", outcome_name(v.outcome)},
                          {"seconds", v.seconds}, {"worst_loss", v.worst_loss},
                          {"worst_grad_norm", v.worst_grad_norm}, {"worst_param", v.worst_param},
                          {"description", to_json(d)},
                          {"summary", summary(d)}};
    if (!is_failure(v.outcome)) {
      if (jsonl.is_open()) jsonl << row.dump() << "\n" << std::flush;
      continue;
    }
    std::cerr << "  " << v.detail << "\n";
    for (const auto& c : v.commands) std::cerr << "    " << c << "\n";
    Description minimal = d;
    Verdict mv = v;
    if (a.do_shrink && (a.replay.empty() || a.shrink_replay)) {
      const auto s = shrink(runner, d, v, a.shrink_trials, true);
      minimal = s.minimal, mv = s.verdict;
      row["shrink_trials"] = s.trials;
    }
    row["minimal"] = to_json(minimal);
    row["minimal_summary"] = summary(minimal);
    row["detail"] = mv.detail;
    row["reproduce"] = replay_command(a.self, a.bin, minimal);
    row["commands"] = mv.commands;
    if (jsonl.is_open()) jsonl << row.dump() << "\n" << std::flush;
    std::string text = std::string(outcome_name(v.outcome)) + " (generator seed " +
                       std::to_string(seed) + ")\n  drawn:   " + summary(d) +
                       "\n  minimal: " + summary(minimal) + "\n  " + mv.detail +
                       "\n  reproduce: " + replay_command(a.self, a.bin, minimal) + "\n  commands:\n";
    for (const auto& c : mv.commands) text += "    " + c + "\n";
    std::cerr << text;
    failures.push_back(text);
    if (a.first_failure) break;
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "strata-matrix: %d descriptions in %.0f s:", ran, total);
  for (const auto& [k, n] : counts) std::fprintf(stderr, " %s %d", k.c_str(), n);
  std::fprintf(stderr, "\n");
  if (!a.report.empty()) {
    std::ofstream r(a.report);
    r << "# strata-matrix report\n\nseed " << a.seed << ", " << ran << " descriptions run of "
      << todo.size() << ", " << total << " s, max world " << a.max_world << "\n\n| outcome | count |\n|---|---|\n";
    for (const auto& [k, n] : counts) r << "| " << k << " | " << n << " |\n";
    r << "\n## Failures\n\n";
    if (failures.empty()) r << "none\n";
    for (const auto& f : failures) r << "```\n" << f << "```\n\n";
  }
  return failures.empty() ? 0 : 1;
}
