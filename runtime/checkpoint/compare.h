// Two checkpoints' full weights side by side (strata-ckpt compare): how far apart each tensor
// is, for tests that train the same model two ways (the differential matrix, docs/matrix.md).
#pragma once

#include <string>

#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

struct TensorDistance {
  std::string name;
  double max_abs = 0;      // max |a - b|
  double ref_max_abs = 0;  // max |b|
};

struct CheckpointDistance {
  std::vector<TensorDistance> tensors;  // in b's order, parameters and buffers
  TensorDistance worst;                 // the largest max_abs
  json to_json() const;
};

// Consolidates both (fp32) and compares them tensor by tensor; then the parameters as the model
// held them when it saved (model_states: the working copy the forward reads, 16-bit under mixed
// precision), named "as-trained:param.NAME". The second view sees a working copy that no longer
// follows its master (a 16-bit shard written back short, a stale host copy), which the master
// alone hides. Throws strata::Error naming the first tensor only one of them has, or whose
// shapes differ: such checkpoints are not two runs of one model.
CheckpointDistance compare_checkpoints(const std::string& dir_a, const std::string& tag_a,
                                       const std::string& dir_b, const std::string& tag_b);

}  // namespace strata::checkpoint
