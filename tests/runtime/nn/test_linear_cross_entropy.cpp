// The fused head and cross-entropy (runtime/nn/linear_cross_entropy.h) against LibTorch's own
// linear + cross_entropy: the loss, both gradients (chunks that do not divide the rows, an
// upstream gradient that is not 1, ignored targets, a head tied to an embedding), bf16, its memory
// at malloc, and under ZeRO-3 one gather of the head per forward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/engine.h"
#include "runtime/nn/linear_cross_entropy.h"
#include "tests/alloc_meter.h"

namespace {

namespace F = torch::nn::functional;
using strata::nn::linear_cross_entropy;
using strata::nn::LinearCrossEntropyOptions;

LinearCrossEntropyOptions chunk(int64_t rows) {
  LinearCrossEntropyOptions o;
  o.chunk_rows = rows;
  return o;
}

torch::Tensor linear_cross_entropy_sum(const torch::Tensor& h, const torch::Tensor& w,
                                       const torch::Tensor& t, int64_t rows) {
  return strata::nn::linear_cross_entropy_sum(h, w, t, chunk(rows));
}

TEST(LinearCrossEntropy, EqualsLinearThenCrossEntropyWithItsGradients) {
  torch::manual_seed(5);
  const int64_t rows = 37, d = 6, vocab = 11;
  const auto opts = torch::dtype(torch::kDouble).requires_grad(true);
  const auto h = torch::randn({rows, d}, opts), w = torch::randn({vocab, d}, opts);
  const auto t = torch::randint(0, vocab, {rows}, torch::kLong);
  const auto got = linear_cross_entropy_sum(h, w, t, /*chunk_rows=*/8) * 0.3;
  const auto want = F::cross_entropy(F::linear(h, w).to(torch::kFloat), t,
                                     F::CrossEntropyFuncOptions().reduction(torch::kSum)) * 0.3;
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-4);
  const auto g = torch::autograd::grad({got}, {h, w});
  const auto r = torch::autograd::grad({want}, {h, w});
  EXPECT_TRUE(torch::allclose(g[0], r[0], 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(g[1], r[1], 1e-5, 1e-6));
  EXPECT_EQ(g[1].scalar_type(), torch::kDouble);  // W's gradient in W's dtype
}

TEST(LinearCrossEntropy, Bf16FollowsFloat) {
  torch::manual_seed(6);
  const auto h = torch::randn({64, 16}), w = torch::randn({50, 16}) * 0.3;
  const auto t = torch::randint(0, 50, {64}, torch::kLong);
  const auto hb = h.to(torch::kBFloat16).requires_grad_(true);
  const auto wb = w.to(torch::kBFloat16).requires_grad_(true);
  const auto hf = hb.detach().to(torch::kFloat).requires_grad_(true);
  const auto wf = wb.detach().to(torch::kFloat).requires_grad_(true);
  const auto lb = linear_cross_entropy_sum(hb, wb, t, 16), lf = linear_cross_entropy_sum(hf, wf, t, 16);
  EXPECT_NEAR(lb.item<double>() / 64, lf.item<double>() / 64, 2e-2);
  lb.backward();
  lf.backward();
  EXPECT_EQ(wb.grad().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(hb.grad().to(torch::kFloat), hf.grad(), 5e-2, 5e-2));
  EXPECT_TRUE(torch::allclose(wb.grad().to(torch::kFloat), wf.grad(), 5e-2, 5e-2));
}

// The logits never exist whole: forward + backward peak well under the float32 logits alone.
TEST(LinearCrossEntropy, HoldsAChunkOfLogitsNotAllOfThem) {
  using strata::test::AllocMeter;
  if (!AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  const int64_t rows = 4096, d = 32, vocab = 4000, chunk = 64;
  const auto h = torch::randn({rows, d}).requires_grad_(true);
  const auto w = torch::randn({vocab, d}).requires_grad_(true);
  const auto t = torch::randint(0, vocab, {rows}, torch::kLong);
  linear_cross_entropy_sum(h, w, t, chunk).backward();  // first-call state out of the measure
  h.mutable_grad() = torch::Tensor();
  w.mutable_grad() = torch::Tensor();
  AllocMeter::reset_peak();
  linear_cross_entropy_sum(h, w, t, chunk).backward();
  const int64_t peak = AllocMeter::peak_since_reset();
  const int64_t logits = rows * vocab * 4;  // float32 [rows, vocab]: 65.5 MB
  // A chunk's logits, their float32 copy and gradient, W's float32 gradient (twice: the sum and
  // its scaled copy), h's gradient.
  const int64_t bound = 4 * chunk * vocab * 4 + 2 * vocab * d * 4 + 2 * rows * d * 4;
  EXPECT_LE(peak, bound) << "peak " << peak << " bytes; the logits alone are " << logits;
  EXPECT_LT(bound, logits / 4);
}

TEST(LinearCrossEntropy, WithoutGradModeComputesTheLossAlone) {
  const auto h = torch::randn({8, 4}), w = torch::randn({5, 4}).requires_grad_(true);
  const auto t = torch::randint(0, 5, {8}, torch::kLong);
  torch::NoGradGuard no_grad;
  const auto l = linear_cross_entropy_sum(h, w, t, 3);
  EXPECT_FALSE(l.requires_grad());
  EXPECT_NEAR(l.item<double>(),
              F::cross_entropy(F::linear(h, w), t, F::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>(),
              1e-4);
}

TEST(LinearCrossEntropy, RefusesMismatchedShapes) {
  EXPECT_THROW(linear_cross_entropy_sum(torch::zeros({4, 3}), torch::zeros({5, 2}),
                                        torch::zeros({4}, torch::kLong), 2),
               std::invalid_argument);
}


// Max |a - b| / max |b| over a tensor: the per-tensor relative error.
double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

// Hugging Face's labels: -100 where a token is not counted. The mean over the counted rows, and
// both gradients, as torch's cross_entropy(ignore_index=-100) gives them, in float32 to 1e-6.
TEST(LinearCrossEntropy, IgnoredTargetsAreNotCountedAsInTorchsCrossEntropy) {
  torch::manual_seed(9);
  const int64_t rows = 45, d = 16, vocab = 37;
  const auto h = torch::randn({rows, d}).requires_grad_(true);
  const auto w = (torch::randn({vocab, d}) * 0.2).requires_grad_(true);
  auto t = torch::randint(0, vocab, {rows}, torch::kLong);
  for (int64_t r : {0, 7, 8, 9, 30, 44}) t[r] = -100;
  const auto got = linear_cross_entropy(h, w, t, chunk(8)) * 0.7;
  const auto want =
      F::cross_entropy(F::linear(h, w), t, F::CrossEntropyFuncOptions().ignore_index(-100)) * 0.7;
  EXPECT_LE(relative(got, want), 1e-6);
  const auto g = torch::autograd::grad({got}, {h, w});
  const auto r = torch::autograd::grad({want}, {h, w});
  EXPECT_LE(relative(g[0], r[0]), 1e-6);
  EXPECT_LE(relative(g[1], r[1]), 1e-6);
  EXPECT_EQ(g[0].index_select(0, torch::tensor({0, 7, 8, 9, 30, 44})).abs().max().item<float>(), 0.0f);
}

// Nothing counted: 0 and zero gradients (torch's mean is NaN there and would poison the step).
TEST(LinearCrossEntropy, NoCountedRowGivesZeroNotNan) {
  const auto h = torch::randn({6, 4}).requires_grad_(true);
  const auto w = torch::randn({5, 4}).requires_grad_(true);
  const auto loss = linear_cross_entropy(h, w, torch::full({6}, -100, torch::kLong), chunk(4));
  EXPECT_EQ(loss.item<float>(), 0.0f);
  loss.backward();
  EXPECT_EQ(h.grad().abs().max().item<float>(), 0.0f);
  EXPECT_EQ(w.grad().abs().max().item<float>(), 0.0f);
}

// A head tied to the embedding: the embedding's gradient sums the lookup's and the head's, as
// with the plain linear + cross_entropy.
TEST(LinearCrossEntropy, TiedHeadGetsTheGradientOfBothUses) {
  torch::manual_seed(10);
  const int64_t vocab = 29, d = 12, b = 3, s = 11;
  const auto embedding = (torch::randn({vocab, d}) * 0.3).requires_grad_(true);
  const auto mix = torch::randn({d, d}).requires_grad_(true);
  const auto tokens = torch::randint(0, vocab, {b, s}, torch::kLong);
  auto targets = torch::randint(0, vocab, {b * s}, torch::kLong);
  targets[4] = -100;
  auto hidden = [&] { return torch::tanh(F::embedding(tokens, embedding).matmul(mix)).reshape({-1, d}); };
  const auto got = linear_cross_entropy(hidden(), embedding, targets, chunk(5));
  const auto want = F::cross_entropy(F::linear(hidden(), embedding), targets);
  EXPECT_LE(relative(got, want), 1e-6);
  const auto g = torch::autograd::grad({got}, {embedding, mix});
  const auto r = torch::autograd::grad({want}, {embedding, mix});
  EXPECT_LE(relative(g[0], r[0]), 1e-6);
  EXPECT_LE(relative(g[1], r[1]), 1e-6);
}

// A model whose head is a plain Linear (or the embedding, tied) and whose loss is the fused one.
struct HeadNetImpl : torch::nn::Module {
  HeadNetImpl(bool tied, bool fused) : tied(tied), fused(fused) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    mix = register_module("mix", torch::nn::Linear(kDim, kDim));
    if (!tied) head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kDim, kVocab).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    const auto h = torch::tanh(mix(embed(x))).reshape({-1, kDim});
    const auto& w = tied ? embed->weight : head->weight;
    if (!fused) return F::cross_entropy(F::linear(h, w), y.reshape({-1}));
    return linear_cross_entropy(h, w, y.reshape({-1}), chunk(4));  // 8 chunks of a 4 x 8 batch
  }
  static constexpr int64_t kVocab = 50, kDim = 16;
  bool tied, fused;
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear mix{nullptr}, head{nullptr};
};
TORCH_MODULE(HeadNet);

// ZeRO-3: the head's unit is gathered once per step (in forward; every chunk runs inside that one
// call, and backward uses the gradients kept from it, not the weight), where the plain loss
// gathers it again for backward. Tied, with the default reuse distance the embedding's unit
// stays gathered from the lookup to the head: one gather too. The losses equal stage 0's.
TEST(LinearCrossEntropy, ZeroStage3GathersTheHeadOncePerStep) {
  for (const bool tied : {false, true}) {
    std::vector<float> losses[2];
    for (const int stage : {0, 3}) {
      for (const bool fused : {true, false}) {
        if (stage == 0 && !fused) continue;
        torch::manual_seed(3);
        HeadNet net(tied, fused);
        strata::json config = {
            {"train_batch_size", 4},
            {"steps_per_print", 1000},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
            {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
        if (!tied && stage == 3)  // nothing kept past the forward's end: a gather per use
          config["zero_optimization"]["stage3_max_reuse_distance"] = 0;
        auto engine = strata::initialize(net, config);
        const auto head_name = tied ? "embed.weight" : "head.weight";
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(100 + step);
          const auto x = torch::randint(0, HeadNetImpl::kVocab, {4, 8});
          const auto y = torch::randint(0, HeadNetImpl::kVocab, {4, 8});
          int64_t before = 0;
          const strata::zero::ParamUnits* units = stage == 3 ? engine->stage3_units() : nullptr;
          size_t head_unit = 0;
          if (units) {
            for (size_t u = 0; u < units->size(); ++u)
              for (const auto& n : units->unit(u).names)
                if (n == head_name) head_unit = u;
            before = units->unit(head_unit).gathers;
          }
          auto loss = engine->forward(x, y);
          if (fused) losses[stage == 3].push_back(loss.item<float>());
          engine->backward(loss);
          engine->step();
          if (!units || step == 0) continue;  // step 1 records the trace
          const int64_t gathers = units->unit(head_unit).gathers - before;
          if (fused) {
            EXPECT_EQ(gathers, 1) << "tied " << tied << " step " << step;
          } else if (!tied) {
            EXPECT_EQ(gathers, 2) << "the plain loss, step " << step;
          }
        }
      }
    }
    ASSERT_EQ(losses[0].size(), losses[1].size());
    for (size_t i = 0; i < losses[0].size(); ++i)
      EXPECT_NEAR(losses[0][i], losses[1][i], 1e-6) << "tied " << tied << " step " << i;
  }
}

}  // namespace
