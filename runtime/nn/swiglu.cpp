#include "runtime/nn/swiglu.h"

#include <ATen/record_function.h>

#include <stdexcept>

#if STRATA_HAS_CUDA
#include "runtime/nn/cuda_bridge.h"
#endif

namespace strata::nn {
// Named, not anonymous: a unity build puts the three layers' files in one translation unit.
namespace swiglu_detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace F = torch::nn::functional;

// mul's gradients, then silu's: as autograd computes those of F::silu(gate) * up.
std::pair<torch::Tensor, torch::Tensor> composite_backward(const torch::Tensor& gy,
                                                           const torch::Tensor& gate,
                                                           const torch::Tensor& up) {
  return {at::silu_backward(gy * up, gate), gy * F::silu(gate)};
}

#if STRATA_HAS_CUDA
bool kernel_fits(const torch::Tensor& t) {
  return t.is_cuda() && t.dim() >= 1 && detail::kernel_type(t.scalar_type()).has_value();
}

// The launch over x's rows: gate at `gate`, up at `up`, each row `stride` elements apart.
cuda::SwiGlu launch_of(const torch::Tensor& x, const void* gate, const void* up, int64_t cols,
                       int64_t stride) {
  cuda::SwiGlu a;
  a.gate = gate;
  a.up = up;
  a.type = *detail::kernel_type(x.scalar_type());
  a.cols = cols;
  a.rows = cols == 0 ? 0 : x.numel() / x.size(-1);
  a.in_stride = stride;
  a.grad_stride = stride;
  a.stream = detail::current_stream(x);
  a.multiprocessors = detail::multiprocessors();
  return a;
}

torch::Tensor kernel_forward(const cuda::SwiGlu& launch, const torch::Tensor& like,
                             at::IntArrayRef sizes) {
  auto out = torch::empty(sizes, like.options());
  auto a = launch;
  a.out = out.data_ptr();
  detail::check_launch(cuda::launch_swiglu_forward(a), "SwiGLU");
  return out;
}

void kernel_backward(const cuda::SwiGlu& launch, const torch::Tensor& grad_out, void* grad_gate,
                     void* grad_up) {
  auto a = launch;
  a.grad_out = grad_out.data_ptr();
  a.grad_gate = grad_gate;
  a.grad_up = grad_up;
  detail::check_launch(cuda::launch_swiglu_backward(a), "SwiGLU backward");
}
#endif

struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate_in,
                               const torch::Tensor& up_in) {
    bool use_kernel = false;
    torch::Tensor gate = gate_in, up = up_in, out;
#if STRATA_HAS_CUDA
    use_kernel = kernel_fits(gate_in) && up_in.device() == gate_in.device() &&
                 up_in.scalar_type() == gate_in.scalar_type();
    if (use_kernel) {
      RECORD_FUNCTION("strata::swiglu", std::vector<c10::IValue>({gate_in, up_in}));
      c10::cuda::CUDAGuard device_guard(gate_in.device());
      gate = gate_in.contiguous();
      up = up_in.contiguous();
      const int64_t cols = gate.size(-1);
      out = kernel_forward(launch_of(gate, gate.data_ptr(), up.data_ptr(), cols, cols), gate,
                           gate.sizes());
    }
#endif
    if (!use_kernel) out = F::silu(gate) * up;
    ctx->saved_data["kernel"] = use_kernel;
    ctx->save_for_backward({gate, up});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &up = saved[1];
#if STRATA_HAS_CUDA
    if (ctx->saved_data["kernel"].toBool()) {
      RECORD_FUNCTION("strata::swiglu_backward", std::vector<c10::IValue>({grads[0], gate, up}));
      c10::cuda::CUDAGuard device_guard(gate.device());
      const auto gy = grads[0].to(gate.scalar_type()).contiguous();
      auto dgate = torch::empty_like(gate), dup = torch::empty_like(up);
      const int64_t cols = gate.size(-1);
      kernel_backward(launch_of(gate, gate.data_ptr(), up.data_ptr(), cols, cols), gy,
                      dgate.data_ptr(), dup.data_ptr());
      return {dgate, dup};
    }
#endif
    auto [dgate, dup] = composite_backward(grads[0], gate, up);
    return {dgate, dup};
  }
};

// gate and up as the halves of one tensor's last dimension (a packed [gate | up] projection, as the
// MoE experts' grouped product writes it): no copy of either half, and one gradient tensor back.
struct SwiGluHalvesFunction : torch::autograd::Function<SwiGluHalvesFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& h_in) {
    const int64_t f = h_in.size(-1) / 2;
    bool use_kernel = false;
    torch::Tensor h = h_in, out;
#if STRATA_HAS_CUDA
    use_kernel = kernel_fits(h_in);
    if (use_kernel) {
      RECORD_FUNCTION("strata::swiglu", std::vector<c10::IValue>({h_in}));
      c10::cuda::CUDAGuard device_guard(h_in.device());
      h = h_in.contiguous();
      auto sizes = h.sizes().vec();
      sizes.back() = f;
      const auto* base = static_cast<const char*>(h.data_ptr());
      out = kernel_forward(launch_of(h, base, base + f * h.element_size(), f, 2 * f), h, sizes);
    }
#endif
    if (!use_kernel) out = F::silu(h.narrow(-1, 0, f)) * h.narrow(-1, f, f);
    ctx->saved_data["kernel"] = use_kernel;
    ctx->save_for_backward({h});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto h = ctx->get_saved_variables()[0];
    const int64_t f = h.size(-1) / 2;
#if STRATA_HAS_CUDA
    if (ctx->saved_data["kernel"].toBool()) {
      RECORD_FUNCTION("strata::swiglu_backward", std::vector<c10::IValue>({grads[0], h}));
      c10::cuda::CUDAGuard device_guard(h.device());
      const auto gy = grads[0].to(h.scalar_type()).contiguous();
      auto dh = torch::empty_like(h);
      const auto* base = static_cast<const char*>(h.data_ptr());
      auto* dbase = static_cast<char*>(dh.data_ptr());
      kernel_backward(launch_of(h, base, base + f * h.element_size(), f, 2 * f), gy, dbase,
                      dbase + f * dh.element_size());
      return {dh};
    }
#endif
    auto [dgate, dup] = composite_backward(grads[0], h.narrow(-1, 0, f), h.narrow(-1, f, f));
    return {torch::cat({dgate, dup}, -1)};
  }
};

}  // namespace swiglu_detail

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  if (!gate.defined() || !up.defined() || gate.sizes() != up.sizes())
    throw std::invalid_argument("swiglu: gate and up must have one shape");
  return swiglu_detail::SwiGluFunction::apply(gate, up);
}

torch::Tensor swiglu(const torch::Tensor& gate_up) {
  if (!gate_up.defined() || gate_up.dim() < 1 || gate_up.size(-1) % 2 != 0)
    throw std::invalid_argument("swiglu: the packed [gate | up] tensor's last dimension must be even");
  return swiglu_detail::SwiGluHalvesFunction::apply(gate_up);
}

}  // namespace strata::nn
