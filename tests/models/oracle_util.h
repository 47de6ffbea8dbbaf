// What the Hugging Face oracle tests share (test_hf_oracle.cpp, test_hf_moe_oracle.cpp): the
// fixtures' folder, the relative error they are held to, the labels' counted tokens.
#pragma once

#include <string>

#include <torch/torch.h>

namespace strata::test::hf_oracle {

inline std::string fixture_dir(const std::string& family) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/models/fixtures/" + family;
}

// max |a - b| / max |b|.
inline double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max() /
          b.to(torch::kDouble).abs().max().clamp_min(1e-30))
      .item<double>();
}

// The counted tokens of `labels` after the shift (Hugging Face's denominator).
inline int64_t counted(const torch::Tensor& labels) {
  return labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum().item<int64_t>();
}

}  // namespace strata::test::hf_oracle
