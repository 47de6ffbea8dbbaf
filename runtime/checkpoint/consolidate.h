// One file of full weights from a (possibly ZeRO-partitioned) checkpoint: the fp32 master
// partitions concatenated back into the flat layout and cut into parameters (or, for a plain
// fp32 stage-0 checkpoint, its parameters as saved), with the buffers, in the dtype asked for.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

// Names as the module's named_parameters()/named_buffers() ("blocks.0.attn.qkv.weight").
NamedTensors consolidate(const std::string& dir, const std::string& tag,
                         torch::ScalarType dtype = torch::kFloat);

// LibTorch's module archive (what torch::save(module, path) writes and torch::load(module,
// path) reads): one nested archive per submodule, so plain LibTorch loads it into the model.
// torch::load reads every child the model has, so `submodules` names them all, in module order
// ("features", "features.0", ..., as named_modules() without the root): a parameter-free child
// (a ReLU in a Sequential) holds no tensor to name it.
void save_module_archive(const std::string& path, const NamedTensors& parameters,
                         const NamedTensors& buffers,
                         const std::vector<std::string>& submodules);

// The key of model_states' scalars that lists the module's submodules (save_module_archive's
// `submodules`), and what a checkpoint lists there: nullopt for one saved before it was kept.
constexpr const char* kSubmodulesKey = "submodules";
std::optional<std::vector<std::string>> saved_submodules(const std::string& dir,
                                                         const std::string& tag);

}  // namespace strata::checkpoint
