// Random bytes, random JSON-ish text and random mutations of real configs, fed in-process: every
// input must either load or throw strata::Error. Anything else (another exception, a crash, a
// hang) fails. Seeds are fixed so a failure reproduces.
#include <chrono>
#include <filesystem>
#include <random>

#include "tests/sanitized.h"
#include "tests/runtime/config/config_test_util.h"

namespace strata::test {
namespace {

enum class Outcome { Loaded, Rejected, Failed };

// Loads `text`: it must load or throw strata::Error; anything else fails the test.
Outcome feed(const std::string& text, const LoadOptions& options) {
  try {
    const Config c = parse_config_text(text, "fuzz.json", options);
    const json printed = to_json(c);  // the printout and pending list must work on any result
    (void)pending_features(c);
    (void)printed.dump();
    return Outcome::Loaded;
  } catch (const Error&) {
    return Outcome::Rejected;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "non-strata exception " << e.what() << " for input:\n" << text.substr(0, 2000);
  } catch (...) {
    ADD_FAILURE() << "unknown exception for input:\n" << text.substr(0, 2000);
  }
  return Outcome::Failed;
}

LoadOptions random_options(std::mt19937& rng) {
  LoadOptions o;
  o.world_size = 1 + rng() % 8;
  o.allow_unresolved_auto = rng() % 2;
  if (rng() % 2) {
    o.autos.micro_batch_per_gpu = rng() % 5;  // 0 is out of range on purpose
    o.autos.gradient_accumulation_steps = 1 + rng() % 4;
    o.autos.lr = (rng() % 3 == 0) ? -1.0 : 1e-4;
    o.autos.beta1 = 0.9;
    o.autos.beta2 = (rng() % 3 == 0) ? 2.0 : 0.999;
    o.autos.hidden_size = (rng() % 4 == 0) ? int64_t(1) << 40 : 1024;
    o.autos.total_steps = 100;
    o.autos.fp16 = rng() % 2;
    o.autos.bf16 = rng() % 2;
  }
  if (rng() % 3 == 0) o.extra_optimizers = {"Custom"};
  return o;
}

TEST(ConfigFuzz, RandomBytes) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 20000; ++i) {
    std::string s(rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    if (feed(s, random_options(rng)) == Outcome::Failed) return;
  }
}

TEST(ConfigFuzz, RandomJsonTokens) {
  static const char* const tokens[] = {"{", "}", "[", "]", ",", ":", "\"train_batch_size\"", "\"zero_optimization\"",
                                       "\"stage\"", "\"optimizer\"", "\"type\"", "\"params\"", "\"Adam\"", "\"auto\"",
                                       "\"lr\"", "1", "-1", "0", "1e400", "5e8", "1.5", "true", "false", "null", "\"x\"",
                                       "NaN", "\"fp16\"", "\"enabled\"", "\"bf16\"", " ", "\n", "//c\n", "\"\\u0000\""};
  std::mt19937 rng(99);
  for (int i = 0; i < 20000; ++i) {
    std::string s = "{";
    const int n = rng() % 40;
    for (int k = 0; k < n; ++k) s += tokens[rng() % (sizeof(tokens) / sizeof(tokens[0]))];
    if (feed(s, random_options(rng)) == Outcome::Failed) return;
  }
}

// ---- structured mutations of real documents ----------------------------------------------------

json random_value(std::mt19937& rng, int depth = 0) {
  switch (rng() % 14) {
    case 0: return nullptr;
    case 1: return true;
    case 2: return false;
    case 3: return static_cast<int64_t>(rng() % 2000) - 1000;
    case 4: return std::ldexp(1.0, static_cast<int>(rng() % 140));  // up to 2^139: beyond int64
    case 5: return 0.5;
    case 6: return "auto";
    case 7: return "true";
    case 8: return "cpu";
    case 9: return std::numeric_limits<uint64_t>::max();
    case 10: return -1e300;
    case 11: return depth < 3 ? json::array({random_value(rng, depth + 1), random_value(rng, depth + 1)}) : json(1);
    case 12: return depth < 3 ? json{{"enabled", random_value(rng, depth + 1)}} : json(2);
    default: return json::object();
  }
}

// Every JSON pointer in the document.
void pointers(const json& j, const json::json_pointer& at, std::vector<json::json_pointer>& out) {
  out.push_back(at);
  if (j.is_object())
    for (auto it = j.begin(); it != j.end(); ++it) pointers(it.value(), at / it.key(), out);
  else if (j.is_array())
    for (size_t i = 0; i < j.size(); ++i) pointers(j[i], at / i, out);
}

void mutate(json& doc, std::mt19937& rng) {
  std::vector<json::json_pointer> all;
  pointers(doc, json::json_pointer(), all);
  const json::json_pointer p = all[rng() % all.size()];
  json& node = doc[p];
  switch (rng() % 6) {
    case 0:  // delete
      if (!p.empty()) {
        json& parent = doc[p.parent_pointer()];
        if (parent.is_object())
          parent.erase(p.back());
        else
          parent.erase(static_cast<size_t>(std::stoul(p.back())));
      }
      break;
    case 1:  // retype
      node = random_value(rng);
      break;
    case 2:  // rename: one character changed
      if (!p.empty() && doc[p.parent_pointer()].is_object()) {
        std::string key = p.back();
        if (!key.empty()) key[rng() % key.size()] = static_cast<char>('a' + rng() % 26);
        json v = node;
        doc[p.parent_pointer()].erase(p.back());
        doc[p.parent_pointer()][key] = v;
      }
      break;
    case 3:  // add a key
      if (node.is_object()) node["k" + std::to_string(rng() % 5)] = random_value(rng);
      break;
    case 4:  // well-known keys with random values
      if (node.is_object()) {
        static const char* const keys[] = {"stage", "enabled", "type", "params", "lr", "device", "betas",
                                           "train_batch_size", "cpu_offload", "bfloat16", "total_num_steps",
                                           "zero_optimization", "offload_param", "num_experts", "ep_size"};
        node[keys[rng() % (sizeof(keys) / sizeof(keys[0]))]] = random_value(rng);
      }
      break;
    default:  // numbers nudged
      if (node.is_number()) node = node.get<double>() * (rng() % 2 ? -1.0 : 1e10);
      break;
  }
}

std::vector<json> seed_documents() {
  std::vector<json> seeds;
  for (const auto& e : std::filesystem::directory_iterator(repo_path("configs")))
    if (e.path().extension() == ".json") seeds.push_back(json::parse(slurp(e.path().string())));
  const std::string shared = std::string(STRATA_SOURCE_DIR) + "/../shared/ds-configs";
  if (std::filesystem::is_directory(shared)) {
    for (const auto& e : std::filesystem::directory_iterator(shared)) {
      if (e.path().extension() != ".json") continue;
      try {
        seeds.push_back(json::parse(slurp(e.path().string())));
      } catch (...) {
      }
    }
  }
  return seeds;
}

TEST(ConfigFuzz, MutatedRealConfigs) {
  const std::vector<json> seeds = seed_documents();
  ASSERT_FALSE(seeds.empty());
  std::mt19937 rng(2024);
  const auto start = std::chrono::steady_clock::now();
  int loaded = 0, rejected = 0;
  const int cases = 40000 / int(strata::test::kSanitizedStride);
  for (int i = 0; i < cases; ++i) {
    json doc = seeds[rng() % seeds.size()];
    const int n = 1 + rng() % 4;
    for (int k = 0; k < n; ++k) mutate(doc, rng);
    const Outcome o = feed(doc.dump(rng() % 2 ? 2 : -1), random_options(rng));
    if (o == Outcome::Failed) return;
    (o == Outcome::Loaded ? loaded : rejected) += 1;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("mutated configs: %d loaded, %d rejected, %.1f s\n", loaded, rejected, s);
  EXPECT_GT(loaded, 0);
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace strata::test
