#include "zero/flat_params.h"

#include <algorithm>

#include <fmt/format.h>

#include "runtime/error.h"
#include "zero/storage.h"

namespace strata::zero {

FlatParams::FlatParams(std::vector<torch::Tensor> params, int64_t partitions, int64_t alignment)
    : params_(std::move(params)), partitions_(partitions) {
  if (params_.empty()) throw Error("FlatParams: no parameters");
  const auto options = params_.front().options();
  offsets_.reserve(params_.size());
  for (const auto& p : params_) {
    if (p.scalar_type() != options.dtype().toScalarType() || p.device() != options.device())
      throw Error(fmt::format(
          "the trainable parameters mix dtypes or devices ({} on {} and {} on {}); ZeRO and "
          "mixed precision flatten them into one buffer: move the model to one device and dtype",
          c10::toString(p.scalar_type()), p.device().str(),
          c10::toString(options.dtype().toScalarType()), options.device().str()));
    offsets_.push_back(numel_);
    numel_ += p.numel();
  }
  const int64_t quantum = partitions_ * alignment;
  const int64_t padded = (numel_ + quantum - 1) / quantum * quantum;
  data_ = torch::zeros({padded}, options);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    data_.narrow(0, offsets_[i], p.numel()).copy_(p.reshape({-1}));
    p.mutable_grad() = torch::Tensor();
    // Same TensorImpl, new storage: the module, autograd and the user keep their handles.
    view_into(p, data_, offsets_[i]);
  }
}

std::pair<int64_t, int64_t> FlatParams::range_of(const std::vector<size_t>& params) const {
  int64_t lo = numel_, hi = 0;
  for (size_t k : params) {
    lo = std::min(lo, offsets_.at(k));
    hi = std::max(hi, offsets_.at(k) + params_.at(k).numel());
  }
  return {lo, hi};
}

torch::Tensor FlatParams::zeros_like_data(torch::ScalarType dtype) const {
  return torch::zeros({padded_numel()}, data_.options().dtype(dtype));
}

torch::Tensor FlatParams::view(const torch::Tensor& flat, size_t param) const {
  return flat.narrow(0, offsets_[param], params_[param].numel()).view(params_[param].sizes());
}

}  // namespace strata::zero
