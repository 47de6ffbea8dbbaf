#include "moe/experts.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <string>

#include <fmt/format.h>

#include "moe/keys.h"
#include "runtime/error.h"

namespace strata::moe {
namespace {

torch::Tensor uniform(at::Generator& gen, at::IntArrayRef shape, double bound) {
  return torch::rand(shape, gen, torch::kFloat) * (2 * bound) - bound;
}

uint64_t expert_key(const ExpertsOptions& o, int64_t global) {
  return key({o.seed, static_cast<uint64_t>(KeyTag::ExpertInit), static_cast<uint64_t>(o.layer_id),
              static_cast<uint64_t>(global)});
}

}  // namespace

ExpertsImpl::ExpertsImpl(ExpertsOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  if (o.hidden_size < 1 || o.local_experts < 1 || o.first_expert < 0) {
    throw Error(fmt::format("moe::Experts: hidden_size = {}, local_experts = {}, first_expert = {}; "
                            "all must be positive (first_expert >= 0)",
                            o.hidden_size, o.local_experts, o.first_expert));
  }
  if (o.factory) {
    // Seed LibTorch's default CPU generator per expert while the factory runs (see the header).
    auto gen = at::detail::getDefaultCPUGenerator();
    const auto saved = gen.get_state();
    for (int64_t i = 0; i < o.local_experts; ++i) {
      const int64_t g = o.first_expert + i;
      gen.set_current_seed(expert_key(o, g));
      torch::nn::AnyModule m;
      try {
        m = o.factory(g);
      } catch (...) {
        gen.set_state(saved);
        throw;
      }
      if (m.is_empty()) {
        gen.set_state(saved);
        throw Error(fmt::format("moe::Experts: the expert factory returned an empty module for "
                                "expert {}; return torch::nn::AnyModule(YourModule(...))", g));
      }
      register_module(std::to_string(g), m.ptr());
      user_.push_back(std::move(m));
    }
    gen.set_state(saved);
    return;
  }
  if (o.ffn_size < 1) {
    throw Error(fmt::format("moe::Experts: ffn_size = {}; the built-in MLP needs ffn_size >= 1 "
                            "(or pass an expert factory)", o.ffn_size));
  }
  const int64_t El = o.local_experts, d = o.hidden_size, f = o.ffn_size;
  auto W1 = torch::empty({El, d, f}), B1 = torch::empty({El, f});
  auto W2 = torch::empty({El, f, d}), B2 = torch::empty({El, d});
  const double bound1 = 1.0 / std::sqrt(double(d)), bound2 = 1.0 / std::sqrt(double(f));
  for (int64_t i = 0; i < El; ++i) {
    auto gen = at::detail::createCPUGenerator(expert_key(o, o.first_expert + i));
    W1[i].copy_(uniform(gen, {d, f}, bound1));
    B1[i].copy_(uniform(gen, {f}, bound1));
    W2[i].copy_(uniform(gen, {f, d}, bound2));
    B2[i].copy_(uniform(gen, {d}, bound2));
  }
  w1 = register_parameter("w1", W1);
  b1 = register_parameter("b1", B1);
  w2 = register_parameter("w2", W2);
  b2 = register_parameter("b2", B2);
}

torch::Tensor ExpertsImpl::forward(const torch::Tensor& x) {
  const int64_t El = options_.local_experts;
  if (x.dim() != 3 || x.size(0) != El || x.size(2) != options_.hidden_size) {
    throw Error(fmt::format("moe::Experts: input {} but this rank holds {} experts of width {}; "
                            "expected [{}, tokens, {}]", c10::str(x.sizes()), El,
                            options_.hidden_size, El, options_.hidden_size));
  }
  if (built_in()) {
    // Padding rows (zeros) pass through too; they are never combined, so get no gradient.
    auto h = torch::gelu(torch::baddbmm(b1.unsqueeze(1), x, w1));
    return torch::baddbmm(b2.unsqueeze(1), h, w2);
  }
  std::vector<torch::Tensor> out;
  out.reserve(El);
  for (int64_t i = 0; i < El; ++i) out.push_back(user_[i].forward<torch::Tensor>(x[i]));
  return torch::stack(out);
}

}  // namespace strata::moe
