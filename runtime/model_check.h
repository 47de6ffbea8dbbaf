// What the engine trains of the user's module, and the checks made on it at initialize.
//
// LibTorch's C++ Module::parameters() lists a tensor once per name it is registered under (a head
// tied to an embedding with register_parameter("out_w", emb->weight) appears twice), unlike
// Python's, which removes duplicates. The engine trains each tensor once: the optimizer, the
// gradient norm, the reducer's hooks and the flat buffer see unique tensors (by TensorImpl, as
// Python does); checkpoints keep every name.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"

namespace strata {

struct NamedTensor {
  std::string name;  // the first name it is registered under, in module order
  torch::Tensor tensor;
  std::vector<std::string> aliases;  // its further names (a tied weight's second name)
};

// Every parameter once (by TensorImpl), in module order; `trainable_only` keeps those that
// require a gradient.
std::vector<NamedTensor> unique_parameters(torch::nn::Module& module, bool trainable_only);

// Mixed precision: the module's floating-point parameters and buffers to `dtype`, as Python's
// module.bfloat16()/.half() (what DeepSpeed calls) and FSDP's MixedPrecision do. Bool and integer
// tensors keep their dtype: LibTorch's Module::to(dtype) casts every tensor, which made a bool
// mask bf16 and BatchNorm's int64 num_batches_tracked a bf16 that stops counting at 256.
// Each tensor keeps its TensorImpl (set_data), so tied names stay tied. Buffers that stay float32
// (moe::is_float32_buffer_name: the MoE router's balancing bias) are left alone.
void cast_floating_point(torch::nn::Module& module, torch::ScalarType dtype);

// Every rank takes rank 0's module buffers (collective over `group`), in one broadcast per dtype:
// at initialize, and before each training forward with broadcast_buffers (DDP's behaviour).
void broadcast_buffers(torch::nn::Module& module, comm::ProcessGroup& group);

// Throws strata::Error unless every trainable parameter is on one device, naming two that are
// not (the flat buffer, the reducer's buckets and the gradient norm assume one device).
void check_one_device(const std::vector<NamedTensor>& params);

// Every rank's module must have the same parameters and buffers (names, shapes, dtypes,
// requires_grad) before rank 0's values are broadcast: otherwise collectives of different sizes
// would mix unrelated tensors, or fail deep inside the backend. Collective over `group`; on a
// difference every rank throws strata::Error naming the first tensor that differs and how.
// `include`, when given, picks the parameters compared by name (buffers are always compared):
// expert parameters differ across expert-parallel ranks and are compared within their
// expert-data-parallel group instead.
using NameFilter = std::function<bool(const std::string&)>;
void check_same_model_on_every_rank(torch::nn::Module& module, comm::ProcessGroup& group,
                                    const NameFilter& include = {}, bool buffers = true);

}  // namespace strata
