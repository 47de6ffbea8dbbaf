// Activation checkpointing for LibTorch models: strata::checkpointing::checkpoint runs a submodule
// or a function without keeping its intermediate activations, keeps its inputs, and recomputes it
// in backward, as deepspeed.checkpointing.checkpoint and torch.utils.checkpoint do in Python. The
// model calls it; nothing else of Strata needs to be in the model.
//
//   namespace ckpt = strata::checkpointing;
//   x = ckpt::checkpoint(block, x);                            // block->forward(x)
//   x = ckpt::checkpoint_blocks<Block>(blocks, x, policy);     // a ModuleList, by a policy
//   auto [y, aux] = ckpt::checkpoint_function(fn, params, x, 0.5, mask);  // any callable
//
// Mechanism (the reentrant one: LibTorch's C++ autograd has no saved-tensor hooks, so PyTorch's
// non-reentrant checkpoint cannot be built on it). A custom autograd Function whose inputs are the
// tensor arguments AND the parameters of the module (or the `params` given with a function):
//   - forward runs the function under no-grad (no graph, so no activations kept), notes the CPU
//     and CUDA generators' and autocast's state (replay_state.h), and keeps the tensor arguments
//     where the config's activation_checkpointing block says (saved_inputs.h);
//   - backward brings them back, re-runs the function with grad enabled on detached copies, the
//     generators and autocast as they were in the forward (so dropout draws the same numbers,
//     then the generators continue where they were), and back-propagates through the
//     recomputed graph with torch::autograd::grad, with respect to the detached inputs and the
//     parameters. Its results are the Function's gradients, so parameters receive theirs
//     through their own gradient accumulators, once, in the outer backward (ZeRO's gradient
//     hooks fire as without checkpointing), and `.grad` is never written by the inner pass.
// Consequences:
//   - works when no argument requires grad (a first block fed by a frozen embedding): the
//     parameters are inputs, so the output requires grad (DeepSpeed and Megatron add a dummy
//     input that requires grad for this; here the parameters play that part);
//   - works under torch::autograd::grad as under backward (torch.utils.checkpoint's reentrant
//     variant supports only backward);
//   - nests: a checkpoint inside a checkpointed function runs plainly in the outer forward (no
//     grad there) and as a checkpoint of its own during the outer recomputation;
//   - non-tensor arguments are kept by value; results may be a tensor, a std::vector of tensors
//     or a std::tuple (non-tensor elements come from the real forward); integer tensors are
//     outputs without gradient;
//   - layers with effects beyond their output (the MoE layer's noise counter, expert loads, its
//     l_aux read by the loss) replay them through runtime/util/recompute.h.
// Limits (each checked where it can be, with an error that says what to do):
//   - the function must depend only on its arguments, its parameters and the random generators:
//     a tensor that requires grad and is captured by the function without being an argument or
//     a parameter of the module would lose its gradient, so backward throws naming it;
//   - one backward per forward (no retain_graph through a checkpoint), and no double backward
//     (create_graph) through it;
//   - in-place changes to a checkpointed input between forward and backward are not detected
//     when inputs stay as they are (cpu_checkpointing and NVMe copy them, so they see the old
//     values);
//   - the recomputation runs the function's collectives again (the MoE all-to-all): every rank
//     must checkpoint the same functions, as Megatron requires.
// Memory: with every block of a stack checkpointed, what stays between forward and backward is
// each block's input; the backward holds at most one block's activations at a time on top.
//
// Policies (CheckpointPolicy::parse, train_gpt --activation-checkpointing):
//   "every"       every block checkpointed;
//   "every:K"     blocks K-1, 2K-1, ... (every K-th block, as torchtitan's ac_freq);
//   "selective"   no block whole; inside each block the model keeps the outputs of its linear
//                 layers and recomputes what lies between them (norms, activations, the
//                 attention core and its dropout) with checkpoint_into_linear.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "runtime/error.h"

namespace strata::checkpointing {

// The type-erased core: `fn` maps the tensor arguments to the flat outputs.
using CheckpointFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

struct CheckpointOptions {
  std::string name = "checkpointed function";  // in errors and in the profile
  // Selective recomputation (checkpoint_into_linear): the outputs of `fn` go through
  // linear(., tail_weight, tail_bias), whose product is computed once, in forward; backward
  // recomputes `fn` only and runs the linear layer's backward by hand.
  torch::Tensor tail_weight, tail_bias;
  size_t tail_outputs = SIZE_MAX;  // how many of fn's leading outputs go through it
};

// Runs fn(inputs) checkpointed, `params` being the tensors the function reads besides its
// inputs that may require grad (parameters). Outside grad mode, or when nothing requires grad,
// it is fn(inputs).
std::vector<torch::Tensor> checkpoint_tensors(const CheckpointFn& fn,
                                              const std::vector<torch::Tensor>& inputs,
                                              const std::vector<torch::Tensor>& params,
                                              const CheckpointOptions& options = {});

struct CheckpointPolicy {
  enum class Kind { kNone, kEvery, kSelective };
  Kind kind = Kind::kNone;
  int64_t every = 1;  // kEvery: checkpoint blocks every-1, 2*every-1, ...

  // "", "none", "every", "every:K" (K >= 1), "selective"; strata::Error otherwise.
  static CheckpointPolicy parse(const std::string& text);
  std::string str() const;
  bool checkpoints_block(int64_t index) const {
    return kind == Kind::kEvery && (index + 1) % every == 0;
  }
  bool selective() const { return kind == Kind::kSelective; }
};

namespace checkpoint_detail {

template <class T>
struct IsTuple : std::false_type {};
template <class... T>
struct IsTuple<std::tuple<T...>> : std::true_type {};

template <class T>
void collect(const T& value, std::vector<torch::Tensor>& out) {
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    out.push_back(value);
  } else if constexpr (std::is_same_v<T, std::vector<torch::Tensor>>) {
    out.insert(out.end(), value.begin(), value.end());
  } else if constexpr (IsTuple<T>::value) {
    std::apply([&](const auto&... e) { (collect(e, out), ...); }, value);
  }
}

// Puts tensors [next, ...) of `from` back where collect() found them (an undefined tensor in
// `from` clears the place: tensors are not kept past the real forward).
template <class T>
void fill(T& value, const std::vector<torch::Tensor>& from, size_t& next) {
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    value = from.at(next++);
  } else if constexpr (std::is_same_v<T, std::vector<torch::Tensor>>) {
    for (auto& t : value) t = from.at(next++);
  } else if constexpr (IsTuple<T>::value) {
    std::apply([&](auto&... e) { (fill(e, from, next), ...); }, value);
  }
}

template <class T>
void clear(T& value) {
  std::vector<torch::Tensor> none;
  collect(value, none);
  for (auto& t : none) t = torch::Tensor();
  size_t next = 0;
  fill(value, none, next);
}

template <class M>
struct ModuleImpl {
  using type = typename M::ContainedType;  // a ModuleHolder
};
template <class T>
struct ModuleImpl<std::shared_ptr<T>> {
  using type = T;
};
template <class M>
std::shared_ptr<typename ModuleImpl<M>::type> shared_module(const M& m) {
  if constexpr (std::is_same_v<M, std::shared_ptr<typename ModuleImpl<M>::type>>)
    return m;
  else
    return m.ptr();
}

}  // namespace checkpoint_detail

// Any callable, called as fn(args...) with the arguments given here (tensors, std::vectors of
// tensors and tuples are the checkpoint's inputs; anything else is kept by value). `params`: the
// parameters it reads (e.g. module->parameters()). `name`: in errors and the profile.
template <class Fn, class... Args>
auto checkpoint_named(std::string name, Fn fn, const std::vector<torch::Tensor>& params,
                      Args&&... args) {
  using namespace checkpoint_detail;
  using Stored = std::tuple<std::decay_t<Args>...>;
  using Result = std::decay_t<std::invoke_result_t<Fn&, std::decay_t<Args>&...>>;
  struct State {
    Stored args;
    std::optional<Result> first;  // the real forward's result, until rebuilt
    bool done = false;
  };
  auto state = std::make_shared<State>(State{Stored(std::forward<Args>(args)...), {}, false});
  std::vector<torch::Tensor> inputs;
  collect(state->args, inputs);
  clear(state->args);  // the inputs live in the checkpoint (wherever it keeps them), not here
  CheckpointFn core = [fn, state](const std::vector<torch::Tensor>& tensors) mutable {
    Stored call = state->args;
    size_t next = 0;
    fill(call, tensors, next);
    Result r = std::apply(fn, call);
    std::vector<torch::Tensor> flat;
    collect(r, flat);
    if (!state->done) state->first = std::move(r);
    return flat;
  };
  CheckpointOptions options;
  options.name = std::move(name);
  auto outs = checkpoint_tensors(core, inputs, params, options);
  Result result = std::move(*state->first);
  state->first.reset();
  state->done = true;
  size_t next = 0;
  fill(result, outs, next);
  return result;
}

template <class Fn, class... Args>
auto checkpoint_function(Fn fn, const std::vector<torch::Tensor>& params, Args&&... args) {
  return checkpoint_named("function", std::move(fn), params, std::forward<Args>(args)...);
}

// A submodule (a ModuleHolder or a std::shared_ptr to a module): module->forward(args...).
// The checkpoint holds the module weakly until its backward: a module that keeps one of its
// outputs (the MoE layer's l_aux) would otherwise own the checkpoint that owns it, a cycle that
// never frees either.
template <class Module, class... Args>
auto checkpoint(Module module, Args&&... args) {
  auto params = module->parameters();
  auto name = module->name();
  std::weak_ptr<typename checkpoint_detail::ModuleImpl<Module>::type> weak =
      checkpoint_detail::shared_module(module);
  return checkpoint_named(
      name,
      [weak, name](auto&... a) {
        auto m = weak.lock();
        if (!m)
          throw Error("activation checkpointing: the module " + name +
                      " was destroyed between its checkpointed forward and the backward; keep "
                      "the model alive until backward");
        return m->forward(a...);
      },
      params, std::forward<Args>(args)...);
}

// The blocks of a ModuleList (each a `Block` holder's module, forward(Tensor) -> Tensor) in
// turn, those the policy names checkpointed. With kSelective the blocks run as they are (the
// block itself recomputes its parts).
template <class Block>
torch::Tensor checkpoint_blocks(const torch::nn::ModuleList& blocks, torch::Tensor x,
                                const CheckpointPolicy& policy) {
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto typed = std::dynamic_pointer_cast<typename Block::ContainedType>(blocks->ptr(i));
    if (!typed)
      throw std::invalid_argument("strata::checkpointing::checkpoint_blocks: block " +
                                  std::to_string(i) + " is not of the type the call names");
    x = policy.checkpoints_block(int64_t(i)) ? checkpoint(typed, x) : typed->forward(x);
  }
  return x;
}

// A Sequential's modules in turn (each Tensor -> Tensor), those the policy names checkpointed.
torch::Tensor checkpoint_sequential(torch::nn::Sequential& sequential, torch::Tensor x,
                                    const CheckpointPolicy& policy);

// Selective recomputation: linear(fn(x)) keeping only x; fn (a norm, an activation, the
// attention core with its dropout) runs again in backward, the linear layer's product does not
// (its backward is computed by hand from the recomputed fn(x), under the forward's autocast).
// `fn_params`: the parameters fn reads (the norm's), beside the linear layer's. `name`: in errors
// and in the profile.
template <class Fn>
torch::Tensor checkpoint_into_linear(Fn fn, const std::vector<torch::Tensor>& fn_params,
                                     const torch::Tensor& x, torch::nn::Linear& linear,
                                     std::string name = "selective") {
  CheckpointOptions options;
  options.name = std::move(name);
  options.tail_weight = linear->weight;
  options.tail_bias = linear->bias;
  CheckpointFn core = [fn](const std::vector<torch::Tensor>& t) {
    return std::vector<torch::Tensor>{fn(t.at(0))};
  };
  return checkpoint_tensors(core, {x}, fn_params, options).at(0);
}

// A residual block that ends in a linear layer, checkpointed whole: fn(x) returns {g, r} and the
// block's result is r + linear(g). Only x is kept; backward recomputes fn but not the linear
// layer's product, whose output backward never needs (its backward is computed by hand from the
// recomputed g). PyTorch's non-reentrant checkpoint gets the same saving by stopping its
// recomputation once every saved tensor is back; here the block says where its last product is.
// `fn_params`: every parameter fn reads (the linear layer's are added).
template <class Fn>
torch::Tensor checkpoint_residual_into_linear(std::string name, Fn fn,
                                              const std::vector<torch::Tensor>& fn_params,
                                              const torch::Tensor& x, torch::nn::Linear& linear) {
  CheckpointOptions options;
  options.name = std::move(name);
  options.tail_weight = linear->weight;
  options.tail_bias = linear->bias;
  options.tail_outputs = 1;
  CheckpointFn core = [fn](const std::vector<torch::Tensor>& t) {
    auto [g, r] = fn(t.at(0));
    return std::vector<torch::Tensor>{g, r};
  };
  const auto outs = checkpoint_tensors(core, {x}, fn_params, options);
  return outs.at(1) + outs.at(0);
}

}  // namespace strata::checkpointing
