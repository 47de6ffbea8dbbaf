// Tiled computation (runtime/util/tiled.h) against the untiled function under plain
// autograd: gradients to 1e-6 in float32 for every tile count (one, uneven, derived, more tiles
// than positions), inside a checkpointed block, under CPU autocast, with dropout, with several
// inputs and outputs; bfloat16 within the differential matrix's tolerance; bad calls named; and
// the memory one tiled block keeps, measured at malloc (tests/alloc_meter) against a formula.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "runtime/checkpointing/checkpoint.h"
#include "runtime/compat.h"
#include "runtime/util/tiled.h"
#include "runtime/error.h"
#include "tests/alloc_meter.h"

namespace tiled_test {
namespace {

namespace ckpt = strata::checkpointing;
namespace F = torch::nn::functional;

// A pre-norm feed-forward: norm, up to `ffn`, GELU, back down (position-wise along the
// sequence).
struct FeedForwardImpl : torch::nn::Module {
  FeedForwardImpl(int64_t d, int64_t ffn) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    up = register_module("up", torch::nn::Linear(d, ffn));
    down = register_module("down", torch::nn::Linear(ffn, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return down(F::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(FeedForward);

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined() ? 0.0 : 1e30;
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

// The gradients of (f(x) * r).sum() with respect to x and the module's parameters.
template <class Run>
std::vector<torch::Tensor> gradients(torch::nn::Module& m, const torch::Tensor& x0,
                                     const torch::Tensor& r, Run run) {
  auto x = x0.detach().clone().requires_grad_(true);
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
  (run(x).to(torch::kFloat) * r).sum().backward();
  std::vector<torch::Tensor> g{x.grad().clone()};
  for (auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

// a against the reference b.
void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  double tolerance, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  // Relative to the gradient's largest element (float32 sums in another order differ in their
  // last bits: a tile's rows are summed apart from the others').
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(1.0, b[i].abs().max().item<double>());
    EXPECT_LE(max_diff(a[i], b[i]), tolerance * scale) << what << ", gradient #" << i;
  }
}

TEST(Tiled, EveryTileCountGivesTheUntiledOutputAndGradients) {
  torch::manual_seed(1);
  FeedForward ff(16, 64);
  const auto x = torch::randn({3, 37, 16}), r = torch::randn({3, 37, 16});
  const auto reference = gradients(*ff, x, r, [&](const torch::Tensor& t) { return ff(t); });
  // 1 tile, 2, 5 (uneven), 0 (derived: ceil(37 / 16) = 3), 100 (more than positions: 37).
  for (int64_t tiles : {1, 2, 5, 0, 100}) {
    ckpt::TileOptions options;
    options.tiles = tiles;
    EXPECT_EQ(ckpt::tile_count(options, 37, 16), tiles == 0 ? 3 : std::min<int64_t>(tiles, 37));
    const auto tiled = gradients(*ff, x, r, [&](const torch::Tensor& t) {
      auto y = ckpt::tiled(ff, t, options);
      EXPECT_LE(max_diff(y, ff(t)), 1e-6);
      return y;
    });
    expect_close(tiled, reference, 1e-6, "tiles " + std::to_string(tiles));
  }
  // Along another dimension: tokens first ([seq, batch, d] as Megatron lays them out).
  ckpt::TileOptions seq_first;
  seq_first.tiles = 4;
  seq_first.dim = 0;
  const auto xt = x.transpose(0, 1).contiguous(), rt = r.transpose(0, 1).contiguous();
  expect_close(gradients(*ff, xt, rt, [&](const torch::Tensor& t) { return ckpt::tiled(ff, t, seq_first); }),
               gradients(*ff, xt, rt, [&](const torch::Tensor& t) { return ff(t); }), 1e-6, "dim 0");
}

TEST(Tiled, SeveralInputsAndOutputsAndAFunctionOfTheTilesPosition) {
  torch::manual_seed(2);
  FeedForward ff(8, 24);
  const auto x = torch::randn({2, 11, 8}), gate = torch::rand({2, 11, 1}), r = torch::randn({2, 11, 8});
  // y = gate * ff(x) + position, and a second output 2 * x; the position comes from `start`.
  auto plain = [&](const torch::Tensor& t, const torch::Tensor& g, int64_t start, int64_t n) {
    auto pos = torch::arange(start, start + n, torch::kFloat).view({1, n, 1});
    return std::vector<torch::Tensor>{g * ff(t) + pos, 2 * t};
  };
  auto run = [&](bool tile) {
    auto xg = x.clone().requires_grad_(true), gg = gate.clone().requires_grad_(true);
    for (auto& p : ff->parameters()) p.mutable_grad() = torch::Tensor();
    std::vector<torch::Tensor> ys;
    if (tile) {
      ckpt::TileOptions options;
      options.tiles = 4;
      ys = ckpt::tiled_tensors(
          [&](const std::vector<torch::Tensor>& t, int64_t start, int64_t n) {
            return plain(t[0], t[1], start, n);
          },
          {xg, gg}, ff->parameters(), options);
    } else {
      ys = plain(xg, gg, 0, 11);
    }
    ((ys[0] * r).sum() + (ys[1] * r).pow(2).sum()).backward();
    std::vector<torch::Tensor> g{ys[0].detach(), ys[1].detach(), xg.grad(), gg.grad()};
    for (auto& p : ff->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  expect_close(run(true), run(false), 1e-5, "two inputs, two outputs");
}

// Inside a checkpointed block (the outer forward runs the tiles under no-grad, its
// recomputation the tiled Function), and a block whose whole body is tiled.
TEST(Tiled, InsideACheckpointedBlockAndAroundANormPlusMlp) {
  torch::manual_seed(3);
  FeedForward ff(16, 48);
  const auto x = torch::randn({2, 29, 16}), r = torch::randn({2, 29, 16});
  const auto reference =
      gradients(*ff, x, r, [&](const torch::Tensor& t) { return t + ff(t) * 0.5; });
  ckpt::TileOptions options;
  options.tiles = 3;
  const auto checkpointed = gradients(*ff, x, r, [&](const torch::Tensor& t) {
    return ckpt::checkpoint_named(
        "block", [&](const torch::Tensor& h) { return h + ckpt::tiled(ff, h, options) * 0.5; },
        ff->parameters(), t);
  });
  expect_close(checkpointed, reference, 1e-6, "tiled inside a checkpoint");
  const auto whole = gradients(*ff, x, r, [&](const torch::Tensor& t) {
    return ckpt::tiled_function([&](const torch::Tensor& h) { return h + ff(h) * 0.5; },
                                ff->parameters(), t, options);
  });
  expect_close(whole, reference, 1e-6, "the residual block tiled whole");
}

// bfloat16 parameters and activations: as close to the exact (float64) gradients as the untiled
// bfloat16 run is (the parameters' gradients are summed over the tiles in float32, one rounding
// to bfloat16 at the end), within the differential matrix's bf16 parameter tolerance (1e-2)
// relative to the gradient's largest element.
TEST(Tiled, Bfloat16AsCloseToExactAsUntiled) {
  torch::manual_seed(4);
  FeedForward ff(32, 128);
  const auto x = torch::randn({2, 96, 32}), r = torch::randn({2, 96, 32});
  ff->to(torch::kDouble);
  const auto exact = gradients(*ff, x.to(torch::kDouble), r.to(torch::kDouble),
                               [&](const torch::Tensor& t) { return ff(t); });
  ff->to(torch::kBFloat16);
  const auto xb = x.to(torch::kBFloat16);
  const auto untiled = gradients(*ff, xb, r, [&](const torch::Tensor& t) { return ff(t); });
  ckpt::TileOptions options;
  options.tiles = 6;
  const auto tiled = gradients(*ff, xb, r, [&](const torch::Tensor& t) { return ckpt::tiled(ff, t, options); });
  for (size_t i = 0; i < tiled.size(); ++i) {
    const double scale = exact[i].abs().max().item<double>();
    const double e_tiled = max_diff(tiled[i], exact[i]), e_untiled = max_diff(untiled[i], exact[i]);
    std::printf("bf16 gradient #%zu: largest %.3g, untiled off by %.3g, tiled by %.3g\n", i, scale,
                e_untiled, e_tiled);
    EXPECT_LE(e_tiled, std::max(1.5 * e_untiled, 1e-2 * scale)) << "gradient #" << i;
    EXPECT_EQ(tiled[i].scalar_type(), torch::kBFloat16);
  }
}

// Under CPU autocast (bf16), the backward outside its scope as the engine's is: the recomputed
// tiles run in the forward's dtypes, so the gradients are those of the untiled autocast run.
TEST(Tiled, UnderAutocastTheRecomputationCastsAsTheForward) {
  torch::manual_seed(5);
  FeedForward ff(16, 64);
  const auto x = torch::randn({2, 40, 16}), r = torch::randn({2, 40, 16});
  auto autocast_run = [&](bool tile) {
    auto xg = x.clone().requires_grad_(true);
    for (auto& p : ff->parameters()) p.mutable_grad() = torch::Tensor();
    torch::Tensor y;
    {
      strata::compat::set_autocast_enabled(c10::DeviceType::CPU, true);
      ckpt::TileOptions options;
      options.tiles = 5;
      y = tile ? ckpt::tiled(ff, xg, options) : ff(xg);
      strata::compat::set_autocast_enabled(c10::DeviceType::CPU, false);
      at::autocast::clear_cache();
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    (y.to(torch::kFloat) * r).sum().backward();
    std::vector<torch::Tensor> g{xg.grad().clone()};
    for (auto& p : ff->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto reference = autocast_run(false), tiled = autocast_run(true);
  for (size_t i = 0; i < tiled.size(); ++i) {
    const double scale = reference[i].abs().max().item<double>();
    EXPECT_LE(max_diff(tiled[i], reference[i]), 2e-2 * scale + 1e-3) << "gradient #" << i;
  }
}

// Dropout: each tile's recomputation draws the mask its forward drew (y = x * mask / (1 - p),
// so dy/dx is y / x), and the generator continues after the backward where the forward left it.
TEST(Tiled, DropoutRecomputesTheMasksOfTheForward) {
  auto dropout = [](const torch::Tensor& t) {
    return F::dropout(t, F::DropoutFuncOptions().p(0.5).training(true));
  };
  ckpt::TileOptions options;
  options.tiles = 7;
  torch::manual_seed(6);
  auto x = (torch::rand({2, 50, 8}) + 0.5).requires_grad_(true);
  auto y = ckpt::tiled_function(dropout, {}, x, options);
  const auto next_after_forward = torch::rand({4});
  y.sum().backward();
  const auto next_after_backward = torch::rand({4});
  EXPECT_LE(max_diff(x.grad(), y.detach() / x.detach()), 1e-6);
  EXPECT_GT(y.eq(0).sum().item<int64_t>(), 0);
  // The same draws without a backward between them: the recomputation drew nothing from the
  // run's stream.
  torch::manual_seed(6);
  auto x2 = torch::rand({2, 50, 8}) + 0.5;
  ckpt::tiled_function(dropout, {}, x2, options);
  EXPECT_TRUE(torch::equal(torch::rand({4}), next_after_forward));
  EXPECT_TRUE(torch::equal(torch::rand({4}), next_after_backward));
}

TEST(Tiled, BadCallsAreNamed) {
  FeedForward ff(8, 16);
  const auto x = torch::randn({2, 10, 8}, torch::requires_grad());
  // (std::exception: an error raised in backward comes back through the autograd engine.)
  auto throws_naming = [](auto&& f, const std::string& words) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming " << words;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  ckpt::TileOptions options;
  options.tiles = 3;
  options.name = "the sum";
  // Not position-wise: a reduction over the sequence.
  throws_naming([&] { ckpt::tiled_function([](const torch::Tensor& t) { return t.sum(1); }, {}, x, options); },
                "the sum");
  options.tiles = -1;
  throws_naming([&] { ckpt::tiled(ff, x, options); }, "tiles = -1");
  options.tiles = 2;
  options.dim = 5;
  throws_naming([&] { ckpt::tiled(ff, x, options); }, "dimension 5");
  options.dim = -2;
  // A parameter read but not passed: its gradient would be lost.
  options.name = "the feed-forward";
  throws_naming(
      [&] {
        ckpt::tiled_function([&](const torch::Tensor& t) { return ff(t); }, ff->up->parameters(), x,
                             options)
            .sum()
            .backward();
      },
      "the feed-forward reads a tensor of shape");
  throws_naming(
      [&] {
        ckpt::tiled_tensors([](const std::vector<torch::Tensor>& t, int64_t, int64_t) { return t; },
                            {x, torch::randn({2, 9, 8})}, {}, options);
      },
      "every tiled input has 10 positions");
}

// Memory, at malloc: between forward and backward an untiled feed-forward keeps its [S, ffn]
// intermediates (the up projection's output for GELU, GELU's output for the down projection:
// 2 * S * ffn floats besides the norm's); tiled it keeps nothing but its output. Through forward
// and backward the tiled peak above what stays (input, output, their gradients, the parameters'
// gradients) is one tile's: at most 4 * ceil(S / T) * ffn floats (up's output, GELU's, and their
// gradients) plus the norm's [tile, d] tensors, against at least 2 * S * ffn untiled.
TEST(TiledMemory, OneTilesIntermediatesAtATime) {
  if (!strata::test::AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  torch::manual_seed(7);
  const int64_t S = 2048, d = 32, ffn = 512, T = 16;
  FeedForward ff(d, ffn);
  const auto x = torch::randn({1, S, d}, torch::requires_grad());
  const int64_t f = 4;  // bytes per float
  auto measure = [&](bool tile, int64_t& kept, int64_t& peak) {
    for (auto& p : ff->parameters()) p.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    ckpt::TileOptions options;
    options.tiles = T;
    strata::test::AllocMeter::reset_peak();
    const int64_t base = strata::test::AllocMeter::live();
    auto y = tile ? ckpt::tiled(ff, x, options) : ff(x);
    kept = strata::test::AllocMeter::live() - base - S * d * f;  // beyond the output
    y.sum().backward();
    peak = strata::test::AllocMeter::peak_since_reset();
  };
  int64_t kept_plain, peak_plain, kept_tiled, peak_tiled;
  measure(false, kept_plain, peak_plain);
  measure(true, kept_tiled, peak_tiled);
  int64_t param_bytes = 0;
  for (const auto& p : ff->parameters()) param_bytes += p.numel() * f;
  const int64_t tile = (S + T - 1) / T;
  // What stays whole: the output and its gradient (ones), the input's gradient, the
  // parameters' gradients (and their float32 sums), the norm's statistics.
  const int64_t whole = 3 * S * d * f + 2 * param_bytes + 2 * S * f;
  const int64_t one_tile = 4 * tile * ffn * f + 6 * tile * d * f;
  std::printf("tiled feed-forward, S %lld, d %lld, ffn %lld, %lld tiles: kept between forward and "
              "backward %.2f MB untiled, %.2f MB tiled; peak %.2f MB untiled, %.2f MB tiled "
              "(formula: whole %.2f MB + one tile %.2f MB)\n",
              (long long)S, (long long)d, (long long)ffn, (long long)T, kept_plain / 1e6,
              kept_tiled / 1e6, peak_plain / 1e6, peak_tiled / 1e6, whole / 1e6, one_tile / 1e6);
  EXPECT_GE(kept_plain, 2 * S * ffn * f);
  // The Function's own bookkeeping (its graph node, the tiles' bounds), no activation: less than
  // a quarter of one tile's [tile, ffn] floats.
  EXPECT_LE(kept_tiled, tile * ffn * f / 4);
  EXPECT_LE(peak_tiled, whole + one_tile);
  EXPECT_GE(peak_plain, 2 * S * ffn * f);
}

}  // namespace
}  // namespace tiled_test
