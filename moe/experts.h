// The experts one rank holds, run as one grouped computation over the capacity-padded layout
// [E_local, T, d] (T = ep_size * capacity tokens per expert, padding rows included).
//
// Two kinds:
//   - built-in: DeepSpeed's Experts of an MLP (Linear(d, ffn), GELU, Linear(ffn, d)), stored as
//     stacked tensors w1 [E_local, d, ffn], b1 [E_local, ffn], w2 [E_local, ffn, d], b2
//     [E_local, d] and run as two batched GEMMs (torch::baddbmm): no loop over experts, no host
//     sync. Row i of each tensor is global expert first_expert() + i.
//   - user: a factory returns one module per global expert (Tensor [T, d] -> Tensor [T, d]);
//     they are registered under their GLOBAL index ("experts.5.fc.weight") and run in a loop
//     over the local experts (no host sync either, but one kernel per expert and layer).
//
// Initialisation does not depend on ep_size: global expert g of layer L draws from a generator
// keyed by (seed, L, g) (moe/keys.h), so an ep_size 2 run holds exactly the slices of an
// ep_size 1 run. Built-in: each matrix uniform(+-1/sqrt(fan_in)) as torch::nn::Linear does,
// drawn in the order w1, b1, w2, b2. User: the factory runs with LibTorch's default CPU
// generator seeded by that key (its previous state restored after), so a factory that builds
// ordinary LibTorch modules gets the same property without doing anything.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <torch/torch.h>

namespace strata::moe {

// One module per global expert index; its forward maps [T, d] to [T, d].
using ExpertFactory = std::function<torch::nn::AnyModule(int64_t global_expert)>;

struct ExpertsOptions {
  int64_t hidden_size = 0;    // d
  int64_t ffn_size = 0;       // built-in MLP only
  int64_t first_expert = 0;   // global index of local expert 0
  int64_t local_experts = 1;  // E_local
  uint64_t seed = 0;
  int64_t layer_id = 0;
  ExpertFactory factory;  // empty: the built-in MLP
};

class ExpertsImpl : public torch::nn::Module {
 public:
  explicit ExpertsImpl(ExpertsOptions options);

  // x: [E_local, T, d] -> [E_local, T, d].
  torch::Tensor forward(const torch::Tensor& x);

  bool built_in() const { return !options_.factory; }
  int64_t first_expert() const { return options_.first_expert; }
  int64_t local_experts() const { return options_.local_experts; }

  // Built-in MLP parameters (undefined for user experts).
  torch::Tensor w1, b1, w2, b2;

 private:
  ExpertsOptions options_;
  std::vector<torch::nn::AnyModule> user_;  // user experts, local order
};
TORCH_MODULE(Experts);

}  // namespace strata::moe
