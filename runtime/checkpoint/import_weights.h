// Weights from a Hugging Face folder (hf_folder.h) into a module before strata::initialize, at
// any ZeRO stage: a module built whole takes each tensor in place; one built inside a
// PartitionedInit (DeepSpeed's zero.Init) takes into each tensor's shard only the elements this
// rank keeps, read by range, so no rank ever holds more than its shards and one tile. With
// offload_param the engine then moves the shards where they live, as it does for any model.
//
//   auto init = strata::zero::PartitionedInit::create(group, {torch::kBFloat16});
//   strata::models::CausalLM model(config);
//   init->finish();
//   strata::checkpoint::ImportOptions io;
//   io.partitioned = init;
//   strata::checkpoint::import_weights(*model, HfWeights(dir), io);
//   // then strata::initialize with InitOptions::partitioned_init = init
//
// Strict: every parameter and buffer must find its tensor(s) and every tensor of the file must
// be used (or named in `ignored`), shapes must agree and dtypes convert (floating point to
// floating point, else the same dtype); everything wrong is listed together by name and nothing
// is written until all of it holds. `fused` maps a model tensor to several of the file's,
// concatenated along dimension 0 in order (fused q/k/v from split projections; stacked experts
// from per-expert weights): each either has the target's trailing shape (concatenated) or is one
// slice of it (stacked).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "runtime/checkpoint/hf_folder.h"

namespace strata::zero {
class PartitionedInit;
}

namespace strata::checkpoint {

struct FusedWeight {
  std::string target;                // the model's name
  std::vector<std::string> sources;  // the file's names, in the order they are concatenated
  // Each source's shape: checked by the import when given, needed by the export (hf_export.h),
  // which splits the model's tensor back into them.
  std::vector<std::vector<int64_t>> shapes;
  // A layout concatenation cannot express (a transpose, gate's and up's columns side by side):
  // combine makes the model's tensor from the sources (whole, in the model's dtype), split the
  // file's tensors from it (the export). Needs `shapes`; read whole, so not for a tensor built
  // in shards.
  std::function<torch::Tensor(const std::vector<torch::Tensor>&)> combine;
  std::function<std::vector<torch::Tensor>(const torch::Tensor&)> split;
};

struct ImportOptions {
  std::vector<FusedWeight> fused;    // names not listed read the file's tensor of their own name
  std::vector<std::string> ignored;  // the file's tensors the model may leave unused (tied lm_head)
  std::shared_ptr<zero::PartitionedInit> partitioned;  // the scope the module was built in
};

struct ImportReport {
  int64_t tensors = 0;     // model tensors filled
  int64_t bytes_read = 0;  // bytes this process read from the files
};

ImportReport import_weights(torch::nn::Module& module, const HfWeights& weights,
                            const ImportOptions& options = {});

}  // namespace strata::checkpoint
