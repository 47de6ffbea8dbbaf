#include "moe/experts.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "moe/dispatch.h"
#include "moe/keys.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/util/tiled.h"

#if STRATA_MOE_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

// at::_grouped_mm (bf16 on sm90/sm100 without a host sync, differentiable) came with LibTorch 2.8;
// 2.9 is the first release taken here.
#define STRATA_MOE_HAS_GROUPED_MM STRATA_TORCH_AT_LEAST(2, 9)

namespace strata::moe {
namespace {

torch::Tensor uniform(at::Generator& gen, at::IntArrayRef shape, double bound) {
  return torch::rand(shape, gen, torch::kFloat) * (2 * bound) - bound;
}

uint64_t expert_key(const ExpertsOptions& o, int64_t global) {
  return key({o.seed, static_cast<uint64_t>(KeyTag::ExpertInit), static_cast<uint64_t>(o.layer_id),
              static_cast<uint64_t>(global)});
}

// The grouped product as a loop over the groups, with the bounds read on the host (a sync on
// CUDA): what _grouped_mm computes, for LibTorch without it and for the CPU. Its backward is the
// same loop (autograd through narrow and cat would build a zero-filled [N, *] gradient per group
// and add them all up: O(groups x N) instead of O(N)). Named scopes, so that profiles count each
// loop as the one product it stands for.
struct GroupedMmLoop : torch::autograd::Function<GroupedMmLoop> {
  // out[i] = a[i] @ b[g] for the rows i of group g, [ends[g-1], ends[g]); rows past the last
  // group are zero.
  static std::vector<int64_t> host_ends(const torch::Tensor& offs) {
    const auto e = offs.to(torch::kCPU, torch::kLong).contiguous();
    return {e.data_ptr<int64_t>(), e.data_ptr<int64_t>() + e.numel()};
  }
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a,
                               const torch::Tensor& b, const torch::Tensor& offs) {
    RECORD_FUNCTION("strata::grouped_mm", std::vector<c10::IValue>({a, b}));
    const auto ends = host_ends(offs);
    auto out = torch::zeros({a.size(0), b.size(2)}, a.options());
    int64_t start = 0;
    for (int64_t g = 0; g < b.size(0); ++g) {
      if (ends[g] > start) {
        auto part = out.narrow(0, start, ends[g] - start);
        at::mm_out(part, a.narrow(0, start, ends[g] - start), b[g]);
      }
      start = ends[g];
    }
    ctx->save_for_backward({a, b, offs});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_FUNCTION("strata::grouped_mm_backward", std::vector<c10::IValue>({grads[0]}));
    const auto saved = ctx->get_saved_variables();
    const auto &a = saved[0], &b = saved[1];
    const auto ends = host_ends(saved[2]);
    const auto g_out = grads[0].contiguous();
    const bool want_a = ctx->needs_input_grad(0), want_b = ctx->needs_input_grad(1);
    auto grad_a = want_a ? torch::zeros_like(a) : torch::Tensor();
    auto grad_b = want_b ? torch::zeros_like(b) : torch::Tensor();
    int64_t start = 0;
    for (int64_t g = 0; g < b.size(0); ++g) {
      const int64_t n = ends[g] - start;
      if (n > 0) {
        const auto gp = g_out.narrow(0, start, n);
        if (want_a) {
          auto ga = grad_a.narrow(0, start, n);
          at::mm_out(ga, gp, b[g].t());
        }
        if (want_b) {
          auto gb = grad_b[g];
          at::mm_out(gb, a.narrow(0, start, n).t(), gp);
        }
      }
      start = ends[g];
    }
    return {grad_a, grad_b, torch::Tensor()};
  }
};

// out[i] = a[i] @ b[g] for the rows i of group g, [offs[g-1], offs[g]); rows from offs[G-1] on
// are left undefined (the caller masks them).
torch::Tensor grouped_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& offs,
                         bool native) {
#if STRATA_MOE_HAS_GROUPED_MM
  if (native) return at::_grouped_mm(a, b, offs);
#endif
  return GroupedMmLoop::apply(a, b, offs);
}

// silu(h[..., :f]) * h[..., f:] over the first product's [gate | up] columns, as one node whose
// backward writes both halves of one gradient with the ops autograd would run (so the same
// values, bit for bit): through narrow, autograd builds a zero-filled gradient of h per half and
// adds the two, three more passes over the largest tensor of the layer. (runtime/nn's SwiGLU
// kernel is a layer above moe/.)
struct PackedSwiGlu : torch::autograd::Function<PackedSwiGlu> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& h) {
    const int64_t f = h.size(-1) / 2;
    ctx->save_for_backward({h});
    return torch::silu(h.narrow(-1, 0, f)) * h.narrow(-1, f, f);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto h = ctx->get_saved_variables()[0];
    const int64_t f = h.size(-1) / 2;
    const auto gate = h.narrow(-1, 0, f), up = h.narrow(-1, f, f);
    const auto& grad = grads[0];
    auto grad_h = torch::empty_like(h, h.options().memory_format(at::MemoryFormat::Contiguous));
    auto grad_gate = grad_h.narrow(-1, 0, f), grad_up = grad_h.narrow(-1, f, f);
    at::silu_backward_out(grad_gate, grad * up, gate);
    at::mul_out(grad_up, grad, torch::silu(gate));
    return {grad_h};
  }
};

// Zero columns after the bias's column of ones: d + kBiasPad keeps bf16 rows 16-byte aligned.
constexpr int64_t kBiasPad = 8;


}  // namespace

torch::nn::AnyModule build_seeded(const ExpertFactory& factory, int64_t index, uint64_t seed) {
  auto gen = at::detail::getDefaultCPUGenerator();
  const auto saved = gen.get_state();
  torch::nn::AnyModule m;
  try {
    gen.set_current_seed(seed);
    m = factory(index);
  } catch (...) {
    gen.set_state(saved);
    throw;
  }
  gen.set_state(saved);
  if (m.is_empty()) {
    throw Error(fmt::format("moe: the expert factory returned an empty module for {}; return "
                            "torch::nn::AnyModule(YourModule(...))",
                            index < 0 ? std::string("the residual MLP (index -1)")
                                      : fmt::format("expert {}", index)));
  }
  return m;
}

ExpertsImpl::ExpertsImpl(ExpertsOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  if (o.hidden_size < 1 || o.local_experts < 1 || o.first_expert < 0) {
    throw Error(fmt::format("moe::Experts: hidden_size = {}, local_experts = {}, first_expert = {}; "
                            "all must be positive (first_expert >= 0)",
                            o.hidden_size, o.local_experts, o.first_expert));
  }
  if (o.unit_experts < 0)
    throw Error(fmt::format("moe::Experts: unit_experts = {}; give the experts per streamed unit "
                            "(>= 1), or 0 for none", o.unit_experts));
  // The units: every local expert in one, or unit_experts at a time (the last may hold fewer).
  const int64_t per = o.unit_experts > 0 ? o.unit_experts : o.local_experts;
  for (int64_t first = 0; first < o.local_experts; first += per)
    units_.push_back({"unit" + std::to_string(o.first_expert + first), first,
                      std::min(per, o.local_experts - first), {}, {}, {}, {}});
  if (o.factory) {
    for (int64_t i = 0; i < o.local_experts; ++i) {
      const int64_t g = o.first_expert + i;
      auto m = build_seeded(o.factory, g, expert_key(o, g));
      register_module(std::to_string(g), m.ptr());
      user_.push_back(std::move(m));
    }
    return;
  }
  if (o.ffn_size < 1) {
    throw Error(fmt::format("moe::Experts: ffn_size = {}; the built-in MLP needs ffn_size >= 1 "
                            "(or pass an expert factory)", o.ffn_size));
  }
  const int64_t El = o.local_experts, d = o.hidden_size, f = o.ffn_size;
  // SwiGLU's first product is gate's and up's side by side.
  const int64_t f1 = o.activation == ExpertActivation::SwiGLU ? 2 * f : f;
  auto W1 = torch::empty({El, d, f1}), B1 = torch::empty({El, f1});
  auto W2 = torch::empty({El, f, d}), B2 = torch::empty({El, d});
  const double bound1 = 1.0 / std::sqrt(double(d)), bound2 = 1.0 / std::sqrt(double(f));
  for (int64_t i = 0; i < El; ++i) {
    auto gen = at::detail::createCPUGenerator(expert_key(o, o.first_expert + i));
    W1[i].copy_(uniform(gen, {d, f1}, bound1));
    B1[i].copy_(uniform(gen, {f1}, bound1));
    W2[i].copy_(uniform(gen, {f, d}, bound2));
    B2[i].copy_(uniform(gen, {d}, bound2));
  }
  if (!streamed()) {
    w1 = register_parameter("w1", W1);
    if (o.bias) b1 = register_parameter("b1", B1);
    w2 = register_parameter("w2", W2);
    if (o.bias) b2 = register_parameter("b2", B2);
    auto& u = units_.front();
    std::tie(u.w1, u.b1, u.w2, u.b2) = std::tie(w1, b1, w2, b2);
    return;
  }
  // Each unit's weights in a submodule of their own, so that each is a storage of its own.
  for (auto& u : units_) {
    auto m = register_module(u.name, std::make_shared<torch::nn::Module>());
    auto rows = [&](const torch::Tensor& t) { return t.narrow(0, u.first, u.count).clone(); };
    u.w1 = m->register_parameter("w1", rows(W1));
    if (o.bias) u.b1 = m->register_parameter("b1", rows(B1));
    u.w2 = m->register_parameter("w2", rows(W2));
    if (o.bias) u.b2 = m->register_parameter("b2", rows(B2));
  }
}

int64_t ExpertsImpl::unit_of(int64_t local_expert) const {
  const int64_t per = streamed() ? options_.unit_experts : options_.local_experts;
  return local_expert / per;
}

std::vector<bool> ExpertsImpl::active_units(const torch::Tensor& rows_per_expert) {
  const auto rows = rows_per_expert.detach().to(torch::kLong).contiguous();
  const auto* r = rows.data_ptr<int64_t>();
  auto used = torch::zeros({int64_t(units_.size())}, torch::kLong);
  auto* u = used.data_ptr<int64_t>();
  for (int64_t e = 0; e < rows.numel(); ++e)
    if (r[e] > 0) u[unit_of(e)] = 1;
  // The ranks that gather the units together run a unit when any of them needs it.
  if (agreement_group_ && agreement_group_->size() > 1)
    agreement_group_->all_reduce(used, comm::ReduceOp::Max);
  std::vector<bool> active(units_.size());
  last_skipped_ = 0;
  for (size_t j = 0; j < units_.size(); ++j) {
    active[j] = u[j] > 0;
    last_skipped_ += active[j] ? 0 : 1;
  }
  return active;
}

torch::Tensor ExpertsImpl::activate(const torch::Tensor& h) const {
  if (options_.activation == ExpertActivation::Gelu) return torch::gelu(h);
  if (h.size(-1) != 2 * options_.ffn_size)
    throw Error(fmt::format("moe::Experts: SwiGLU's first product has {} columns; gate and up "
                            "take 2 x ffn_size = {}", h.size(-1), 2 * options_.ffn_size));
  return PackedSwiGlu::apply(h);
}

std::vector<torch::Tensor> ExpertsImpl::unit_parameters(const Unit& unit) const {
  std::vector<torch::Tensor> params;
  for (const auto& t : {unit.w1, unit.b1, unit.w2, unit.b2})
    if (t.defined()) params.push_back(t);
  return params;
}

int64_t ExpertsImpl::tiles_for(int64_t rows) const {
  checkpointing::TileOptions t;
  t.tiles = options_.tiles;
  return checkpointing::tile_count(t, rows, options_.hidden_size);
}

torch::Tensor ExpertsImpl::batched(const torch::Tensor& x, const Unit& unit) const {
  if (options_.tiles < 0 || x.size(1) == 0) return batched_product(x, unit);
  // Over tiles of the slots (dimension 1): each slot's row is its own product's.
  checkpointing::TileOptions t;
  t.tiles = std::min(tiles_for(x.size(0) * x.size(1)), x.size(1));
  t.dim = 1;
  t.name = unit.name + " (tiled experts)";
  const Unit u = unit;  // the tensors, kept by the Function until its backward
  return checkpointing::tiled_tensors(
             [this, u](const std::vector<torch::Tensor>& tile, int64_t, int64_t) {
               return std::vector<torch::Tensor>{batched_product(tile[0], u)};
             },
             {x}, unit_parameters(unit), t)
      .at(0);
}

torch::Tensor ExpertsImpl::batched_product(const torch::Tensor& x, const Unit& unit) const {
  // Padding rows (zeros) pass through too; they are never combined, so get no gradient.
  if (!has_bias()) return torch::bmm(activate(torch::bmm(x, unit.w1)), unit.w2);
  auto h = activate(torch::baddbmm(unit.b1.unsqueeze(1), x, unit.w1));
  return torch::baddbmm(unit.b2.unsqueeze(1), h, unit.w2);
}

torch::Tensor ExpertsImpl::forward(const torch::Tensor& x) {
  check_input(x);
  if (!built_in()) return run_user(x);
  if (units_.size() == 1) return batched(x, units_.front());
  // Streamed, not told which rows are filled: every unit runs.
  std::vector<torch::Tensor> out;
  for (const auto& u : units_) out.push_back(batched(x.narrow(0, u.first, u.count), u));
  return torch::cat(out);
}

bool ExpertsImpl::grouped(const torch::Tensor& x) const {
  if (!built_in() || kernel_ == ExpertKernel::Batched) return false;
  if (kernel_ == ExpertKernel::Grouped) return true;
  return native_grouped(x);
}

bool ExpertsImpl::native_grouped(const torch::Tensor& x) const {
#if STRATA_MOE_HAS_GROUPED_MM && STRATA_MOE_HAS_CUDA
  // _grouped_mm's fast path: bf16 operands on compute capability 9.0 or 10.0 (else it falls back
  // to a loop that reads the offsets on the host), rows 16-byte aligned (d, ffn multiples of 8).
  const auto& w = units_.front();
  if (!x.is_cuda() || x.scalar_type() != torch::kBFloat16 ||
      w.w1.scalar_type() != torch::kBFloat16 || w.w2.scalar_type() != torch::kBFloat16) {
    return false;
  }
  if (options_.hidden_size % 8 != 0 || options_.ffn_size % 8 != 0) return false;
  const auto* props = at::cuda::getDeviceProperties(x.get_device());
  return (props->major == 9 || props->major == 10) && props->minor == 0;
#else
  (void)x;
  return false;
#endif
}

torch::Tensor ExpertsImpl::forward(const torch::Tensor& x, const torch::Tensor& filled) {
  const int64_t El = options_.local_experts;
  const bool skip = streamed() && filled.defined();
  if (!grouped(x) && !skip) return forward(x);
  check_input(x);
  const int64_t T = x.size(1);
  if (!filled.defined() || filled.dim() != 2 || filled.size(0) != El || filled.size(1) < 1 ||
      T % filled.size(1) != 0) {
    throw Error(fmt::format("moe::Experts: filled must be [{}, blocks] with blocks dividing {}, "
                            "got {}", El, T, filled.defined() ? c10::str(filled.sizes()) : "none"));
  }
  if (!skip) return grouped_padded(x, filled, units_.front());
  // Streamed: unit after unit; a unit no route reaches is not touched (its rows are padding).
  // One device-to-host copy per layer: the price of leaving unrouted units unread.
  const auto active = active_units(filled.sum(1).to(torch::kCPU));
  if (!built_in()) return run_user(x, active);
  std::vector<torch::Tensor> out;
  for (size_t j = 0; j < units_.size(); ++j) {
    const auto& u = units_[j];
    const auto xu = x.narrow(0, u.first, u.count);
    if (!active[j])
      out.push_back(torch::zeros_like(xu));
    else if (grouped(x))
      out.push_back(grouped_padded(xu, filled.narrow(0, u.first, u.count), u));
    else
      out.push_back(batched(xu, u));
  }
  return torch::cat(out);
}

torch::Tensor ExpertsImpl::grouped_padded(const torch::Tensor& x, const torch::Tensor& filled,
                                          const Unit& unit) {
  const int64_t El = x.size(0), d = options_.hidden_size, T = x.size(1), N = El * T;
  const int64_t B = filled.size(1), Cb = T / B;
  const auto i64 = filled.options().dtype(torch::kLong);
  // Pack: expert e's filled rows, block by block, at [offs[e-1], offs[e]); the rest of the N rows
  // is zero and no group's. Padding rows go to a scratch row N, cut off.
  const auto counts = filled.to(torch::kLong).reshape({El * B});
  const auto base = (counts.cumsum(0) - counts).view({El, B, 1});
  const auto s = torch::arange(Cb, i64).view({1, 1, Cb});
  const auto row_filled = s.lt(counts.view({El, B, 1}));
  const auto packed_pos = (base + s).masked_fill(row_filled.logical_not(), N).reshape({N});
  const auto packed = torch::zeros({N + 1, packed_width()}, x.options())
                          .index_copy(0, packed_pos, with_bias_column(x.reshape({N, d})))
                          .narrow(0, 0, N);
  const auto y = run_packed(packed, counts.view({El, B}).sum(1), unit);
  // Unpack to the padded layout: only filled rows are read (padding rows read zeros), and the
  // gradient comes back in place.
  return gather_unique_rows(y, packed_pos).view({El, T, d});
}

PackedRoutes ExpertsImpl::forward_routes(const torch::Tensor& x, int64_t k,
                                         const torch::Tensor& expert, const torch::Tensor& slot,
                                         const torch::Tensor& kept,
                                         const torch::Tensor& kept_counts) {
  const int64_t El = options_.local_experts, d = options_.hidden_size, N = expert.size(0);
  if (x.dim() != 2 || x.size(1) != d || kept_counts.numel() != El)
    throw Error(fmt::format("moe::Experts::forward_routes: x {} and kept_counts {} for {} experts "
                            "of width {}", c10::str(x.sizes()), c10::str(kept_counts.sizes()), El,
                            d));
  // Expert e's kept routes at rows [base[e], base[e] + kept_counts[e]) of N = all routes (the
  // kept ones always fit); a dropped route's row is the scratch row N, cut off.
  const auto counts = kept_counts.to(torch::kLong);
  const auto base = counts.cumsum(0) - counts;
  auto position = base.index_select(0, expert) + slot;
  std::shared_ptr<RoutePermutation> permutation;
  torch::Tensor packed;
  if (!kept.defined()) {
    // Dropless: the rows are a permutation of the routes, gathered from the tokens.
    permutation = std::make_shared<RoutePermutation>(position, k);
    packed = permutation->gather(with_bias_column(x));
  } else {
    position = position.masked_fill(kept.logical_not(), N);
    packed = torch::zeros({N + 1, packed_width()}, x.options())
                 .index_copy(0, position, route_inputs(with_bias_column(x), k))
                 .narrow(0, 0, N);
  }
  if (!streamed()) return {run_packed(packed, counts, units_.front()), position, permutation};
  // Streamed: each unit's experts' rows are contiguous, [ends[first - 1], ends[first + count - 1]),
  // known on the host from the one read the skipping needs anyway.
  const auto host_counts = counts.to(torch::kCPU);  // the one device-to-host copy per layer
  const auto active = active_units(host_counts);
  const auto ends = host_counts.cumsum(0);
  const auto* end = ends.data_ptr<int64_t>();
  std::vector<torch::Tensor> out;
  int64_t row = 0;
  for (size_t j = 0; j < units_.size(); ++j) {
    const auto& u = units_[j];
    const int64_t to = end[u.first + u.count - 1];
    if (active[j])
      out.push_back(run_packed(packed.narrow(0, row, to - row), counts.narrow(0, u.first, u.count), u));
    row = to;
  }
  // Rows past the kept routes belong to no expert and are never read.
  out.push_back(torch::zeros({N - row, d}, x.options()));
  return {torch::cat(out), position, permutation};
}

std::vector<bool> ExpertsImpl::agree_units(const std::vector<int64_t>& rows_per_expert) {
  if (!streamed()) return {};
  return active_units(torch::tensor(rows_per_expert, torch::kLong));
}

namespace {

// No unit ran: this rank received no rows (a unit runs wherever one of its rows arrived). The
// empty result still hangs off the received rows, so backward runs the exchange's backward here
// too: on a rank whose output did not depend on them, the other ranks' return all-to-all would
// find no partner (every rank must make the same collectives).
torch::Tensor no_rows(const torch::Tensor& rows) {
  if (rows.size(0) != 0)
    throw Error(fmt::format("moe::Experts::forward_rows: {} rows arrived but no unit ran", rows.size(0)));
  return rows.mul(0);
}

}  // namespace

torch::Tensor ExpertsImpl::forward_rows(const torch::Tensor& rows, const torch::Tensor& counts,
                                        const std::vector<int64_t>& host_counts,
                                        const std::vector<bool>& active) {
  const int64_t El = options_.local_experts, d = options_.hidden_size;
  int64_t total = 0;
  for (const auto n : host_counts) total += n;
  if (rows.dim() != 2 || rows.size(1) != d || counts.numel() != El ||
      int64_t(host_counts.size()) != El || total != rows.size(0) ||
      (!active.empty() && active.size() != units_.size()))
    throw Error(fmt::format("moe::Experts::forward_rows: rows {} with counts {} ({} on the host, "
                            "{} rows) for {} experts of width {}", c10::str(rows.sizes()),
                            c10::str(counts.sizes()), host_counts.size(), total, El, d));
  // _grouped_mm's offsets are int32 (and the loop's bounds follow them).
  if (total > std::numeric_limits<int32_t>::max())
    throw Error(fmt::format("moe::Experts: {} rows for this rank's experts in one exchange; the "
                            "grouped product's offsets are int32 (at most {}): raise "
                            "moe.exchange_chunks or lower the micro-batch", total,
                            std::numeric_limits<int32_t>::max()));
  auto runs = [&](size_t unit) { return active.empty() || active[unit]; };
  if (!built_in()) {
    std::vector<torch::Tensor> out;
    int64_t row = 0;
    for (int64_t e = 0; e < El; ++e) {
      const auto part = rows.narrow(0, row, host_counts[size_t(e)]);
      row += host_counts[size_t(e)];
      if (runs(size_t(unit_of(e)))) out.push_back(user_[size_t(e)].forward<torch::Tensor>(part));
    }
    return out.empty() ? no_rows(rows) : torch::cat(out);
  }
  const auto packed = with_bias_column(rows);
  if (!streamed()) return run_packed(packed, counts, units_.front());
  std::vector<torch::Tensor> out;
  int64_t row = 0;
  for (size_t j = 0; j < units_.size(); ++j) {
    const auto& u = units_[j];
    int64_t n = 0;
    for (int64_t e = u.first; e < u.first + u.count; ++e) n += host_counts[size_t(e)];
    if (runs(j)) out.push_back(run_packed(packed.narrow(0, row, n), counts.narrow(0, u.first, u.count), u));
    row += n;
  }
  return out.empty() ? no_rows(rows) : torch::cat(out);
}

int64_t ExpertsImpl::packed_width() const {
  return options_.hidden_size + (has_bias() ? kBiasPad : 0);
}

torch::Tensor ExpertsImpl::with_bias_column(const torch::Tensor& rows) const {
  if (!has_bias()) return rows;
  const int64_t n = rows.size(0);
  return torch::cat({rows, torch::ones({n, 1}, rows.options()),
                     torch::zeros({n, kBiasPad - 1}, rows.options())}, 1);
}

torch::Tensor ExpertsImpl::run_packed(const torch::Tensor& packed, const torch::Tensor& counts,
                                      const Unit& unit) {
  const auto offs = counts.to(torch::kLong).cumsum(0);
  const int64_t N = packed.size(0);
  if (options_.tiles < 0 || N == 0) return packed_product(packed, offs, unit);
  // Over tiles of the packed rows: tile [start, start + n) holds the part of each expert's group
  // that falls in it, at offsets (offs - start) clamped to [0, n) (no host read).
  checkpointing::TileOptions t;
  t.tiles = tiles_for(N);
  t.dim = 0;
  t.name = unit.name + " (tiled experts)";
  const Unit u = unit;
  return checkpointing::tiled_tensors(
             [this, u, offs](const std::vector<torch::Tensor>& tile, int64_t start, int64_t n) {
               return std::vector<torch::Tensor>{
                   packed_product(tile[0], (offs - start).clamp(0, n), u)};
             },
             {packed}, unit_parameters(unit), t)
      .at(0);
}

torch::Tensor ExpertsImpl::packed_product(const torch::Tensor& packed, const torch::Tensor& offs,
                                          const Unit& unit) {
  const int64_t El = unit.count, N = packed.size(0);
  const auto &w1 = unit.w1, &b1 = unit.b1, &w2 = unit.w2, &b2 = unit.b2;
  const auto i64 = offs.options().dtype(torch::kLong);
  // The first bias rides in the first product: the packed rows carry a column of ones after the
  // d inputs (with_bias_column; 7 zero columns keep rows 16-byte aligned) and the bias is row d
  // of the weight, so its gradient is the grouped product's own, over each group's rows only.
  // Rows past the last group are left undefined by the grouped product (garbage, possibly NaN):
  // nothing reads them, forward or backward, so they need no mask.
  const bool native = native_grouped(packed);
  const auto offs32 = offs.to(torch::kInt);
  if (!has_bias())
    return grouped_mm(activate(grouped_mm(packed, w1, offs32, native)), w2, offs32, native);
  const auto w1_aug = torch::cat(
      {w1, b1.unsqueeze(1), torch::zeros({El, kBiasPad - 1, w1.size(2)}, w1.options())}, 1);
  // The second bias: a product with each packed row's one-hot expert (no expert past the last
  // group), whose gradient is a product too (an index_select of the biases would reduce N rows
  // into El by atomics in backward, thousands to one address). Only filled rows receive a
  // gradient, so it is clean.
  const auto row_expert = torch::searchsorted(offs, torch::arange(N, i64), /*out_int32=*/false,
                                              /*right=*/true);
  const auto one_hot =
      row_expert.unsqueeze(1).eq(torch::arange(El, i64).unsqueeze(0)).to(packed.scalar_type());
  const auto h = activate(grouped_mm(packed, w1_aug, offs32, native));
  return grouped_mm(h, w2, offs32, native) + one_hot.mm(b2);
}

void ExpertsImpl::check_input(const torch::Tensor& x) const {
  const int64_t El = options_.local_experts;
  if (x.dim() != 3 || x.size(0) != El || x.size(2) != options_.hidden_size) {
    throw Error(fmt::format("moe::Experts: input {} but this rank holds {} experts of width {}; "
                            "expected [{}, tokens, {}]", c10::str(x.sizes()), El,
                            options_.hidden_size, El, options_.hidden_size));
  }
}

torch::Tensor ExpertsImpl::run_user(const torch::Tensor& x, const std::vector<bool>& active) {
  const int64_t El = options_.local_experts;
  std::vector<torch::Tensor> out;
  out.reserve(El);
  for (int64_t i = 0; i < El; ++i)
    out.push_back(active.empty() || active[size_t(unit_of(i))]
                      ? user_[i].forward<torch::Tensor>(x[i])
                      : torch::zeros_like(x[i]));
  return torch::stack(out);
}

}  // namespace strata::moe
