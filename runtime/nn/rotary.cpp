#include "runtime/nn/rotary.h"

#include <ATen/record_function.h>

#include <stdexcept>

#include <fmt/format.h>

#if STRATA_HAS_CUDA
#include "runtime/nn/cuda_bridge.h"
#endif

namespace strata::nn {
// Named, not anonymous: a unity build puts the three layers' files in one translation unit.
namespace rotary_detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor composite(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto half = x.size(-1) / 2;
  const auto rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// autograd's gradient of composite() for x: g * cos + cat(r2, -r1), r = g * sin.
torch::Tensor composite_backward(const torch::Tensor& g, const torch::Tensor& cos,
                                 const torch::Tensor& sin) {
  const auto half = g.size(-1) / 2;
  const auto r = g * sin;
  return g * cos + torch::cat({r.narrow(-1, half, half), -r.narrow(-1, 0, half)}, -1);
}

#if STRATA_HAS_CUDA
bool kernel_fits(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (!x.is_cuda() || x.dim() != 4 || x.stride(3) != 1 || x.size(3) % 2 != 0) return false;
  for (const auto* t : {&cos, &sin})
    if (t->device() != x.device() || t->scalar_type() != x.scalar_type() || t->dim() != 2 ||
        t->size(0) != x.size(2) || t->size(1) != x.size(3) || t->stride(1) != 1)
      return false;
  return bool(detail::kernel_type(x.scalar_type()));
}

torch::Tensor kernel(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin,
                     bool backward) {
  RECORD_FUNCTION(backward ? "strata::rotary_backward" : "strata::rotary",
                  std::vector<c10::IValue>({x_in, cos, sin}));
  c10::cuda::CUDAGuard device_guard(x_in.device());
  const auto x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  auto out = torch::empty_like(x);
  if (out.stride(3) != 1) out = torch::empty(x.sizes(), x.options());
  cuda::Rotary a;
  a.x = x.data_ptr();
  a.out = out.data_ptr();
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.type = *detail::kernel_type(x.scalar_type());
  for (int d = 0; d < 4; ++d) a.sizes[d] = x.size(d);
  for (int d = 0; d < 3; ++d) a.x_strides[d] = x.stride(d), a.out_strides[d] = out.stride(d);
  a.cos_stride = cos.stride(0);
  a.sin_stride = sin.stride(0);
  a.backward = backward;
  a.stream = detail::current_stream(x);
  detail::check_launch(cuda::launch_rotary(a), backward ? "rotary backward" : "rotary");
  return out;
}
#endif

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    bool use_kernel = false;
    torch::Tensor out;
#if STRATA_HAS_CUDA
    use_kernel = kernel_fits(x, cos, sin);
    if (use_kernel) out = kernel(x, cos, sin, /*backward=*/false);
#endif
    if (!use_kernel) out = composite(x, cos, sin);
    ctx->saved_data["kernel"] = use_kernel;
    ctx->save_for_backward({cos, sin});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1];
#if STRATA_HAS_CUDA
    // The gradient's layout is the consumer's (SDPA's backward): the kernel takes its strides.
    if (ctx->saved_data["kernel"].toBool() && grads[0].dim() == 4 && grads[0].stride(3) == 1)
      return {kernel(grads[0], cos, sin, /*backward=*/true), torch::Tensor(), torch::Tensor()};
#endif
    return {composite_backward(grads[0], cos, sin), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace rotary_detail

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (!x.defined() || !cos.defined() || !sin.defined() || x.dim() < 1 || x.size(-1) % 2 != 0 ||
      cos.sizes() != sin.sizes() || cos.dim() < 1 || cos.size(-1) != x.size(-1))
    throw std::invalid_argument(
        "rotary: x's last dimension must be even and equal cos's and sin's, which must have one "
        "shape");
  // Position tables that learn (none of the published models' do): autograd of the composite.
  if (cos.requires_grad() || sin.requires_grad()) return rotary_detail::composite(x, cos, sin);
  return rotary_detail::RotaryFunction::apply(x, cos, sin);
}

}  // namespace strata::nn
