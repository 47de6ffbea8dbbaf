#include "runtime/nn/rms_norm.h"

#include <ATen/record_function.h>

#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#if STRATA_HAS_CUDA
#include "runtime/nn/cuda_bridge.h"
#endif

namespace strata::nn {
// Named, not anonymous: a unity build puts the three layers' files in one translation unit.
namespace rms_norm_detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The composite ops. The gradient is the chain rule of the same function:
// dx = rstd * (g - xhat * mean(g * xhat)) in fp32, g the incoming gradient of the normed rows cast to
// fp32 as autograd casts it (mul's gradient, in the normed rows' dtype, then to()'s backward).
torch::Tensor composite_forward(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                torch::Tensor& rstd) {
  const auto xf = x.to(torch::kFloat);
  rstd = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * (xf * rstd).to(x.scalar_type());
}

void composite_backward(const torch::Tensor& gy, const torch::Tensor& x, const torch::Tensor& weight,
                        const torch::Tensor& rstd, bool want_x, bool want_weight,
                        torch::Tensor& dx, torch::Tensor& dweight) {
  const auto xhat = x.to(torch::kFloat) * rstd;
  if (want_x) {
    const auto g = (gy * weight).to(x.scalar_type()).to(torch::kFloat);
    dx = ((g - xhat * (g * xhat).mean(-1, /*keepdim=*/true)) * rstd).to(x.scalar_type());
  }
  if (want_weight)
    dweight = (gy * xhat.to(x.scalar_type())).sum_to_size(weight.sizes()).to(weight.scalar_type());
}

#if STRATA_HAS_CUDA
bool kernel_fits(const torch::Tensor& x, const torch::Tensor& weight) {
  if (!x.is_cuda() || weight.device() != x.device() || !x.is_contiguous() ||
      !weight.is_contiguous() || weight.dim() != 1 || x.dim() < 1)
    return false;
  const int64_t cols = x.size(-1);
  if (cols == 0 || cols > cuda::kRmsNormMaxCols || weight.size(0) != cols) return false;
  if (!detail::kernel_type(x.scalar_type())) return false;
  return weight.scalar_type() == x.scalar_type() || weight.scalar_type() == torch::kFloat;
}

torch::Tensor kernel_forward(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                             torch::Tensor& rstd) {
  RECORD_FUNCTION("strata::rms_norm", std::vector<c10::IValue>({x, weight}));
  c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t cols = x.size(-1);
  const auto out_type = weight.scalar_type() == torch::kFloat ? torch::kFloat : x.scalar_type();
  auto out = torch::empty_like(x, x.options().dtype(out_type));
  rstd = torch::empty({x.numel() / cols}, x.options().dtype(torch::kFloat));
  cuda::RmsNormForward a;
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.out = out.data_ptr();
  a.rstd = rstd.data_ptr<float>();
  a.x_type = *detail::kernel_type(x.scalar_type());
  a.weight_type = *detail::kernel_type(weight.scalar_type());
  a.rows = rstd.numel();
  a.cols = cols;
  a.eps = float(eps);
  a.stream = detail::current_stream(x);
  a.multiprocessors = detail::multiprocessors();
  detail::check_launch(cuda::launch_rms_norm_forward(a), "RMSNorm");
  return out;
}

void kernel_backward(const torch::Tensor& grad_out, const torch::Tensor& x,
                     const torch::Tensor& weight, const torch::Tensor& rstd, bool want_x,
                     bool want_weight, torch::Tensor& dx, torch::Tensor& dweight) {
  RECORD_FUNCTION("strata::rms_norm_backward", std::vector<c10::IValue>({grad_out, x, weight}));
  c10::cuda::CUDAGuard device_guard(x.device());
  const auto out_type = weight.scalar_type() == torch::kFloat ? torch::kFloat : x.scalar_type();
  const auto gy = grad_out.to(out_type).contiguous();
  cuda::RmsNormBackward a;
  a.rows = rstd.numel();
  a.cols = x.size(-1);
  a.blocks = cuda::rms_norm_backward_blocks(a.rows, a.cols, *detail::kernel_type(x.scalar_type()),
                                            detail::multiprocessors());
  torch::Tensor partial;
  if (want_x) dx = torch::empty_like(x);
  if (want_weight) partial = torch::empty({a.blocks, a.cols}, x.options().dtype(torch::kFloat));
  a.grad_out = gy.data_ptr();
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.rstd = rstd.data_ptr<float>();
  a.grad_x = want_x ? dx.data_ptr() : nullptr;
  a.grad_weight_partial = want_weight ? partial.data_ptr<float>() : nullptr;
  a.x_type = *detail::kernel_type(x.scalar_type());
  a.weight_type = *detail::kernel_type(weight.scalar_type());
  a.stream = detail::current_stream(x);
  detail::check_launch(cuda::launch_rms_norm_backward(a), "RMSNorm backward");
  if (want_weight) dweight = partial.sum(0).to(weight.scalar_type());
}
#endif

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    torch::Tensor rstd, out;
    bool kernel = false;
#if STRATA_HAS_CUDA
    kernel = kernel_fits(x, weight);
    if (kernel) out = kernel_forward(x, weight, eps, rstd);
#endif
    if (!kernel) out = composite_forward(x, weight, eps, rstd);
    ctx->saved_data["kernel"] = kernel;
    ctx->save_for_backward({x, weight, rstd});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const bool want_x = ctx->needs_input_grad(0), want_weight = ctx->needs_input_grad(1);
    torch::Tensor dx, dweight;
#if STRATA_HAS_CUDA
    if (ctx->saved_data["kernel"].toBool()) {
      kernel_backward(grads[0], x, weight, rstd, want_x, want_weight, dx, dweight);
      return {dx, dweight, torch::Tensor()};
    }
#endif
    composite_backward(grads[0], x, weight, rstd, want_x, want_weight, dx, dweight);
    return {dx, dweight, torch::Tensor()};
  }
};

}  // namespace rms_norm_detail

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (!x.defined() || !weight.defined() || weight.dim() != 1 || x.dim() < 1 ||
      x.size(-1) != weight.size(0))
    throw std::invalid_argument(fmt::format(
        "rms_norm: x's last dimension must equal the weight's length (x {}, weight {})",
        x.defined() ? fmt::format("{}", fmt::join(x.sizes(), "x")) : "undefined",
        weight.defined() ? fmt::format("{}", fmt::join(weight.sizes(), "x")) : "undefined"));
  return rms_norm_detail::RmsNormFunction::apply(x, weight, eps);
}

}  // namespace strata::nn
