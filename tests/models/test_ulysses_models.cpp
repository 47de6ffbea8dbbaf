// The published-architecture models under Ulysses sequence parallelism, over real processes
// (Gloo, loopback): sequence_parallel_size 2 and 4 against the whole sequence in one process.
// Each rank feeds its shard of input_ids and labels (some labels -100, the shard boundaries'
// labels included); the ranks' losses sum to the whole sequence's loss, and each parameter's
// gradient summed over the ranks is the whole sequence's (1e-5 relative, fp32): RoPE at the
// shard's global positions, the label after each shard's last position taken from the next rank,
// the mean over the whole sequence's counted tokens, attention over the exchanged heads (kv heads
// split at 2 ranks, replicated at 4). With every layer checkpointed (the exchange replays in the
// recomputation) and with the tiled MLP.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "comm/process_group.h"
#include "models/causal_lm.h"
#include "runtime/error.h"
#include "runtime/sequence/ulysses.h"
#include "tests/comm/ranks.h"
#include "tests/models/oracle_util.h"

// Named: this binary also holds tests/runtime/sequence/test_ulysses.cpp (main() is there), and a
// unity build compiles them as one translation unit.
namespace strata::test::ulysses_models {
namespace {

constexpr int64_t kBatch = 2, kSeq = 16;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) throw Error(fmt::format("{} is not set", name));
  return v;
}

models::CausalLM build(const models::DecoderConfig& config) {
  torch::manual_seed(3);  // every rank and the reference draw the same weights
  return models::CausalLM(config);
}

STRATA_SCENARIO(ulysses_causal_lm) {
  auto world = comm::init_process_group();
  auto config = models::read_hf_config(hf_oracle::fixture_dir(env("ULYSSES_FAMILY")));
  config.checkpointing = env("ULYSSES_CHECKPOINTING");
  config.mlp_tiles = std::stoll(env("ULYSSES_TILES"));
  torch::manual_seed(11);
  const auto ids = torch::randint(0, config.vocab_size, {kBatch, kSeq}, torch::kLong);
  auto labels = ids.clone();
  // Not counted: a few positions, among them the first label of the second half (the target of
  // the first half's last position at P = 2).
  labels.index_put_({0, kSeq / 2}, -100);
  labels.index_put_({1, 3}, -100);
  labels.index_put_({1, kSeq - 1}, -100);

  auto whole = build(config);
  const auto want = whole->forward(ids, labels);
  want.backward();

  auto sharded = build(config);
  sharded->set_sequence_parallel(world);
  auto loss = sharded->forward(sequence::shard_sequence(ids, world),
                               sequence::shard_sequence(labels, world));
  loss.backward();
  auto total = loss.detach().clone().reshape({1});
  world->all_reduce(total, comm::ReduceOp::Sum);
  const std::string at = fmt::format("{} P {} {} tiles {} rank {}", env("ULYSSES_FAMILY"),
                                     world->size(), config.checkpointing, config.mlp_tiles,
                                     world->rank());
  const double loss_error = hf_oracle::relative(total.squeeze(0), want.detach());
  if (!(loss_error <= 1e-5))
    throw Error(fmt::format("{}: loss summed over the ranks {} against {} (relative {})", at,
                            total.item<double>(), want.item<double>(), loss_error));
  const auto want_params = whole->named_parameters(), got_params = sharded->named_parameters();
  double worst = 0;
  for (const auto& p : want_params) {
    const auto& mine = got_params[p.key()];
    if (!mine.grad().defined()) throw Error(at + ": no gradient for " + p.key());
    auto sum = mine.grad().clone();
    world->all_reduce(sum, comm::ReduceOp::Sum);
    const double e = hf_oracle::relative(sum, p.value().grad());
    if (!(e <= 1e-5))
      throw Error(fmt::format("{}: {}'s gradient summed over the ranks differs (relative {})", at,
                              p.key(), e));
    worst = std::max(worst, e);
  }
  std::printf("MESSAGE: %s: loss %.6f (relative %.1e), %zu gradients, worst relative %.1e\n",
              at.c_str(), want.item<double>(), loss_error, want_params.size(), worst);
}

TEST(UlyssesModels, ShardedSequenceGivesTheWholeSequencesLossAndGradients) {
  struct Case {
    const char* family;
    int world;
    const char* checkpointing;
    int tiles;
  };
  for (const Case& c : {Case{"llama3", 2, "", -1}, Case{"qwen3", 2, "every", -1},
                        Case{"llama3_tied", 4, "", 2}, Case{"llama3", 4, "every", 0}}) {
    if (kSanitized && !(c.world == 4 && c.tiles == 0)) continue;  // CI's sanitized suite: one case
    LaunchSpec spec;
    spec.scenario = "ulysses_causal_lm";
    spec.world = c.world;
    spec.env = {{"ULYSSES_FAMILY", c.family},
                {"ULYSSES_CHECKPOINTING", c.checkpointing},
                {"ULYSSES_TILES", std::to_string(c.tiles)}};
    spec.timeout_s = 90;
    auto l = run_ranks(spec);
    l.print_messages();
    EXPECT_TRUE(l.all_ok()) << c.family << " P " << c.world << ": " << l.report();
  }
}

// Three ranks cannot split 4 heads: refused by name on every rank, before any exchange.
STRATA_SCENARIO(ulysses_refused) {
  auto world = comm::init_process_group();
  auto model = build(models::read_hf_config(hf_oracle::fixture_dir("llama3")));
  try {
    model->set_sequence_parallel(world);
  } catch (const Error& e) {
    const std::string text = e.what();
    if (text.find("4 attention heads and 2 kv heads do not split over sequence_parallel_size 3") ==
        std::string::npos)
      throw Error("unexpected refusal: " + text);
    return;
  }
  throw Error("sequence_parallel_size 3 accepted for 4 heads");
}

TEST(UlyssesModels, HeadsThatDoNotSplitAreRefused) {
  LaunchSpec spec;
  spec.scenario = "ulysses_refused";
  spec.world = 3;
  auto l = run_ranks(spec);
  EXPECT_TRUE(l.all_ok()) << l.report();
}

}  // namespace
}  // namespace strata::test::ulysses_models
