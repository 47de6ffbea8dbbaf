// The scalars of a checkpoint that re-partitioning trusts, crafted inside files with valid
// checksums: the MoE experts' layout and pieces (SavedExperts) and what strata-ckpt
// consolidates by (flat_numel, flat_params, aliases, pieces, master shapes). Each case returns
// or throws strata::Error naming the checkpoint, within its memory and time bound.
#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/saved_experts.h"
#include "tests/fuzz_tally.h"
#include "tests/runtime/checkpoint/hostile_util.h"
#include "tests/runtime/checkpoint/scratch_dir.h"

namespace ckpt = strata::checkpoint;
using strata::test::FuzzTally;
using strata::test::ScratchDir;
using json = nlohmann::json;

namespace {

const int64_t kBig = int64_t(1) << 62;

// Two experts of one layer, 9 elements each (w1 [3, 2] stacked, b [3] per expert), one per
// rank, as engine_experts.cpp saves them; `edit` changes a rank's file before it is written.
void save_experts(const std::string& dir, const strata::test::EditPartition& edit) {
  std::vector<ckpt::CheckpointWriter> writers;
  for (int r = 0; r < 2; ++r) writers.emplace_back(dir, "t", r, 2);
  writers[0].write_shared("model_states", {{"param.gate.weight", torch::ones({2, 4})}});
  const json layout = {{{"layer", "moe.experts"},
                        {"experts", 2},
                        {"params",
                         {{{"name", "w1"}, {"shape", {3, 2}}, {"stacked", true}},
                          {{"name", "b"}, {"shape", {3}}, {"stacked", false}}}}}};
  for (int r = 0; r < 2; ++r) {
    json scalars = {{"expert_layout", layout},
                    {"expert_numel", 18},
                    {"expert_pieces", {{9 * r, 9, 0}}},
                    {"state.type", "adam"},
                    {"state.step", 3}};
    ckpt::NamedTensors tensors = {{"master", torch::arange(9.0f) + 9 * r + 1},
                                  {"weights", torch::arange(9.0f)},
                                  {"state.exp_avg", torch::zeros({9})}};
    if (edit) edit(r, scalars, tensors);
    writers[r].write_partition("expert_states", tensors, scalars);
  }
  writers[0].commit({});
}

void read_experts(const std::string& dir) {
  const ckpt::CheckpointReader reader(dir);
  const ckpt::SavedExperts saved(reader);
  const auto master = saved.assemble("master");
  ASSERT_EQ(master.numel(), saved.numel());
  for (const auto& name : saved.state_tensors()) saved.assemble(name);
  int64_t total = 0;
  for (const auto& [name, t] : saved.parameters(master)) total += t.numel();
  EXPECT_EQ(total, saved.numel());
}

// A value a hostile file might hold where a count or an offset belongs.
json odd_value(std::mt19937_64& rng) {
  static const std::vector<json> values = {0,    -1, 1,   2,    3,     8,    9,    17,  18,
                                           19,   kBig, INT64_MAX, -kBig, 1.5,  "9",  nullptr,
                                           json::array(), json::object()};
  return values[rng() % values.size()];
}

}  // namespace

TEST(HostileScalars, ExpertLayoutsAndPiecesAreCheckedBeforeUse) {
  std::mt19937_64 rng(3);
  FuzzTally tally("MoE expert states");
  int accepted_as_saved = 0;
  for (int c = 0; c < 400; ++c) {
    ScratchDir tmp;
    std::string what;
    const int changes = c == 0 ? 0 : 1 + rng() % 2;
    std::vector<std::function<void(int, json&, ckpt::NamedTensors&)>> edits;
    for (int k = 0; k < changes; ++k) {
      const int rank = rng() % 2, kind = rng() % 9, which = rng() % 3;
      const json v = odd_value(rng);
      what += " rank " + std::to_string(rank) + " change " + std::to_string(kind) + " " + v.dump();
      edits.push_back([=](int r, json& s, ckpt::NamedTensors& t) {
        if (r != rank) return;
        auto& layer = s["expert_layout"][0];
        switch (kind) {
          case 0: layer["experts"] = v; break;
          case 1: layer["params"][which % 2]["shape"][0] = v; break;
          case 2: layer["params"][1]["stacked"] = v; break;
          case 3: s["expert_numel"] = v; break;
          case 4: s["expert_pieces"][0][which] = v; break;
          case 5: s["expert_pieces"].push_back({v, 9, 0}); break;
          case 6: s.erase("state.type"); break;  // a rank that saved no experts, with pieces
          case 7: t[0].second = torch::zeros({3, 3}); break;  // a master of another shape
          default: t[2].second = torch::zeros({v.is_number_integer() ? 5 : 10}); break;
        }
      });
    }
    save_experts(tmp.str(), [&](int r, json& s, ckpt::NamedTensors& t) {
      for (auto& e : edits) e(r, s, t);
    });
    tally.run("case " + std::to_string(c) + what, tmp.str(), 4096, true, [&] {
      read_experts(tmp.str());
      if (c == 0) ++accepted_as_saved;
    });
  }
  EXPECT_EQ(accepted_as_saved, 1);
  EXPECT_GT(tally.refused(), 300);
}

// strata-ckpt consolidate over optimizer partitions whose scalars lie. What it cuts by is rank
// 0's (flat_params, aliases, layout): those lies are refused; the same keys in rank 1's file
// are not read, and a change there passes.
TEST(HostileScalars, ConsolidationChecksWhatItCutsBy) {
  FuzzTally tally("consolidate");
  const std::vector<std::pair<std::string, json>> changes = {
      {"flat_numel", 7}, {"flat_numel", 9}, {"flat_numel", -1}, {"flat_numel", kBig},
      {"flat_numel", 1.5}, {"flat_numel", "8"}, {"flat_params", {"fc.weight"}},
      {"flat_params", {"fc.weight", "fc.bias", "fc.bias"}}, {"flat_params", {"nope"}},
      {"flat_params", {1}}, {"flat_params", "fc.weight"}, {"flat_params", json::object()},
      {"flat_param_aliases", {{"a", "missing"}}}, {"flat_param_aliases", {{"a", 3}}},
      {"flat_param_aliases", json::array({1})}, {"layout", 3}, {"layout", nullptr},
      {"shard_pieces", {{0, 4, 0}}}, {"shard_pieces", {{4, 4, 1}}}, {"shard_pieces", {{5, 4, 0}}},
      {"shard_pieces", {{4, 2, 0}, {6, 2, 1}}}, {"shard_pieces", {{INT64_MAX, 4, 0}}},
      {"shard_pieces", json::array()}, {"shard_pieces", {{4, 4, 0, 0}}}};
  for (int rank = 0; rank < 2; ++rank)
    for (const auto& [key, value] : changes) {
      ScratchDir tmp;
      strata::test::save_small_checkpoint(tmp.str(), "s", [&](int r, json& s, ckpt::NamedTensors&) {
        if (r == rank) s[key] = value;
      });
      tally.run("rank " + std::to_string(rank) + " " + key + " = " + value.dump(), tmp.str(), 8192,
                true, [&] { strata::test::read_small_checkpoint(tmp.str()); });
    }
  for (const auto& master : {torch::zeros({2, 2}), torch::zeros({5}), torch::zeros({3}),
                             torch::zeros({4}, torch::kDouble), torch::zeros({0})}) {
    ScratchDir tmp;
    strata::test::save_small_checkpoint(tmp.str(), "s", [&](int r, json&, ckpt::NamedTensors& t) {
      if (r == 1) t[0].second = master;
    });
    tally.run("rank 1 master " + ckpt::shape_text(master.sizes().vec()), tmp.str(), 8192, true,
              [&] { strata::test::read_small_checkpoint(tmp.str()); });
  }
  EXPECT_GT(tally.refused(), 38);
}
