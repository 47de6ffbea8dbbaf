// The MoE layer in one process, against a reference computed another way: the gate's routes
// (moe::gate on the same logits) applied token by token with each expert's MLP written out
// (a loop in the test), forward and gradients to 1e-5 in float32. Also: the dispatch never holds
// an [S, E, C] tensor, the named seeds (init per global expert, noise per call), user experts,
// expert parameter discovery and the errors. The losses, used_token and autocast:
// test_layer_losses.cpp.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "moe/keys.h"
#include "moe/layer.h"
#include "runtime/error.h"
#include "tests/moe/layer_reference.h"

namespace {

using namespace strata::moe;
using namespace strata::test::moe_layer;
namespace F = torch::nn::functional;

struct Case {
  const char* name;
  int64_t k;
  bool drop_tokens;
  bool use_rts;
  NoisyGatePolicy noise;
  bool second_sampling;
  DropPolicy drop = DropPolicy::Probs;
  bool expert_bias = true;
  bool padding = false;  // used_token marks the last 4 tokens of each sequence as padding
  bool swiglu = false;   // SwiGLU experts (Qwen3-MoE's, Mixtral's)
  bool norm = true;      // norm_topk_prob: the kept weights renormalised (k >= 2)
};

// The case as its CTest name shows it (without this, gtest prints the struct's bytes, a pointer
// among them, and the name changes from build to build).
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class LayerVsReference : public ::testing::TestWithParam<Case> {};

void check_against_reference(const Case& cs, ExpertKernel kernel) {
  auto o = options(cs.k, cs.drop_tokens);
  o.use_rts = cs.use_rts;
  o.noisy_gate_policy = cs.noise;
  o.top2_2nd_expert_sampling = cs.second_sampling;
  o.drop_policy = cs.drop;
  o.expert_bias = cs.expert_bias;
  if (cs.swiglu) o.expert_activation = ExpertActivation::SwiGLU;
  o.norm_topk_prob = cs.norm;
  o.capacity_factor = 0.75;  // drops at k <= 2
  o.aux_loss_coef = 0.5;
  MoE m(o);
  ASSERT_EQ(m->experts->b1.defined(), cs.expert_bias);
  ASSERT_EQ(m->experts->named_parameters().contains("b2"), cs.expert_bias);
  m->experts->set_kernel(kernel);
  Reference ref(m);
  m->set_call_index(5);  // the noise of call 5, in the layer and the reference alike

  torch::manual_seed(1);
  // [2, 12, d]: the layer flattens leading dimensions; the reference sees the flat tokens.
  auto x = torch::randn({2, 12, kD}).requires_grad_(true);
  auto x_ref = x.detach().clone().reshape({24, kD}).requires_grad_(true);
  auto probe = torch::randn({24, kD});

  torch::Tensor used;
  if (cs.padding) {
    used = torch::ones({2, 12}, torch::kLong);
    used.narrow(1, 8, 4).zero_();
  }
  auto y = m->forward(x, used);
  ASSERT_EQ(y.sizes(), x.sizes());
  auto [y_ref, g] = ref.forward(o, x_ref, 5, true, cs.padding ? used.reshape({-1}) : torch::Tensor());
  if (cs.padding) {  // padding gets no expert output, and counts among the routes dropped
    EXPECT_EQ(y.reshape({24, kD}).index({used.reshape({-1}).eq(0)}).abs().max().item<double>(), 0.0);
    EXPECT_GE(m->last().dropped_count(), 8);
  }
  expect_close(y.reshape({24, kD}), y_ref, "output");
  EXPECT_GT(y_ref.abs().max().item<double>(), 0.05) << "a vacuous reference";
  // Dropless with the grouped kernel (ep_size 1) keeps every route without reading the largest
  // load: its capacity is the S * k bound (moe/layer.h).
  const bool uncapped = !cs.drop_tokens && m->experts->grouped(x);
  EXPECT_EQ(m->last().capacity, uncapped ? 24 * cs.k : g.capacity);
  EXPECT_EQ(m->last().dropped_count(), g.dropped);
  EXPECT_TRUE(torch::equal(m->last().exp_counts, g.exp_counts));
  if (cs.drop_tokens && cs.k <= 2) {
    EXPECT_GT(g.dropped, 0) << "the case should drop routes";
  }
  if (!cs.drop_tokens) {
    EXPECT_EQ(g.dropped, cs.padding ? 8 : 0);  // dropless: padding only
  }

  // loss(): each auxiliary loss under its own coefficient (z_loss has router_z_loss_coef).
  const auto loss = (y.reshape({24, kD}) * probe).sum() + m->loss();
  const auto loss_ref = (y_ref * probe).sum() + 0.5 * g.l_aux + g.z_loss;
  expect_close(loss, loss_ref, "loss");
  loss.backward();
  loss_ref.backward();
  expect_close(x.grad().reshape({24, kD}), x_ref.grad(), "d input");
  expect_close(m->gate->weight.grad(), ref.wg.grad(), "d gate weight");
  expect_close(m->experts->w1.grad(), ref.w1.grad(), "d w1");
  expect_close(m->experts->w2.grad(), ref.w2.grad(), "d w2");
  if (cs.expert_bias) {
    expect_close(m->experts->b1.grad(), ref.b1.grad(), "d b1");
    expect_close(m->experts->b2.grad(), ref.b2.grad(), "d b2");
  }
  EXPECT_EQ(m->call_index(), 6);
}

TEST_P(LayerVsReference, ForwardAndGradients) { check_against_reference(GetParam(), ExpertKernel::Batched); }

// The grouped kernel (only the filled rows, packed by expert; here with the group-by-group loop
// in place of _grouped_mm) gives the same layer.
TEST_P(LayerVsReference, GroupedKernelForwardAndGradients) {
  check_against_reference(GetParam(), ExpertKernel::Grouped);
}

INSTANTIATE_TEST_SUITE_P(
    Moe, LayerVsReference,
    ::testing::Values(
        Case{"top1_plain", 1, true, false, NoisyGatePolicy::None, false},
        Case{"top1_rts", 1, true, true, NoisyGatePolicy::None, false},
        Case{"top1_rts_jitter", 1, true, true, NoisyGatePolicy::Jitter, false},
        Case{"top1_rsample", 1, true, true, NoisyGatePolicy::RSample, false},
        Case{"top1_no_drop", 1, false, true, NoisyGatePolicy::None, false},
        // used_token on the dropless path (with the grouped kernel: the packed routes) and on
        // the capped one.
        Case{"top1_no_drop_padding", 1, false, true, NoisyGatePolicy::None, false,
             DropPolicy::Probs, true, true},
        Case{"top1_rts_padding", 1, true, true, NoisyGatePolicy::None, false, DropPolicy::Probs,
             true, true},
        Case{"top2", 2, true, false, NoisyGatePolicy::None, false},
        Case{"top2_sampling", 2, true, false, NoisyGatePolicy::None, true},
        Case{"top2_jitter", 2, true, false, NoisyGatePolicy::Jitter, true},
        Case{"top3_jitter", 3, true, false, NoisyGatePolicy::Jitter, false},
        Case{"top2_no_drop", 2, false, false, NoisyGatePolicy::None, true},
        Case{"top3_probs", 3, true, false, NoisyGatePolicy::None, false},
        Case{"top3_position", 3, true, false, NoisyGatePolicy::None, false,
             DropPolicy::Position},
        // Experts without biases (moe-8x's, the peers'): w1 and w2 only.
        Case{"top2_no_bias", 2, true, false, NoisyGatePolicy::None, true, DropPolicy::Probs,
             false},
        Case{"top1_no_bias_no_drop", 1, false, true, NoisyGatePolicy::None, false,
             DropPolicy::Probs, false},
        // Qwen3-MoE / Mixtral: SwiGLU experts, dropless with raw weights; and with drops and
        // biases (renormalised SwiGLU routes: the Hugging Face oracle, tests/models).
        Case{"top2_swiglu_raw_no_drop", 2, false, false, NoisyGatePolicy::None, false,
             DropPolicy::Probs, false, false, true, false},
        Case{"top3_swiglu_raw", 3, true, false, NoisyGatePolicy::None, false, DropPolicy::Probs,
             true, false, true, false}),
    [](const auto& info) { return std::string(info.param.name); });

// The gate's noise is named by the call index: the same call draws the same routes, another call
// others (RTS at k = 1 over capacity picks different survivors).
TEST(MoeLayer, NoiseIsKeyedByCallIndex) {
  auto o = options(1, true);
  o.capacity_factor = 0.5;  // many drops: the survivors are the random choice
  MoE m(o);
  torch::manual_seed(2);
  const auto x = torch::randn({64, kD});
  torch::NoGradGuard no_grad;
  m->set_call_index(11);
  const auto a = m->forward(x);
  m->set_call_index(11);
  EXPECT_TRUE(torch::equal(m->forward(x), a));
  EXPECT_FALSE(torch::equal(m->forward(x), a)) << "call 12 should draw other RTS priorities";
}

// Peak tensor size during forward and backward, from every op's outputs.
std::atomic<int64_t> g_max_numel{0};
std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) { return nullptr; }
void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  for (const auto& v : fn.outputs()) {
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    int64_t n = v.toTensor().numel(), cur = g_max_numel.load();
    while (n > cur && !g_max_numel.compare_exchange_weak(cur, n)) {
    }
  }
}

TEST(MoeLayer, DispatchIsCapacityPaddedNeverSxExC) {
  MoEOptions o = options(2, true);
  o.num_experts = 8;
  o.ffn_size = 32;
  MoE m(o);
  const int64_t S = 256, E = 8;
  const auto x = torch::randn({S, kD}).requires_grad_(true);
  g_max_numel = 0;
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                          .needsOutputs(true)
                                          .scopes({at::RecordScope::FUNCTION,
                                                   at::RecordScope::BACKWARD_FUNCTION}));
  auto y = m->forward(x);
  (y.pow(2).sum() + m->loss()).backward();
  at::removeCallback(handle);
  const int64_t C = m->last().capacity;
  ASSERT_EQ(C, 64);  // ceil(256 / 8 * 1.0 * 2)
  EXPECT_EQ(m->last().dispatch_shape, (std::vector<int64_t>{E, C, kD}));
  EXPECT_EQ(m->last().expert_input_shape, (std::vector<int64_t>{E, C, kD}));
  // The largest tensor is the experts' hidden [E, C, ffn] (16384), far below S*E*C (131072).
  EXPECT_GT(g_max_numel.load(), 0);
  EXPECT_LE(g_max_numel.load(), E * C * 32);
  EXPECT_LT(g_max_numel.load(), S * E * C / 4);
}

// A ProcessGroup that only answers who it is: enough to build an ep_size 2 layer's rank r.
class FakeGroup : public strata::comm::ProcessGroup {
 public:
  FakeGroup(int rank, int size) : rank_(rank), size_(size), ranks_{0, 1} {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::vector<int>& world_ranks() const override { return ranks_; }
  const std::string& name() const override { return name_; }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(1); }
  strata::comm::WorkPtr all_reduce_async(torch::Tensor, strata::comm::ReduceOp) override { return no(); }
  strata::comm::WorkPtr broadcast_async(torch::Tensor, int) override { return no(); }
  strata::comm::WorkPtr all_gather_async(torch::Tensor, torch::Tensor) override { return no(); }
  strata::comm::WorkPtr reduce_scatter_async(torch::Tensor, torch::Tensor,
                                             strata::comm::ReduceOp) override { return no(); }
  strata::comm::WorkPtr all_to_all_single_async(torch::Tensor, torch::Tensor, std::vector<int64_t>,
                                                std::vector<int64_t>) override { return no(); }
  strata::comm::WorkPtr barrier_async() override { return no(); }
  strata::comm::GroupPtr new_group(const std::vector<int>&) override { return nullptr; }
  strata::comm::GroupPtr split(int, int) override { return nullptr; }

 private:
  static strata::comm::WorkPtr no() { throw strata::Error("FakeGroup: no collectives"); }
  int rank_, size_;
  std::vector<int> ranks_;
  std::string name_ = "fake";
};

TEST(MoeLayer, InitDoesNotDependOnEpSize) {
  MoE whole(options(2, true));
  for (int r = 0; r < 2; ++r) {
    auto o = options(2, true);
    o.ep_size = 2;
    o.ep_group = std::make_shared<FakeGroup>(r, 2);
    MoE part(o);
    EXPECT_EQ(part->first_expert(), 2 * r);
    EXPECT_TRUE(torch::equal(part->gate->weight, whole->gate->weight));
    const auto rows = torch::indexing::Slice(2 * r, 2 * r + 2);
    EXPECT_TRUE(torch::equal(part->experts->w1, whole->experts->w1.index({rows})));
    EXPECT_TRUE(torch::equal(part->experts->b2, whole->experts->b2.index({rows})));
    // User experts: the factory runs under a generator seeded per global expert.
    o.expert_factory = [](int64_t) {
      return torch::nn::AnyModule(torch::nn::Linear(kD, kD));
    };
    auto o1 = o;
    o1.ep_size = 1;
    o1.ep_group = nullptr;
    MoE user_part(o), user_whole(o1);
    for (int64_t g = 2 * r; g < 2 * r + 2; ++g) {
      const std::string name = "experts." + std::to_string(g) + ".weight";
      EXPECT_TRUE(torch::equal(user_part->named_parameters()[name],
                               user_whole->named_parameters()[name])) << name;
    }
  }
  // Experts differ from each other and from another layer's.
  EXPECT_FALSE(torch::equal(whole->experts->w1[0], whole->experts->w1[1]));
  auto other = options(2, true);
  other.layer_id = 4;
  EXPECT_FALSE(torch::equal(MoE(other)->experts->w1, whole->experts->w1));
}

struct UserMlpImpl : torch::nn::Module {
  UserMlpImpl() {
    up = register_module("up", torch::nn::Linear(kD, kFfn));
    down = register_module("down", torch::nn::Linear(kFfn, kD));
  }
  torch::Tensor forward(const torch::Tensor& x) { return down(torch::tanh(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(UserMlp);

// User experts: each a user MLP built by the factory, run one by one on its padded rows;
// checked against the same token-by-token reference with the user's modules.
TEST(MoeLayer, UserExpertsMatchTokenByToken) {
  auto o = options(2, true);
  o.expert_factory = [](int64_t) { return torch::nn::AnyModule(UserMlp()); };
  MoE m(o);
  torch::manual_seed(4);
  const auto x = torch::randn({20, kD});
  torch::NoGradGuard no_grad;
  const auto y = m->forward(x);
  GateOptions go = o.gate_options();
  go.seed = key({o.seed, uint64_t(KeyTag::GateNoise), uint64_t(o.layer_id), 0});
  const auto g = gate(F::linear(x, m->gate->weight), go);
  auto want = torch::zeros_like(x);
  for (int64_t r = 0; r < g.token.size(0); ++r) {
    const int64_t t = g.token[r].item<int64_t>(), e = g.expert[r].item<int64_t>();
    auto* expert = m->experts->named_children()[std::to_string(e)]->as<UserMlp>();
    want[t] += g.weight[r] * expert->forward(x[t].unsqueeze(0))[0];
  }
  expect_close(y, want, "user experts");
}

TEST(MoeLayer, ExpertParametersAreFoundByNameAndByWalk) {
  torch::nn::Sequential model(torch::nn::Linear(kD, kD), MoE(options(2, true)));
  const auto found = expert_parameters(*model);
  ASSERT_EQ(found.size(), 4u);
  EXPECT_EQ(found[0].name, "1.experts.w1");
  EXPECT_TRUE(found[0].stacked);
  EXPECT_EQ(found[0].num_experts, kE);
  int experts = 0;
  for (const auto& kv : model->named_parameters()) experts += is_expert_parameter_name(kv.key());
  EXPECT_EQ(experts, 4);
  EXPECT_FALSE(is_expert_parameter_name("1.gate.weight"));
  EXPECT_FALSE(is_expert_parameter_name("my_experts.w"));
  EXPECT_TRUE(is_expert_parameter_name("experts.3.fc.weight"));
}

TEST(MoeLayer, OptionsFromGateOptionsAndUserExpertNames) {
  GateOptions g;
  g.k = 2;
  g.capacity_factor = 1.25;
  g.eval_capacity_factor = 2.0;
  g.min_capacity = 3;
  g.drop_tokens = false;
  g.use_rts = false;
  g.top2_2nd_expert_sampling = false;
  g.drop_policy = DropPolicy::Position;
  g.z_loss_coef = 0.5;
  g.seed = 99;
  const MoEOptions o(kD, kFfn, kE, g);
  EXPECT_EQ(o.hidden_size, kD);
  EXPECT_EQ(o.num_experts, kE);
  const GateOptions back = o.gate_options();
  EXPECT_EQ(back.k, 2);
  EXPECT_EQ(back.capacity_factor, 1.25);
  EXPECT_EQ(back.eval_capacity_factor, 2.0);
  EXPECT_EQ(back.min_capacity, 3);
  EXPECT_FALSE(back.drop_tokens);
  EXPECT_FALSE(back.use_rts);
  EXPECT_FALSE(back.top2_2nd_expert_sampling);
  EXPECT_EQ(back.drop_policy, DropPolicy::Position);
  EXPECT_EQ(back.z_loss_coef, 0.5);
  EXPECT_EQ(back.seed, 99u);

  // User experts are named by their global index; expert_parameters() reports it.
  auto uo = options(1, true);
  uo.ep_size = 2;
  uo.ep_group = std::make_shared<FakeGroup>(1, 2);
  uo.expert_factory = [](int64_t) { return torch::nn::AnyModule(UserMlp()); };
  MoE m(uo);
  const auto found = expert_parameters(*m);
  ASSERT_EQ(found.size(), 8u);  // experts 2 and 3, up/down weight and bias each
  EXPECT_EQ(found[0].name, "experts.2.up.weight");
  EXPECT_EQ(found[0].first_expert, 2);
  EXPECT_EQ(found[4].first_expert, 3);
  EXPECT_FALSE(found[0].stacked);
  EXPECT_EQ(found[0].num_experts, 1);
}

// use_residual (DeepSpeed's Residual MoE): the experts' output of the same layer without it
// (the same named draws give the same gate and experts), mixed per token with the dense MLP's
// by softmax(coefficient(x)), written out here; gradients reach the MLP and the coefficient,
// which are ordinary parameters (not experts). The dense MLP's draws do not depend on ep_size.
TEST(MoeLayer, ResidualMixesTheDenseMlpByItsCoefficient) {
  for (bool user : {false, true}) {
    SCOPED_TRACE(user ? "user experts" : "built-in experts");
    auto o = options(2, true);
    std::vector<int64_t> built;
    if (user)
      o.expert_factory = [&built](int64_t g) {
        built.push_back(g);
        return torch::nn::AnyModule(UserMlp());
      };
    auto plain_options = o;
    o.use_residual = true;
    MoE plain(plain_options), residual(o);
    if (user) {
      EXPECT_EQ(built.back(), kResidualMLP) << "the factory builds the residual MLP last";
      EXPECT_EQ(std::count(built.begin(), built.end(), kResidualMLP), 1);
    }
    const auto names = residual->named_parameters().keys();
    for (const char* n : {"coefficient.weight", "coefficient.bias"})
      EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
    if (!user) {
      for (const char* n : {"mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"})
        EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
    }
    EXPECT_EQ(expert_parameters(*residual).size(), expert_parameters(*plain).size());

    torch::manual_seed(5);
    const auto x = torch::randn({3, 7, kD});
    const auto y = residual->forward(x);
    torch::Tensor want;
    {
      torch::NoGradGuard no_grad;
      const auto flat = x.reshape({-1, kD});
      const auto moe = plain->forward(x).reshape({-1, kD});
      const auto dense = residual->mlp.forward<torch::Tensor>(flat);
      const auto c = torch::softmax(F::linear(flat, residual->coefficient->weight,
                                              residual->coefficient->bias), -1);
      want = (moe * c.select(1, 0).unsqueeze(1) + dense * c.select(1, 1).unsqueeze(1)).view(x.sizes());
      EXPECT_GT((want - moe.view(x.sizes())).abs().max().item<double>(), 1e-3)
          << "the residual must change the output";
    }
    expect_close(y, want, "residual MoE output");
    y.square().sum().backward();
    for (const auto& p : residual->named_parameters()) {
      if (p.key().rfind("experts.", 0) == 0) continue;  // experts without tokens get none
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0) << p.key();
    }
  }
  // The dense MLP and coefficient are drawn from the layer's keys alone: the same at ep_size 2.
  auto o = options(1, true);
  o.use_residual = true;
  auto o2 = o;
  o2.ep_size = 2;
  o2.ep_group = std::make_shared<FakeGroup>(1, 2);
  MoE one(o), two(o2);
  auto a = one->named_parameters(), b = two->named_parameters();
  for (const char* n : {"mlp.fc1.weight", "mlp.fc2.bias", "coefficient.weight", "coefficient.bias"})
    EXPECT_TRUE(torch::equal(a[n], b[n])) << n;
  EXPECT_FALSE(torch::equal(a["mlp.fc1.weight"], one->experts->w1[0].t())) << "its own draws";
}

// The config's moe keys against the options a layer was built with: only the keys it gives.
TEST(MoeLayer, OptionsSayWhichGivenConfigKeyTheyDoNotFollow) {
  strata::MoeConfig c;
  c.num_experts = kE;
  c.top_k = 1;
  c.use_residual = true;
  auto o = options(2, true);
  EXPECT_EQ(o.differs_from(c), "") << "no key given";
  c.given = {"num_experts", "use_residual"};
  EXPECT_EQ(o.differs_from(c), "moe.use_residual is true in the config, the layer's is false");
  o.use_residual = true;
  EXPECT_EQ(o.differs_from(c), "");
  c.given.insert("top_k");
  EXPECT_EQ(o.differs_from(c), "moe.top_k is 1 in the config, the layer's is 2");
  o.k = 1;
  c.given.insert("noisy_gate_policy");
  c.noisy_gate_policy = "Jitter";
  EXPECT_EQ(o.differs_from(c), "moe.noisy_gate_policy is \"Jitter\" in the config, the layer's is \"None\"");
  o.noisy_gate_policy = NoisyGatePolicy::Jitter;
  // The layer's loss() applies aux_loss_coef: a layer built with another would ignore the key.
  c.given.insert("aux_loss_coef");
  c.aux_loss_coef = 0.5;
  EXPECT_EQ(o.differs_from(c), "moe.aux_loss_coef is 0.5 in the config, the layer's is 0.01");
  o = MoEOptions::from_config(c, kD, kFfn, 0, 1, nullptr);
  EXPECT_TRUE(o.use_residual);
  EXPECT_EQ(o.aux_loss_coef, 0.5);
  EXPECT_EQ(o.differs_from(c), "") << "from_config follows every key";
}

TEST(MoeLayer, ErrorsSayWhatToChange) {
  auto expect_error = [](MoEOptions o, const std::string& part) {
    try {
      MoE m(o);
      ADD_FAILURE() << "no error; wanted one mentioning " << part;
    } catch (const strata::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  auto o = options(1, true);
  o.ep_size = 3;
  expect_error(o, "E % ep_size");
  o.ep_size = 2;
  expect_error(o, "create_expert_groups");
  o.ep_group = std::make_shared<FakeGroup>(0, 4);
  expect_error(o, "has 4 ranks");
  o = options(5, true);
  expect_error(o, "k <= num_experts");
  MoE m(options(1, true));
  try {
    m->forward(torch::randn({4, kD + 1}));
    ADD_FAILURE() << "no error for a wrong width";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden_size"), std::string::npos) << e.what();
  }
}

}  // namespace
