// The real DeepSpeed configs in ../shared/ds-configs (issue #34): every one that `strata-config
// check` accepts and that does not enable fp16 trains 2 steps of --model tiny on the CPU with
// finite losses, run as its program would run it (train_gpt fills "auto" from its flags and
// passes its AdamW where the config names none, and derives the accumulation where the config
// writes train_batch_size with "auto" factors and no --grad-accum is given). Only NVMe paths are
// rewritten, to a scratch folder. The corpus lives beside the repository (../shared/ds-configs),
// not in it: where it is absent (a clone on a user's machine) the test skips, saying so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <unistd.h>

#include "train_gpt_runs.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using train_gpt_runs::capture;

// Refused by the engine, by design, with the text each refusal must name. Empty: every accepted
// config that does not enable fp16 trains (the last four, parameter offload without the optimizer
// offloaded, train since ParamUnits::store_partition). A config added here fails the test if it
// trains.
const std::map<std::string, std::string> kKnownRefusals = {};

bool enables_fp16(const json& doc) {
  return doc.contains("fp16") && doc["fp16"].is_object() && doc["fp16"].value("enabled", json(false)) == json(true);
}

void point_nvme_at(json& doc, const std::string& folder) {
  if (!doc.contains("zero_optimization") || !doc["zero_optimization"].is_object()) return;
  for (const char* block : {"offload_param", "offload_optimizer"}) {
    json& b = doc["zero_optimization"][block];
    if (b.is_object() && b.contains("nvme_path")) b["nvme_path"] = folder;
  }
}

TEST(DsConfigsTrain, EveryAcceptedNonFp16ConfigTrainsTwoSteps) {
  const fs::path corpus = fs::path(STRATA_SOURCE_DIR) / ".." / "shared" / "ds-configs";
  if (!fs::is_directory(corpus))
    GTEST_SKIP() << "no corpus at " << corpus
                 << ": the real DeepSpeed configs sit beside the repository (../shared/ds-configs), "
                    "not in a clone of it";
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(corpus))
    if (e.path().extension() == ".json") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_GT(files.size(), 100u);

  const fs::path scratch = fs::temp_directory_path() / ("strata_ds_configs." + std::to_string(::getpid()));
  fs::create_directories(scratch / "nvme");
  int accepted = 0, fp16 = 0, trained = 0, refused = 0;
  for (const fs::path& file : files) {
    const std::string name = file.filename().string();
    const auto check = capture(std::string(STRATA_BIN_DIR) + "/strata-config check '" + file.string() + "' > /dev/null");
    if (check.exit_code != 0) continue;
    ++accepted;
    std::ifstream in(file);
    json doc = json::parse(in);
    if (enables_fp16(doc)) {
      ++fp16;
      continue;
    }
    point_nvme_at(doc, (scratch / "nvme").string());
    const fs::path copy = scratch / name;
    std::ofstream(copy) << doc.dump(2);
    const fs::path metrics = scratch / "metrics.jsonl";
    const auto run = train_gpt_runs::run("--config '" + copy.string() + "' --model tiny --steps 2 --metrics-jsonl '" +
                                         metrics.string() + "'");
    const auto known = kKnownRefusals.find(name);
    if (known != kKnownRefusals.end()) {
      ++refused;
      EXPECT_NE(run.exit_code, 0) << name << " is listed as refused but trains: remove it from the list";
      EXPECT_NE(run.output.find(known->second), std::string::npos) << name << ":\n" << run.output;
      continue;
    }
    if (run.exit_code != 0) {
      ADD_FAILURE() << name << ":\n" << run.output;
      continue;
    }
    const auto rows = train_gpt_runs::read_jsonl(metrics.string());
    ASSERT_EQ(rows.size(), 2u) << name;
    for (const auto& row : rows) EXPECT_TRUE(std::isfinite(row["loss"].get<double>())) << name << ": " << row.dump();
    ++trained;
  }
  fs::remove_all(scratch);
  std::printf("ds-configs: %zu files, %d accepted by strata-config check, %d enable fp16, %d trained, %d refused "
              "(listed)\n", files.size(), accepted, fp16, trained, refused);
  EXPECT_EQ(trained + refused, accepted - fp16);
}

}  // namespace
