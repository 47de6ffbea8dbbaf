// strata::optim::Adam / SGD against LibTorch's own optimizers and a float64 reference; the
// optimizer registry; checkpoint round trips of the Adam state (with an LR schedule).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <vector>

#include "runtime/error.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/registry.h"
#include "runtime/optim/sgd.h"
#include "runtime/sched/lr_scheduler.h"

namespace {

using strata::json;

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// Same seed, same weights: each call returns an identical model.
std::shared_ptr<Mlp> make_mlp() {
  torch::manual_seed(0);
  return std::make_shared<Mlp>();
}

struct Batch {
  torch::Tensor x, y;
};

Batch make_batch() {
  torch::manual_seed(1);
  return {torch::randn({32, 8}), torch::randn({32, 4})};
}

void train(Mlp& model, torch::optim::Optimizer& optimizer, const Batch& batch, int steps,
           strata::LRScheduler* scheduler = nullptr) {
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    torch::mse_loss(model.forward(batch.x), batch.y).backward();
    optimizer.step();
    if (scheduler != nullptr) scheduler->step();
  }
}

void copy_params(Mlp& from, Mlp& to) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

void expect_close(Mlp& a, Mlp& b, double rtol) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::allclose(pa[i], pb[i], rtol, /*atol=*/1e-7))
        << "parameter " << i << ": max |diff| " << (pa[i] - pb[i]).abs().max().item<double>();
}

void expect_equal(Mlp& a, Mlp& b) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
}

// Training must move the weights, or a comparison proves nothing.
void expect_trained(Mlp& model) {
  auto fresh = make_mlp();
  auto now = model.parameters();
  auto before = fresh->parameters();
  double moved = 0;
  for (size_t i = 0; i < now.size(); ++i)
    moved = std::max(moved, (now[i] - before[i]).abs().max().item<double>());
  EXPECT_GT(moved, 1e-3);
}

constexpr int kSteps = 20;
constexpr double kRtol = 1e-6;

TEST(Adam, DecoupledModeMatchesTorchAdamW) {
  auto batch = make_batch();
  auto ours = make_mlp();
  auto theirs = make_mlp();
  strata::optim::Adam a(ours->parameters(), strata::optim::AdamOptions(1e-2)
                                                .betas(std::make_tuple(0.8, 0.95))
                                                .eps(1e-6)
                                                .weight_decay(0.1)
                                                .adam_w_mode(true));
  torch::optim::AdamW b(theirs->parameters(), torch::optim::AdamWOptions(1e-2)
                                                  .betas(std::make_tuple(0.8, 0.95))
                                                  .eps(1e-6)
                                                  .weight_decay(0.1));
  train(*ours, a, batch, kSteps);
  train(*theirs, b, batch, kSteps);
  expect_trained(*ours);
  expect_close(*ours, *theirs, kRtol);
}

TEST(Adam, L2ModeMatchesTorchAdam) {
  auto batch = make_batch();
  auto ours = make_mlp();
  auto theirs = make_mlp();
  strata::optim::Adam a(ours->parameters(), strata::optim::AdamOptions(1e-2)
                                                .betas(std::make_tuple(0.9, 0.999))
                                                .eps(1e-8)
                                                .weight_decay(0.05)
                                                .adam_w_mode(false));
  torch::optim::Adam b(theirs->parameters(), torch::optim::AdamOptions(1e-2)
                                                 .betas(std::make_tuple(0.9, 0.999))
                                                 .eps(1e-8)
                                                 .weight_decay(0.05));
  train(*ours, a, batch, kSteps);
  train(*theirs, b, batch, kSteps);
  expect_trained(*ours);
  expect_close(*ours, *theirs, kRtol);
}

// Float64 Adam written out by hand, FusedAdam's formulas, on one parameter vector.
std::vector<double> reference_adam(std::vector<double> p,
                                   const std::vector<std::vector<double>>& grads, double lr,
                                   double beta1, double beta2, double eps, double wd, bool adam_w,
                                   bool bias_correction) {
  std::vector<double> m(p.size(), 0.0), v(p.size(), 0.0);
  for (size_t t = 1; t <= grads.size(); ++t) {
    const double c1 = bias_correction ? 1 - std::pow(beta1, double(t)) : 1.0;
    const double c2 = bias_correction ? 1 - std::pow(beta2, double(t)) : 1.0;
    for (size_t j = 0; j < p.size(); ++j) {
      double g = grads[t - 1][j];
      if (!adam_w) g += wd * p[j];
      m[j] = beta1 * m[j] + (1 - beta1) * g;
      v[j] = beta2 * v[j] + (1 - beta2) * g * g;
      double update = (m[j] / c1) / (std::sqrt(v[j] / c2) + eps);
      if (adam_w) update += wd * p[j];
      p[j] -= lr * update;
    }
  }
  return p;
}

void check_against_reference(bool adam_w, bool bias_correction) {
  const std::vector<double> start = {0.5, -1.25, 2.0, 0.0, -0.75, 1.5};
  std::vector<std::vector<double>> grads;
  for (int t = 0; t < kSteps; ++t) {
    std::vector<double> g;
    for (size_t j = 0; j < start.size(); ++j)
      g.push_back(std::sin(0.7 * t + 1.3 * j) * (1 + 0.1 * j));
    grads.push_back(g);
  }
  const double lr = 0.01, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, wd = 0.05;
  const auto expected =
      reference_adam(start, grads, lr, beta1, beta2, eps, wd, adam_w, bias_correction);

  auto p = torch::tensor(std::vector<float>(start.begin(), start.end())).requires_grad_(true);
  strata::optim::Adam adam(std::vector<torch::Tensor>{p}, strata::optim::AdamOptions(lr)
                                                              .betas(std::make_tuple(beta1, beta2))
                                                              .eps(eps)
                                                              .weight_decay(wd)
                                                              .adam_w_mode(adam_w)
                                                              .bias_correction(bias_correction));
  for (const auto& g : grads) {
    p.mutable_grad() = torch::tensor(std::vector<float>(g.begin(), g.end()));
    adam.step();
  }
  auto got = p.detach().to(torch::kDouble);
  for (size_t j = 0; j < start.size(); ++j)
    EXPECT_NEAR(got[j].item<double>(), expected[j], 2e-6 * std::max(1.0, std::abs(expected[j])))
        << "element " << j << (adam_w ? " (decoupled)" : " (L2)")
        << (bias_correction ? " with" : " without") << " bias correction";
}

TEST(Adam, WithoutBiasCorrectionMatchesFloat64Reference) {
  check_against_reference(/*adam_w=*/true, /*bias_correction=*/false);
  check_against_reference(/*adam_w=*/false, /*bias_correction=*/false);
}

TEST(Adam, WithBiasCorrectionMatchesFloat64Reference) {
  check_against_reference(/*adam_w=*/true, /*bias_correction=*/true);
}

TEST(Adam, RejectsBadOptions) {
  auto model = make_mlp();
  EXPECT_THROW(strata::optim::Adam(model->parameters(), strata::optim::AdamOptions(-1)),
               strata::Error);
  EXPECT_THROW(strata::optim::Adam(model->parameters(), strata::optim::AdamOptions(1e-3).betas(
                                                            std::make_tuple(1.0, 0.9))),
               strata::Error);
}

// Per-group options stay as given (LibTorch 2.x would otherwise replace them with the defaults
// for option types it does not know).
TEST(Adam, PerGroupOptionsAreKept) {
  auto model = make_mlp();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{model->fc1->bias, model->fc2->bias},
                      std::make_unique<strata::optim::AdamOptions>(
                          strata::optim::AdamOptions(0.1).weight_decay(0.0)));
  groups.emplace_back(std::vector<torch::Tensor>{model->fc1->weight, model->fc2->weight});
  strata::optim::Adam adam(std::move(groups), strata::optim::AdamOptions(0.01).weight_decay(0.1));
  const auto& no_decay =
      static_cast<const strata::optim::AdamOptions&>(adam.param_groups()[0].options());
  const auto& decay =
      static_cast<const strata::optim::AdamOptions&>(adam.param_groups()[1].options());
  EXPECT_DOUBLE_EQ(no_decay.lr(), 0.1);
  EXPECT_DOUBLE_EQ(no_decay.weight_decay(), 0.0);
  EXPECT_DOUBLE_EQ(decay.lr(), 0.01);
  EXPECT_DOUBLE_EQ(decay.weight_decay(), 0.1);
}

struct SgdCase {
  double momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(SGD, MatchesTorchSGD) {
  const SgdCase cases[] = {{0.0, 0.0, 0.0, false},  {0.0, 0.0, 0.01, false},
                           {0.9, 0.0, 0.01, false}, {0.9, 0.3, 0.01, false},
                           {0.9, 0.0, 0.01, true},  {0.8, 0.0, 0.0, true}};
  auto batch = make_batch();
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message()
                 << "momentum " << c.momentum << " dampening " << c.dampening << " weight_decay "
                 << c.weight_decay << " nesterov " << c.nesterov);
    auto ours = make_mlp();
    auto theirs = make_mlp();
    strata::optim::SGD a(ours->parameters(), strata::optim::SGDOptions(0.05)
                                                 .momentum(c.momentum)
                                                 .dampening(c.dampening)
                                                 .weight_decay(c.weight_decay)
                                                 .nesterov(c.nesterov));
    torch::optim::SGD b(theirs->parameters(), torch::optim::SGDOptions(0.05)
                                                  .momentum(c.momentum)
                                                  .dampening(c.dampening)
                                                  .weight_decay(c.weight_decay)
                                                  .nesterov(c.nesterov));
    train(*ours, a, batch, kSteps);
    train(*theirs, b, batch, kSteps);
    expect_trained(*ours);
    expect_close(*ours, *theirs, kRtol);
  }
}

TEST(SGD, NesterovNeedsMomentumAndNoDampening) {
  auto model = make_mlp();
  EXPECT_THROW(
      strata::optim::SGD(model->parameters(), strata::optim::SGDOptions(0.1).nesterov(true)),
      strata::Error);
  EXPECT_THROW(strata::optim::SGD(
                   model->parameters(),
                   strata::optim::SGDOptions(0.1).momentum(0.9).dampening(0.1).nesterov(true)),
               strata::Error);
}

// ---- checkpoints ------------------------------------------------------------------------------

// Train, checkpoint the optimizer through LibTorch's serialization (and the schedule as JSON),
// restore into a fresh model/optimizer/schedule, continue both: identical to the last bit.
TEST(Checkpoint, AdamStateAndScheduleRoundTrip) {
  auto batch = make_batch();
  const auto options = strata::optim::AdamOptions(1e-2).weight_decay(0.01).adam_w_mode(true);
  const json schedule = {{"total_num_steps", 20},
                         {"warmup_min_ratio", 0.1},
                         {"warmup_num_steps", 5},
                         {"cos_min_ratio", 0.01},
                         {"warmup_type", "linear"}};

  auto a = make_mlp();
  strata::optim::Adam adam_a(a->parameters(), options);
  strata::WarmupCosineLR sched_a(adam_a, schedule);
  train(*a, adam_a, batch, 6, &sched_a);

  std::stringstream saved;
  torch::save(adam_a, saved);
  const json sched_state = sched_a.state_dict();

  auto b = make_mlp();
  copy_params(*a, *b);
  strata::optim::Adam adam_b(b->parameters(), options);  // as the engine builds it from the config
  strata::WarmupCosineLR sched_b(adam_b, json(schedule));
  torch::load(adam_b, saved);
  sched_b.load_state_dict(sched_state);
  EXPECT_EQ(sched_b.last_batch_iteration(), sched_a.last_batch_iteration());
  EXPECT_DOUBLE_EQ(adam_b.param_groups()[0].options().get_lr(),
                   adam_a.param_groups()[0].options().get_lr());

  train(*a, adam_a, batch, 6, &sched_a);
  train(*b, adam_b, batch, 6, &sched_b);
  expect_trained(*a);
  expect_equal(*a, *b);
}

// Without the state a resumed run diverges: the round trip above is not passing by accident.
TEST(Checkpoint, FreshAdamStateDiffers) {
  auto batch = make_batch();
  auto a = make_mlp();
  strata::optim::Adam adam_a(a->parameters(), strata::optim::AdamOptions(1e-2));
  train(*a, adam_a, batch, 6);
  auto b = make_mlp();
  copy_params(*a, *b);
  strata::optim::Adam adam_b(b->parameters(), strata::optim::AdamOptions(1e-2));
  train(*a, adam_a, batch, 3);
  train(*b, adam_b, batch, 3);
  EXPECT_FALSE(torch::equal(a->parameters()[0], b->parameters()[0]));
}

TEST(Checkpoint, SgdMomentumRoundTrip) {
  auto batch = make_batch();
  const auto options = strata::optim::SGDOptions(0.05).momentum(0.9).nesterov(true);
  auto a = make_mlp();
  strata::optim::SGD sgd_a(a->parameters(), options);
  train(*a, sgd_a, batch, 4);
  std::stringstream saved;
  torch::save(sgd_a, saved);
  auto b = make_mlp();
  copy_params(*a, *b);
  // Other options than saved: load() restores them with the momentum buffers.
  strata::optim::SGD sgd_b(b->parameters(), strata::optim::SGDOptions(0.5).momentum(0.5));
  torch::load(sgd_b, saved);
  const auto& restored =
      static_cast<const strata::optim::SGDOptions&>(sgd_b.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(restored.lr(), 0.05);
  EXPECT_DOUBLE_EQ(restored.momentum(), 0.9);
  EXPECT_TRUE(restored.nesterov());
  train(*a, sgd_a, batch, 4);
  train(*b, sgd_b, batch, 4);
  expect_equal(*a, *b);
}

// ---- registry ---------------------------------------------------------------------------------

strata::OptimizerConfig config(const std::string& type, json params) {
  strata::OptimizerConfig c;
  c.present = true;
  c.type = type;
  c.params = std::move(params);
  return c;
}

json adam_params(bool adam_w_mode) {
  return {{"lr", 0.003},          {"betas", {0.8, 0.9}},      {"eps", 1e-7},
          {"weight_decay", 0.02}, {"bias_correction", false}, {"adam_w_mode", adam_w_mode}};
}

const strata::optim::AdamOptions& adam_options(torch::optim::Optimizer& o) {
  return static_cast<const strata::optim::AdamOptions&>(o.param_groups()[0].options());
}

TEST(OptimizerRegistry, BuiltinsAreRegistered) {
  const auto names = strata::optimizer_names();
  for (const char* name : {"adam", "adamw", "sgd"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
}

TEST(OptimizerRegistry, AdamReadsEveryParam) {
  auto model = make_mlp();
  auto opt = strata::make_optimizer(config("Adam", adam_params(false)), model->parameters());
  ASSERT_NE(dynamic_cast<strata::optim::Adam*>(opt.get()), nullptr);
  const auto& o = adam_options(*opt);
  EXPECT_DOUBLE_EQ(o.lr(), 0.003);
  EXPECT_DOUBLE_EQ(std::get<0>(o.betas()), 0.8);
  EXPECT_DOUBLE_EQ(std::get<1>(o.betas()), 0.9);
  EXPECT_DOUBLE_EQ(o.eps(), 1e-7);
  EXPECT_DOUBLE_EQ(o.weight_decay(), 0.02);
  EXPECT_FALSE(o.bias_correction());
  EXPECT_FALSE(o.adam_w_mode());
}

TEST(OptimizerRegistry, AdamWForcesDecoupledWeightDecay) {
  auto model = make_mlp();
  auto opt = strata::make_optimizer(config("adamw", adam_params(false)), model->parameters());
  EXPECT_TRUE(adam_options(*opt).adam_w_mode());
}

TEST(OptimizerRegistry, AdamWithoutAdamWModeIsL2) {
  auto model = make_mlp();
  json params = adam_params(true);
  params.erase("adam_w_mode");  // the config layer's normalised "adam" means adam_w_mode false
  auto opt = strata::make_optimizer(config("adam", params), model->parameters());
  EXPECT_FALSE(adam_options(*opt).adam_w_mode());
}

TEST(OptimizerRegistry, SgdReadsEveryParam) {
  auto model = make_mlp();
  auto opt = strata::make_optimizer(config("SGD", {{"lr", 0.1},
                                                   {"momentum", 0.9},
                                                   {"dampening", 0.0},
                                                   {"weight_decay", 1e-4},
                                                   {"nesterov", true}}),
                                    model->parameters());
  auto* sgd = dynamic_cast<strata::optim::SGD*>(opt.get());
  ASSERT_NE(sgd, nullptr);
  const auto& o = static_cast<const strata::optim::SGDOptions&>(sgd->param_groups()[0].options());
  EXPECT_DOUBLE_EQ(o.lr(), 0.1);
  EXPECT_DOUBLE_EQ(o.momentum(), 0.9);
  EXPECT_DOUBLE_EQ(o.weight_decay(), 1e-4);
  EXPECT_TRUE(o.nesterov());
}

TEST(OptimizerRegistry, RegisteredClientOptimizerIsMadeByName) {
  // A client's plain LibTorch optimizer, interchangeable with Strata's.
  strata::register_optimizer(
      "TestTorchSGD", [](std::vector<torch::Tensor> params, const json& cfg) {
        return std::make_unique<torch::optim::SGD>(
            std::move(params), torch::optim::SGDOptions(cfg.at("lr").get<double>()));
      });
  const auto names = strata::optimizer_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "TestTorchSGD"), names.end());

  auto model = make_mlp();
  auto opt = strata::make_optimizer(config("testtorchsgd", {{"lr", 0.25}}), model->parameters());
  ASSERT_NE(dynamic_cast<torch::optim::SGD*>(opt.get()), nullptr);
  EXPECT_DOUBLE_EQ(opt->param_groups()[0].options().get_lr(), 0.25);

  EXPECT_THROW(strata::register_optimizer(
                   "TESTTORCHSGD",
                   [](auto, const json&) { return std::unique_ptr<torch::optim::Optimizer>(); }),
               strata::Error);
  EXPECT_THROW(strata::register_optimizer("Adam", nullptr), strata::Error);
}

TEST(OptimizerRegistry, UnknownTypeListsRegisteredNames) {
  auto model = make_mlp();
  try {
    strata::make_optimizer(config("adamx", adam_params(true)), model->parameters());
    FAIL() << "no error for an unknown optimizer";
  } catch (const strata::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("\"adamx\""), std::string::npos) << what;
    EXPECT_NE(what.find("adam, adamw"), std::string::npos) << what;
    EXPECT_NE(what.find("sgd"), std::string::npos) << what;
  }
}

TEST(OptimizerRegistry, MissingOrUnresolvedParamNamesItsPath) {
  auto model = make_mlp();
  json params = adam_params(true);
  params.erase("eps");
  try {
    strata::make_optimizer(config("adam", params), model->parameters());
    FAIL() << "no error for a missing param";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.params.eps"), std::string::npos) << e.what();
  }
  params = adam_params(true);
  params["lr"] = "auto";
  EXPECT_THROW(strata::make_optimizer(config("adam", params), model->parameters()), strata::Error);
}

}  // namespace
