// The tiled Function (tiled.h says the mechanism and its limits).
#include "runtime/util/tiled.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <unordered_set>

#include <fmt/format.h>

#include "runtime/util/replay_state.h"
#include "runtime/error.h"
#include "runtime/util/lost_gradients.h"
#include "runtime/util/recompute.h"

namespace strata::checkpointing {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One tiled call, from its forward to its backward.
struct TiledCall {
  TileFn fn;
  TileOptions options;
  int64_t dim = 0;  // non-negative
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (start, length)
  size_t n_inputs = 0;
  std::vector<bool> input_requires_grad;
  std::vector<torch::Tensor> params;  // those that require grad
  std::vector<int> cuda_devices;
  ReplayState replay;
  std::vector<uint64_t> tape;  // recompute::remember's values over every tile, in order
  bool done = false;
};

struct TiledHolder : torch::CustomClassHolder {
  std::shared_ptr<TiledCall> call;
};

std::vector<torch::Tensor> slices(const std::vector<torch::Tensor>& inputs, int64_t dim,
                                  int64_t start, int64_t length) {
  std::vector<torch::Tensor> out;
  out.reserve(inputs.size());
  for (const auto& t : inputs) out.push_back(t.narrow(dim, start, length));
  return out;
}

// Runs fn on every tile and writes the tiles' outputs into outputs allocated at the first tile.
std::vector<torch::Tensor> run_tiles(TiledCall& c, const std::vector<torch::Tensor>& inputs,
                                     int64_t seq) {
  std::vector<torch::Tensor> outs;
  for (const auto& [start, length] : c.tiles) {
    auto tile = c.fn(slices(inputs, c.dim, start, length), start, length);
    if (outs.empty()) {
      for (const auto& o : tile) {
        if (!o.defined() || o.dim() <= c.dim || o.size(c.dim) != length)
          throw Error(fmt::format(
              "tiled computation: {} returned {} for a tile of {} positions along dimension {}; "
              "a tiled function returns defined tensors with the tile's positions along that "
              "dimension (a position-wise function)",
              c.options.name, o.defined() ? "shape " + c10::str(o.sizes()) : "an undefined tensor",
              length, c.dim));
        auto sizes = o.sizes().vec();
        sizes[size_t(c.dim)] = seq;
        outs.push_back(torch::empty(sizes, o.options()));
      }
    }
    if (tile.size() != outs.size())
      throw Error(fmt::format("tiled computation: {} returned {} outputs for one tile and {} for "
                              "another; return the same outputs for every tile",
                              c.options.name, outs.size(), tile.size()));
    for (size_t k = 0; k < tile.size(); ++k) {
      auto slot = outs[k].narrow(c.dim, start, length);
      if (!tile[k].defined() || tile[k].sizes() != slot.sizes())
        throw Error(fmt::format("tiled computation: {} returned output {} of shape {} for a tile "
                                "whose slot is {}; a tiled function is position-wise along "
                                "dimension {}",
                                c.options.name, k,
                                tile[k].defined() ? c10::str(tile[k].sizes()) : "undefined",
                                c10::str(slot.sizes()), c.dim));
      slot.copy_(tile[k]);
    }
  }
  return outs;
}

void refuse_side_outputs(const recompute::Region& region, const std::string& name) {
  if (!region.side_outputs.empty())
    throw Error(fmt::format(
        "tiled computation: {} hands out a tensor besides its outputs (a layer's side output, "
        "such as the MoE layer's l_aux); tiling it would make one per tile. Tile the "
        "position-wise part only (the MoE layer tiles its experts itself: moe::MoEOptions::tiles)",
        name));
}

class TiledFunction : public torch::autograd::Function<TiledFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, std::shared_ptr<TiledCall> call,
                               at::TensorList args) {
    auto& c = *call;
    ctx->set_materialize_grads(false);
    const std::vector<torch::Tensor> inputs(args.begin(), args.begin() + int64_t(c.n_inputs));
    c.replay = ReplayState::capture(c.cuda_devices);
    recompute::Region region;
    region.name = c.options.name.c_str();
    variable_list outs;
    {
      recompute::RegionScope scope(region);
      outs = run_tiles(c, inputs, inputs.at(0).size(c.dim));
    }
    refuse_side_outputs(region, c.options.name);
    c.tape = std::move(region.tape);
    ctx->save_for_backward(inputs);
    variable_list non_differentiable;
    for (const auto& o : outs)
      if (!o.is_floating_point() && !o.is_complex()) non_differentiable.push_back(o);
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    auto holder = c10::make_intrusive<TiledHolder>();
    holder->call = std::move(call);
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(holder));
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = ctx->saved_data.at("call").toCapsule();
    auto call = static_cast<TiledHolder*>(holder.get())->call;
    auto& c = *call;
    if (c.done)
      throw Error(fmt::format("tiled computation: a second backward through {}; call backward "
                              "once per forward",
                              c.options.name));
    const auto inputs = ctx->get_saved_variables();
    // The inputs' gradients, written tile by tile; the parameters', summed over the tiles (in
    // float32 for 16-bit parameters).
    std::vector<torch::Tensor> input_grads(c.n_inputs), param_grads(c.params.size());
    for (size_t i = 0; i < c.n_inputs; ++i)
      if (c.input_requires_grad[i]) input_grads[i] = torch::zeros_like(inputs[i]);
    recompute::Region region;
    region.mode = recompute::Mode::kReplay;
    region.name = c.options.name.c_str();
    region.tape = c.tape;
    {
      auto applied = c.replay.apply();
      torch::AutoGradMode grad_mode(true);
      recompute::RegionScope scope(region);
      for (const auto& [start, length] : c.tiles) {
        std::vector<torch::Tensor> tile, targets;
        std::vector<size_t> target_input;  // per target: its input, or SIZE_MAX for a parameter
        for (size_t i = 0; i < c.n_inputs; ++i) {
          tile.push_back(inputs[i].narrow(c.dim, start, length).detach().requires_grad_(
              c.input_requires_grad[i]));
          if (c.input_requires_grad[i]) {
            targets.push_back(tile.back());
            target_input.push_back(i);
          }
        }
        for (const auto& p : c.params) {
          targets.push_back(p);
          target_input.push_back(SIZE_MAX);
        }
        auto outs = c.fn(tile, start, length);
        refuse_side_outputs(region, c.options.name);
        if (outs.size() != grads.size())
          throw Error(fmt::format("tiled computation: the recomputation of {} gave {} outputs, "
                                  "its forward {}; make it depend only on its inputs",
                                  c.options.name, outs.size(), grads.size()));
        std::vector<torch::Tensor> sources, source_grads;
        for (size_t k = 0; k < outs.size(); ++k) {
          if (!grads[k].defined() || !outs[k].requires_grad()) continue;
          sources.push_back(outs[k]);
          source_grads.push_back(grads[k].narrow(c.dim, start, length));
        }
        if (sources.empty() || targets.empty()) continue;
        if (start == 0)  // once: every tile runs the same function
          recompute::check_leaves(sources, targets, "tiled computation", c.options.name,
                                  "Pass it in the params of the tiled call (a module's own "
                                  "parameters are passed by strata::checkpointing::tiled)");
        auto got = torch::autograd::grad(sources, targets, source_grads, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
        sources.clear();
        outs.clear();
        size_t p = 0;
        for (size_t j = 0; j < got.size(); ++j) {
          if (target_input[j] != SIZE_MAX) {
            if (got[j].defined())
              input_grads[target_input[j]].narrow(c.dim, start, length).copy_(got[j]);
            continue;
          }
          auto& sum = param_grads[p++];
          if (!got[j].defined()) continue;
          if (!sum.defined()) {
            const auto t = got[j].scalar_type();
            sum = t == at::kHalf || t == at::kBFloat16 ? got[j].to(at::kFloat) : got[j];
          } else {
            sum.add_(got[j]);
          }
        }
      }
      if (region.cursor != region.tape.size())
        throw Error(fmt::format(
            "tiled computation: the recomputation of {} used {} of the {} values its forward "
            "noted: it took another path the second time; make it depend only on its inputs",
            c.options.name, region.cursor, region.tape.size()));
    }
    c.done = true;
    c.fn = nullptr;  // what the function captured
    // The Function's inputs: the call (no gradient), the tiled inputs, the parameters.
    variable_list result(1 + c.n_inputs + c.params.size());
    for (size_t i = 0; i < c.n_inputs; ++i) result[1 + i] = input_grads[i];
    for (size_t p = 0; p < c.params.size(); ++p)
      if (param_grads[p].defined())
        result[1 + c.n_inputs + p] = param_grads[p].to(c.params[p].scalar_type());
    return result;
  }
};

std::atomic<uint64_t> g_calls{0};

}  // namespace

uint64_t tiled_calls() { return g_calls.load(); }

int64_t default_tiles(int64_t seq, int64_t hidden) {
  if (hidden <= 0) return 1;
  return std::max<int64_t>(1, (seq + hidden - 1) / hidden);
}

int64_t tile_count(const TileOptions& options, int64_t seq, int64_t hidden) {
  const int64_t wanted = options.tiles > 0 ? options.tiles : default_tiles(seq, hidden);
  return std::max<int64_t>(1, std::min(wanted, seq));
}

std::vector<torch::Tensor> tiled_tensors(const TileFn& fn, const std::vector<torch::Tensor>& inputs,
                                         const std::vector<torch::Tensor>& params,
                                         const TileOptions& options) {
  if (inputs.empty() || !inputs[0].defined())
    throw Error(fmt::format("tiled computation: {} was given no tensor to tile", options.name));
  if (options.tiles < 0)
    throw Error(fmt::format("tiled computation: {}: tiles = {}; give 0 (derived from the shapes) "
                            "or a positive count",
                            options.name, options.tiles));
  const auto& first = inputs[0];
  const int64_t rank = first.dim();
  const int64_t dim = options.dim < 0 ? options.dim + rank : options.dim;
  if (dim < 0 || dim >= rank)
    throw Error(fmt::format("tiled computation: {}: dimension {} of an input of shape {}",
                            options.name, options.dim, c10::str(first.sizes())));
  const int64_t seq = first.size(dim);
  for (const auto& t : inputs)
    if (!t.defined() || t.dim() != rank || t.size(dim) != seq)
      throw Error(fmt::format("tiled computation: {}: every tiled input has {} positions along "
                              "dimension {} (the first is {}); one is {}",
                              options.name, seq, options.dim, c10::str(first.sizes()),
                              t.defined() ? c10::str(t.sizes()) : "undefined"));
  ++g_calls;
  auto call = std::make_shared<TiledCall>();
  call->fn = fn;
  call->options = options;
  call->dim = dim;
  const int64_t n = seq == 0 ? 0 : tile_count(options, seq, rank > 0 ? first.size(-1) : 1);
  for (int64_t t = 0, start = 0; t < n; ++t) {
    const int64_t length = seq / n + (t < seq % n ? 1 : 0);  // balanced, as torch.tensor_split
    call->tiles.emplace_back(start, length);
    start += length;
  }
  bool graph = false;
  if (torch::GradMode::is_enabled()) {
    for (const auto& t : inputs) graph = graph || t.requires_grad();
    for (const auto& p : params) graph = graph || (p.defined() && p.requires_grad());
  }
  if (!graph || seq == 0) {
    // Nothing to save for backward (no grad, an outer checkpoint's forward): the tiles as they
    // are, one tile's intermediates at a time, remember() and side outputs going to the
    // enclosing region.
    if (seq == 0) return fn(inputs, 0, 0);
    return run_tiles(*call, inputs, seq);
  }
  call->n_inputs = inputs.size();
  std::unordered_set<const void*> seen;
  for (const auto& p : params)
    if (p.defined() && p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second)
      call->params.push_back(p);
  auto note_device = [&](const torch::Tensor& t) {
    auto& d = call->cuda_devices;
    if (t.is_cuda() && std::find(d.begin(), d.end(), t.device().index()) == d.end())
      d.push_back(t.device().index());
  };
  for (const auto& t : inputs) {
    call->input_requires_grad.push_back(t.requires_grad());
    note_device(t);
  }
  for (const auto& p : call->params) note_device(p);
  variable_list args(inputs.begin(), inputs.end());
  args.insert(args.end(), call->params.begin(), call->params.end());
  return TiledFunction::apply(call, at::TensorList(args));
}

}  // namespace strata::checkpointing
