// One file of full weights from a (possibly ZeRO-partitioned) checkpoint: the fp32 master
// partitions concatenated back into the flat layout and cut into parameters (or, for a plain
// fp32 stage-0 checkpoint, its parameters as saved), with the buffers, in the dtype asked for.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

class CheckpointReader;
class SavedPartitions;
class TensorFileReader;

// A checkpoint's full weights one tensor at a time (what consolidate() collects): each parameter
// read from its range of the saved fp32 master partitions, so a model larger than host memory is
// written out tensor by tensor. Keys are "param.<name>" and "buffer.<name>", module order, MoE
// experts (per expert, as the ep_size 1 model names them) last.
class FullWeights {
 public:
  FullWeights(const std::string& dir, const std::string& tag);
  ~FullWeights();

  // Each tensor's name, shape and dtype as at() returns it (a parameter's master: float32).
  const std::vector<TensorSpec>& specs() const { return specs_; }
  // One tensor, in `dtype` where it is cast (parameters, and floating-point buffers that do not
  // stay float32); strata::Error naming the checkpoint for anything inconsistent.
  torch::Tensor at(const std::string& key, torch::ScalarType dtype = torch::kFloat) const;
  const std::string& folder() const;
  // Whether at() casts tensor `key` to the dtype asked for.
  bool casts(const std::string& key) const;
  // model_states' scalars (the step counters, the program's client_state, ...).
  const json& model_scalars() const;

 private:
  torch::Tensor read(const std::string& key) const;

  std::unique_ptr<CheckpointReader> reader_;
  std::unique_ptr<TensorFileReader> model_;
  std::unique_ptr<SavedPartitions> master_;  // the flat layout's partitions, when there are
  std::map<std::string, std::pair<int64_t, int64_t>> master_range_;  // name -> offset, numel
  std::map<std::string, torch::Tensor> experts_;  // "param.<name>" -> fp32 (read whole)
  std::vector<TensorSpec> specs_;
};

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
