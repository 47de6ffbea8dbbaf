#include "runtime/optim/fused_adam.h"

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"

#if STRATA_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "runtime/optim/cuda/fused_adam_launch.h"
#endif

namespace strata::optim {
namespace {

void check(bool ok, const std::string& what) {
  if (!ok) throw Error("fused Adam step: " + what);
}

bool is_float_type(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf;
}

offload::Float host_float(torch::ScalarType t) {
  if (t == torch::kBFloat16) return offload::Float::kBF16;
  if (t == torch::kHalf) return offload::Float::kF16;
  return offload::Float::kF32;
}

// The host tier's SIMD Adam (offload/cpu_adam.h), on LibTorch's intra-op threads.
void cpu_step(const torch::Tensor& p, const torch::Tensor& m, const torch::Tensor& v,
              const torch::Tensor& g, const torch::Tensor& out, const AdamScalars& s) {
  offload::cpu_adam_step(p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                         g.data_ptr(), host_float(g.scalar_type()),
                         out.defined() ? out.data_ptr() : nullptr,
                         out.defined() ? host_float(out.scalar_type()) : offload::Float::kF32,
                         p.numel(), s, at::get_num_threads());
}

#if STRATA_HAS_CUDA
cuda::FloatType float_type(torch::ScalarType t) {
  if (t == torch::kBFloat16) return cuda::FloatType::kBFloat16;
  if (t == torch::kHalf) return cuda::FloatType::kFloat16;
  return cuda::FloatType::kFloat32;
}

void cuda_step(const torch::Tensor& p, const torch::Tensor& m, const torch::Tensor& v,
               const torch::Tensor& g, const torch::Tensor& out, const AdamScalars& s) {
  c10::cuda::CUDAGuard guard(p.device());
  cuda::FusedAdamLaunch launch;
  launch.master = p.data_ptr<float>();
  launch.exp_avg = m.data_ptr<float>();
  launch.exp_avg_sq = v.data_ptr<float>();
  launch.grad = g.data_ptr();
  launch.grad_type = float_type(g.scalar_type());
  if (out.defined()) {
    launch.out = out.data_ptr();
    launch.out_type = float_type(out.scalar_type());
  }
  launch.n = p.numel();
  launch.scalars = s;
  launch.stream = c10::cuda::getCurrentCUDAStream(p.device().index()).stream();
  launch.multiprocessors = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (const char* error = cuda::launch_fused_adam(launch))
    throw Error(fmt::format("fused Adam step: the CUDA kernel did not launch: {}", error));
}
#endif

}  // namespace

void fused_adam_step(const torch::Tensor& master, const torch::Tensor& exp_avg,
                     const torch::Tensor& exp_avg_sq, const torch::Tensor& grad,
                     const torch::Tensor& out, const AdamScalars& scalars) {
  const int64_t n = master.numel();
  for (const auto* t : {&master, &exp_avg, &exp_avg_sq}) {
    check(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->numel() == n &&
              t->device() == master.device(),
          "the weights and both moments must be contiguous fp32 tensors of one length on one "
          "device");
  }
  check(grad.numel() == n && grad.is_contiguous() && grad.device() == master.device() &&
            is_float_type(grad.scalar_type()),
        fmt::format("the gradient must be a contiguous fp32/bf16/fp16 tensor of {} elements on "
                    "{} (got {} elements of {} on {})",
                    n, master.device().str(), grad.numel(), c10::toString(grad.scalar_type()),
                    grad.device().str()));
  if (out.defined())
    check(out.numel() == n && out.is_contiguous() && out.device() == master.device() &&
              is_float_type(out.scalar_type()) && !out.is_same(master),
          "the copy-out tensor must be a contiguous fp32/bf16/fp16 tensor of the same length on "
          "the same device, distinct from the weights");
  if (master.is_cuda()) {
#if STRATA_HAS_CUDA
    return cuda_step(master, exp_avg, exp_avg_sq, grad, out, scalars);
#else
    throw Error("fused Adam step: CUDA tensors, but this build of Strata has no CUDA");
#endif
  }
  check(master.is_cpu(), "the tensors must be on a CPU or CUDA device, not " +
                             master.device().str());
  cpu_step(master, exp_avg, exp_avg_sq, grad, out, scalars);  // dtypes checked above
}

}  // namespace strata::optim
