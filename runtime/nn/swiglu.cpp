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

#if STRATA_HAS_CUDA
bool kernel_fits(const torch::Tensor& gate, const torch::Tensor& up) {
  return gate.is_cuda() && up.device() == gate.device() && up.scalar_type() == gate.scalar_type() &&
         up.sizes() == gate.sizes() && detail::kernel_type(gate.scalar_type()).has_value();
}

cuda::SwiGlu launch_of(const torch::Tensor& gate, const torch::Tensor& up) {
  cuda::SwiGlu a;
  a.gate = gate.data_ptr();
  a.up = up.data_ptr();
  a.type = *detail::kernel_type(gate.scalar_type());
  a.n = gate.numel();
  a.stream = detail::current_stream(gate);
  a.multiprocessors = detail::multiprocessors();
  return a;
}
#endif

struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate_in,
                               const torch::Tensor& up_in) {
    bool use_kernel = false;
    torch::Tensor gate = gate_in, up = up_in, out;
#if STRATA_HAS_CUDA
    use_kernel = kernel_fits(gate_in, up_in);
    if (use_kernel) {
      RECORD_FUNCTION("strata::swiglu", std::vector<c10::IValue>({gate_in, up_in}));
      c10::cuda::CUDAGuard guard(gate_in.device());
      gate = gate_in.contiguous();
      up = up_in.contiguous();
      out = torch::empty_like(gate, at::MemoryFormat::Contiguous);
      auto a = launch_of(gate, up);
      a.out = out.data_ptr();
      detail::check_launch(cuda::launch_swiglu_forward(a), "SwiGLU");
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
      c10::cuda::CUDAGuard guard(gate.device());
      const auto gy = grads[0].to(gate.scalar_type()).contiguous();
      auto dgate = torch::empty_like(gate), dup = torch::empty_like(up);
      auto a = launch_of(gate, up);
      a.grad_out = gy.data_ptr();
      a.grad_gate = dgate.data_ptr();
      a.grad_up = dup.data_ptr();
      detail::check_launch(cuda::launch_swiglu_backward(a), "SwiGLU backward");
      return {dgate, dup};
    }
#endif
    // mul's gradients, then silu's: as autograd computes those of F::silu(gate) * up.
    const auto& gy = grads[0];
    const auto s = F::silu(gate);
    return {at::silu_backward(gy * up, gate), gy * s};
  }
};

}  // namespace swiglu_detail

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  if (!gate.defined() || !up.defined() || gate.sizes() != up.sizes())
    throw std::invalid_argument("swiglu: gate and up must have one shape");
  return swiglu_detail::SwiGluFunction::apply(gate, up);
}

}  // namespace strata::nn
