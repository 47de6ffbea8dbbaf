// The experts one rank holds, run as one grouped computation over the capacity-padded layout
// [E_local, T, d] (T = ep_size * capacity tokens per expert, padding rows included).
//
// Two kinds:
//   - built-in: DeepSpeed's Experts of an MLP (Linear(d, ffn), GELU, Linear(ffn, d); or SwiGLU:
//     ExpertActivation), stored as
//     stacked tensors w1 [E_local, d, ffn], b1 [E_local, ffn], w2 [E_local, ffn, d], b2
//     [E_local, d] (ExpertsOptions::bias false: w1 and w2 only, as the PyTorch peer's and
//     torchtitan's experts). Row i of each tensor is global expert first_expert() + i. Two
//     kernels, no loop over experts and no host sync in either:
//       * batched: two batched GEMMs (torch::baddbmm) over every row, padding included;
//       * grouped (forward(x, filled)): only the filled rows are computed. They are packed so
//         that expert e's rows are contiguous, [offs[e-1], offs[e]) with offs the cumulative
//         filled counts (a device tensor), and run as two at::_grouped_mm with those offsets, as
//         the PyTorch peer and torchtitan do; the results are unpacked to the padded layout
//         (padding rows 0). Used by default where _grouped_mm has its sync-free kernel: LibTorch
//         >= 2.9, CUDA, bf16 input and weights, compute capability 9.0 or 10.0, d and ffn
//         multiples of 8. Elsewhere the batched kernel runs (set_kernel(Grouped) forces the
//         grouped one with a group-by-group loop in place of _grouped_mm, for tests).
//   - user: a factory returns one module per global expert (Tensor [T, d] -> Tensor [T, d]);
//     they are registered under their GLOBAL index ("experts.5.fc.weight") and run in a loop
//     over the local experts (no host sync either, but one kernel per expert and layer).
//
// Streamed experts (ExpertsOptions::unit_experts = n > 0, the config's moe.expert_unit_size): the
// weights are split into units of n local experts, each a submodule of its own ("unit4.w1" for
// the unit whose first global expert is 4; the last unit may hold fewer; a user expert keeps its
// own names, its unit is a matter of grouping), so that ZeRO-3 can gather, release and offload
// them one unit at a time. Each forward then reads the routed rows per expert on the host (one
// device-to-host copy per layer), computes unit after unit over contiguous rows, and never
// touches a unit that no route reaches: its weights are not gathered or read from host memory
// or NVMe, its gradient is zero (the reducer still reduces it, the optimizer still steps it).
// Under ZeRO-3 the ranks that gather the units together (the expert-data-parallel group,
// set_agreement_group) agree first on which units any of them needs, one small all-reduce per
// layer, so that every rank runs the same gathers.
//
// Initialisation does not depend on ep_size: global expert g of layer L draws from a generator
// keyed by (seed, L, g) (moe/keys.h), so an ep_size 2 run holds exactly the slices of an
// ep_size 1 run. Built-in: each matrix uniform(+-1/sqrt(fan_in)) as torch::nn::Linear does,
// drawn in the order w1, b1, w2, b2 (the biases drawn without bias too, so that w2 is the same).
// User: the factory runs with LibTorch's default CPU generator seeded by that key (its previous
// state restored after), so a factory that builds ordinary LibTorch modules gets the same property
// without doing anything.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "moe/dispatch.h"

namespace strata::moe {

enum class ExpertKernel { Auto, Batched, Grouped };

// The experts' outputs for the routes in the packed layout (forward_routes).
struct PackedRoutes {
  torch::Tensor rows;      // [R, d]
  torch::Tensor position;  // [R]: each route's row, R for a dropped route
  // Every route kept (kept undefined): the routes' rows as a permutation, whose combine() takes
  // the place of combine_tokens.
  std::shared_ptr<RoutePermutation> permutation;
};

// One module per global expert index; its forward maps [T, d] to [T, d].
using ExpertFactory = std::function<torch::nn::AnyModule(int64_t global_expert)>;

// factory(index) run with LibTorch's default CPU generator seeded by `seed` (its state restored
// after, also when the factory throws); an empty module is refused by name.
torch::nn::AnyModule build_seeded(const ExpertFactory& factory, int64_t index, uint64_t seed);

// The built-in MLP's activation. SwiGLU (Qwen3-MoE's and Mixtral's experts):
// down(silu(gate(x)) * up(x)); w1 [E_local, d, 2 * ffn] holds gate's columns [0, ffn) and up's
// [ffn, 2 * ffn) (b1 likewise), so both kernels run it as the GELU MLP with its first product
// twice as wide.
enum class ExpertActivation { Gelu, SwiGLU };

struct ExpertsOptions {
  int64_t hidden_size = 0;    // d
  int64_t ffn_size = 0;       // built-in MLP only
  ExpertActivation activation = ExpertActivation::Gelu;  // built-in MLP only
  bool bias = true;           // built-in MLP only: b1 and b2
  int64_t first_expert = 0;   // global index of local expert 0
  int64_t local_experts = 1;  // E_local
  uint64_t seed = 0;
  int64_t layer_id = 0;
  ExpertFactory factory;  // empty: the built-in MLP
  int64_t unit_experts = 0;  // experts per streamed unit (see above); 0: not streamed
  // The built-in MLP over tiles of its rows (MoEOptions::tiles): -1 untiled, 0 ceil(rows / d), N.
  int64_t tiles = -1;
};

class ExpertsImpl : public torch::nn::Module {
 public:
  explicit ExpertsImpl(ExpertsOptions options);

  // x: [E_local, T, d] -> [E_local, T, d].
  torch::Tensor forward(const torch::Tensor& x);
  // The same, told which rows are filled: filled [E_local, B] int64 on x's device, B dividing T;
  // block b of expert e (T / B rows) holds tokens in its first filled[e][b] rows, padding after.
  // Padding rows' outputs are unspecified (0 with the grouped kernel) and must not be read.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& filled);

  // Expert parallelism off (all experts here) with the grouped kernel: the gate's routes go
  // straight into the packed layout, without the capacity-padded buffer. x [S, d]; expert,
  // slot, kept [R = k * S] (the gate's routes, in its order r = choice * S + token; a kept
  // route's slot is below its expert's kept_counts); kept_counts [E]. Returns the packed
  // outputs [R, d] and each route's row in them (R for a dropped route), for combine_tokens.
  // kept undefined: every route is kept (dropless), and the result carries the permutation.
  PackedRoutes forward_routes(const torch::Tensor& x, int64_t k,
                              const torch::Tensor& expert, const torch::Tensor& slot,
                              const torch::Tensor& kept, const torch::Tensor& kept_counts);
  // Expert parallelism's packed rows (moe/exchange.h): rows [N, d] hold local expert e's rows at
  // [ends[e-1], ends[e]), ends = cumsum(counts); counts [E_local] int64 on the rows' device and
  // the same on the host (`host_counts`, read once per layer by the exchange, so nothing here
  // waits on the device). Built-in experts run as one grouped product per unit (_grouped_mm where
  // its sync-free kernel applies, the group-by-group loop elsewhere); user experts one after the
  // other on their rows (every expert runs, on zero rows too, so that ZeRO-3 gathers the same on
  // every rank). `active`: the units to run (agree_units's answer; empty: all); a unit left out
  // must have no rows. Returns [N, d]. N must fit the grouped kernel's int32 offsets.
  torch::Tensor forward_rows(const torch::Tensor& rows, const torch::Tensor& counts,
                             const std::vector<int64_t>& host_counts,
                             const std::vector<bool>& active = {});
  // Streaming: the units to run, given the rows per local expert (host), agreed with the
  // set_agreement_group ranks (one small all-reduce); empty when not streamed (all run).
  std::vector<bool> agree_units(const std::vector<int64_t>& rows_per_expert);
  // Whether forward(x, filled) runs the grouped kernel for this input (the caller then computes
  // `filled`; otherwise it may pass an undefined tensor).
  bool grouped(const torch::Tensor& x) const;
  void set_kernel(ExpertKernel kernel) { kernel_ = kernel; }

  bool built_in() const { return !options_.factory; }
  int64_t first_expert() const { return options_.first_expert; }
  int64_t local_experts() const { return options_.local_experts; }

  // Streaming: local experts [first, first + count) form a unit; `name` is its submodule's
  // (built-in) or its label (user experts): "unit" + the global index of its first expert.
  struct Unit {
    std::string name;
    int64_t first = 0, count = 0;
    torch::Tensor w1, b1, w2, b2;  // built-in weights [count, ...] (b1, b2 undefined without bias)
  };
  bool streamed() const { return options_.unit_experts > 0; }
  const std::vector<Unit>& units() const { return units_; }
  // The unit that local expert i belongs to.
  int64_t unit_of(int64_t local_expert) const;
  // ZeRO-3: the ranks that gather this layer's units together; they agree on the units to run.
  void set_agreement_group(comm::GroupPtr group) { agreement_group_ = std::move(group); }
  // Units the last forward left alone (no route reached them on any agreeing rank).
  int64_t last_skipped_units() const { return last_skipped_; }

  // Built-in MLP parameters, not streamed (undefined for user experts, when streamed, and b1 and
  // b2 without bias).
  torch::Tensor w1, b1, w2, b2;

 private:
  bool native_grouped(const torch::Tensor& x) const;  // _grouped_mm's sync-free kernel applies
  bool has_bias() const { return options_.bias && built_in(); }
  // Streaming: which units run, from the routed rows per local expert ([E_local], on the host).
  std::vector<bool> active_units(const torch::Tensor& rows_per_expert);
  // The activation between the two products (h: the first product's output, bias included).
  torch::Tensor activate(const torch::Tensor& h) const;
  // The batched MLP of one unit over its experts' padded rows x [count, T, d] (over tiles of T
  // when options_.tiles >= 0), and the product itself.
  torch::Tensor batched(const torch::Tensor& x, const Unit& unit) const;
  torch::Tensor batched_product(const torch::Tensor& x, const Unit& unit) const;
  std::vector<torch::Tensor> unit_parameters(const Unit& unit) const;
  int64_t tiles_for(int64_t rows) const;  // options_.tiles over `rows` rows of width d
  // The grouped MLP of one unit over its experts' padded rows, told which rows are filled.
  torch::Tensor grouped_padded(const torch::Tensor& x, const torch::Tensor& filled,
                               const Unit& unit);
  // The width of a packed row: d, and with bias 8 more (with_bias_column).
  int64_t packed_width() const;
  // rows [n, d] -> [n, packed_width()]: with bias, a column of ones (the first bias's input) and
  // zero padding; without, the rows as they are.
  torch::Tensor with_bias_column(const torch::Tensor& rows) const;
  // One unit's grouped MLP over packed rows [N, packed_width()], its expert e's rows at
  // [offs[e-1], offs[e]) with offs = cumsum(counts); rows past the last group are left
  // unspecified.
  // Over tiles of the rows when options_.tiles >= 0 (runtime/util/tiled.h).
  torch::Tensor run_packed(const torch::Tensor& packed, const torch::Tensor& counts,
                           const Unit& unit);
  // The product itself, group e at rows [offs[e-1], offs[e]) of packed (offs: int64, ascending).
  torch::Tensor packed_product(const torch::Tensor& packed, const torch::Tensor& offs,
                               const Unit& unit);
  void check_input(const torch::Tensor& x) const;
  // User experts over x [E_local, T, d]; an expert of a unit not in `active` gives zeros.
  torch::Tensor run_user(const torch::Tensor& x, const std::vector<bool>& active = {});

  ExpertsOptions options_;
  ExpertKernel kernel_ = ExpertKernel::Auto;
  std::vector<torch::nn::AnyModule> user_;  // user experts, local order
  std::vector<Unit> units_;  // built-in: one unit of every local expert unless streamed
  comm::GroupPtr agreement_group_;
  int64_t last_skipped_ = 0;
};
TORCH_MODULE(Experts);

}  // namespace strata::moe
