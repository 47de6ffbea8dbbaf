// Differences between LibTorch 1.13 (Debian's libtorch-dev, CPU) and LibTorch 2.x live here and
// nowhere else.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#define STRATA_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace strata::compat {

// Causal self-attention over [batch, heads, seq, head_dim]. LibTorch 2.x has a fused kernel
// (flash / memory-efficient on CUDA); 1.13 gets the textbook formula.
inline torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v) {
#if STRATA_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  const auto t = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  auto mask = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
#endif
}

}  // namespace strata::compat
