// Tiled experts (MoEOptions::tiles, runtime/util/tiled.h): the layer over tiles of its experts'
// rows gives the untiled layer's output, l_aux and gradients (1e-6 relative, float32) for both
// kernels (the grouped one over packed routes, the batched one over capacity slots), dropless and
// with drops, GELU with biases and SwiGLU without, k 1 and 2, streamed experts, and inside a
// checkpoint; a user's experts with tiles are refused.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "moe/layer.h"
#include "runtime/checkpointing/checkpoint.h"
#include "runtime/error.h"
#include "runtime/util/tiled.h"
#include "tests/moe/layer_reference.h"

namespace moe_tiled_test {
namespace {

using namespace strata::moe;
using strata::test::moe_layer::kD;
using strata::test::moe_layer::options;

struct Run {
  std::vector<torch::Tensor> values;  // y, l_aux, x's gradient, the parameters' gradients
  uint64_t tiled_calls = 0;           // tiled computations the run made
};

// The layer of `o` (same seed, so the same weights) on one batch; `checkpointed` runs it inside
// an activation checkpoint.
Run run(MoEOptions o, int64_t tiles, ExpertKernel kernel, bool checkpointed = false) {
  o.tiles = tiles;
  const uint64_t calls = strata::checkpointing::tiled_calls();
  MoE m(o);
  m->experts->set_kernel(kernel);
  m->set_call_index(3);
  torch::manual_seed(11);
  auto x = torch::randn({2, 40, kD}).requires_grad_(true);
  const auto probe = torch::randn({2, 40, kD});
  const auto y = checkpointed
                     ? strata::checkpointing::checkpoint_named(
                           "moe", [&](const torch::Tensor& t) { return m->forward(t); },
                           m->parameters(), x)
                     : m->forward(x);
  (y * probe).sum().add(m->loss()).backward();
  Run r{{y.detach(), m->loss().detach(), x.grad()}, strata::checkpointing::tiled_calls() - calls};
  for (const auto& p : m->parameters()) r.values.push_back(p.grad());
  return r;
}

void expect_same(const Run& a, const Run& b, const std::string& what) {
  ASSERT_EQ(a.values.size(), b.values.size()) << what;
  for (size_t i = 0; i < a.values.size(); ++i) {
    ASSERT_EQ(a.values[i].defined(), b.values[i].defined()) << what << " #" << i;
    if (!a.values[i].defined()) continue;
    const double scale = std::max(1.0, b.values[i].abs().max().item<double>());
    EXPECT_LE((a.values[i] - b.values[i]).abs().max().item<double>(), 1e-6 * scale)
        << what << ", value #" << i;
  }
}

TEST(TiledExperts, GiveTheUntiledLayerForEveryKernelAndRouting) {
  int cases = 0;
  for (const auto kernel : {ExpertKernel::Grouped, ExpertKernel::Batched})
    for (const bool drop : {true, false})
      for (const bool swiglu : {false, true})
        for (const int64_t k : {1, 2}) {
          auto o = options(k, drop);
          o.capacity_factor = 0.75;  // drops at k <= 2
          o.aux_loss_coef = 0.5;
          if (swiglu) o.expert_activation = ExpertActivation::SwiGLU, o.expert_bias = false;
          const std::string what = std::string(kernel == ExpertKernel::Grouped ? "grouped" : "batched") +
                                   (drop ? " drop" : " dropless") + (swiglu ? " swiglu" : " gelu") +
                                   " k" + std::to_string(k);
          const auto plain = run(o, -1, kernel);
          EXPECT_EQ(plain.tiled_calls, 0u) << what;
          for (const int64_t tiles : {0, 3, 1000}) {
            const auto tiled = run(o, tiles, kernel);
            EXPECT_GT(tiled.tiled_calls, 0u) << what;
            expect_same(tiled, plain, what + " tiles " + std::to_string(tiles));
          }
          ++cases;
        }
  EXPECT_EQ(cases, 16);
}

TEST(TiledExperts, StreamedExpertsAndInsideACheckpoint) {
  auto o = options(2, false);
  o.expert_unit_size = 2;  // two units of two experts
  for (const auto kernel : {ExpertKernel::Grouped, ExpertKernel::Batched}) {
    const auto plain = run(o, -1, kernel);
    expect_same(run(o, 4, kernel), plain, "streamed");
    expect_same(run(o, 4, kernel, /*checkpointed=*/true), plain, "streamed, checkpointed");
  }
}

TEST(TiledExperts, AUsersExpertsAreNotTiled) {
  auto o = options(2, true);
  o.tiles = 2;
  o.expert_factory = [](int64_t) { return torch::nn::AnyModule(torch::nn::Linear(kD, kD)); };
  try {
    MoE m(o);
    ADD_FAILURE() << "tiles with a user's experts accepted";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tiles = 2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe_tiled_test
