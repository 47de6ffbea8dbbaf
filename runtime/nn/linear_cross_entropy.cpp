#include "runtime/nn/linear_cross_entropy.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include <ATen/record_function.h>

#if STRATA_HAS_CUDA
#include "runtime/nn/cuda_bridge.h"
#endif

namespace strata::nn {
namespace {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if STRATA_HAS_CUDA
// The CUDA kernel (cuda/cross_entropy.cu) takes a chunk's logits on the GPU, rows of at most 2^31
// elements, of fp32/bf16/fp16.
bool fused_kernel_fits(const torch::Tensor& logits) {
  return logits.is_cuda() && logits.dim() == 2 && logits.size(1) > 0 &&
         detail::kernel_type(logits.scalar_type()).has_value();
}

// Each row's loss (0 for an ignored target) as float [rows]; with `grad`, the logits become the
// loss's gradient in place (zero rows for ignored targets).
torch::Tensor fused_softmax_cross_entropy(torch::Tensor& logits, const torch::Tensor& targets,
                                          int64_t ignore_index, bool grad) {
  RECORD_FUNCTION("strata::softmax_cross_entropy", std::vector<c10::IValue>({logits, targets}));
  c10::cuda::CUDAGuard device_guard(logits.device());
  const auto t = targets.to(logits.device(), torch::kLong).contiguous();
  auto row_loss = torch::empty({logits.size(0)}, logits.options().dtype(torch::kFloat));
  cuda::SoftmaxCrossEntropy a;
  a.logits = logits.data_ptr();
  a.targets = t.data_ptr<int64_t>();
  a.row_loss = row_loss.data_ptr<float>();
  a.type = *detail::kernel_type(logits.scalar_type());
  a.rows = logits.size(0);
  a.vocab = logits.size(1);
  a.ignore_index = ignore_index;
  a.write_grad = grad;
  a.stream = detail::current_stream(logits);
  a.multiprocessors = detail::multiprocessors();
  detail::check_launch(cuda::launch_softmax_cross_entropy(a), "linear_cross_entropy");
  return row_loss;
}
#endif

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& h,
                               const torch::Tensor& weight, const torch::Tensor& targets,
                               int64_t chunk_rows, int64_t ignore_index) {
    const int64_t rows = h.size(0);
    const bool want_h = h.requires_grad(), want_w = weight.requires_grad();
    torch::Tensor grad_h = want_h ? torch::empty_like(h) : torch::Tensor();
    // W's gradient: summed over the chunks in float32, or, from one chunk, the product in the
    // logits' dtype (one rounding either way before it is handed back in W's dtype).
    torch::Tensor grad_w;
    auto loss = torch::zeros({}, h.options().dtype(torch::kFloat));
    torch::Tensor w_g;  // the weight in the gradient's dtype, cast once (not once per chunk)
    for (int64_t s = 0; s < rows; s += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - s);
      const auto hc = h.narrow(0, s, n);
      // Ignored rows read column 0 (any valid index) and are masked out of the loss and of both
      // gradients: on [n] and [n, d], never on the chunk's [n, vocab].
      const auto ignored = targets.narrow(0, s, n).eq(ignore_index).unsqueeze(1);
      const auto tc = targets.narrow(0, s, n).unsqueeze(1).masked_fill(ignored, 0);
      const auto logits = F::linear(hc, weight);
      torch::Tensor g;  // d loss / d logits, in the logits' dtype
      bool rows_zeroed = false;  // the ignored rows of g are zeros already
#if STRATA_HAS_CUDA
      if (fused_kernel_fits(logits)) {
        g = logits.is_contiguous() ? logits : logits.contiguous();
        loss += fused_softmax_cross_entropy(g, targets.narrow(0, s, n), ignore_index,
                                            want_h || want_w)
                    .sum();
        rows_zeroed = true;
      }
#endif
      if (!g.defined()) {
        // One fused pass for the log-probabilities (in float: the logits are 16-bit under
        // autocast).
        auto log_p = torch::log_softmax(logits.to(torch::kFloat), 1);
        const auto target_log_p = log_p.gather(1, tc);
        loss -= target_log_p.masked_fill(ignored, 0.0).sum();
        if (!want_h && !want_w) continue;
        // d loss / d logits = softmax - one_hot(target): exp of the log-probabilities, written in
        // the logits' dtype (float in, one rounding); the targets' entries computed in float.
        g = log_p;
        if (logits.scalar_type() == torch::kFloat) {
          g.exp_();
        } else {
          g = torch::empty_like(logits);
          torch::exp_out(g, log_p);
        }
        log_p = torch::Tensor();
        g.scatter_(1, tc, target_log_p.exp().sub_(1.0).to(g.scalar_type()));
      }
      if (!want_h && !want_w) continue;
      if (want_h) {
        if (!w_g.defined()) w_g = weight.to(g.scalar_type());
        auto out = grad_h.narrow(0, s, n);
        if (out.scalar_type() == g.scalar_type()) torch::mm_out(out, g, w_g);  // no temporary
        else out.copy_(g.mm(w_g));
        if (!rows_zeroed) out.masked_fill_(ignored, 0.0);
      }
      // h's ignored rows masked too: g's zero rows would carry a NaN of theirs into W's gradient.
      if (want_w) {
        auto part = g.t().mm(hc.to(g.scalar_type()).masked_fill(ignored, 0.0));
        if (grad_w.defined()) grad_w.add_(part);
        else grad_w = n == rows ? part : part.to(torch::kFloat);
      }
    }
    if (want_w && !grad_w.defined()) grad_w = torch::zeros(weight.sizes(), weight.options());
    ctx->save_for_backward({grad_h, grad_w});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& upstream = grads[0];
    torch::Tensor gh, gw;
    if (saved[0].defined()) gh = saved[0] * upstream.to(saved[0].scalar_type());
    if (saved[1].defined()) {
      // Scaled and cast in one pass (the float32 sum of several chunks is W's size twice over).
      const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
      gw = torch::empty(saved[1].sizes(), saved[1].options().dtype(dtype));
      torch::mul_out(gw, saved[1], upstream.to(saved[1].scalar_type()));
    }
    return {gh, gw, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor linear_cross_entropy_sum(const torch::Tensor& h, const torch::Tensor& weight,
                                       const torch::Tensor& targets,
                                       const LinearCrossEntropyOptions& options) {
  const int64_t chunk_rows = options.chunk_rows;
  if (h.dim() != 2 || weight.dim() != 2 || h.size(1) != weight.size(1) || targets.dim() != 1 ||
      targets.size(0) != h.size(0) || chunk_rows < 1)
    throw std::invalid_argument(fmt::format(
        "linear_cross_entropy: h {}, weight {}, targets {}, chunk {}: need h [rows, d], "
        "weight [vocab, d], targets [rows], chunk >= 1", c10::str(h.sizes()),
        c10::str(weight.sizes()), c10::str(targets.sizes()), chunk_rows));
  if (targets.scalar_type() != torch::kLong)
    throw std::invalid_argument(fmt::format(
        "linear_cross_entropy: targets are {}: need int64 class indices",
        c10::toString(targets.scalar_type())));
  // Without grad mode (evaluation) the loss alone: inside the function grad mode is always off,
  // so it tells from its inputs whether gradients are wanted.
  if (!torch::GradMode::is_enabled())
    return LinearCrossEntropy::apply(h.detach(), weight.detach(), targets, chunk_rows,
                                     options.ignore_index);
  return LinearCrossEntropy::apply(h, weight, targets, chunk_rows, options.ignore_index);
}

torch::Tensor linear_cross_entropy(const torch::Tensor& h, const torch::Tensor& weight,
                                   const torch::Tensor& targets,
                                   const LinearCrossEntropyOptions& options) {
  const auto sum = linear_cross_entropy_sum(h, weight, targets, options);
  // The count stays on the device (no read of it): a constant of the division for autograd.
  const auto counted = targets.ne(options.ignore_index).sum().to(torch::kFloat).clamp_min(1.0);
  return sum / counted;
}

}  // namespace strata::nn
