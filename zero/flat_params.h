// One flat buffer for the model's trainable parameters (llm.c's layout): each parameter becomes a
// view into it, so that ZeRO partitions are ranges of the buffer (shard_map.h says which) and
// collectives work on flat ranges. The buffer is padded to a multiple of (partitions x alignment)
// elements so that contiguous partitions all have the same size.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace strata::zero {

class FlatParams {
 public:
  // Moves `params` (one dtype, one device) into the buffer; afterwards each is a view of it and
  // keeps its TensorImpl (autograd, the user's module and optimizers see the same tensors).
  FlatParams(std::vector<torch::Tensor> params, int64_t partitions, int64_t alignment = 64);

  const torch::Tensor& data() const { return data_; }
  const std::vector<torch::Tensor>& params() const { return params_; }
  int64_t offset(size_t param) const { return offsets_[param]; }
  int64_t numel() const { return numel_; }                  // without the padding
  int64_t padded_numel() const { return data_.numel(); }
  int64_t partitions() const { return partitions_; }
  // The flat range [lo, hi) spanned by the parameters `params` (indices; e.g. one bucket).
  std::pair<int64_t, int64_t> range_of(const std::vector<size_t>& params) const;
  // A zero tensor laid out like data() whose slices are the parameters' shapes.
  torch::Tensor zeros_like_data(torch::ScalarType dtype) const;
  // Parameter `param`'s slice of a tensor laid out like data(), in the parameter's shape.
  torch::Tensor view(const torch::Tensor& flat, size_t param) const;

 private:
  std::vector<torch::Tensor> params_;
  std::vector<int64_t> offsets_;
  int64_t numel_ = 0;
  int64_t partitions_ = 1;
  torch::Tensor data_;
};

}  // namespace strata::zero
