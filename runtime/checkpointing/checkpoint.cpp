// The checkpoint Function (checkpoint.h says the mechanism and its limits).
#include "runtime/checkpointing/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <unordered_set>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>

#include "runtime/util/clock.h"
#include "runtime/util/replay_state.h"
#include "runtime/checkpointing/saved_inputs.h"
#include "runtime/checkpointing/settings.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/util/lost_gradients.h"
#include "runtime/util/recompute.h"

namespace strata::checkpointing {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Clock = std::chrono::steady_clock;

// One checkpointed call, from its forward to its backward.
struct Call {
  CheckpointFn fn;
  CheckpointOptions options;
  size_t n_inputs = 0;
  std::vector<bool> input_requires_grad;
  std::vector<torch::Tensor> params;  // those that require grad
  std::vector<int> cuda_devices;
  std::shared_ptr<SavedInputs> saved;
  ReplayState replay;
  std::vector<uint64_t> tape;
  size_t n_outputs = 0;  // the function's own (side outputs follow)
  std::vector<std::function<void(const torch::Tensor&)>> side_setters;
  Settings settings;
  size_t profile_index = SIZE_MAX;
};

struct CallHolder : torch::CustomClassHolder {
  std::shared_ptr<Call> call;
};

void synchronize_if(const Call& c) {
  if (c.settings.synchronize && !c.cuda_devices.empty()) torch::cuda::synchronize();
}

// linear(h, W, b) as the forward's autocast computes it (F::linear under autocast casts its
// floating-point arguments to the autocast dtype).
torch::Tensor cast_for_linear(const torch::Tensor& t) {
  if (!t.defined() || !t.is_floating_point()) return t;
  const auto device = t.device().type();
  if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) return t;
  if (!compat::autocast_enabled(device)) return t;
  const auto dtype = compat::autocast_dtype(device);
  return t.scalar_type() == dtype || t.scalar_type() == at::kDouble ? t : t.to(dtype);
}

// The tail linear layer (checkpoint_into_linear, checkpoint_residual_into_linear) on the leading
// outputs it takes: computed once, in the forward.
void apply_tail(std::vector<torch::Tensor>& outs, const CheckpointOptions& options) {
  if (!options.tail_weight.defined()) return;
  for (size_t k = 0; k < outs.size() && k < options.tail_outputs; ++k)
    outs[k] = torch::nn::functional::linear(outs[k], options.tail_weight, options.tail_bias);
}

// A tensor of t's shape, dtype and device over one element (zero strides) on t's place in the
// graph: what autograd::grad reads of an output (its edge, its metadata) without t's bytes.
torch::Tensor stand_in(const torch::Tensor& t) {
  auto s = torch::empty_strided(t.sizes(), std::vector<int64_t>(size_t(t.dim()), 0), t.options());
  torch::autograd::impl::set_gradient_edge(s, torch::autograd::impl::gradient_edge(t));
  return s;
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // `args` as a TensorList: LibTorch flattens that one into the Function's inputs (a
  // std::vector would count as a single non-tensor argument).
  static variable_list forward(AutogradContext* ctx, std::shared_ptr<Call> call,
                               at::TensorList args) {
    auto& c = *call;
    ctx->set_materialize_grads(false);
    const std::vector<torch::Tensor> inputs(args.begin(), args.begin() + c.n_inputs);
    c.replay = ReplayState::capture(c.cuda_devices);
    synchronize_if(c);
    const auto start = Clock::now();
    recompute::Region region;
    region.name = c.options.name.c_str();
    std::vector<torch::Tensor> outs;
    {
      recompute::RegionScope scope(region);
      outs = c.fn(inputs);
    }
    apply_tail(outs, c.options);
    synchronize_if(c);
    const double forward_ms = ms_since(start);
    c.tape = std::move(region.tape);
    c.saved = SavedInputs::keep(inputs);
    if (c.settings.profile)
      c.profile_index = profile_forward(c.options.name, forward_ms, c.saved->bytes());
    for (const auto& o : outs)
      if (!o.defined())
        throw Error(fmt::format("activation checkpointing: {} returned an undefined tensor; "
                                "return only defined tensors from a checkpointed function",
                                c.options.name));
    c.n_outputs = outs.size();
    for (auto& side : region.side_outputs) {
      outs.push_back(side.tensor);
      c.side_setters.push_back(std::move(side.set));
    }
    variable_list non_differentiable;
    for (const auto& o : outs)
      if (!o.is_floating_point() && !o.is_complex()) non_differentiable.push_back(o);
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    auto holder = c10::make_intrusive<CallHolder>();
    holder->call = std::move(call);
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(holder));
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = ctx->saved_data.at("call").toCapsule();
    auto call = static_cast<CallHolder*>(holder.get())->call;
    auto& c = *call;
    if (!c.saved)
      throw Error(fmt::format("activation checkpointing: a second backward through {} (its "
                              "inputs were used by the first); call backward once per forward",
                              c.options.name));
    std::vector<torch::Tensor> inputs = c.saved->take();
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined())
        inputs[i] = inputs[i].detach().requires_grad_(c.input_requires_grad[i]);
    synchronize_if(c);
    const auto start = Clock::now();
    recompute::Region region;
    region.mode = recompute::Mode::kReplay;
    region.name = c.options.name.c_str();
    region.tape = c.tape;
    std::vector<torch::Tensor> outs, targets, out_grads;
    std::vector<torch::Tensor> grad_sources;  // what autograd::grad starts from
    {
      auto applied = c.replay.apply();
      torch::AutoGradMode grad_mode(true);
      {
        recompute::RegionScope scope(region);
        outs = c.fn(inputs);
      }
      if (region.cursor != region.tape.size())
        throw Error(fmt::format(
            "activation checkpointing: the recomputation of {} used {} of the {} values its "
            "forward noted: it took another path the second time; make the checkpointed "
            "function depend only on its arguments",
            c.options.name, region.cursor, region.tape.size()));
      if (outs.size() != c.n_outputs || region.side_outputs.size() + c.n_outputs != grads.size())
        throw Error(fmt::format(
            "activation checkpointing: the recomputation of {} gave {} outputs and {} side "
            "outputs, its forward {} and {}; make it depend only on its arguments",
            c.options.name, outs.size(), region.side_outputs.size(), c.n_outputs,
            grads.size() - c.n_outputs));
      for (const auto& side : region.side_outputs) outs.push_back(side.tensor);
      for (size_t i = 0; i < inputs.size(); ++i)
        if (inputs[i].defined() && c.input_requires_grad[i]) targets.push_back(inputs[i]);
      targets.insert(targets.end(), c.params.begin(), c.params.end());
      const auto& w = c.options.tail_weight;
      for (size_t k = 0; k < outs.size(); ++k) {
        if (!grads[k].defined() || !outs[k].requires_grad()) continue;
        if (k < c.n_outputs && k < c.options.tail_outputs && w.defined()) {
          // The linear layer's backward by hand: the recomputed h and the weight in the
          // forward's autocast dtype, products as LibTorch's mm backward forms them.
          const auto h = cast_for_linear(outs[k]);
          const auto wc = cast_for_linear(w);
          const auto g = grads[k].reshape({-1, grads[k].size(-1)});
          const auto h2 = h.reshape({-1, h.size(-1)});
          grad_sources.push_back(h);
          out_grads.push_back(g.mm(wc).view(h.sizes()));
          if (wc.requires_grad()) {
            grad_sources.push_back(wc);
            out_grads.push_back(g.t().mm(h2));
          }
          const auto bc = cast_for_linear(c.options.tail_bias);
          if (bc.defined() && bc.requires_grad()) {
            grad_sources.push_back(bc);
            out_grads.push_back(g.sum(0));
          }
          continue;
        }
        grad_sources.push_back(outs[k]);
        out_grads.push_back(grads[k]);
      }
    }
    recompute::check_leaves(grad_sources, targets, "activation checkpointing", c.options.name,
                            "Pass it as an argument, or list it in the params of "
                            "strata::checkpointing::checkpoint_function (a submodule's own "
                            "parameters are listed already)");
    // The recomputed outputs themselves (a block's output, the input of a tail's product) are
    // no part of the graph's own backward (a node that needs its result saved it): stand-ins
    // keep their places in the graph, and their bytes go before that backward runs.
    for (auto& source : grad_sources)
      if (source.grad_fn()) source = stand_in(source);
    outs.clear();
    std::vector<torch::Tensor> target_grads;
    if (!grad_sources.empty() && !targets.empty())
      target_grads = torch::autograd::grad(grad_sources, targets, out_grads,
                                           /*retain_graph=*/false, /*create_graph=*/false,
                                           /*allow_unused=*/true);
    synchronize_if(c);
    if (c.profile_index != SIZE_MAX)
      profile_recompute(c.profile_index, ms_since(start));
    // The Function's inputs: the call (no gradient), the tensor arguments, the parameters.
    variable_list result(1 + c.n_inputs + c.params.size());
    size_t next = 0;
    for (size_t i = 0; i < c.n_inputs; ++i)
      if (inputs[i].defined() && c.input_requires_grad[i] && next < target_grads.size())
        result[1 + i] = target_grads[next++];
    for (size_t p = 0; p < c.params.size() && next < target_grads.size(); ++p)
      result[1 + c.n_inputs + p] = target_grads[next++];
    c.saved.reset();  // a contiguous buffer's slot, an NVMe file: free for the next forward
    c.fn = nullptr;   // what the function captured (a module keeping this node's output)
    return result;
  }
};

bool needs_graph(const std::vector<torch::Tensor>& inputs,
                 const std::vector<torch::Tensor>& params) {
  if (!torch::GradMode::is_enabled()) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  for (const auto& t : params)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

}  // namespace

std::vector<torch::Tensor> checkpoint_tensors(const CheckpointFn& fn,
                                              const std::vector<torch::Tensor>& inputs,
                                              const std::vector<torch::Tensor>& params,
                                              const CheckpointOptions& options) {
  std::vector<torch::Tensor> all_params = params;
  for (const auto& t : {options.tail_weight, options.tail_bias})
    if (t.defined()) all_params.push_back(t);
  if (!needs_graph(inputs, all_params)) {
    // No graph to save anything for: the function as it is (in an outer checkpoint's forward,
    // its remember() and side outputs go to the outer region).
    auto outs = fn(inputs);
    apply_tail(outs, options);
    return outs;
  }
  auto call = std::make_shared<Call>();
  call->fn = fn;
  call->options = options;
  call->settings = settings();
  call->n_inputs = inputs.size();
  std::unordered_set<const void*> seen;
  for (const auto& p : all_params)
    if (p.defined() && p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second)
      call->params.push_back(p);
  auto note_device = [&](const torch::Tensor& t) {
    auto& d = call->cuda_devices;
    if (t.defined() && t.is_cuda() && std::find(d.begin(), d.end(), t.device().index()) == d.end())
      d.push_back(t.device().index());
  };
  for (const auto& t : inputs) {
    call->input_requires_grad.push_back(t.defined() && t.requires_grad());
    note_device(t);
  }
  for (const auto& p : call->params) note_device(p);
  variable_list args;
  args.reserve(inputs.size() + call->params.size());
  for (const auto& t : inputs) args.push_back(t);
  args.insert(args.end(), call->params.begin(), call->params.end());
  auto outs = CheckpointFunction::apply(call, at::TensorList(args));
  // Side outputs: the layer keeps the Function's output (connected to autograd) in place of the
  // tensor it computed without a graph; inside a recomputation the enclosing region takes it.
  auto setters = std::move(call->side_setters);
  call->side_setters.clear();
  const bool outer_recomputing = recompute::recomputing();
  for (size_t k = 0; k < setters.size(); ++k) {
    const auto& t = outs.at(call->n_outputs + k);
    if (recompute::current_region())
      recompute::side_output(t, setters[k]);
    if (!outer_recomputing && setters[k]) setters[k](t);
  }
  outs.resize(call->n_outputs);
  return outs;
}

CheckpointPolicy CheckpointPolicy::parse(const std::string& text) {
  CheckpointPolicy p;
  if (text.empty() || text == "none") return p;
  if (text == "every") {
    p.kind = Kind::kEvery;
    return p;
  }
  if (text == "selective") {
    p.kind = Kind::kSelective;
    return p;
  }
  const std::string prefix = "every:";
  if (text.rfind(prefix, 0) == 0) {
    try {
      size_t used = 0;
      const long long k = std::stoll(text.substr(prefix.size()), &used);
      if (used == text.size() - prefix.size() && k >= 1) {
        p.kind = Kind::kEvery;
        p.every = k;
        return p;
      }
    } catch (const std::exception&) {
    }
  }
  throw Error(fmt::format("activation checkpointing policy '{}': expected none, every, every:K "
                          "(K >= 1: every K-th block) or selective",
                          text));
}

std::string CheckpointPolicy::str() const {
  switch (kind) {
    case Kind::kNone:
      return "none";
    case Kind::kSelective:
      return "selective";
    case Kind::kEvery:
      return every == 1 ? "every" : fmt::format("every:{}", every);
  }
  return "none";
}

torch::Tensor checkpoint_sequential(torch::nn::Sequential& sequential, torch::Tensor x,
                                    const CheckpointPolicy& policy) {
  int64_t i = 0;
  for (auto& any : *sequential) {
    if (policy.checkpoints_block(i++)) {
      CheckpointOptions options;
      options.name = any.ptr()->name();
      CheckpointFn fn = [any](const std::vector<torch::Tensor>& t) mutable {
        return std::vector<torch::Tensor>{any.forward<torch::Tensor>(t.at(0))};
      };
      x = checkpoint_tensors(fn, {x}, any.ptr()->parameters(), options).at(0);
    } else {
      x = any.forward<torch::Tensor>(x);
    }
  }
  return x;
}

}  // namespace strata::checkpointing
