// Streamed experts (MoEOptions::expert_unit_size, moe/experts.h) in one process: the layer with its
// experts' weights in units of n experts computes what the layer with stacked weights computes
// (outputs and every gradient, both kernels, with and without drops and biases, units that do not
// divide the experts), names its parameters per unit while keeping their per-expert names, and
// never touches the weights of a unit that no route reaches: no op reads them, forward or
// backward, and they get no gradient.
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "moe/expert_params.h"
#include "moe/layer.h"
#include "runtime/error.h"
#include "tests/moe/layer_reference.h"

namespace {

using namespace strata::moe;
using namespace strata::test::moe_layer;

constexpr int64_t kExperts = 8;

MoEOptions streamed_options(int64_t k, bool drop_tokens, bool bias, int64_t unit,
                            bool swiglu = false) {
  auto o = options(k, drop_tokens);
  if (swiglu) o.expert_activation = ExpertActivation::SwiGLU;
  o.num_experts = kExperts;
  o.expert_bias = bias;
  o.capacity_factor = 0.75;
  o.expert_unit_size = unit;
  return o;
}

// The stacked layer's weight `name` for the rows of unit u.
torch::Tensor rows_of(const torch::Tensor& stacked, const ExpertsImpl::Unit& u) {
  return stacked.narrow(0, u.first, u.count);
}

struct StreamedCase {
  ExpertKernel kernel;
  bool drop_tokens;
  bool bias;
  int64_t unit;
  bool swiglu = false;
};

std::string case_name(const StreamedCase& c) {
  return std::string(c.kernel == ExpertKernel::Grouped ? "grouped" : "batched") +
         (c.drop_tokens ? "_drop" : "_dropless") + (c.bias ? "_bias" : "_nobias") + "_unit" +
         std::to_string(c.unit) + (c.swiglu ? "_swiglu" : "");
}

// The case as its CTest name shows it (without this, gtest prints the struct's bytes, padding
// among them).
void PrintTo(const StreamedCase& c, std::ostream* os) { *os << case_name(c); }

class StreamedVsStacked : public ::testing::TestWithParam<StreamedCase> {};

TEST_P(StreamedVsStacked, SameOutputsAndGradients) {
  const auto cs = GetParam();
  MoE stacked(streamed_options(2, cs.drop_tokens, cs.bias, 0, cs.swiglu));
  MoE streamed(streamed_options(2, cs.drop_tokens, cs.bias, cs.unit, cs.swiglu));
  stacked->experts->set_kernel(cs.kernel);
  streamed->experts->set_kernel(cs.kernel);
  ASSERT_TRUE(streamed->experts->streamed());
  ASSERT_EQ(streamed->experts->units().size(), size_t((kExperts + cs.unit - 1) / cs.unit));
  // The same initial weights, unit by unit (named draws per global expert).
  for (const auto& u : streamed->experts->units()) {
    EXPECT_TRUE(torch::equal(u.w1, rows_of(stacked->experts->w1, u))) << u.name;
    EXPECT_TRUE(torch::equal(u.w2, rows_of(stacked->experts->w2, u))) << u.name;
  }
  torch::manual_seed(3);
  const auto input = torch::randn({2, 24, kD});
  std::vector<torch::Tensor> dx;
  std::vector<torch::Tensor> y;
  for (MoE* m : {&stacked, &streamed}) {
    (*m)->set_call_index(4);
    auto x = input.clone().requires_grad_(true);
    auto out = (*m)->forward(x);
    (out.pow(2).sum() + (*m)->loss()).backward();
    y.push_back(out.detach());
    dx.push_back(x.grad());
  }
  expect_close(y[1], y[0], "output");
  expect_close(dx[1], dx[0], "d input");
  expect_close(streamed->gate->weight.grad(), stacked->gate->weight.grad(), "d gate");
  int64_t reached = 0;
  for (const auto& u : streamed->experts->units()) {
    if (!u.w1.grad().defined()) continue;  // a unit no route reached (checked below)
    ++reached;
    expect_close(u.w1.grad(), rows_of(stacked->experts->w1.grad(), u), u.name + " d w1");
    expect_close(u.w2.grad(), rows_of(stacked->experts->w2.grad(), u), u.name + " d w2");
    if (cs.bias) {
      expect_close(u.b1.grad(), rows_of(stacked->experts->b1.grad(), u), u.name + " d b1");
      expect_close(u.b2.grad(), rows_of(stacked->experts->b2.grad(), u), u.name + " d b2");
    }
  }
  EXPECT_EQ(reached + streamed->experts->last_skipped_units(),
            int64_t(streamed->experts->units().size()));
  EXPECT_GT(reached, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, StreamedVsStacked,
    ::testing::Values(StreamedCase{ExpertKernel::Batched, true, true, 1},
                      StreamedCase{ExpertKernel::Batched, false, false, 3},
                      StreamedCase{ExpertKernel::Grouped, true, true, 1},   // packed routes, drops
                      StreamedCase{ExpertKernel::Grouped, false, true, 3},  // dropless, 3 + 3 + 2
                      StreamedCase{ExpertKernel::Grouped, false, false, 2},
                      StreamedCase{ExpertKernel::Grouped, false, false, 3, true}),  // SwiGLU
    [](const auto& info) { return case_name(info.param); });

// Op inputs' storages seen while a callback is installed.
std::mutex g_mutex;
std::set<const void*> g_seen;

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& input : fn.inputs())
    if (input.isTensor() && input.toTensor().defined() && input.toTensor().has_storage())
      g_seen.insert(input.toTensor().storage().unsafeGetStorageImpl());
  return nullptr;
}

// Two tokens, top-1, eight experts of one unit each: at most two units run; the others are not
// read by any op, forward or backward, and get no gradient; with either kernel.
TEST(StreamedExperts, UnitsNoRouteReachesAreNeverRead) {
  for (auto kernel : {ExpertKernel::Batched, ExpertKernel::Grouped}) {
    MoE m(streamed_options(1, /*drop_tokens=*/false, /*bias=*/true, 1));
    m->experts->set_kernel(kernel);
    const auto x = torch::randn({2, kD}).requires_grad_(true);
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_seen.clear();
    }
    auto handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_op).needsInputs(true).scopes(
            {at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    auto y = m->forward(x);
    (y.pow(2).sum() + m->loss()).backward();
    at::removeCallback(handle);
    const auto routed = m->last().exp_counts.gt(0).sum().item<int64_t>();
    ASSERT_LE(routed, 2);
    EXPECT_EQ(m->experts->last_skipped_units(), kExperts - routed);
    for (const auto& u : m->experts->units()) {
      const bool reached = m->last().exp_counts[u.first].item<int64_t>() > 0;
      const bool read = g_seen.count(u.w1.storage().unsafeGetStorageImpl()) > 0 ||
                        g_seen.count(u.b2.storage().unsafeGetStorageImpl()) > 0;
      EXPECT_EQ(read, reached) << u.name;
      EXPECT_EQ(u.w1.grad().defined(), reached) << u.name;
    }
  }
}

// The parameters: one submodule per unit ("experts.unit4.w1"), each its own tensor; the engine
// reads their per-expert names and units from expert_parameters().
TEST(StreamedExperts, ParametersAreNamedPerUnitAndKeepTheirPerExpertNames) {
  MoE m(streamed_options(2, true, true, 3));
  const auto found = expert_parameters(*m);
  ASSERT_EQ(found.size(), 3u * 4u);  // units of 3, 3, 2 experts; w1 b1 w2 b2 each
  EXPECT_EQ(found[0].name, "experts.unit0.w1");
  EXPECT_EQ(found[0].per_expert_name, "w1");
  EXPECT_EQ(found[0].unit, "unit0");
  EXPECT_EQ(found[0].num_experts, 3);
  EXPECT_EQ(found[11].name, "experts.unit6.b2");
  EXPECT_EQ(found[11].per_expert_name, "b2");
  EXPECT_EQ(found[11].first_expert, 6);
  EXPECT_EQ(found[11].num_experts, 2);
  EXPECT_EQ(found[11].param.size(0), 2);
  // Not streamed: the stacked names, no unit.
  MoE plain(streamed_options(2, true, true, 0));
  const auto stacked = expert_parameters(*plain);
  EXPECT_EQ(stacked[0].name, "experts.w1");
  EXPECT_EQ(stacked[0].per_expert_name, "w1");
  EXPECT_EQ(stacked[0].unit, "");
  EXPECT_THROW(MoE(streamed_options(2, true, true, -1)), strata::Error);
}

// User experts (a factory): grouped into units by index; an expert of a unit no route reaches is
// not run.
TEST(StreamedExperts, UserExpertsOfUnreachedUnitsDoNotRun) {
  auto o = streamed_options(1, false, true, 2);
  int64_t calls = 0;
  struct Counted : torch::nn::Module {
    Counted(int64_t* calls) : calls(calls) { fc = register_module("fc", torch::nn::Linear(kD, kD)); }
    torch::Tensor forward(const torch::Tensor& x) {
      ++*calls;
      return fc(x);
    }
    int64_t* calls;
    torch::nn::Linear fc{nullptr};
  };
  o.expert_factory = [&](int64_t) { return torch::nn::AnyModule(std::make_shared<Counted>(&calls)); };
  MoE m(o);
  const auto found = expert_parameters(*m);
  EXPECT_EQ(found[0].name, "experts.0.fc.weight");
  EXPECT_EQ(found[0].per_expert_name, "fc.weight");
  EXPECT_EQ(found[0].unit, "unit0");
  EXPECT_EQ(found[4].unit, "unit2");  // expert 2's weight
  calls = 0;
  m->forward(torch::randn({1, kD}));  // one token, top-1: one unit of two experts runs
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(m->experts->last_skipped_units(), 3);
}

}  // namespace
