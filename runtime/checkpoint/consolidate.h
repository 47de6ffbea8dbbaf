// One file of full weights from a (possibly ZeRO-partitioned) checkpoint: the fp32 master
// partitions concatenated back into the flat layout and cut into parameters (or, for a plain
// fp32 stage-0 checkpoint, its parameters as saved), with the buffers, in the dtype asked for.
#pragma once

#include <string>

#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

// Names as the module's named_parameters()/named_buffers() ("blocks.0.attn.qkv.weight").
NamedTensors consolidate(const std::string& dir, const std::string& tag,
                         torch::ScalarType dtype = torch::kFloat);

// LibTorch's module archive (what torch::save(module, path) writes and torch::load(module,
// path) reads): one nested archive per submodule, so plain LibTorch loads it into the model.
void save_module_archive(const std::string& path, const NamedTensors& parameters,
                         const NamedTensors& buffers);

}  // namespace strata::checkpoint
