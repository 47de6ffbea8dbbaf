// `strata-ckpt compare` as a process: two runs of one model are compared tensor by tensor (the
// differential matrix's parameter check, docs/matrix.md); a run against itself is 0 apart, a run
// with another LR is apart by about what the LR moved (in the masters and in the weights as the
// model held them), and checkpoints of two different models are refused by name.
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/examples/train_gpt_runs.h"
#include "tests/runtime/checkpoint/scratch_dir.h"

namespace {

using train_gpt_runs::capture;

const std::string kBin = STRATA_BIN_DIR;

std::string train(const std::string& dir, const std::string& name, const std::string& model,
                  double lr) {
  const std::string config = dir + "/" + name + ".json", out = dir + "/" + name;
  std::ofstream(config) << R"({"train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
      "zero_optimization": {"stage": 1},
      "optimizer": {"type": "AdamW", "params": {"lr": )" << lr << "}}}";
  const auto r = capture(kBin + "/train_gpt --device cpu --model " + model + " --config " +
                         config + " --steps 2 --seed 4 --save-dir " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return out;
}

TEST(CompareTool, TellsHowFarTwoRunsOfOneModelAreAndRefusesOtherModels) {
  strata::test::ScratchDir tmp;
  const std::string a = train(tmp.str(), "a", "tiny", 1e-3);
  const std::string again = train(tmp.str(), "again", "tiny", 1e-3);
  const std::string faster = train(tmp.str(), "faster", "tiny", 2e-3);
  const std::string tied = train(tmp.str(), "tied", "tiny-tied", 1e-3);

  auto compare = [&](const std::string& x, const std::string& y) {
    const auto r = capture(kBin + "/strata-ckpt compare " + x + " " + y);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return nlohmann::json::parse(r.output.substr(r.output.find('{')));
  };
  const auto same = compare(a, again);
  EXPECT_EQ(same.at("worst").at("max_abs").get<double>(), 0.0) << same.dump();
  EXPECT_FALSE(same.at("tensors").empty());
  // Both views: the consolidated masters and the weights as the model held them (model_states).
  int as_trained = 0;
  for (const auto& t : same.at("tensors"))
    as_trained += t.at("name").get<std::string>().rfind("as-trained:param.", 0) == 0;
  EXPECT_GT(as_trained, 0) << same.dump();

  // Adam moves each element by about lr per step: two steps at 1e-3 more than the other run's.
  const auto apart = compare(a, faster);
  const double worst = apart.at("worst").at("max_abs").get<double>();
  EXPECT_GT(worst, 1e-3) << apart.dump();
  EXPECT_LT(worst, 1e-2) << apart.dump();
  EXPECT_FALSE(apart.at("worst").at("name").get<std::string>().empty());

  const auto other = capture(kBin + "/strata-ckpt compare " + a + " " + tied);
  EXPECT_EQ(other.exit_code, 1) << other.output;
  EXPECT_NE(other.output.find("strata-ckpt compare: "), std::string::npos) << other.output;
  EXPECT_NE(other.output.find(tied), std::string::npos) << other.output;
}

}  // namespace
