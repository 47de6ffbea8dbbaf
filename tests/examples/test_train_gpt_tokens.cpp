// train_gpt --data tokens:FILE (runtime/data/token_dataset.h) on real processes: the global batch
// holds the same samples at world sizes 1 to 4, and a run saved on 2 ranks and resumed on 4 with
// another micro-batch and accumulation gives the straight run's losses (fp32, 1e-6) without
// reading any sample twice.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <random>
#include <set>
#include <tuple>
#include <string>

#include "../sanitized.h"
#include "train_gpt_runs.h"

namespace {

using namespace train_gpt_runs;

std::string temp(const std::string& name) {
  return testing::TempDir() + "/tokens_" + name + "_" + std::to_string(getpid());
}

// 40,000 uint16 ids below tiny's vocabulary of 256: 624 samples of 64 + 1 tokens.
std::string token_file() {
  const auto path = temp("train.bin");
  std::ofstream out(path, std::ios::binary);
  std::mt19937 rng(5);
  for (int i = 0; i < 40000; ++i) {
    const uint16_t id = uint16_t(rng() % 256);
    out.put(char(id & 0xff));
    out.put(char(id >> 8));
  }
  return path;
}

std::string config(int64_t micro, int64_t gas, const std::string& name) {
  const nlohmann::json c = {{"train_batch_size", 12},
                            {"train_micro_batch_size_per_gpu", micro},
                            {"gradient_accumulation_steps", gas},
                            {"steps_per_print", 1000},
                            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}}};
  const auto path = temp(name + ".json");
  std::ofstream(path) << c.dump();
  return path;
}

std::vector<nlohmann::json> train(int ranks, int64_t micro, int64_t gas, const std::string& name,
                                  int steps, const std::string& extra = "") {
  const auto args = "--model tiny --data tokens:" + token_file() + " --config " +
                    config(micro, gas, name) + " --steps " + std::to_string(steps) +
                    " --metrics-jsonl " + temp(name + ".jsonl") + " " + extra;
  if (ranks == 1) {
    const auto r = run(args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  } else {
    EXPECT_EQ(launch(ranks, args), "");
  }
  return read_jsonl(temp(name + ".jsonl"));
}

TEST(TrainGptTokens, TheGlobalBatchHoldsTheSameSamplesAtWorldSizesOneToFour) {
  const auto one = train(1, 1, 12, "w1", 2);
  ASSERT_EQ(one.size(), 2u);
  for (const auto& [world, micro, gas] : {std::tuple{2, 2, 3}, std::tuple{3, 4, 1}, std::tuple{4, 1, 3}}) {
    if (strata::test::kSanitized && world != 4) continue;  // CI's sanitized suite: 1 against 4
    const auto many = train(world, micro, gas, "w" + std::to_string(world), 2);
    ASSERT_EQ(many.size(), 2u) << world;
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(many[s].at("sample_ids"), one[s].at("sample_ids")) << world << " ranks, step " << s + 1;
      EXPECT_NEAR(many[s].at("loss").get<double>(), one[s].at("loss").get<double>(),
                  1e-5 * one[s].at("loss").get<double>())
          << world << " ranks, step " << s + 1;
    }
  }
}

TEST(TrainGptTokens, AResumeAtAnotherWorldSizeAndLayoutContinuesWithTheNextUnseenSample) {
  const auto straight = train(2, 2, 3, "straight", 6);
  ASSERT_EQ(straight.size(), 6u);
  const auto dir = temp("ckpt");
  ASSERT_EQ(launch(2, "--model tiny --data tokens:" + token_file() + " --config " +
                          config(2, 3, "first") + " --steps 3 --save-dir " + dir),
            "");
  const auto resumed = train(4, 3, 1, "resumed", 6, "--resume " + dir);
  ASSERT_EQ(resumed.size(), 3u);
  std::set<int64_t> seen;
  size_t ids = 0;
  for (size_t s = 0; s < 6; ++s) {
    const auto& row = s < 3 ? straight[s] : resumed[s - 3];
    if (s >= 3) {
      const double want = straight[s].at("loss").get<double>();
      EXPECT_LE(std::abs(row.at("loss").get<double>() - want), 1e-6 * want) << "step " << s + 1;
      EXPECT_EQ(row.at("sample_ids"), straight[s].at("sample_ids")) << "step " << s + 1;
    }
    for (const auto& id : row.at("sample_ids")) {
      seen.insert(id.get<int64_t>());
      ++ids;
    }
  }
  EXPECT_EQ(ids, 72u);
  EXPECT_EQ(seen.size(), ids) << "a sample was read twice";
}

TEST(TrainGptTokens, BadTokenFilesAreNamed) {
  const auto odd = temp("odd.bin");
  std::ofstream(odd, std::ios::binary) << std::string(1001, '\x01');
  auto r = run("--model tiny --data tokens:" + odd + " --config " + config(12, 1, "odd") +
               " --steps 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("odd.bin"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("byte offset 1000"), std::string::npos) << r.output;
  const auto big = temp("big.bin");
  {
    std::ofstream out(big, std::ios::binary);
    for (int i = 0; i < 2000; ++i) out.put(char(0)), out.put(char(1));  // id 256 everywhere
  }
  r = run("--model tiny --data tokens:" + big + " --config " + config(12, 1, "big") + " --steps 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("token id 256"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("vocabulary of 256"), std::string::npos) << r.output;
}

}  // namespace
