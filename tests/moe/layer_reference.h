// The MoE layer's token-by-token reference and the options the layer tests share
// (test_layer.cpp, test_layer_losses.cpp).
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "moe/keys.h"
#include "moe/layer.h"

namespace strata::test::moe_layer {

using namespace strata::moe;
namespace F = torch::nn::functional;

constexpr int64_t kD = 8, kFfn = 16, kE = 4;

inline MoEOptions options(int64_t k, bool drop_tokens, uint64_t seed = 7) {
  MoEOptions o;
  o.hidden_size = kD;
  o.ffn_size = kFfn;
  o.num_experts = kE;
  o.k = k;
  o.min_capacity = 0;
  o.drop_tokens = drop_tokens;
  o.router_z_loss_coef = 0.01;
  o.seed = seed;
  o.layer_id = 3;
  return o;
}

inline void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what,
                  double tol = 1e-5) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double diff = (got - want).abs().max().item<double>();
  EXPECT_LE(diff, tol * (1 + want.abs().max().item<double>())) << what;
}

// Parameters of the reference: copies of the layer's, so gradients are computed separately.
struct Reference {
  torch::Tensor wg, w1, b1, w2, b2;
  explicit Reference(MoE& m) {
    auto copy = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
    wg = copy(m->gate->weight);
    w1 = copy(m->experts->w1);
    w2 = copy(m->experts->w2);
    if (m->experts->b1.defined()) {
      b1 = copy(m->experts->b1);
      b2 = copy(m->experts->b2);
    }
  }
  // Call c of the layer, as moe/layer.h documents it: gate on x.float() @ W_g^T (jittered per
  // the named seed), then each kept route's expert MLP on its token alone.
  std::pair<torch::Tensor, GateOutput> forward(const MoEOptions& o, const torch::Tensor& x,
                                               uint64_t c, bool training = true,
                                               const torch::Tensor& used_token = {}) {
    auto gate_in = x.to(torch::kFloat);
    // DeepSpeed's TopKGate.forward jitters the gate's input for every k while training.
    if (o.noisy_gate_policy == NoisyGatePolicy::Jitter && training) {
      auto gen = at::detail::createCPUGenerator(
          key({o.seed, uint64_t(KeyTag::Jitter), uint64_t(o.layer_id), c}));
      gate_in = gate_in * (torch::rand({x.size(0), x.size(1)}, gen, torch::kFloat) * 0.02 + 0.99);
    }
    GateOptions go = o.gate_options();
    go.training = training;
    go.seed = key({o.seed, uint64_t(KeyTag::GateNoise), uint64_t(o.layer_id), c});
    go.used_token = used_token;
    GateOutput g = gate(F::linear(gate_in, wg), go);
    std::vector<torch::Tensor> rows(x.size(0), torch::zeros({x.size(1)}));
    for (int64_t r = 0; r < g.token.size(0); ++r) {
      const int64_t t = g.token[r].item<int64_t>(), e = g.expert[r].item<int64_t>();
      auto h = torch::matmul(x[t], w1[e]);
      if (b1.defined()) h = h + b1[e];
      if (o.expert_activation == ExpertActivation::SwiGLU)  // gate's columns, then up's
        h = F::silu(h.narrow(0, 0, o.ffn_size)) * h.narrow(0, o.ffn_size, o.ffn_size);
      else
        h = F::gelu(h);
      auto out = torch::matmul(h, w2[e]);
      if (b2.defined()) out = out + b2[e];
      rows[t] = rows[t] + g.weight[r] * out;
    }
    return {torch::stack(rows), g};
  }
};

}  // namespace strata::test::moe_layer
