// Causal attention one group of kv heads at a time (grouped_attention.h).
#include "runtime/nn/grouped_attention.h"

#include <atomic>
#include <mutex>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace strata::nn {

namespace {

// LibTorch returns flash attention's max_q/max_k as SymInt in some versions, int64 in others.
[[maybe_unused]] int64_t as_int(int64_t v) { return v; }
[[maybe_unused]] int64_t as_int(const c10::SymInt& v) { return v.expect_int(); }

#if STRATA_TORCH_AT_LEAST(2, 2)
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One group's forward results the backward needs, whichever kernel ran.
struct GroupSaved {
  torch::Tensor lse, seed, offset, cum_q, cum_k;
  int64_t max_q = 0, max_k = 0;
};

// cuDNN's attention (LibTorch 2.6+: the backend SDPA picks for these shapes on Hopper, about 1.4x
// flash's speed here) unless it refused once in this process; then flash attention's.
std::atomic<bool> cudnn_refused{false};

bool use_cudnn() {
#if STRATA_TORCH_AT_LEAST(2, 6)
  return !cudnn_refused.load() && at::globalContext().userEnabledCuDNNSDP();
#else
  return false;
#endif
}

torch::Tensor group_forward(bool cudnn, const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v, GroupSaved& saved) {
#if STRATA_TORCH_AT_LEAST(2, 6)
  if (cudnn) {
    auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, /*attn_bias=*/std::nullopt,
                                                     /*compute_log_sumexp=*/true, /*dropout_p=*/0.0,
                                                     /*is_causal=*/true, /*return_debug_mask=*/false);
    saved = {std::get<1>(r), std::get<6>(r), std::get<7>(r), std::get<2>(r), std::get<3>(r),
             as_int(std::get<4>(r)), as_int(std::get<5>(r))};
    return std::get<0>(r);
  }
#endif
  (void)cudnn;
  auto r = at::_scaled_dot_product_flash_attention(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true,
                                                   /*return_debug_mask=*/false);
  saved = {std::get<1>(r), std::get<6>(r), std::get<7>(r), std::get<2>(r), std::get<3>(r),
           as_int(std::get<4>(r)), as_int(std::get<5>(r))};
  return std::get<0>(r);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> group_backward(
    bool cudnn, const torch::Tensor& gout, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const torch::Tensor& out, const GroupSaved& s) {
#if STRATA_TORCH_AT_LEAST(2, 6)
  if (cudnn)
    return at::_scaled_dot_product_cudnn_attention_backward(
        gout, q, k, v, out, s.lse, s.seed, s.offset, /*attn_bias=*/torch::Tensor(), s.cum_q, s.cum_k,
        s.max_q, s.max_k, /*dropout_p=*/0.0, /*is_causal=*/true);
#endif
  (void)cudnn;
  return at::_scaled_dot_product_flash_attention_backward(gout, q, k, v, out, s.lse, s.cum_q, s.cum_k,
                                                          s.max_q, s.max_k, /*dropout_p=*/0.0,
                                                          /*is_causal=*/true, s.seed, s.offset);
}

// Once per process, before the first group: cuDNN's forward and backward on a small grouped-query
// problem of these heads, dtype and device. Either refusing means flash attention's kernels.
bool cudnn_runs(const torch::Tensor& q, int64_t kv_heads, int64_t q_heads) {
  static std::once_flag once;
  std::call_once(once, [&] {
    try {
      const auto o = q.options();
      const auto qs = torch::randn({1, q_heads, 256, q.size(3)}, o);
      const auto ks = torch::randn({1, kv_heads, 256, q.size(3)}, o), vs = torch::randn_like(ks);
      GroupSaved s;
      const auto y = group_forward(true, qs, ks, vs, s);
      group_backward(true, torch::ones_like(y), qs, ks, vs, y, s);
    } catch (const c10::Error& e) {
      cudnn_refused = true;
      log::info("[strata] grouped attention: cuDNN's attention refused ({}); flash attention's "
                "kernels instead", std::string(e.what_without_backtrace()).substr(0, 200));
    }
  });
  return !cudnn_refused.load();
}

// q [b, h, t, d], k and v [b, kv, t, d]; group g holds kv heads [g * kv_per_call, ...) and their
// query heads. Both kernels take grouped-query shapes (fewer kv heads than query heads) as they are.
class GroupedAttention : public torch::autograd::Function<GroupedAttention> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t kv_per_call) {
    const int64_t kv = k.size(1), per_kv = q.size(1) / kv;
    // The output as the kernels lay it out ([b, t, h, d] in memory), so that [b, t, h * d] is a view.
    auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    bool cudnn = use_cudnn() && cudnn_runs(q, std::min(kv_per_call, kv), std::min(kv_per_call, kv) * per_kv);
    std::vector<GroupSaved> groups;
    for (int64_t g = 0; g < kv; g += kv_per_call) {
      const int64_t n = std::min(kv_per_call, kv - g);
      const auto qg = q.narrow(1, g * per_kv, n * per_kv), kg = k.narrow(1, g, n), vg = v.narrow(1, g, n);
      GroupSaved saved;
      torch::Tensor y;
      try {
        y = group_forward(cudnn, qg, kg, vg, saved);
      } catch (const c10::Error& e) {
        if (!cudnn || g > 0) throw;
        // Refused for these shapes or this build (no cuDNN frontend, an old cuDNN): flash from now on.
        cudnn_refused = true;
        cudnn = false;
        log::info("[strata] grouped attention: cuDNN's attention refused ({}); flash attention's kernel "
                  "from here on", std::string(e.what_without_backtrace()).substr(0, 200));
        y = group_forward(cudnn, qg, kg, vg, saved);
      }
      out.narrow(1, g * per_kv, n * per_kv).copy_(y);
      groups.push_back(std::move(saved));
    }
    std::vector<torch::Tensor> keep = {q, k, v, out};
    for (const auto& s : groups)
      for (const auto& t : {s.lse, s.seed, s.offset, s.cum_q, s.cum_k}) keep.push_back(t);
    ctx->save_for_backward(keep);
    std::vector<int64_t> maxes;
    for (const auto& s : groups) maxes.insert(maxes.end(), {s.max_q, s.max_k});
    ctx->saved_data["kv_per_call"] = kv_per_call;
    ctx->saved_data["cudnn"] = cudnn;
    ctx->saved_data["maxes"] = maxes;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const int64_t kv_per_call = ctx->saved_data["kv_per_call"].toInt();
    const bool cudnn = ctx->saved_data["cudnn"].toBool();
    const auto maxes = ctx->saved_data["maxes"].toIntVector();
    const int64_t kv = k.size(1), per_kv = q.size(1) / kv;
    auto dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
    const auto& gout = grads[0];
    for (int64_t g = 0, i = 0; g < kv; g += kv_per_call, ++i) {
      const int64_t n = std::min(kv_per_call, kv - g);
      const auto heads = [&](const torch::Tensor& t) { return t.narrow(1, g * per_kv, n * per_kv); };
      const size_t at = 4 + 5 * size_t(i);
      const GroupSaved s{saved[at], saved[at + 1], saved[at + 2], saved[at + 3], saved[at + 4],
                         maxes[2 * size_t(i)], maxes[2 * size_t(i) + 1]};
      auto r = group_backward(cudnn, heads(gout), heads(q), k.narrow(1, g, n), v.narrow(1, g, n),
                              heads(out), s);
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
  if (grouped_attention_runs(q, k, kv_per_call)) return GroupedAttention::apply(q, k, v, kv_per_call);
#endif
  throw Error("strata::nn::grouped_attention: not for these tensors (a CUDA device, fp16/bf16, "
              "LibTorch 2.2+, fewer kv heads per call than kv heads); check grouped_attention_runs");
}

}  // namespace strata::nn
