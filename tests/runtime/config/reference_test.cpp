// The config reference (`strata-config schema`) and docs/config.md, its committed Markdown form.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/config/reference.h"
#include "tests/runtime/config/config_test_util.h"

namespace strata {
namespace {

std::string read_doc() {
  std::ifstream in(std::string(STRATA_SOURCE_DIR) + "/docs/config.md", std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const char* kRegenerate =
    "docs/config.md is stale: regenerate it with\n"
    "  build/bin/strata-config schema --markdown > docs/config.md\n";

TEST(ConfigReference, DocsConfigMdIsUpToDate) {
  const std::string doc = read_doc();
  ASSERT_FALSE(doc.empty()) << "docs/config.md is missing\n" << kRegenerate;
  const std::string now = config_reference_markdown();
  if (doc == now) return;
  std::istringstream a(doc), b(now);
  std::string la, lb;
  for (int line = 1;; ++line) {
    const bool ga = static_cast<bool>(std::getline(a, la));
    const bool gb = static_cast<bool>(std::getline(b, lb));
    if (!ga && !gb) break;
    if (!ga || !gb || la != lb) {
      FAIL() << kRegenerate << "first difference at line " << line << ":\n  committed: "
             << (ga ? la : "(end of file)") << "\n  generated: " << (gb ? lb : "(end of file)");
    }
  }
  FAIL() << kRegenerate;
}

void leaf_paths(const json& j, const std::string& path, std::vector<std::string>& out) {
  if (!path.empty()) out.push_back(path);
  if (!j.is_object()) return;
  for (auto it = j.begin(); it != j.end(); ++it)
    leaf_paths(it.value(), path.empty() ? it.key() : path + "." + it.key(), out);
}

// Every key of a resolved config (printed by another walk, print_block, with defaults filled
// in), the built-in optimizer's and scheduler's params included, is in docs/config.md.
TEST(ConfigReference, CoversEveryKeyOfAResolvedConfig) {
  const std::string doc = config_reference_markdown();
  for (const char* text : {
           R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
               "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}})",
           R"({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}})",
           R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
               "params": {"total_num_steps": 10}}})",
           R"({"train_batch_size": 8, "scheduler": {"type": "LRRangeTest"}})",
           R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR"}})"}) {
    const Config cfg = test::load(text);
    std::vector<std::string> paths;
    leaf_paths(to_json(cfg), "", paths);
    ASSERT_GT(paths.size(), 100u);
    for (const std::string& p : paths)
      EXPECT_NE(doc.find("`" + p + "`"), std::string::npos) << p << " is not in docs/config.md";
  }
}

TEST(ConfigReference, JsonAndMarkdownListTheSameKeys) {
  const json ref = config_reference_json();
  const std::string doc = config_reference_markdown();
  ASSERT_GT(ref.at("keys").size(), 150u);
  for (const json& k : ref.at("keys")) {
    const std::string path = k.at("path").get<std::string>();
    EXPECT_NE(doc.find("| `" + path + "` |"), std::string::npos) << path;
    EXPECT_TRUE(k.contains("support")) << path;
  }
}

// Every key the schema knows (blocks, legacy spellings and the built-in optimizer's and
// scheduler's params included) says what it means in DeepSpeed, in one line of its own words.
TEST(ConfigReference, EveryKeyHasDeepSpeedsMeaning) {
  const json ref = config_reference_json();
  ASSERT_GT(ref.at("keys").size(), 150u);
  for (const json& k : ref.at("keys")) {
    std::string path = k.at("path").get<std::string>();
    if (k.contains("for_type")) path += " (" + k.at("for_type").get<std::string>() + ")";
    const std::string what = k.value("description", std::string());
    EXPECT_FALSE(what.empty()) << path << " has no description: give its declaration in "
                               << "runtime/config/schema_*.cpp a .describe(\"DeepSpeed's meaning\")";
    EXPECT_EQ(what.find('\n'), std::string::npos) << path << ": one line";
    EXPECT_LE(what.size(), 140u) << path << ": keep DeepSpeed's meaning to one short line";
  }
}

}  // namespace
}  // namespace strata
