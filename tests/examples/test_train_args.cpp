// train_gpt's command line against the config it runs (examples/train_args.h): a flag given on
// the command line that disagrees with a value written in the config is refused naming the key,
// the config's value and the flag's, as Hugging Face's trainer_config_process refuses it; "auto",
// an absent key and a flag left at its default are not compared.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "examples/train_args.h"
#include "runtime/error.h"

namespace {

using nlohmann::json;
using strata::examples::TrainArgs;

TrainArgs parse(std::vector<std::string> words) {
  words.insert(words.begin(), {"train_gpt", "--config", "ds.json"});
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  return strata::examples::parse_train_args(int(argv.size()), argv.data());
}

std::string refusal(const json& doc, const TrainArgs& args) {
  try {
    strata::examples::check_flags_match_config(doc, args, "ds.json");
  } catch (const strata::Error& e) {
    return e.what();
  }
  return "";
}

const json kConfig = {
    {"train_micro_batch_size_per_gpu", 4},
    {"gradient_accumulation_steps", "auto"},
    {"gradient_clipping", 1.0},
    {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"betas", {0.9, 0.95}}, {"eps", "auto"}, {"weight_decay", 0.1}}}}},
    {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 3e-4}, {"warmup_num_steps", 100}}}}},
    {"bf16", {{"enabled", true}}}};

TEST(TrainArgsMatch, FlagsThatAgreeOrFillAutoOrAreDefaultsPass) {
  // Defaults (--lr 5e-5, --micro-batch 8, --precision fp32...) disagree but were not given.
  EXPECT_EQ(refusal(kConfig, parse({})), "");
  // Given and equal, written another way (1 and 1.0; 0.0003 and 3e-4); "auto" takes any value.
  EXPECT_EQ(refusal(kConfig, parse({"--micro-batch", "4", "--clip", "1", "--lr", "0.0003", "--betas",
                                    "0.9,0.95", "--weight-decay", "0.1", "--eps", "1e-6",
                                    "--grad-accum", "3", "--warmup-steps", "100", "--precision",
                                    "bf16", "--steps", "2"})),
            "");
  // A flag whose key the config does not have (no fp16 block) is not compared.
  json doc = kConfig;
  doc.erase("bf16");
  EXPECT_EQ(refusal(doc, parse({"--precision", "fp16"})), "");
}

TEST(TrainArgsMatch, AFlagThatDisagreesWithAWrittenValueIsNamedWithBoth) {
  const auto e = refusal(kConfig, parse({"--lr", "1e-3", "--micro-batch", "8", "--precision", "fp32"}));
  EXPECT_NE(e.find("ds.json: flags given on the command line disagree"), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer.params.lr is 0.0003 in the config, --lr 0.001 on the command line"),
            std::string::npos) << e;
  EXPECT_NE(e.find("scheduler.params.warmup_max_lr is 0.0003 in the config, --lr 0.001"),
            std::string::npos) << e;
  EXPECT_NE(e.find("train_micro_batch_size_per_gpu is 4 in the config, --micro-batch 8"),
            std::string::npos) << e;
  EXPECT_NE(e.find("bf16.enabled is true in the config, --precision fp32"), std::string::npos) << e;
  EXPECT_NE(e.find("Write \"auto\" for these keys"), std::string::npos) << e;
  for (const auto& [flags, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--betas", "0.9,0.999"}, "optimizer.params.betas is [0.9,0.95] in the config, --betas 0.9,0.999"},
           {{"--clip", "0.5"}, "gradient_clipping is 1.0 in the config, --clip 0.5"},
           {{"--weight-decay", "0"}, "optimizer.params.weight_decay is 0.1 in the config, --weight-decay 0"},
           {{"--warmup-steps", "10"}, "scheduler.params.warmup_num_steps is 100 in the config, --warmup-steps 10"}}) {
    const auto m = refusal(kConfig, parse(flags));
    EXPECT_NE(m.find(expected), std::string::npos) << m;
  }
}

TEST(TrainArgs, AppliedStepsIsAPositiveCount) {
  EXPECT_EQ(parse({"--applied-steps", "2"}).applied_steps, 2);
  EXPECT_FALSE(parse({}).applied_steps.has_value());
  EXPECT_THROW(parse({"--applied-steps", "0"}), strata::Error);
}

}  // namespace
