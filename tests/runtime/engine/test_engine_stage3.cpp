// ZeRO-3 through the engine, on a model that knows nothing of it (blocks in a ModuleList, an
// embedding tied to the output head, LayerNorms small enough to stay whole, a frozen layer):
// against LibTorch's AdamW and clip_grad_norm_ on the whole batch in this process. The
// Stage3Worker cases run as one process (CTest runs each) and on 2 and 4 ranks through
// strata-run (this binary re-run as the ranks). Also: a step
// that skips a block, ranks that take different branches, a weight read outside the step,
// gathered parameters, and the memory the mechanism keeps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <set>
#include <string>

#include "comm/process_group.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/util/tiled.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "tests/offload/build_fs_dir.h"
#include "tests/runtime/engine/launch_workers.h"

namespace {

using strata::json;
namespace F = torch::nn::functional;

constexpr const char* kWorker = "STRATA_STAGE3_WORKER";
bool is_worker() { return strata::test_support::is_worker(kWorker); }
int rank() { return is_worker() ? strata::test_support::env_int("RANK") : 0; }
int world() { return is_worker() ? strata::test_support::env_int("WORLD_SIZE") : 1; }

constexpr int64_t kVocab = 16, kDim = 16;

// `tiles` >= 0: the block runs over tiles of the sequence (runtime/util/tiled.h).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t tiles = -1) : tiles(tiles) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    up = register_module("up", torch::nn::Linear(kDim, 2 * kDim));
    down = register_module("down", torch::nn::Linear(2 * kDim, kDim));
  }
  torch::Tensor body(const torch::Tensor& x) { return x + down(F::gelu(up(norm(x)))); }
  torch::Tensor forward(const torch::Tensor& x) {
    if (tiles < 0) return body(x);
    strata::checkpointing::TileOptions options;
    options.tiles = tiles;
    return strata::checkpointing::tiled_function([this](const torch::Tensor& t) { return body(t); },
                                                 parameters(), x, options);
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
  int64_t tiles;
};
TORCH_MODULE(Block);

// `skip`: a block not run in this forward (-1: none).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t blocks_n = 3, int64_t tiles = -1) {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < blocks_n; ++i) blocks->push_back(Block(tiles));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    register_parameter("head_weight", emb->weight);  // tied
  }
  // `reverse`: the blocks last to first (another order of use than training's).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y, int64_t skip = -1,
                        bool reverse = false) {
    auto h = emb(x);
    const int64_t n = int64_t(blocks->size());
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = reverse ? n - 1 - k : k;
      if (i != skip) h = blocks[i]->as<Block>()->forward(h);
    }
    auto logits = F::linear(norm(h), emb->weight);
    return F::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
  }
  std::vector<torch::Tensor> unique_trainable() {
    std::vector<torch::Tensor> out;
    std::set<const void*> seen;
    for (auto& p : parameters())
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
    return out;
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Net);

json stage3_config(int64_t global, int64_t gas, bool bf16 = false) {
  json c = {{"train_batch_size", global},
            {"gradient_accumulation_steps", gas},
            {"steps_per_print", 1000},
            {"gradient_clipping", 0.5},
            // LayerNorm weights (16 elements) stay whole; everything else is partitioned.
            {"zero_optimization", {{"stage", 3}, {"stage3_param_persistence_threshold", 16}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}}};
  if (bf16) c["bf16"] = {{"enabled", true}};
  return c;
}

// ---- equivalence -------------------------------------------------------------------------------

// This rank's slices of each global batch through the engine; the whole batch through LibTorch's
// AdamW here. Step 2 skips block 1 on every rank (a branch decided by the step).
void train_like_libtorch(int r, int w) {
  const int64_t global = 8, gas = 2, micro = global / (gas * w);
  torch::manual_seed(3);
  Net net, ref;
  net->blocks[2]->as<Block>()->up->weight.set_requires_grad(false);  // frozen, still partitioned
  ref->blocks[2]->as<Block>()->up->weight.set_requires_grad(false);
  {
    torch::NoGradGuard no_grad;
    auto pn = net->parameters(), pr = ref->parameters();
    for (size_t i = 0; i < pn.size(); ++i) pr[i].copy_(pn[i]);
  }
  const auto frozen_before = net->blocks[2]->as<Block>()->up->weight.detach().clone();
  auto engine = strata::initialize(net, stage3_config(global, gas));
  ASSERT_NE(engine->stage3_units(), nullptr);
  torch::optim::AdamW opt(ref->unique_trainable(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int64_t step = 0; step < 4; ++step) {
    const int64_t skip = step == 2 ? 1 : -1;
    torch::manual_seed(70 + step);
    const auto x = torch::randint(0, kVocab, {global, 6}), y = torch::randint(0, kVocab, {global, 6});
    for (int64_t m = 0; m < gas; ++m) {
      const int64_t first = (m * w + r) * micro;
      engine->backward(engine->forward(x.narrow(0, first, micro), y.narrow(0, first, micro), skip));
      engine->step();
    }
    opt.zero_grad();
    ref->forward(x, y, skip).backward();
    // DeepSpeed's ignore_unused_parameters: a parameter the step did not use has a zero gradient
    // (LibTorch 2.x's zero_grad() leaves none, and its AdamW would then skip the parameter).
    for (auto& p : ref->unique_trainable())
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    const double norm = torch::nn::utils::clip_grad_norm_(ref->unique_trainable(), 0.5);
    EXPECT_NEAR(engine->last_grad_norm(), norm, 1e-5 * norm) << "step " << step;
    opt.step();
    auto whole = engine->gathered_parameters();  // every rank: a collective
    auto pn = net->parameters(), pr = ref->parameters();
    for (size_t i = 0; i < pn.size(); ++i)
      ASSERT_TRUE(torch::allclose(pn[i], pr[i], 1e-5, 1e-6))
          << "rank " << r << " of " << w << " step " << step << " parameter "
          << net->named_parameters().keys()[i] << " differs by "
          << (pn[i] - pr[i]).abs().max().item<double>();
    EXPECT_TRUE(torch::equal(net->blocks[2]->as<Block>()->up->weight, frozen_before));
  }
  EXPECT_GT(engine->stage3_coordinator()->prefetches(), 0);  // the trace of step 1 was followed
  // Outside the scope the units are released again: only the whole LayerNorms stay.
  const auto* units = engine->stage3_units();
  EXPECT_LT(units->gathered_bytes(), units->largest_unit_bytes());
  EXPECT_TRUE(net->named_parameters()["head_weight"].is_same(net->emb->weight));
}

TEST(Stage3Worker, TrainsLikeLibTorchWithTiedFrozenAndSkippedBlocks) {
  train_like_libtorch(rank(), world());
}

// ---- memory --------------------------------------------------------------------------------------

// bf16 with Adam, prefetch and liveness set to about one unit (the defaults keep everything, as
// DeepSpeed's do): between uses only shards stay; while the model runs, the units in use and those
// prefetched, within stage3_max_live_parameters plus the unit an op needs, beside the persistent
// LayerNorms. Model states per rank: 2 (bf16 shard) + 2 (bf16 gradient shard) + 4 (fp32 master)
// + 8 (Adam) bytes per element of the padded partition P, plus the persistent parameters' whole
// bf16 copy: ZeRO-3's 16 Psi / N + 2 Psi_p (1 - 1/N), where this layout also keeps the
// persistent shard (2 Psi_p / N).
void memory_follows_the_formula(int r, int w) {
  torch::manual_seed(5);
  Net net(4);
  const int64_t block = (kDim * 2 * kDim + 2 * kDim) + (2 * kDim * kDim + kDim);  // a unit
  auto config = stage3_config(4 * w, 1, /*bf16=*/true);
  config["zero_optimization"]["stage3_prefetch_bucket_size"] = block;
  config["zero_optimization"]["stage3_max_live_parameters"] = 2 * block;
  config["zero_optimization"]["stage3_max_reuse_distance"] = 0;
  auto engine = strata::initialize(net, config);
  const auto* units = engine->stage3_units();
  int64_t persistent_numel = 0, persistent_bytes = 0, psi = 0;
  for (size_t u = 0; u < units->size(); ++u) {
    const auto& unit = units->unit(u);
    if (unit.trainable) psi += unit.numel;
    if (unit.persistent) {
      persistent_numel += unit.numel;
      persistent_bytes += unit.full.numel() * 2;
    }
  }
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(10 + step);
    const auto x = torch::randint(0, kVocab, {4, 6}), y = torch::randint(0, kVocab, {4, 6});
    engine->backward(engine->forward(x, y));
    engine->step();
  }
  const int64_t peak = engine->live_param_bytes_peak();
  EXPECT_GT(engine->stage3_coordinator()->prefetches(), 0);
  EXPECT_GT(peak, persistent_bytes + units->largest_unit_bytes()) << "rank " << r << ": no prefetch";
  EXPECT_LE(peak, persistent_bytes + 2 * (2 * block) + units->largest_unit_bytes()) << "rank " << r;
  const auto bytes = engine->model_state_bytes();
  const int64_t p = units->shards().partition_numel();
  EXPECT_EQ(bytes.params, 2 * p + persistent_bytes);
  EXPECT_EQ(bytes.grads, 2 * p);
  EXPECT_EQ(bytes.master, 4 * p);
  EXPECT_NEAR(double(bytes.optimizer), 8.0 * p, 64);  // + the step counter
  EXPECT_EQ(bytes.host, bytes.total());  // a CPU run: every state counted as in host memory
  // P is Psi / N plus alignment padding (64 elements per unit at most).
  EXPECT_LE(p * w - psi, int64_t(units->size()) * 64 * w);
  const double formula = 16.0 * psi / w + 2.0 * persistent_numel * (1.0 - 1.0 / w);
  const double slack = 16.0 * (p - double(psi) / w) + 2.0 * persistent_numel / w;
  EXPECT_NEAR(double(bytes.total()), formula, slack + 64) << "rank " << r;
  std::printf("stage3 memory: rank %d of %d: live peak %lld B (persistent %lld, largest unit "
              "%lld, max live %lld), model states %lld B, formula %.0f B\n",
              r, w, (long long)peak, (long long)persistent_bytes,
              (long long)units->largest_unit_bytes(), (long long)(2 * 2 * block),
              (long long)bytes.total(), formula);
}

TEST(Stage3Worker, MemoryFollowsTheFormula) { memory_follows_the_formula(rank(), world()); }

// The forward's end is a turn: with stage3_max_reuse_distance 0 no unit stays gathered through
// the loss (not the tied head the forward used last, not one prefetched for backward), so every
// use gathers once each way. With the default distance (DeepSpeed's 1e9 elements, which keeps
// every unit of this model between its uses) the head the backward starts with stays.
TEST(Stage3Worker, TheForwardsEndReleasesEveryUnitNotKeptForReuse) {
  for (const bool keep : {false, true}) {
    torch::manual_seed(5);
    Net net(4);
    const int64_t block = (kDim * 2 * kDim + 2 * kDim) + (2 * kDim * kDim + kDim);
    auto config = stage3_config(4 * world(), 1);
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 2 * block;
    if (!keep) config["zero_optimization"]["stage3_max_reuse_distance"] = 0;
    auto engine = strata::initialize(net, config);
    const auto* units = engine->stage3_units();
    auto* coordinator = engine->stage3_coordinator();
    const auto x = torch::randint(0, kVocab, {4, 6}), y = torch::randint(0, kVocab, {4, 6});
    for (int step = 0; step < 3; ++step) {
      const int64_t gathers_before = coordinator->gathers();
      auto loss = engine->forward(x, y);
      const auto& live = units->live_units();  // persistent ones aside
      bool head_live = false;
      for (size_t u : live) head_live = head_live || units->unit(u).names.front() == "emb.weight";
      if (!keep) {
        EXPECT_TRUE(live.empty()) << "step " << step << ": " << live.size() << " units gathered";
      } else if (step > 0) {  // on the trace: the unit backward uses first stays
        EXPECT_TRUE(head_live) << "step " << step;
      }
      engine->backward(loss);
      engine->step();
      // Forward: emb, blocks 0-3, the head (emb's unit again); backward: the head, blocks 3-0
      // (the embedding's backward reads no weight).
      const int64_t gathers = coordinator->gathers() - gathers_before;
      if (step > 0) {
        if (keep)
          EXPECT_EQ(gathers, 5) << "step " << step;  // each unit once
        else
          EXPECT_EQ(gathers, 6 + 5) << "step " << step;
      }
    }
    EXPECT_EQ(coordinator->trace_departures(), 0) << "keep " << keep;
    EXPECT_GT(coordinator->prefetches(), 0) << "keep " << keep;
  }
}

// ---- mistakes ------------------------------------------------------------------------------------

// Reading a weight between steps would need a gather the other ranks never join: NaN, and the
// next engine call names the parameter. Every rank makes the mistake here, so none waits.
// Tiled blocks (each over 3 tiles of the sequence) train as the untiled ones, with as many
// gathers: every tile's ops touch the block's unit, so it is gathered once per tiled call and
// once for its recomputation in backward, not once per tile.
TEST(Stage3Worker, TiledBlocksTrainAsUntiledAndGatherAsOften) {
  std::vector<std::vector<double>> losses(2);
  std::vector<std::vector<int64_t>> gathers(2);
  for (int tiled = 0; tiled < 2; ++tiled) {
    torch::manual_seed(9);
    Net net(3, tiled ? 3 : -1);
    auto config = stage3_config(4 * world(), 1);
    config["zero_optimization"]["stage3_max_reuse_distance"] = 0;
    auto engine = strata::initialize(net, config);
    auto* coordinator = engine->stage3_coordinator();
    torch::manual_seed(10 + rank());
    for (int step = 0; step < 3; ++step) {
      const auto x = torch::randint(0, kVocab, {4, 9}), y = torch::randint(0, kVocab, {4, 9});
      const int64_t before = coordinator->gathers();
      auto loss = engine->forward(x, y);
      engine->backward(loss);
      engine->step();
      losses[tiled].push_back(loss.item<double>());
      gathers[tiled].push_back(coordinator->gathers() - before);
    }
  }
  EXPECT_EQ(gathers[1], gathers[0]);
  for (size_t i = 0; i < losses[0].size(); ++i)
    EXPECT_NEAR(losses[1][i], losses[0][i], 1e-5 * std::abs(losses[0][i])) << "step " << i;
}

TEST(Stage3Worker, ReadingAReleasedWeightOutsideTheStepIsNamed) {
  torch::manual_seed(5);
  Net net;
  auto engine = strata::initialize(net, stage3_config(2 * world(), 1));
  const auto x = torch::randint(0, kVocab, {2, 6}), y = torch::randint(0, kVocab, {2, 6});
  engine->backward(engine->forward(x, y));
  engine->step();
  const auto read = net->blocks[1]->as<Block>()->up->weight.sum();
  if (world() == 1) {
    // Alone, the shard is the whole: the read gathers locally and sees the weight.
    auto whole = engine->gathered_parameters();
    EXPECT_EQ(read.item<double>(), net->blocks[1]->as<Block>()->up->weight.sum().item<double>());
    EXPECT_FALSE(std::isnan(read.item<double>()));
  } else {
    EXPECT_TRUE(std::isnan(read.item<double>()));
    try {
      engine->forward(x, y);
      FAIL() << "expected strata::Error";
    } catch (const strata::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'blocks.1.up.weight'"), std::string::npos) << what;
      EXPECT_NE(what.find("gathered_parameters"), std::string::npos) << what;
    }
  }
}

// Ranks that run different blocks of the same size would mix their weights without a word: the
// step names what each rank gathered.
TEST(Stage3Worker, RanksThatGatherDifferentUnitsAreNamed) {
  if (world() < 2) GTEST_SKIP();
  torch::manual_seed(5);
  Net net(2);
  auto engine = strata::initialize(net, stage3_config(2 * world(), 1));
  const auto x = torch::randint(0, kVocab, {2, 6}), y = torch::randint(0, kVocab, {2, 6});
  engine->backward(engine->forward(x, y, /*skip=*/rank() % 2));
  try {
    engine->step();
    FAIL() << "expected strata::Error";
  } catch (const strata::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("gathered different parameters"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0: 'blocks.1'"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1: 'blocks.0'"), std::string::npos) << what;
  }
}

// Two vectors of equal size where the persistence thresholds keep only one of them whole: every
// rank must keep the same one (DeepSpeed decides in module order). The ranks create the two
// tensors in opposite orders, so their allocations differ (an order by address differed by rank
// and mixed the weights: a rank read b's values as a's). Inside gathered_parameters every rank
// sees a = 1 and b = 2, and a step keeps them apart.
struct PairImpl : torch::nn::Module {
  explicit PairImpl(bool b_first) {
    w = register_parameter("w", torch::full({4, 8}, 0.5));
    torch::Tensor a_t, b_t;
    if (b_first) b_t = torch::full({8}, 2.0);
    a_t = torch::full({8}, 1.0);
    if (!b_first) b_t = torch::full({8}, 2.0);
    a = register_parameter("a", a_t);
    b = register_parameter("b", b_t);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return (torch::matmul(x, w) * a + b).pow(2).mean();
  }
  torch::Tensor w, a, b;
};
TORCH_MODULE(Pair);

json pair_config(int64_t model_persistence) {
  return {{"train_batch_size", 2 * world()},
          {"steps_per_print", 1000},
          {"zero_optimization",
           {{"stage", 3},
            {"stage3_param_persistence_threshold", 8},
            {"stage3_model_persistence_threshold", model_persistence}}},
          {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.0}}}}}};
}

TEST(Stage3Worker, EveryRankKeepsTheSameParametersWhole) {
  Pair throwaway(rank() % 2 == 0);  // shifts rank 0's allocations, as a program's other objects do
  Pair net(rank() % 2 == 1);
  auto engine = strata::initialize(net, pair_config(8));
  const auto* units = engine->stage3_units();
  for (size_t u = 0; u < units->size(); ++u)
    if (units->unit(u).persistent) {
      ASSERT_EQ(units->unit(u).names, std::vector<std::string>{"a"}) << "rank " << rank();
    }
  const auto x = torch::ones({2, 4});
  for (int step = 0; step < 2; ++step) {
    engine->backward(engine->forward(x));
    engine->step();
  }
  auto whole = engine->gathered_parameters();
  EXPECT_TRUE(torch::equal(net->a, torch::full({8}, 1.0))) << "rank " << rank() << ": " << net->a;
  EXPECT_TRUE(torch::equal(net->b, torch::full({8}, 2.0))) << "rank " << rank() << ": " << net->b;
}

// Ranks that lay a unit of the same size out differently (here: units named in another order
// per rank, and a forward whose order follows, so that both gather "unit 0" first) would mix
// their weights with every id and size equal: the step's check compares the layouts (parameter
// names and offsets) too, and names the unit.
struct DuoImpl : torch::nn::Module {
  DuoImpl() {
    m1 = register_module("m1", std::make_shared<torch::nn::Module>());
    m2 = register_module("m2", std::make_shared<torch::nn::Module>());
    x = m1->register_parameter("x", torch::full({64}, 1.0));
    y = m2->register_parameter("y", torch::full({64}, 2.0));
  }
  torch::Tensor forward(bool x_first) {
    auto a = x_first ? x.sum() : y.sum();
    return a + (x_first ? y.sum() : x.sum());
  }
  std::shared_ptr<torch::nn::Module> m1, m2;
  torch::Tensor x, y;
};
TORCH_MODULE(Duo);

TEST(Stage3Worker, RanksThatLayAUnitOutDifferentlyAreNamed) {
  if (world() < 2) GTEST_SKIP();
  Duo net;
  strata::InitOptions options;
  const bool swapped = rank() % 2 == 1;
  options.stage3_units = swapped ? std::vector<std::string>{"m2", "m1"}
                                 : std::vector<std::string>{"m1", "m2"};
  auto engine = strata::initialize(net, pair_config(0), options);
  engine->backward(engine->forward(/*x_first=*/!swapped));
  try {
    engine->step();
    FAIL() << "expected strata::Error";
  } catch (const strata::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("holds different parameters on the ranks"), std::string::npos) << what;
    EXPECT_NE(what.find("gather 1 of the step"), std::string::npos) << what;
  }
}

// Defect of ZeRO-3 at the default persistence threshold (every bias and LayerNorm whole): the
// persistent unit completes last in backward, and as the first bucket it held every unit's
// gradient bucket until backward ended. Now buckets launch in the order they complete (rank 0's
// order of the first step, shared): reduce-scatters start while backward runs, and the buffers
// held at once stay within 2 x max(reduce_bucket_size, the largest unit) elements.
struct TallBlockImpl : torch::nn::Module {
  TallBlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({512})));
    up = register_module("up", torch::nn::Linear(512, 1024));
    down = register_module("down", torch::nn::Linear(1024, 512));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::tanh(up(norm(x)))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(TallBlock);

// 8 blocks of 4 MiB (fp32), their LayerNorms and biases under the default threshold.
struct TallImpl : torch::nn::Module {
  TallImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 8; ++i) blocks->push_back(TallBlock());
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : *blocks) x = block->as<TallBlock>()->forward(x);
    return x.pow(2).mean();
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Tall);

TEST(Stage3Worker, GradientBucketsLaunchDuringBackwardAtTheDefaultThreshold) {
  torch::manual_seed(3);
  Tall net;
  const json config = {{"train_batch_size", 2 * world()},
                       {"steps_per_print", 1000},
                       {"zero_optimization", {{"stage", 3}, {"reduce_bucket_size", 1000}}},
                       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
  auto engine = strata::initialize(net, config);
  const auto* units = engine->stage3_units();
  int64_t largest = 0;
  bool persistent = false;
  for (size_t u = 0; u < units->size(); ++u) {
    persistent = persistent || (units->unit(u).persistent && units->unit(u).trainable);
    if (units->unit(u).trainable) largest = std::max(largest, units->parts() * units->unit(u).chunk);
  }
  ASSERT_TRUE(persistent) << "the default threshold keeps the LayerNorms and biases whole";
  const auto* reducer = engine->gradient_reducer();
  ASSERT_NE(reducer, nullptr);
  const auto x = torch::randn({2, 512});
  for (int step = 0; step < 3; ++step) {
    engine->backward(engine->forward(x));
    if (world() > 1) {
      EXPECT_GT(reducer->launched_during_backward(), 0u) << "step " << step << ": no reduce-scatter "
                                                            "started before backward ended";
    }
    engine->step();
  }
  const int64_t bound = 2 * std::max<int64_t>(1000, largest);
  EXPECT_LE(reducer->peak_bucket_numel(), bound) << "rank " << rank();
  std::printf("stage3 gradient buckets: rank %d of %d: peak %lld B of buckets (bound %lld B = 2 x "
              "largest unit %lld B), %zu of %zu reduce-scatters launched during backward\n",
              rank(), world(), (long long)(4 * reducer->peak_bucket_numel()), (long long)(4 * bound),
              (long long)(4 * largest), reducer->launched_during_backward(), reducer->bucket_count());
}

// Eval under NoGradGuard, and a pass whose order differs from training's (the blocks in reverse,
// as a generation loop might), gather on use through engine->forward like training does: the
// same losses as a copy of the weights taken in a gathered scope.
TEST(Stage3Worker, EvalAndAnotherOrderWork) {
  torch::manual_seed(5);
  Net net;
  auto engine = strata::initialize(net, stage3_config(2 * world(), 1));
  const auto x = torch::randint(0, kVocab, {2, 6}), y = torch::randint(0, kVocab, {2, 6});
  engine->backward(engine->forward(x, y));
  engine->step();
  torch::NoGradGuard no_grad;
  const double loss = engine->forward(x, y).item<double>();
  const double reversed = engine->forward(x, y, -1, /*reverse=*/true).item<double>();
  const auto gathers = engine->stage3_coordinator()->gathers();
  Net copy;
  {
    auto whole = engine->gathered_parameters();
    auto pc = copy->parameters(), pn = net->parameters();
    for (size_t i = 0; i < pc.size(); ++i) pc[i].copy_(pn[i]);
  }
  EXPECT_NEAR(copy->forward(x, y).item<double>(), loss, 1e-6);
  EXPECT_NEAR(copy->forward(x, y, -1, true).item<double>(), reversed, 1e-6);
  EXPECT_NE(loss, reversed);
  EXPECT_GT(gathers, 0);
  // Between the passes every unit but the persistent ones is released again.
  EXPECT_LE(engine->stage3_units()->gathered_bytes(), engine->stage3_units()->largest_unit_bytes());
}

// save_16bit_model: refused at stage 3 unless the config asks for the gathered weights; with it,
// one module archive that plain LibTorch loads, holding the trained weights.
TEST(Stage3Worker, Save16BitModelGathersTheWeightsWhenAsked) {
  torch::manual_seed(5);
  Net net;
  auto config = stage3_config(2 * world(), 1);
  auto engine = strata::initialize(net, config);
  const auto x = torch::randint(0, kVocab, {2, 6}), y = torch::randint(0, kVocab, {2, 6});
  engine->backward(engine->forward(x, y));
  engine->step();
  try {
    engine->save_16bit_model(testing::TempDir());
    FAIL() << "expected strata::Error";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("stage3_gather_16bit_weights_on_model_save"),
              std::string::npos) << e.what();
  }
  torch::manual_seed(5);
  Net net2;
  config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true;
  auto engine2 = strata::initialize(net2, config);
  engine2->backward(engine2->forward(x, y));
  engine2->step();
  const char* job = std::getenv("MASTER_PORT");  // one folder per run of the ranks
  const std::string dir = testing::TempDir() + "/stage3_16bit_" + (job ? job : "1");
  engine2->save_16bit_model(dir, "net.pt");
  // And as a Hugging Face folder's safetensors, one unit gathered at a time.
  engine2->save_16bit_model(dir, "model.safetensors");
  Net plain;
  torch::load(plain, dir + "/net.pt");
  const strata::checkpoint::HfWeights hf(dir);
  auto whole = engine2->gathered_parameters();
  size_t seen = 0;
  for (const auto& p : net2->named_parameters()) {
    EXPECT_TRUE(torch::equal(plain->named_parameters()[p.key()], p.value())) << p.key();
    if (!hf.find(p.key())) continue;  // a tied weight's second name
    auto back = torch::empty_like(p.value());
    hf.read(p.key(), 0, back.numel(), back.scalar_type(), back.data_ptr());
    EXPECT_TRUE(torch::equal(back, p.value())) << p.key();
    ++seen;
  }
  EXPECT_EQ(seen + net2->named_buffers().size(), hf.names().size());
  try {
    engine2->save_16bit_model(dir, "weights.safetensors");
    ADD_FAILURE() << "expected strata::Error";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
  }
}

// ---- building a model larger than a rank ----------------------------------------------------------

struct WideImpl : torch::nn::Module {
  WideImpl() {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 8; ++i) layers->push_back(torch::nn::Linear(1024, 1024));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& y) {
    for (auto& layer : *layers) x = torch::tanh(layer->as<torch::nn::Linear>()->forward(x));
    return F::mse_loss(x, y);
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Wide);

// LibTorch's CPU allocator reports each allocation and free to the thread's memory profiler (as
// for the PyTorch profiler's memory view): the net bytes allocated since the scope began, and
// their peak. (Both signatures: LibTorch 1.13 passes the totals as int64_t, 2.x as size_t.)
struct CpuMemoryPeak : c10::MemoryReportingInfoBase {
  int64_t now = 0, peak = 0;
  void count(int64_t bytes, c10::Device device) {
    if (!device.is_cpu()) return;
    now += bytes;
    peak = std::max(peak, now);
  }
  void reportMemoryUsage(void*, int64_t bytes, int64_t, int64_t, c10::Device device) { count(bytes, device); }
  void reportMemoryUsage(void*, int64_t bytes, size_t, size_t, c10::Device device) { count(bytes, device); }
  bool memoryProfilingEnabled() const override { return true; }
};

// DeepSpeed's zero.Init: built inside a PartitionedInit on 4 ranks, the 33.6 MB model never
// exists whole on a rank (the peak of the bytes LibTorch's CPU allocator handed out while it was
// built stays below the model's), and it trains exactly as the same model built whole.
TEST(Stage3InitWorker, ModelBuiltInShardsNeverExistsWholeAndTrainsTheSame) {
  if (!is_worker()) GTEST_SKIP() << "runs on 4 ranks (Stage3Init.FourRanksBuildTheModelInShards)";
  auto group = strata::comm::init_process_group();
  json config = {{"train_batch_size", 8 * world()},
                 {"steps_per_print", 1000},
                 {"zero_optimization", {{"stage", 3}}},
                 {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
  torch::manual_seed(11 + rank());  // different RNG on every rank: rank 0's values win
  auto memory = std::make_shared<CpuMemoryPeak>();
  std::shared_ptr<strata::zero::PartitionedInit> init;
  Wide wide{nullptr};
  {
    c10::DebugInfoGuard measure(c10::DebugInfoKind::PROFILER_STATE, memory);
    init = strata::zero::PartitionedInit::create(group);
    wide = Wide();
    init->finish();
  }
  const int64_t grown = memory->peak;
  int64_t full_bytes = 0;
  for (const auto& p : wide->parameters()) full_bytes += p.numel() * 4;
  std::printf("PartitionedInit: rank %d of %d: peak tensor memory %.1f MB while building a %.1f MB "
              "model (shards %.1f MB)\n",
              rank(), world(), grown / 1e6, full_bytes / 1e6, init->shard_bytes() / 1e6);
  EXPECT_LT(grown, full_bytes) << "rank " << rank();
  EXPECT_GT(init->shard_bytes(), 0);
  EXPECT_EQ(wide->layers[0]->as<torch::nn::Linear>()->weight.storage().nbytes(), 0u);

  strata::InitOptions options;
  options.group = group;
  options.partitioned_init = init;
  auto engine = strata::initialize(wide, config, options);
  torch::manual_seed(11);  // rank 0's seed: the same values as rank 0 built
  auto control = std::make_shared<CpuMemoryPeak>();
  Wide whole{nullptr};
  {
    c10::DebugInfoGuard measure(c10::DebugInfoKind::PROFILER_STATE, control);
    whole = Wide();
  }
  EXPECT_GE(control->peak, full_bytes) << "the measurement misses the model built whole";
  strata::InitOptions plain;
  plain.group = group;
  auto reference = strata::initialize(whole, config, plain);
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({8, 1024}), y = torch::randn({8, 1024});
    const auto mine = x.narrow(0, 0, 8), target = y.narrow(0, 0, 8);
    auto a = engine->forward(mine, target);
    engine->backward(a);
    engine->step();
    auto b = reference->forward(mine, target);
    reference->backward(b);
    reference->step();
    EXPECT_EQ(a.item<double>(), b.item<double>()) << "step " << step;
  }
}

// ZeRO-Infinity's accounting: with the optimizer and the parameters on NVMe, the master, both
// moments and the parameter shards are NVMe bytes, not host bytes (the master's shape-only
// tensor was counted as 4 bytes per element of host memory).
class Stage3Nvme : public strata::test_support::BuildFsDirTest {
 protected:
  Stage3Nvme() : BuildFsDirTest("engine-stage3-nvme") {}
};

TEST_F(Stage3Nvme, ModelStateBytesCountSwapFilesApart) {
  if (is_worker()) GTEST_SKIP();
  torch::manual_seed(5);
  Net net;
  auto config = stage3_config(2, 1);
  config["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", dir_.string()}};
  config["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", dir_.string()}};
  auto engine = strata::initialize(net, config);
  const auto x = torch::randint(0, kVocab, {2, 6}), y = torch::randint(0, kVocab, {2, 6});
  engine->backward(engine->forward(x, y));
  engine->step();
  const int64_t p = engine->stage3_units()->shards().partition_numel();
  const auto bytes = engine->model_state_bytes();
  EXPECT_EQ(bytes.master, 0);
  EXPECT_EQ(bytes.nvme, 3 * 4 * p + 4 * p);  // master, exp_avg, exp_avg_sq; the fp32 shards
  EXPECT_LT(bytes.params, 4 * p) << "the shards are on NVMe";
}

// A frozen parameter that is not floating point (an index table) is kept whole at stage 3, as
// DeepSpeed keeps what it does not partition (it was refused with advice to use one dtype, which
// an int64 table cannot follow): the losses of stage 0, and a checkpoint restores the table.
struct IndexedImpl : torch::nn::Module {
  IndexedImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    fc = register_module("fc", torch::nn::Linear(kDim, kVocab));
    order = register_parameter("order", torch::arange(kVocab - 1, -1, -1, torch::kLong), false);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto logits = fc(emb(order.index_select(0, x.reshape({-1}))));
    return F::cross_entropy(logits, y.reshape({-1}));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::Tensor order;
};
TORCH_MODULE(Indexed);

TEST(Stage3, AFrozenIntegerParameterStaysWholeAndTrainsAsAtStageZero) {
  if (is_worker()) GTEST_SKIP();
  auto run = [](int stage, const std::string& save, const std::string& load) {
    torch::manual_seed(7);
    Indexed net;
    auto config = stage3_config(2, 1);
    config["zero_optimization"] = {{"stage", stage}, {"stage3_param_persistence_threshold", 0}};
    auto engine = strata::initialize(net, config);
    if (!load.empty()) {
      torch::NoGradGuard no_grad;
      net->order.fill_(0);  // must come back from the checkpoint
      engine->load_checkpoint(load);
    }
    std::vector<double> losses;
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(20 + step);
      const auto x = torch::randint(0, kVocab, {2, 6}), y = torch::randint(0, kVocab, {2, 6});
      auto loss = engine->forward(x, y);
      losses.push_back(loss.item<double>());
      engine->backward(loss);
      engine->step();
    }
    if (!save.empty()) engine->save_checkpoint(save);
    EXPECT_TRUE(torch::equal(net->order, torch::arange(kVocab - 1, -1, -1, torch::kLong)));
    return losses;
  };
  const std::string dir = testing::TempDir() + "/stage3_indexed_" + std::to_string(getpid());
  const auto plain = run(0, "", ""), sharded = run(3, dir, "");
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_NEAR(plain[i], sharded[i], 1e-6) << "step " << i;
  run(3, "", dir);
}

// ---- the ranks -----------------------------------------------------------------------------------

class Stage3Ranks : public testing::TestWithParam<int> {};

TEST_P(Stage3Ranks, EveryWorkerCasePassesOnEveryRank) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers(kWorker, GetParam(), "Stage3Worker.*", &output), 0)
      << output;
  EXPECT_NE(output.find("[  PASSED  ] 11 tests"), std::string::npos) << output;
}

INSTANTIATE_TEST_SUITE_P(Ranks, Stage3Ranks, testing::Values(2, 4));

// PartitionedInit in processes of their own: a process's peak memory is a lifetime maximum.
TEST(Stage3Init, FourRanksBuildTheModelInShards) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers(kWorker, 4, "Stage3InitWorker.*", &output), 0)
      << output;
  EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
}

}  // namespace
