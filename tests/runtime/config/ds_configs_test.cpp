// The 150 real DeepSpeed configs in /work/shared/ds-configs (not copied into the repository):
// each loads or is rejected with messages that name a key and a fix; misspelling a key or
// giving a value of the wrong type anywhere the schema reaches is caught, naming that key.
#include <algorithm>
#include <filesystem>
#include <random>

#include "runtime/config/schema_blocks.h"
#include "tests/runtime/config/config_test_util.h"

namespace strata::test {
namespace {

namespace fs = std::filesystem;

// Measured: see the report in the test's output; a drop means a real config stopped loading.
constexpr size_t kExpectedLoaded = 97;  // 99 of 150 loaded when this was written

std::string corpus_dir() { return std::string(STRATA_SOURCE_DIR) + "/../shared/ds-configs"; }

std::vector<fs::path> corpus() {
  std::vector<fs::path> files;
  if (!fs::is_directory(corpus_dir())) return files;
  for (const auto& e : fs::directory_iterator(corpus_dir()))
    if (e.path().extension() == ".json") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

// What a Hugging Face Trainer would pass, so that "auto" configs load as they would in training.
LoadOptions program_options(int64_t world) {
  LoadOptions o;
  o.world_size = world;
  o.autos.micro_batch_per_gpu = 4;
  o.autos.gradient_accumulation_steps = 1;
  o.autos.lr = 1e-4;
  o.autos.beta1 = 0.9;
  o.autos.beta2 = 0.999;
  o.autos.eps = 1e-8;
  o.autos.weight_decay = 0.0;
  o.autos.max_grad_norm = 1.0;
  o.autos.warmup_steps = 10;
  o.autos.total_steps = 1000;
  o.autos.fp16 = false;
  o.autos.bf16 = false;
  o.autos.hidden_size = 1024;
  return o;
}

// A config written for N GPUs: N = train / (micro x gas) when all are numbers (test-only guess).
int64_t world_for(const json& doc) {
  // A number as written, or what program_options() resolves "auto" / a missing key to.
  auto num = [&](const char* k, int64_t otherwise) -> int64_t {
    return doc.contains(k) && doc[k].is_number() ? doc[k].get<int64_t>() : otherwise;
  };
  const int64_t t = num("train_batch_size", 0), m = num("train_micro_batch_size_per_gpu", 4);
  const int64_t g = num("gradient_accumulation_steps", 1);
  if (t > 0 && m > 0 && g > 0 && t % (m * g) == 0) return t / (m * g);
  return 1;
}

struct DsConfigOutcome {
  std::string name;
  json doc;
  LoadOptions options;
  bool loaded = false;
  std::vector<std::string> problems;
};

DsConfigOutcome try_load(const fs::path& path) {
  DsConfigOutcome o;
  o.name = path.filename().string();
  const std::string text = slurp(path.string());
  o.doc = json::parse(text, nullptr, false);
  o.options = program_options(1);
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      parse_config_text(text, o.name, o.options);
      o.loaded = true;
      return o;
    } catch (const ConfigError& e) {
      o.problems = e.problems();
      const int64_t world = o.doc.is_object() ? world_for(o.doc) : 1;
      if (world == o.options.world_size) break;
      o.options.world_size = world;
    }
  }
  return o;
}

bool names_a_fix(const std::string& m) {
  for (const char* fix : {"did you mean", "remove", "write", "expected", "allowed", "keep ", "use ", "give ",
                          "set ", "needs", "must", "make ", "required", "delete"})
    if (m.find(fix) != std::string::npos) return true;
  return false;
}

bool names_a_key(const std::string& m) {
  if (m.find('\'') != std::string::npos || m.find(" = ") != std::string::npos) return true;
  for (const auto& f : schema::root_block().fields)
    if (m.find(f.key) != std::string::npos) return true;
  return false;
}

TEST(DsConfigs, EachLoadsOrIsRejectedNamingAKeyAndAFix) {
  const std::vector<fs::path> files = corpus();
  if (files.empty()) GTEST_SKIP() << "no corpus at " << corpus_dir();
  size_t loaded = 0;
  std::string report;
  for (const fs::path& f : files) {
    const DsConfigOutcome o = try_load(f);
    if (o.loaded) {
      ++loaded;
      continue;
    }
    ASSERT_FALSE(o.problems.empty()) << o.name;
    report += "  rejected " + o.name + "\n      " + o.problems.front() + "\n";
    for (const std::string& p : o.problems) {
      EXPECT_EQ(p.rfind(o.name, 0), 0u) << "not prefixed with the file: " << p;
      EXPECT_TRUE(names_a_key(p)) << "names no key: " << p;
      EXPECT_TRUE(names_a_fix(p)) << "names no fix: " << p;
    }
  }
  std::printf("ds-configs: %zu files, %zu loaded, %zu rejected\n%s", files.size(), loaded, files.size() - loaded,
              report.c_str());
  EXPECT_GE(loaded, kExpectedLoaded) << "fewer real DeepSpeed configs load than before";
}

// The real configs that set fp16.auto_cast (InternVL's ZeRO 1-3 configs) load with fp16 on, as a
// Trainer run with --fp16 resolves them, and nothing in them is pending: the engine runs them
// (tests/runtime/engine/test_engine_autocast.cpp trains under each).
TEST(DsConfigs, TheConfigsWithFp16AutoCastLoadWithNothingPending) {
  const std::vector<fs::path> files = corpus();
  if (files.empty()) GTEST_SKIP() << "no corpus at " << corpus_dir();
  std::vector<std::string> auto_cast;
  for (const fs::path& f : files) {
    const json doc = json::parse(slurp(f.string()), nullptr, false);
    if (!doc.is_object() || !doc.contains("fp16") || !doc["fp16"].is_object()) continue;
    const json& fp16 = doc["fp16"];
    if (fp16.contains("auto_cast") && fp16["auto_cast"] == true) auto_cast.push_back(f.filename().string());
  }
  EXPECT_EQ(auto_cast.size(), 5u);
  for (const std::string& name : auto_cast) {
    LoadOptions options = program_options(1);
    options.autos.fp16 = true;
    const Config c = parse_config_text(slurp(corpus_dir() + "/" + name), name, options);
    EXPECT_TRUE(c.fp16.enabled) << name;
    EXPECT_TRUE(c.fp16.auto_cast) << name;
    std::string pending;
    for (const std::string& p : pending_features(c)) pending += p + "\n";
    EXPECT_TRUE(pending.empty()) << name << ":\n" << pending;
  }
}

// ---- mutations: the schema-reachable keys of the configs that load -------------------------

struct Site {
  std::vector<std::string> keys;  // path of object keys from the root
  const schema::Field* field;
  const schema::Block* block;
};

void sites(const json& obj, const schema::Block& block, std::vector<std::string> at, std::vector<Site>& out) {
  if (!obj.is_object()) return;
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const schema::Field* f = block.find(it.key());
    if (!f) continue;
    std::vector<std::string> here = at;
    here.push_back(it.key());
    out.push_back({here, f, &block});
    if (f->kind == schema::Kind::Block) sites(it.value(), *f->block, here, out);
  }
}

std::string dotted(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) s += (s.empty() ? "" : ".") + k;
  return s;
}

json& at(json& doc, const std::vector<std::string>& keys, size_t depth) {
  json* node = &doc;
  for (size_t i = 0; i < depth; ++i) node = &(*node)[keys[i]];
  return *node;
}

std::string reject_message(const std::string& text, const std::string& name, const LoadOptions& options) {
  try {
    parse_config_text(text, name, options);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(DsConfigs, MisspelledKeysAreRejectedWithTheClosestKey) {
  const std::vector<fs::path> files = corpus();
  if (files.empty()) GTEST_SKIP() << "no corpus at " << corpus_dir();
  std::mt19937 rng(5);
  size_t tried = 0, exact = 0;
  for (const fs::path& f : files) {
    const DsConfigOutcome o = try_load(f);
    if (!o.loaded) continue;
    std::vector<Site> all;
    sites(o.doc, schema::root_block(), {}, all);
    for (int n = 0; n < 4 && !all.empty(); ++n) {
      const Site& s = all[rng() % all.size()];
      std::string bad = s.keys.back();
      bad[rng() % bad.size()] = static_cast<char>('a' + rng() % 26);
      json doc = o.doc;
      if (bad == s.keys.back() || s.block->find(bad) || at(doc, s.keys, s.keys.size() - 1).contains(bad)) continue;
      json& p = at(doc, s.keys, s.keys.size() - 1);
      p[bad] = p[s.keys.back()];
      p.erase(s.keys.back());
      std::vector<std::string> bad_path = s.keys;
      bad_path.back() = bad;
      const std::string m = reject_message(doc.dump(2), o.name, o.options);
      ++tried;
      EXPECT_CONTAINS(m, "unknown key '" + dotted(bad_path) + "'");
      EXPECT_CONTAINS(m, "did you mean '");
      if (m.find("did you mean '" + s.field->key + "'") != std::string::npos) ++exact;
    }
  }
  std::printf("misspellings: %zu tried, %zu suggested the original key\n", tried, exact);
  EXPECT_GT(tried, 100u);
  EXPECT_GE(exact * 100, tried * 95) << "the suggestion should almost always be the original key";
}

json wrong_value(schema::Kind kind) {
  switch (kind) {
    case schema::Kind::Bool: return "maybe";
    case schema::Kind::Int:
    case schema::Kind::Float: return "many";
    case schema::Kind::String: return 12345;
    case schema::Kind::FloatList:
    case schema::Kind::StringList: return true;
    default: return 7;  // objects and blocks
  }
}

TEST(DsConfigs, WrongTypesAreRejectedNamingTheKey) {
  const std::vector<fs::path> files = corpus();
  if (files.empty()) GTEST_SKIP() << "no corpus at " << corpus_dir();
  std::mt19937 rng(6);
  size_t tried = 0;
  for (const fs::path& f : files) {
    const DsConfigOutcome o = try_load(f);
    if (!o.loaded) continue;
    std::vector<Site> all;
    sites(o.doc, schema::root_block(), {}, all);
    all.erase(std::remove_if(all.begin(), all.end(),
                             [](const Site& s) {
                               return s.field->kind == schema::Kind::Any || s.field->kind == schema::Kind::Legacy;
                             }),
              all.end());
    for (int n = 0; n < 4 && !all.empty(); ++n) {
      const Site& s = all[rng() % all.size()];
      json doc = o.doc;
      at(doc, s.keys, s.keys.size()) = wrong_value(s.field->kind);
      const std::string m = reject_message(doc.dump(2), o.name, o.options);
      ++tried;
      EXPECT_CONTAINS(m, dotted(s.keys));
      EXPECT_CONTAINS(m, "expected");
    }
  }
  std::printf("wrong types: %zu tried\n", tried);
  EXPECT_GT(tried, 100u);
}

}  // namespace
}  // namespace strata::test
