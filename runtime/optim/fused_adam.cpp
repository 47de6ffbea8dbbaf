#include "runtime/optim/fused_adam.h"

#include <fmt/format.h>

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

template <class G, class Out>
void cpu_loop(float* p, float* m, float* v, const G* g, Out* out, int64_t n,
              const AdamScalars& s) {
  at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      adam_update(p[i], m[i], v[i], static_cast<float>(g[i]), s);
      if constexpr (!std::is_void_v<Out>) out[i] = static_cast<Out>(p[i]);
    }
  });
}

template <class G>
void cpu_step(const torch::Tensor& p, const torch::Tensor& m, const torch::Tensor& v,
              const torch::Tensor& g, const torch::Tensor& out, const AdamScalars& s) {
  auto* pp = p.data_ptr<float>();
  auto* mp = m.data_ptr<float>();
  auto* vp = v.data_ptr<float>();
  const auto* gp = g.data_ptr<G>();
  const int64_t n = p.numel();
  if (!out.defined()) return cpu_loop<G, void>(pp, mp, vp, gp, nullptr, n, s);
  switch (out.scalar_type()) {
    case torch::kFloat: return cpu_loop(pp, mp, vp, gp, out.data_ptr<float>(), n, s);
    case torch::kBFloat16: return cpu_loop(pp, mp, vp, gp, out.data_ptr<c10::BFloat16>(), n, s);
    case torch::kHalf: return cpu_loop(pp, mp, vp, gp, out.data_ptr<c10::Half>(), n, s);
    default: break;
  }
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
  switch (grad.scalar_type()) {
    case torch::kFloat: return cpu_step<float>(master, exp_avg, exp_avg_sq, grad, out, scalars);
    case torch::kBFloat16:
      return cpu_step<c10::BFloat16>(master, exp_avg, exp_avg_sq, grad, out, scalars);
    case torch::kHalf: return cpu_step<c10::Half>(master, exp_avg, exp_avg_sq, grad, out, scalars);
    default: break;
  }
}

}  // namespace strata::optim
