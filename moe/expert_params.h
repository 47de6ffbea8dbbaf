// Which parameters of a model are experts, for the engine: expert parameters are reduced over the
// expert-data-parallel group only, kept in their own optimizer and checkpointed per expert
// (runtime/engine_experts.cpp). The MoE layer registers its experts in a submodule named
// "experts", so their full names contain the component "experts".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace strata::moe {

class MoEImpl;

// True when a parameter's full name has a component "experts" (e.g. "blocks.1.moe.experts.w1"),
// the name the MoE layer gives its expert submodule. For names only (checkpoint keys); on a live
// model prefer expert_parameters(), which cannot mistake a user's own module named "experts".
bool is_expert_parameter_name(const std::string& name);

// The sigmoid router's balancing bias is a buffer of the layer's gate, under Hugging Face
// DeepSeek-V3's name ("blocks.1.moe.gate.e_score_correction_bias"), so that every export of the
// module's buffers carries it. It stays float32 in a 16-bit model and in 16-bit exports (its
// updates of bias_update_speed, 1e-3, are below bf16's spacing near 1, 2^-7), as Hugging Face
// keeps it (_keep_in_fp32_modules_strict).
inline constexpr const char* kExpertBiasBuffer = "e_score_correction_bias";
// True for a buffer that stays float32 whatever the model's dtype: its name's last component is
// kExpertBiasBuffer.
bool is_float32_buffer_name(const std::string& name);

struct ExpertParameter {
  std::string name;  // full name in the model
  torch::Tensor param;
  int64_t first_expert;  // global index of the first expert it holds
  // Built-in stacked tensors hold local_experts experts along dim 0; a user expert's
  // parameter holds one.
  int64_t num_experts;
  bool stacked;
  int64_t layer_id;
  int64_t layer_experts;  // the layer's experts over the whole EP group (E)
  int64_t ep_size;        // the layer's expert-parallel size
  // Where its layer's name ends: name = prefix + "experts." + the expert module's own name.
  std::string layer_prefix;
  // Its name within one expert ("w1"; a user expert's "fc.weight"): what checkpoints key it by,
  // the same whether or not the experts are streamed.
  std::string per_expert_name;
  // Streamed experts (moe/experts.h): the name of the unit it belongs to ("unit4"); empty when
  // the layer's local experts form one unit.
  std::string unit;
};

// Every expert parameter of every MoE layer inside `model` (the model itself included), in
// module order.
std::vector<ExpertParameter> expert_parameters(const torch::nn::Module& model);

// Every MoE layer inside `model`, in module order.
std::vector<MoEImpl*> moe_layers(torch::nn::Module& model);

}  // namespace strata::moe
