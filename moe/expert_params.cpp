#include "moe/expert_params.h"

#include "moe/layer.h"

#include <algorithm>

namespace strata::moe {

bool is_expert_parameter_name(const std::string& name) {
  size_t start = 0;
  while (start <= name.size()) {
    const size_t end = std::min(name.find('.', start), name.size());
    if (name.compare(start, end - start, "experts") == 0 && end - start == 7) return true;
    start = end + 1;
  }
  return false;
}

bool is_float32_buffer_name(const std::string& name) {
  const std::string leaf = kExpertBiasBuffer;
  return name.size() >= leaf.size() && name.compare(name.size() - leaf.size(), leaf.size(), leaf) == 0 &&
         (name.size() == leaf.size() || name[name.size() - leaf.size() - 1] == '.');
}

namespace {

void collect(const torch::nn::Module& m, const std::string& prefix,
             std::vector<ExpertParameter>& out) {
  if (const auto* moe = dynamic_cast<const MoEImpl*>(&m)) {
    const auto& ex = *moe->experts;
    const std::string base = prefix + "experts.";
    for (const auto& kv : ex.named_parameters(/*recurse=*/true)) {
      ExpertParameter p;
      p.name = base + kv.key();
      p.param = kv.value();
      p.stacked = ex.built_in();
      const auto dot = kv.key().find('.');
      if (p.stacked && !ex.streamed()) {  // "w1": every local expert
        p.first_expert = ex.first_expert();
        p.num_experts = ex.local_experts();
        p.per_expert_name = kv.key();
      } else if (p.stacked) {  // "unit4.w1": the unit's experts
        const auto& unit = *std::find_if(ex.units().begin(), ex.units().end(), [&](const auto& u) {
          return kv.key().compare(0, dot, u.name) == 0 && u.name.size() == dot;
        });
        p.first_expert = ex.first_expert() + unit.first;
        p.num_experts = unit.count;
        p.per_expert_name = kv.key().substr(dot + 1);
        p.unit = unit.name;
      } else {  // a user expert's parameters sit under its global index: "5.fc.weight"
        p.first_expert = std::stoll(kv.key().substr(0, dot));
        p.num_experts = 1;
        p.per_expert_name = kv.key().substr(dot + 1);
        if (ex.streamed()) p.unit = ex.units()[size_t(ex.unit_of(p.first_expert - ex.first_expert()))].name;
      }
      p.layer_id = moe->options().layer_id;
      p.layer_experts = moe->options().num_experts;
      p.ep_size = moe->options().ep_size;
      p.layer_prefix = prefix;
      out.push_back(std::move(p));
    }
    return;  // an MoE's other children (the gate) hold no experts
  }
  for (const auto& kv : m.named_children()) collect(*kv.value(), prefix + kv.key() + ".", out);
}

void collect_layers(torch::nn::Module& m, std::vector<MoEImpl*>& out) {
  if (auto* moe = dynamic_cast<MoEImpl*>(&m)) {
    out.push_back(moe);
    return;
  }
  for (const auto& child : m.children()) collect_layers(*child, out);
}

}  // namespace

std::vector<ExpertParameter> expert_parameters(const torch::nn::Module& model) {
  std::vector<ExpertParameter> out;
  collect(model, "", out);
  return out;
}

std::vector<MoEImpl*> moe_layers(torch::nn::Module& model) {
  std::vector<MoEImpl*> out;
  collect_layers(model, out);
  return out;
}

}  // namespace strata::moe
