// A model small enough that its checkpoint is a few KB, and the engine configs the
// checkpoint-through-the-engine tests save and resume it with.
#pragma once

#include <torch/torch.h>

#include "runtime/engine.h"

namespace strata::test {

// Linear(4, out) named `name`, a buffer "calls" of `calls` elements; the variations are models
// a checkpoint of the default one does not fit.
struct TinyNetImpl : torch::nn::Module {
  explicit TinyNetImpl(int64_t out = 3, const std::string& name = "fc", int64_t calls = 1,
                       bool bias = true, bool extra = false) {
    fc = register_module(name, torch::nn::Linear(torch::nn::LinearOptions(4, out).bias(bias)));
    register_buffer("calls", torch::zeros({calls}, torch::kLong));
    if (extra) register_parameter("scale", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    const auto out = fc(x.to(fc->weight.scalar_type())).to(torch::kFloat);
    return (out.sum(1, true) - y).pow(2).mean();
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TinyNet);

inline json tiny_config(int stage, bool bf16 = false) {
  json c = {{"train_micro_batch_size_per_gpu", 4},
            {"gradient_accumulation_steps", 1},
            {"steps_per_print", 1000},
            {"zero_optimization", {{"stage", stage}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}}};
  if (bf16) c["bf16"] = {{"enabled", true}};
  return c;
}

template <class E>
void train_tiny(E& engine, int steps) {
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(100 + s);
    const auto x = torch::randn({4, 4});
    engine->backward(engine->forward(x, x.sum(1, true)));
    engine->step();
  }
}

inline std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

inline bool unchanged(torch::nn::Module& m, const std::vector<torch::Tensor>& before) {
  const auto now = snapshot(m);
  for (size_t i = 0; i < now.size(); ++i)
    if (!torch::equal(now[i], before[i])) return false;
  return true;
}

}  // namespace strata::test
