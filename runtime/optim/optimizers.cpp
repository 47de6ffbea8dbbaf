// strata::optim::Adam and strata::optim::SGD: the per-parameter reference implementations.
// Both follow the operation order of LibTorch's own Adam / AdamW / SGD so that, given the same
// inputs, they agree with them to the last bit; FusedAdam's formulas are the same algebra.
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>

#include "runtime/error.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/fused_adam.h"
#include "runtime/optim/sgd.h"
#include "runtime/optim/state_bytes.h"
#include "runtime/optim/state_io.h"
#include "runtime/optim/state_key.h"

namespace strata::optim {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

double read_double(InputArchive& archive, const char* key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toDouble();
}

bool read_bool(InputArchive& archive, const char* key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toBool();
}

torch::Tensor read_tensor(InputArchive& archive, const char* key) {
  c10::IValue value;
  return archive.try_read(key, value) ? value.toTensor() : torch::Tensor();
}

void write_tensor(OutputArchive& archive, const char* key, const torch::Tensor& t) {
  if (t.defined()) archive.write(key, c10::IValue(t));
}

// LibTorch's serialize() restores only the per-parameter state; restore each group's options
// too (lr, betas, ...), as PyTorch's load_state_dict does, so a resumed run continues exactly.
template <class State, class Options>
void load_optimizer(InputArchive& archive, torch::optim::Optimizer& optimizer) {
  torch::optim::serialize<State, Options>(archive, optimizer);
  InputArchive groups;
  archive.read("param_groups", groups);
  auto& param_groups = optimizer.param_groups();
  for (size_t i = 0; i < param_groups.size(); ++i) {
    InputArchive group;
    InputArchive options;
    groups.read("param_groups/" + std::to_string(i), group);
    group.read("options", options);
    static_cast<Options&>(param_groups[i].options()).serialize(options);
  }
}

// Every group must carry this optimizer's own options type: step() static_casts to it.
template <class Options>
const Options& group_options(const torch::optim::OptimizerParamGroup& group, size_t index,
                             const char* optimizer) {
  const auto* options = dynamic_cast<const Options*>(&group.options());
  if (options == nullptr)
    throw Error(
        fmt::format("{}: param group {} carries options of another optimizer; give it "
                    "{}Options or none (it then copies the defaults)",
                    optimizer, index, optimizer));
  return *options;
}

// LibTorch 2.x's add_param_group() merges a group's options into the defaults only for its own
// option types and gives any other type the plain defaults, dropping per-group settings such as
// "no weight decay for biases". Put back what the caller gave (1.13 kept it as given).
void keep_group_options(const std::vector<torch::optim::OptimizerParamGroup>& given,
                        std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t i = 0; i < given.size() && i < groups.size(); ++i)
    if (given[i].has_options()) groups[i].set_options(given[i].options().clone());
}

void check(bool ok, const char* optimizer, size_t group, const std::string& what) {
  if (!ok) throw Error(fmt::format("{}: param group {}: {}", optimizer, group, what));
}

}  // namespace

// ---- Adam -------------------------------------------------------------------------------------

AdamOptions::AdamOptions(double lr) : lr_(lr) {}

void AdamOptions::serialize(OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("beta1", c10::IValue(std::get<0>(betas())));
  archive.write("beta2", c10::IValue(std::get<1>(betas())));
  archive.write("eps", c10::IValue(eps()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("adam_w_mode", c10::IValue(adam_w_mode()));
  archive.write("bias_correction", c10::IValue(bias_correction()));
}

void AdamOptions::serialize(InputArchive& archive) {
  lr(read_double(archive, "lr"));
  betas(std::make_tuple(read_double(archive, "beta1"), read_double(archive, "beta2")));
  eps(read_double(archive, "eps"));
  weight_decay(read_double(archive, "weight_decay"));
  adam_w_mode(read_bool(archive, "adam_w_mode"));
  bias_correction(read_bool(archive, "bias_correction"));
}

double AdamOptions::get_lr() const { return lr(); }
void AdamOptions::set_lr(const double value) { lr(value); }

void AdamParamState::serialize(OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  write_tensor(archive, "exp_avg", exp_avg());
  write_tensor(archive, "exp_avg_sq", exp_avg_sq());
}

void AdamParamState::serialize(InputArchive& archive) {
  c10::IValue value;
  archive.read("step", value);
  step(value.toInt());
  exp_avg(read_tensor(archive, "exp_avg"));
  exp_avg_sq(read_tensor(archive, "exp_avg_sq"));
}

Adam::Adam(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamOptions defaults)
    : Optimizer(param_groups, std::make_unique<AdamOptions>(defaults)) {
  keep_group_options(param_groups, param_groups_);
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto& o = group_options<AdamOptions>(param_groups_[i], i, "Adam");
    const auto [beta1, beta2] = o.betas();
    check(o.lr() >= 0, "Adam", i, fmt::format("lr must be >= 0, got {}", o.lr()));
    check(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "Adam", i,
          fmt::format("betas must lie in [0, 1), got ({}, {})", beta1, beta2));
    check(o.eps() >= 0, "Adam", i, fmt::format("eps must be >= 0, got {}", o.eps()));
    check(o.weight_decay() >= 0, "Adam", i,
          fmt::format("weight_decay must be >= 0, got {}", o.weight_decay()));
  }
}

Adam::Adam(std::vector<torch::Tensor> params, AdamOptions defaults)
    : Adam(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
               std::move(params))},
           std::move(defaults)) {}

AdamParamState& Adam::count_of(const torch::Tensor& p) {
  const auto key = detail::state_key<decltype(state_)>(p);
  if (state_.find(key) == state_.end()) state_[key] = std::make_unique<AdamParamState>();
  return static_cast<AdamParamState&>(*state_[key]);
}

AdamParamState& Adam::state_of(const torch::Tensor& p) {
  auto& state = count_of(p);
  if (!state.exp_avg().defined()) {  // new, or kept as a count only (next_flat_scalars)
    state.exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    state.exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  }
  return state;
}

bool Adam::can_step_flat() const {
  if (param_groups_.size() != 1 || param_groups_[0].params().size() != 1) return false;
  const auto& p = param_groups_[0].params()[0];
  return p.scalar_type() == torch::kFloat && p.is_contiguous();
}

const torch::Tensor& Adam::flat_param() const {
  if (!can_step_flat())
    throw Error("strata::optim::Adam: a flat step needs one param group holding one contiguous "
                "fp32 tensor");
  return param_groups_[0].params()[0];
}

AdamScalars Adam::scalars_for(int64_t step, double grad_scale) const {
  const auto& o = group_options<AdamOptions>(param_groups_[0], 0, "Adam");
  const auto [beta1, beta2] = o.betas();
  AdamScalars s;
  s.grad_scale = static_cast<float>(grad_scale);
  s.lr = static_cast<float>(o.lr());
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1 - beta1);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.eps = static_cast<float>(o.eps());
  s.weight_decay = static_cast<float>(o.weight_decay());
  s.adam_w_mode = o.adam_w_mode();
  s.decay_factor = static_cast<float>(1 - o.lr() * o.weight_decay());
  double correction1 = 1.0, correction2 = 1.0;
  if (o.bias_correction()) {
    correction1 = 1 - std::pow(beta1, static_cast<double>(step));
    correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  }
  s.step_size = static_cast<float>(o.lr() / correction1);
  s.sqrt_c2 = static_cast<float>(std::sqrt(correction2));
  return s;
}

AdamScalars Adam::next_flat_scalars(double grad_scale) {
  auto& state = count_of(flat_param());
  state.step(state.step() + 1);
  return scalars_for(state.step(), grad_scale);
}

int64_t Adam::flat_steps() const {
  const auto it = state_.find(detail::state_key<decltype(state_)>(flat_param()));
  return it == state_.end() ? 0 : static_cast<const AdamParamState&>(*it->second).step();
}

void Adam::set_flat_steps(int64_t steps) { count_of(flat_param()).step(steps); }

Adam::FlatStepParts Adam::begin_flat_step(double grad_scale, bool advance) {
  auto& state = state_of(flat_param());  // flat_param() checks the shape of the groups
  if (advance) state.step(state.step() + 1);
  return {scalars_for(state.step() + (advance ? 0 : 1), grad_scale), state.exp_avg(),
          state.exp_avg_sq()};
}

void Adam::step_flat(const torch::Tensor& grad, double grad_scale, const torch::Tensor& copy_out,
                     int64_t tile_numel, const TileDone& after_tile) {
  torch::NoGradGuard no_grad;
  auto& p = param_groups_[0].params()[0];
  const auto parts = begin_flat_step(grad_scale);
  auto& state = state_of(p);
  const AdamScalars& s = parts.scalars;
  const int64_t n = p.numel();
  if (tile_numel <= 0 || tile_numel >= n) {
    fused_adam_step(p, state.exp_avg(), state.exp_avg_sq(), grad, copy_out, s);
    if (after_tile) after_tile(0, n);
    return;
  }
  for (int64_t lo = 0; lo < n; lo += tile_numel) {
    const int64_t len = std::min(tile_numel, n - lo);
    auto tile = [&](const torch::Tensor& t) { return t.defined() ? t.narrow(0, lo, len) : t; };
    fused_adam_step(tile(p), tile(state.exp_avg()), tile(state.exp_avg_sq()), tile(grad),
                    tile(copy_out), s);
    if (after_tile) after_tile(lo, len);
  }
}

torch::Tensor Adam::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = group_options<AdamOptions>(group, &group - param_groups_.data(), "Adam");
    const auto [beta1, beta2] = o.betas();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::Tensor grad = p.grad();
      if (grad.is_sparse())
        throw Error("strata::optim::Adam does not support sparse gradients; use dense ones");

      auto& state = state_of(p);
      state.step(state.step() + 1);

      if (o.weight_decay() != 0) {
        if (o.adam_w_mode()) {
          p.mul_(1 - o.lr() * o.weight_decay());  // decoupled, on the pre-update p
        } else {
          grad = grad.add(p, o.weight_decay());  // L2: into the moments
        }
      }
      state.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
      state.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);

      double correction1 = 1.0;
      double correction2 = 1.0;
      if (o.bias_correction()) {
        correction1 = 1 - std::pow(beta1, static_cast<double>(state.step()));
        correction2 = 1 - std::pow(beta2, static_cast<double>(state.step()));
      }
      auto denom = (state.exp_avg_sq().sqrt() / std::sqrt(correction2)).add_(o.eps());
      p.addcdiv_(state.exp_avg(), denom, -o.lr() / correction1);
    }
  }
  return loss;
}

void Adam::save(OutputArchive& archive) const {
  torch::optim::serialize<AdamParamState, AdamOptions>(archive, *this);
}

void Adam::load(InputArchive& archive) {
  load_optimizer<AdamParamState, AdamOptions>(archive, *this);
}

// ---- SGD --------------------------------------------------------------------------------------

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

void SGDOptions::serialize(OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("momentum", c10::IValue(momentum()));
  archive.write("dampening", c10::IValue(dampening()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("nesterov", c10::IValue(nesterov()));
}

void SGDOptions::serialize(InputArchive& archive) {
  lr(read_double(archive, "lr"));
  momentum(read_double(archive, "momentum"));
  dampening(read_double(archive, "dampening"));
  weight_decay(read_double(archive, "weight_decay"));
  nesterov(read_bool(archive, "nesterov"));
}

double SGDOptions::get_lr() const { return lr(); }
void SGDOptions::set_lr(const double value) { lr(value); }

void SGDParamState::serialize(OutputArchive& archive) const {
  write_tensor(archive, "momentum_buffer", momentum_buffer());
}

void SGDParamState::serialize(InputArchive& archive) {
  momentum_buffer(read_tensor(archive, "momentum_buffer"));
}

SGD::SGD(std::vector<torch::optim::OptimizerParamGroup> param_groups, SGDOptions defaults)
    : Optimizer(param_groups, std::make_unique<SGDOptions>(defaults)) {
  keep_group_options(param_groups, param_groups_);
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto& o = group_options<SGDOptions>(param_groups_[i], i, "SGD");
    check(o.lr() >= 0, "SGD", i, fmt::format("lr must be >= 0, got {}", o.lr()));
    check(o.momentum() >= 0, "SGD", i, fmt::format("momentum must be >= 0, got {}", o.momentum()));
    check(o.weight_decay() >= 0, "SGD", i,
          fmt::format("weight_decay must be >= 0, got {}", o.weight_decay()));
    check(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0), "SGD", i,
          "nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)");
  }
}

SGD::SGD(std::vector<torch::Tensor> params, SGDOptions defaults)
    : SGD(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
              std::move(params))},
          std::move(defaults)) {}

torch::Tensor SGD::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = group_options<SGDOptions>(group, &group - param_groups_.data(), "SGD");
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::Tensor d_p = p.grad();
      if (o.weight_decay() != 0) d_p = d_p.add(p, o.weight_decay());
      if (o.momentum() != 0) {
        const auto key = detail::state_key<decltype(state_)>(p);
        torch::Tensor buf;
        auto found = state_.find(key);
        if (found == state_.end()) {
          buf = torch::clone(d_p).detach();  // first step: the buffer is the gradient itself
          auto fresh = std::make_unique<SGDParamState>();
          fresh->momentum_buffer(buf);
          state_[key] = std::move(fresh);
        } else {
          buf = static_cast<SGDParamState&>(*found->second).momentum_buffer();
          buf.mul_(o.momentum()).add_(d_p, 1 - o.dampening());
        }
        d_p = o.nesterov() ? d_p.add(buf, o.momentum()) : buf;
      }
      p.add_(d_p, -o.lr());
    }
  }
  return loss;
}

void SGD::save(OutputArchive& archive) const {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

void SGD::load(InputArchive& archive) { load_optimizer<SGDParamState, SGDOptions>(archive, *this); }

}  // namespace strata::optim


namespace strata::optim {

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer, bool host_only) {
  auto nbytes = [&](const torch::Tensor& t) -> int64_t {
    return t.defined() && (!host_only || t.is_cpu()) ? t.numel() * t.element_size() : 0;
  };
  int64_t bytes = 0;
  for (const auto& entry : optimizer.state()) {
    const auto* state = entry.second.get();
    if (const auto* s = dynamic_cast<const AdamParamState*>(state)) {
      bytes += nbytes(s->exp_avg()) + nbytes(s->exp_avg_sq());
    } else if (const auto* s = dynamic_cast<const SGDParamState*>(state)) {
      bytes += nbytes(s->momentum_buffer());
    } else if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
      bytes += nbytes(s->exp_avg()) + nbytes(s->exp_avg_sq()) + nbytes(s->max_exp_avg_sq());
    } else if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
      bytes += nbytes(s->exp_avg()) + nbytes(s->exp_avg_sq()) + nbytes(s->max_exp_avg_sq());
    } else if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
      bytes += nbytes(s->momentum_buffer());
    }
  }
  return bytes;
}

}  // namespace strata::optim


namespace strata::optim {

std::optional<ParamState> export_param_state(const torch::optim::Optimizer& optimizer,
                                             const torch::Tensor& param) {
  const auto& states = optimizer.state();
  const auto it = states.find(detail::state_key<std::decay_t<decltype(states)>>(param));
  ParamState out;
  if (it == states.end()) {
    out.type = "none";
    return out;
  }
  const auto* state = it->second.get();
  if (const auto* s = dynamic_cast<const AdamParamState*>(state)) {
    out.type = "adam";
    out.tensors = {{"exp_avg", s->exp_avg()}, {"exp_avg_sq", s->exp_avg_sq()}};
    out.scalars["step"] = s->step();
    return out;
  }
  if (const auto* s = dynamic_cast<const SGDParamState*>(state)) {
    out.type = "sgd";
    out.tensors = {{"momentum_buffer", s->momentum_buffer()}};
    return out;
  }
  return std::nullopt;
}

void check_param_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                       const ParamState& state) {
  std::vector<std::string> needs;
  if (state.type == "none") {
  } else if (state.type == "adam" && dynamic_cast<const Adam*>(&optimizer)) {
    needs = {"exp_avg", "exp_avg_sq"};
    if (!state.scalars.contains("step") || !state.scalars.at("step").is_number_integer())
      throw Error("optimizer state 'adam' lacks its integer 'step'");
  } else if (state.type == "sgd" && dynamic_cast<const SGD*>(&optimizer)) {
    needs = {"momentum_buffer"};
  } else {
    throw Error(fmt::format("a checkpoint's '{}' optimizer state does not fit this optimizer; "
                            "resume with the optimizer type the checkpoint was saved with",
                            state.type));
  }
  for (const auto& name : needs) {
    const auto it = std::find_if(state.tensors.begin(), state.tensors.end(),
                                 [&](const auto& t) { return t.first == name; });
    if (it == state.tensors.end())
      throw Error(fmt::format("optimizer state '{}' lacks tensor '{}'", state.type, name));
    if (it->second.sizes() != param.sizes())
      throw Error(fmt::format("optimizer state '{}': tensor '{}' has shape {}, the parameter {}",
                              state.type, name, c10::str(it->second.sizes()),
                              c10::str(param.sizes())));
  }
}

void import_param_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                        const ParamState& state, bool copy) {
  check_param_state(optimizer, param, state);
  auto& states = optimizer.state();
  const auto key = detail::state_key<std::decay_t<decltype(states)>>(param);
  auto tensor = [&](const std::string& name) {
    for (const auto& [n, t] : state.tensors)
      if (n == name) {
        if (!copy && (t.scalar_type() != param.scalar_type() || t.device() != param.device()))
          throw Error(fmt::format("optimizer state '{}': tensor '{}' kept as given must have the "
                                  "parameter's dtype and device", state.type, name));
        return copy ? t.to(param.options(), /*non_blocking=*/false, /*copy=*/true) : t;
      }
    throw Error(fmt::format("optimizer state '{}' lacks tensor '{}'", state.type, name));
  };
  if (state.type == "none") {
    states.erase(key);
  } else if (state.type == "adam") {
    auto s = std::make_unique<AdamParamState>();
    s->step(state.scalars.at("step").get<int64_t>());
    s->exp_avg(tensor("exp_avg"));
    s->exp_avg_sq(tensor("exp_avg_sq"));
    states[key] = std::move(s);
  } else {
    auto s = std::make_unique<SGDParamState>();
    s->momentum_buffer(tensor("momentum_buffer"));
    states[key] = std::move(s);
  }
}

std::string save_optimizer_archive(torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load_optimizer_archive(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  optimizer.load(archive);
}

}  // namespace strata::optim
