#include "bench/op_census.h"

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <set>
#include <vector>

#include <ATen/record_function.h>

namespace strata::bench {
namespace {

// Ops that launch nothing and move no bytes when they are leaves (a reshape that copies calls
// clone, and is then no leaf).
const std::set<std::string>& views() {
  static const std::set<std::string> names = {
      "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::narrow",
      "aten::slice", "aten::select", "aten::t", "aten::transpose", "aten::permute",
      "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias",
      "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_",
      "aten::lift_fresh", "aten::_unsafe_view", "aten::view_as", "aten::expand_as",
      "aten::unbind", "aten::split", "aten::chunk", "aten::contiguous", "aten::to",
      "aten::set_", "aten::requires_grad_", "aten::result_type", "aten::is_nonzero",
      "aten::_has_compatible_shallow_copy_type", "aten::unflatten", "aten::flatten",
      "aten::split_with_sizes", "aten::numpy_T", "aten::matrix_H", "aten::conj",
      "aten::resolve_conj", "aten::resolve_neg", "aten::is_same_size", "aten::size",
      "aten::stride", "aten::dim", "aten::broadcast_to", "detach"};
  return names;
}

bool is_product(const std::string& name) {
  static const std::set<std::string> names = {
      "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::_grouped_mm",
      "aten::matmul", "aten::linear", "aten::scaled_dot_product_attention",
      "strata::grouped_mm", "strata::grouped_mm_backward"};
  return names.count(name) > 0 || name.rfind("aten::_scaled_dot_product", 0) == 0 ||
         name.rfind("aten::_flash_attention", 0) == 0 ||
         name.rfind("aten::_efficient_attention", 0) == 0;
}

int64_t bytes_of(const c10::IValue& v) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
  }
  if (v.isTensorList()) {
    int64_t n = 0;
    for (const auto& t : v.toTensorList()) n += bytes_of(c10::IValue(static_cast<at::Tensor>(t)));
    return n;
  }
  if (v.isList()) {
    int64_t n = 0;
    for (const auto& e : v.toListRef()) n += bytes_of(e);
    return n;
  }
  return 0;
}

struct Frame {
  std::string name;
  int64_t input_bytes = 0;
  bool op = false;     // a dispatched op (not an autograd node or a named scope)
  bool moves = false;  // it, or an op it dispatched, is more than a view or an allocation
};

struct Shared {
  std::mutex mutex;
  std::map<std::string, OpCount> memory, products;
};
Shared* g_shared = nullptr;  // the live census (one at a time)
thread_local std::vector<Frame> t_stack;

struct Context : at::ObserverContext {};

// The ops counted are the outermost ones (called by the program, by an autograd node or by a
// custom function): what the program asks for, each about one kernel on a GPU, whatever the
// CPU's implementation dispatches inside it (a sort's copy, a reshape's clone).
bool outermost() {
  for (const auto& f : t_stack)
    if (f.op) return false;
  return true;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  Frame f;
  f.name = fn.name();
  // The autograd engine's own records ("autograd::engine::evaluate_function: ...") hold the
  // backward's ops; they are not ops themselves.
  f.op = fn.scope() == at::RecordScope::FUNCTION && f.name.rfind("autograd::", 0) != 0;
  if (f.op && outermost())
    for (const auto& v : fn.inputs()) f.input_bytes += bytes_of(v);
  t_stack.push_back(std::move(f));
  return std::make_unique<Context>();
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (t_stack.empty()) return;
  Frame f = std::move(t_stack.back());
  t_stack.pop_back();
  if (!f.op) return;
  f.moves = f.moves || !views().count(f.name);
  if (!outermost()) {
    for (auto it = t_stack.rbegin(); f.moves && it != t_stack.rend(); ++it)
      if (it->op) {
        it->moves = true;
        break;
      }
    return;
  }
  if (!f.moves || !g_shared) return;
  int64_t out = 0;
  for (const auto& v : fn.outputs()) out += bytes_of(v);
  std::lock_guard<std::mutex> lock(g_shared->mutex);
  auto& c = is_product(f.name) ? g_shared->products[f.name] : g_shared->memory[f.name];
  c.calls += 1;
  c.bytes += f.input_bytes + out;
}

OpCount total(const std::map<std::string, OpCount>& m) {
  OpCount t;
  for (const auto& [name, c] : m) {
    t.calls += c.calls;
    t.bytes += c.bytes;
  }
  return t;
}

}  // namespace

struct OpCensus::State {
  Shared shared;
  at::CallbackHandle handle = 0;
};

OpCensus::OpCensus() : state_(std::make_unique<State>()) { resume(); }

void OpCensus::resume() {
  if (state_->handle) return;
  g_shared = &state_->shared;
  state_->handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_start, &on_end)
          .needsInputs(true)
          .needsOutputs(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                   at::RecordScope::USER_SCOPE}));
}

OpCensus::~OpCensus() { stop(); }

void OpCensus::stop() {
  if (state_->handle) at::removeCallback(state_->handle);
  state_->handle = 0;
  if (g_shared == &state_->shared) g_shared = nullptr;
}

const std::map<std::string, OpCount>& OpCensus::memory_ops() const { return state_->shared.memory; }
const std::map<std::string, OpCount>& OpCensus::products() const { return state_->shared.products; }
void OpCensus::print(int top, int steps) const {
  const auto m = memory_total(), p = products_total();
  std::printf("op census per step: %.1f memory-moving ops, %.1f MB; %.1f products, %.1f MB\n",
              double(m.calls) / steps, m.bytes / 1e6 / steps, double(p.calls) / steps,
              p.bytes / 1e6 / steps);
  std::vector<std::pair<std::string, OpCount>> rows(memory_ops().begin(), memory_ops().end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.bytes > b.second.bytes; });
  std::printf("memory-moving ops by bytes (MB per step, calls per step):\n");
  for (int i = 0; i < top && i < static_cast<int>(rows.size()); ++i)
    std::printf("  %10.1f %7.1f  %s\n", rows[i].second.bytes / 1e6 / steps,
                double(rows[i].second.calls) / steps, rows[i].first.c_str());
  std::printf("products (MB per step, calls per step):\n");
  for (const auto& [name, c] : products())
    std::printf("  %10.1f %7.1f  %s\n", c.bytes / 1e6 / steps, double(c.calls) / steps,
                name.c_str());
}

OpCount OpCensus::memory_total() const { return total(state_->shared.memory); }
OpCount OpCensus::products_total() const { return total(state_->shared.products); }

}  // namespace strata::bench
