// Tiled computation, beside activation checkpointing: a position-wise function (an MLP, norm +
// MLP, an MoE layer's experts) run over tiles of the sequence, each tile's intermediates freed
// as soon as its output is written, and recomputed tile by tile in backward. DeepSpeed's ALST
// `TiledMLP` / `sequence_tiled_compute` for LibTorch models:
//
//   namespace ckpt = strata::checkpointing;
//   y = ckpt::tiled(mlp, x);                                   // mlp->forward(x), over tiles
//   y = ckpt::tiled_function([&](const torch::Tensor& t) { return mlp(norm(t)); }, params, x);
//   auto ys = ckpt::tiled_tensors(fn, {x, w}, params, options);  // several tiled inputs/outputs
//
// Memory: a block's feed-forward keeps [tokens, ffn] intermediates (GELU's input and output,
// SwiGLU's gate and up) for backward, 2-3x its input per ffn/d; tiled, nothing of them stays
// between forward and backward, and forward and backward each hold one tile's at a time (the
// input and output stay whole: they are the residual stream's). With T tiles over S tokens the
// transient peak drops from S to ceil(S / T) tokens' intermediates.
//
// Mechanism: a custom autograd Function whose inputs are the tiled tensors and the parameters
// (as checkpoint.h's): forward runs fn on each tile under no-grad and writes the tile's outputs
// into outputs allocated once; backward re-runs fn on each tile with grad enabled (on detached
// slices of the inputs), back-propagates the tile's slice of the output gradient with
// torch::autograd::grad, writes the inputs' gradient slices and sums the parameters' gradients
// over the tiles (in float32 for 16-bit parameters: one rounding, as the untiled product's).
// The parameters receive their gradients as the Function's, once, in the outer backward: ZeRO's
// gradient hooks fire once per tiled call, and at stage 3 every tile's ops touch the same unit,
// so its weights are gathered once per tiled call (forward) and once per recomputation, not once
// per tile.
// Consequences and limits:
//   - the function must be position-wise along `dim`: output positions [a, b) depend on input
//     positions [a, b) only (the tiled result is then the untiled one; attention is not);
//   - random generators and autocast are replayed as in checkpoint.h: the recomputation draws
//     what the forward drew, tile by tile (a tiled dropout draws other numbers than an untiled
//     one, since it draws per tile, but forward and backward agree);
//   - inside a checkpointed block the outer forward runs under no-grad: the tiles run plainly
//     (still one tile's intermediates at a time), and the outer recomputation runs the tiled
//     Function;
//   - values noted with recompute::remember are replayed in the recomputation; side outputs (the
//     MoE layer's l_aux) are refused by name: the MoE layer tiles its experts itself
//     (moe::MoEOptions::tiles);
//   - a tensor that requires grad and is read without being an input or in `params` is refused
//     by name in backward (its gradient would be lost), as a checkpoint's;
//   - one backward per forward, no double backward.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace strata::checkpointing {

struct TileOptions {
  // Tiles along `dim`: 0 derives them from the shapes, ceil(seq / hidden) as ALST does (hidden:
  // the first input's last dimension), at least 1; more tiles than positions are fewer tiles.
  int64_t tiles = 0;
  int64_t dim = -2;  // the sequence dimension of every tiled input and output ([..., seq, d])
  std::string name = "tiled function";  // in errors
};

// fn(tile_inputs, start, length): the outputs for positions [start, start + length) of every
// tiled input (`tile_inputs` are their slices along `dim`); every output has `length` positions
// along `dim`. `params`: the tensors fn reads besides its inputs that may require grad.
using TileFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& tile,
                                                        int64_t start, int64_t length)>;

std::vector<torch::Tensor> tiled_tensors(const TileFn& fn, const std::vector<torch::Tensor>& inputs,
                                         const std::vector<torch::Tensor>& params,
                                         const TileOptions& options = {});

// Tiled calls made in this process so far (the engine checks that a config's mlp_tiles reached
// the model: settings.h).
uint64_t tiled_calls();

// The tiles derived from the shapes (TileOptions::tiles 0): ceil(seq / hidden), at least 1.
int64_t default_tiles(int64_t seq, int64_t hidden);
// The number of tiles a call with these options runs over `seq` positions of width `hidden`.
int64_t tile_count(const TileOptions& options, int64_t seq, int64_t hidden);

// A position-wise callable of one tensor, over tiles of x.
template <class Fn>
torch::Tensor tiled_function(Fn fn, const std::vector<torch::Tensor>& params,
                             const torch::Tensor& x, const TileOptions& options = {}) {
  TileFn core = [fn](const std::vector<torch::Tensor>& tile, int64_t, int64_t) mutable {
    return std::vector<torch::Tensor>{fn(tile.at(0))};
  };
  return tiled_tensors(core, {x}, params, options).at(0);
}

// A position-wise module (a ModuleHolder such as MLP, or a shared_ptr to one) over tiles of x:
// module->forward(x), its parameters the Function's.
template <class M>
torch::Tensor tiled(M& module, const torch::Tensor& x, TileOptions options = {}) {
  if (options.name == TileOptions{}.name) options.name = module->name();
  auto m = module;
  return tiled_function([m](const torch::Tensor& t) mutable { return m->forward(t); },
                        module->parameters(), x, options);
}

}  // namespace strata::checkpointing
