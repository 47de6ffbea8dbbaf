#include "runtime/checkpoint/compare.h"

#include <cmath>
#include <map>

#include <fmt/format.h>

#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/error.h"

namespace strata::checkpoint {

json CheckpointDistance::to_json() const {
  json per = json::array();
  for (const auto& t : tensors)
    per.push_back({{"name", t.name}, {"max_abs", t.max_abs}, {"ref_max_abs", t.ref_max_abs}});
  return {{"tensors", per},
          {"worst", {{"name", worst.name}, {"max_abs", worst.max_abs},
                     {"ref_max_abs", worst.ref_max_abs}}}};
}

namespace {

// The parameters of model_states as saved (the experts live in their own files, from their
// masters, so consolidate's view covers them).
NamedTensors as_trained(const std::string& dir, const std::string& tag) {
  NamedTensors out;
  for (auto& [key, t] : CheckpointReader(dir, tag).load_shared("model_states").tensors)
    if (key.rfind("param.", 0) == 0 && t.is_floating_point())
      out.emplace_back("as-trained:" + key, t.to(torch::kFloat));
  return out;
}

NamedTensors both_views(const std::string& dir, const std::string& tag) {
  NamedTensors out = consolidate(dir, tag);
  for (auto& named : as_trained(dir, tag)) out.push_back(std::move(named));
  return out;
}

}  // namespace

CheckpointDistance compare_checkpoints(const std::string& dir_a, const std::string& tag_a,
                                       const std::string& dir_b, const std::string& tag_b) {
  const NamedTensors a = both_views(dir_a, tag_a), b = both_views(dir_b, tag_b);
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& [name, t] : a) by_name.emplace(name, t);
  auto only_in_b = [&](const std::string& name) {
    return Error(fmt::format("strata-ckpt compare: {} holds '{}', {} does not", dir_b, name,
                             dir_a));
  };
  if (a.size() != b.size() || by_name.size() != a.size()) {
    for (const auto& [name, t] : b)
      if (!by_name.count(name)) throw only_in_b(name);
    throw Error(fmt::format("strata-ckpt compare: {} holds {} tensors, {} holds {}", dir_a,
                            a.size(), dir_b, b.size()));
  }
  CheckpointDistance out;
  for (const auto& [name, tb] : b) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw only_in_b(name);
    const torch::Tensor& ta = it->second;
    if (ta.sizes() != tb.sizes())
      throw Error(fmt::format("strata-ckpt compare: '{}' is {} in {} and {} in {}", name,
                              c10::str(ta.sizes()), dir_a, c10::str(tb.sizes()), dir_b));
    TensorDistance d{name};
    if (tb.numel() > 0) {
      const auto fa = ta.to(torch::kDouble), fb = tb.to(torch::kDouble);
      d.max_abs = (fa - fb).abs().max().item<double>();
      d.ref_max_abs = fb.abs().max().item<double>();
      if (std::isnan(d.max_abs)) d.max_abs = INFINITY;  // a NaN on one side only, or both
    }
    if (d.max_abs > out.worst.max_abs || out.worst.name.empty()) out.worst = d;
    out.tensors.push_back(std::move(d));
  }
  return out;
}

}  // namespace strata::checkpoint
