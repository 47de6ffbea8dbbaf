// Causal attention one group of kv heads at a time (grouped_attention.h).
#include "runtime/nn/grouped_attention.h"

#include <cmath>
#include <vector>

#include "runtime/compat.h"
#include "runtime/error.h"

namespace strata::nn {

namespace {

// LibTorch returns flash attention's max_q/max_k as SymInt in some versions, int64 in others.
[[maybe_unused]] int64_t as_int(int64_t v) { return v; }
[[maybe_unused]] int64_t as_int(const c10::SymInt& v) { return v.expect_int(); }

#if STRATA_TORCH_AT_LEAST(2, 2)
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// q [b, h, t, d], k and v [b, kv, t, d]; group g holds kv heads [g * kv_per_call, ...) and their
// query heads.
class GroupedFlash : public torch::autograd::Function<GroupedFlash> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t kv_per_call) {
    const int64_t kv = k.size(1), per_kv = q.size(1) / kv;
    // The output as flash lays it out ([b, t, h, d] in memory), so that [b, t, h * d] is a view.
    auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    std::vector<torch::Tensor> lse;
    torch::Tensor seed, offset;
    int64_t max_q = 0, max_k = 0;
    for (int64_t g = 0; g < kv; g += kv_per_call) {
      const int64_t n = std::min(kv_per_call, kv - g);
      auto r = at::_scaled_dot_product_flash_attention(q.narrow(1, g * per_kv, n * per_kv),
                                                       k.narrow(1, g, n), v.narrow(1, g, n),
                                                       /*dropout_p=*/0.0, /*is_causal=*/true,
                                                       /*return_debug_mask=*/false);
      out.narrow(1, g * per_kv, n * per_kv).copy_(std::get<0>(r));
      lse.push_back(std::get<1>(r));
      max_q = as_int(std::get<4>(r));
      max_k = as_int(std::get<5>(r));
      seed = std::get<6>(r);
      offset = std::get<7>(r);
    }
    ctx->save_for_backward({q, k, v, out, torch::cat(lse, 1), seed, offset});
    ctx->saved_data["kv_per_call"] = kv_per_call;
    ctx->saved_data["max_q"] = max_q;
    ctx->saved_data["max_k"] = max_k;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto &seed = saved[5], &offset = saved[6];
    const int64_t kv_per_call = ctx->saved_data["kv_per_call"].toInt();
    const int64_t max_q = ctx->saved_data["max_q"].toInt(), max_k = ctx->saved_data["max_k"].toInt();
    const int64_t kv = k.size(1), per_kv = q.size(1) / kv;
    auto dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
    const auto& gout = grads[0];
    const torch::Tensor none;
    for (int64_t g = 0; g < kv; g += kv_per_call) {
      const int64_t n = std::min(kv_per_call, kv - g);
      const auto heads = [&](const torch::Tensor& t) { return t.narrow(1, g * per_kv, n * per_kv); };
      auto r = at::_scaled_dot_product_flash_attention_backward(
          heads(gout), heads(q), k.narrow(1, g, n), v.narrow(1, g, n), heads(out), heads(lse),
          none, none, max_q, max_k, /*dropout_p=*/0.0, /*is_causal=*/true, seed, offset);
      heads(dq).copy_(std::get<0>(r));
      dk.narrow(1, g, n).copy_(std::get<1>(r));
      dv.narrow(1, g, n).copy_(std::get<2>(r));
    }
    return {dq, dk, dv, torch::Tensor()};
  }
};
#endif

}  // namespace

bool grouped_attention_runs(const torch::Tensor& q, const torch::Tensor& k, int64_t kv_per_call) {
#if STRATA_TORCH_AT_LEAST(2, 2)
  return q.is_cuda() && (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf) &&
         q.dim() == 4 && k.dim() == 4 && q.size(1) % k.size(1) == 0 && q.size(-1) % 8 == 0 &&
         q.size(-1) <= 256 && kv_per_call > 0 && kv_per_call < k.size(1);
#else
  (void)q, (void)k, (void)kv_per_call;
  return false;
#endif
}

torch::Tensor grouped_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                int64_t kv_per_call) {
#if STRATA_TORCH_AT_LEAST(2, 2)
  if (grouped_attention_runs(q, k, kv_per_call)) return GroupedFlash::apply(q, k, v, kv_per_call);
#endif
  throw Error("strata::nn::grouped_attention: not for these tensors (a CUDA device, fp16/bf16, "
              "LibTorch 2.2+, fewer kv heads per call than kv heads); check grouped_attention_runs");
}

}  // namespace strata::nn
