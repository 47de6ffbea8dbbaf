// Running a description black-box (train_gpt through strata-run, the metrics JSONL), its oracle
// (the same training on one process at stage 0 in the same dtype), the comparison with per-dtype
// tolerances, and the shrinker.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "description.h"

namespace matrix {

struct Tolerance {
  double loss;       // relative, per step
  double grad_norm;  // relative, per step
  double lr;         // relative, per step
  // The parameters after the last step: max |description - oracle| over every element, in
  // units of lr x steps (about how far Adam moves an element in that many steps).
  double param;
};
// Per dtype (docs/matrix.md says why); autocast at a world size that is not a power of two gets
// bf16's, since the oracle's loss / (world x gas) rounds differently in bf16 there.
Tolerance tolerance_for(const Description& d);

enum class Outcome {
  kPass,             // trained, and matched the oracle
  kRefusedAsPredicted,
  kMismatch,         // trained, and differed from the oracle beyond the tolerance
  kCrash,            // exited non-zero where the matrix predicted success
  kNotRefused,       // trained where the matrix predicted a refusal
  kWrongRefusal,     // exited non-zero without naming the predicted key
  kOracleFailed,     // the stage-0 reference itself did not train (a failure too)
};
const char* outcome_name(Outcome o);
inline bool is_failure(Outcome o) { return o != Outcome::kPass && o != Outcome::kRefusedAsPredicted; }

struct Verdict {
  Outcome outcome = Outcome::kPass;
  std::string detail;                 // the first mismatch, or the error's last lines
  std::vector<std::string> commands;  // what ran (shell lines), oracle first
  double seconds = 0;
  double worst_loss = 0, worst_grad_norm = 0;  // largest relative differences seen
  double worst_param = 0;  // the parameters' max |difference| / (lr x steps); -1: not compared
};

struct RunnerOptions {
  std::string bin;      // folder of train_gpt and strata-run
  std::string tools;    // folder of the strata-ckpt that compares checkpoints (default: bin)
  std::string work;     // scratch folder (a real file system: NVMe swap files live under it)
  int timeout_s = 300;  // per launch
  bool keep = false;    // keep each description's folder
};

class Runner {
 public:
  explicit Runner(RunnerOptions options);
  // d against its reference (reference_of); a description with dropout first runs without it
  // against the oracle, then with it against its twin.
  Verdict run(const Description& d);
  // Does this build train fp16 on the CPU? (one tiny step)
  bool probe_cpu_fp16();

 private:
  struct Launch {
    int exit_code;
    std::string output;
    std::string command;
  };
  Verdict run_against_reference(const Description& d);
  std::string token_file(uint64_t seed) const;  // the description's token file (token_data)
  Launch launch(const Description& d, const Phase& p, int index, const std::string& folder,
                const std::string& jsonl, const std::string& extra);
  // The rows of d's reference (reference_of), run once per distinct one (cached under
  // work/oracle).
  // Its final checkpoint is in *final_dir.
  bool oracle_rows(const Description& d, std::vector<nlohmann::json>* rows, Verdict* v,
                   std::string* final_dir);
  // The parameters after the last step against the oracle's (strata-ckpt compare).
  void compare_parameters(const Description& d, const std::string& mine,
                          const std::string& oracle, Verdict* v);
  RunnerOptions o_;
  int counter_ = 0;
  std::map<std::string, std::vector<nlohmann::json>> oracle_cache_;
};

// The config file train_gpt reads for phase p of d.
nlohmann::json config_for(const Description& d, const Phase& p, const std::string& nvme_path);
// The oracle of d: one process, stage 0, the same dtype, global batch and steps, no resume.
Description oracle_of(const Description& d);
// What d's rows and final parameters are held against: its oracle, or for a model with dropout
// (whose masks differ per rank) its twin, d without activation checkpointing.
Description reference_of(const Description& d);
// train_gpt's flags for phase i of d run in `folder`: its steps, the save after the first of two
// phases, the resume of the second, the final checkpoint of the last.
std::string phase_flags(const Description& d, size_t i, const std::string& folder);

struct ShrinkResult {
  Description minimal;
  Verdict verdict;
  int trials = 0;
};
// Reduces a failing description (greedily, one simplification at a time) to one whose
// simplifications all pass or fail otherwise; at most max_trials runs.
ShrinkResult shrink(Runner& runner, const Description& failing, const Verdict& failure,
                    int max_trials, bool verbose);

// The command that reproduces d through this driver.
std::string replay_command(const std::string& driver, const std::string& bin, const Description& d);

}  // namespace matrix
