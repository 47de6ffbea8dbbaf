// The dropless permutation (moe/dispatch.h, RoutePermutation) against index arithmetic written
// out: the packed rows, the weighted combine, and both gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "moe/dispatch.h"
#include "runtime/error.h"

namespace {

using strata::moe::RoutePermutation;

// route r = choice * S + token sits at row[r]; returns the reference outputs, built route by route.
struct Reference {
  torch::Tensor packed, combined;
};

Reference reference(const torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& weight,
                    const torch::Tensor& row, int64_t k) {
  const int64_t S = x.size(0), R = S * k;
  std::vector<torch::Tensor> packed(R), out(S);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r % S, at = row[r].item<int64_t>();
    packed[at] = x[t];
    const auto term = weight[r] * rows[at];
    out[t] = out[t].defined() ? out[t] + term : term;
  }
  return {torch::stack(packed), torch::stack(out)};
}

TEST(RoutePermutation, GathersAndCombinesAsTheRoutesSay) {
  torch::manual_seed(3);
  const int64_t S = 7, k = 3, d = 5, R = S * k;
  const auto row = torch::randperm(R, torch::kLong);
  const auto opts = torch::dtype(torch::kDouble).requires_grad(true);
  const auto x = torch::randn({S, d}, opts), rows = torch::randn({R, d}, opts),
             weight = torch::rand({R}, opts);
  const RoutePermutation perm(row, k);
  const auto packed = perm.gather(x);
  const auto combined = perm.combine(rows, weight);
  const auto ref = reference(x, rows, weight, row, k);
  EXPECT_TRUE(torch::allclose(packed, ref.packed, 0, 0));
  EXPECT_TRUE(torch::allclose(combined, ref.combined, 1e-12, 1e-12));

  const auto probe_p = torch::randn({R, d}, torch::kDouble), probe_c = torch::randn({S, d}, torch::kDouble);
  const auto got = torch::autograd::grad({(packed * probe_p).sum() + (combined * probe_c).sum()},
                                         {x, rows, weight});
  const auto want = torch::autograd::grad(
      {(ref.packed * probe_p).sum() + (ref.combined * probe_c).sum()}, {x, rows, weight});
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-12, 1e-12)) << "gradient " << i;
}

// bf16 (the GPU's dtype) gives the fp32 result to bf16's precision, on the CPU too (LibTorch
// 1.13's embedding_bag takes float only there: the sums go through float).
TEST(RoutePermutation, Bf16MatchesFloat) {
  torch::manual_seed(4);
  const int64_t S = 16, k = 4, d = 8, R = S * k;
  const auto row = torch::randperm(R, torch::kLong);
  const RoutePermutation perm(row, k);
  const auto rows = torch::randn({R, d}), weight = torch::rand({R});
  const auto want = perm.combine(rows, weight);
  const auto got = perm.combine(rows.to(torch::kBFloat16), weight);
  EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(got.to(torch::kFloat), want, 2e-2, 2e-2));
}

// The two kernels of the bag sums (a CPU's embedding_bag, a GPU's gather and batched product)
// give one result: the GPU's runs here on the CPU, so its arithmetic is checked where CI runs.
TEST(BagSums, TheGatheredKernelGivesEmbeddingBagsSums) {
  namespace detail = strata::moe::detail;
  torch::manual_seed(5);
  const int64_t rows = 11, d = 9, bags = 6;
  for (const auto dtype : {torch::kDouble, torch::kFloat, torch::kBFloat16}) {
    const auto table = torch::randn({rows, d}).to(dtype);
    const double tol = dtype == torch::kBFloat16 ? 1e-2 : dtype == torch::kFloat ? 1e-6 : 1e-12;
    for (const int64_t bag : {1, 3}) {
      const auto index = torch::randint(rows, {bags * bag}, torch::kLong);
      for (const bool weighted : {false, true}) {
        const auto weight = weighted ? torch::rand({bags * bag}).to(dtype) : torch::Tensor();
        const auto want = detail::bag_sums_embedding_bag(table, index, bag, weight);
        const auto got = detail::bag_sums_gathered(table, index, bag, weight);
        ASSERT_EQ(got.sizes(), want.sizes());
        EXPECT_EQ(got.scalar_type(), dtype);
        EXPECT_TRUE(torch::allclose(got.to(torch::kDouble), want.to(torch::kDouble), tol, tol))
            << c10::toString(dtype) << " bag " << bag << " weighted " << weighted;
      }
    }
  }
}

TEST(RoutePermutation, RefusesRowsThatAreNotKRoutesPerToken) {
  EXPECT_THROW(RoutePermutation(torch::arange(7, torch::kLong), 3), strata::Error);
}

}  // namespace
