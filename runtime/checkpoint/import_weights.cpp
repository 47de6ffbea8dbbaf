#include "runtime/checkpoint/import_weights.h"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/checkpoint/tensor_stream.h"
#include "runtime/error.h"
#include "zero/partitioned_init.h"

namespace strata::checkpoint {
namespace {

// A model tensor and where its elements come from: its sources back to back.
struct Plan {
  std::string name;
  torch::Tensor tensor;
  std::vector<std::string> sources;
  std::vector<int64_t> source_numel;
  const FusedWeight* fused = nullptr;  // with combine: read whole, combined
};

std::string listed(const std::vector<std::string>& items) {
  constexpr size_t kShown = 12;
  std::string out;
  for (size_t i = 0; i < items.size() && i < kShown; ++i) out += "\n    " + items[i];
  if (items.size() > kShown) out += fmt::format("\n    ... ({} in all)", items.size());
  return out;
}

// Whether source shapes concatenate (or stack) along dimension 0 into `target`.
bool fits(const std::vector<int64_t>& target, const std::vector<const TensorSpec*>& sources) {
  if (target.empty()) return sources.size() == 1 && sources[0]->shape.empty();
  const std::vector<int64_t> tail(target.begin() + 1, target.end());
  int64_t rows = 0;
  for (const auto* s : sources) {
    if (s->shape == tail) {
      rows += 1;  // one slice of a stack
    } else if (!s->shape.empty() && std::vector<int64_t>(s->shape.begin() + 1, s->shape.end()) == tail) {
      rows += s->shape[0];
    } else {
      return false;
    }
  }
  return rows == target[0];
}

// Elements [begin, begin + n) of the plan's flattened tensor into `dst` (n elements, `dtype`).
int64_t read_range(const HfWeights& weights, const Plan& plan, int64_t begin, int64_t n,
                   const torch::Tensor& dst) {
  int64_t bytes = 0, base = 0, done = 0;
  const bool direct = dst.device().is_cpu() && dst.is_contiguous();
  const int64_t tile = std::max<int64_t>(1, kStreamTileBytes / int64_t(dst.element_size()));
  torch::Tensor host;
  for (size_t s = 0; s < plan.sources.size() && done < n; ++s) {
    const int64_t lo = std::max(begin + done, base), hi = std::min(begin + n, base + plan.source_numel[s]);
    for (int64_t at = lo; at < hi;) {
      const int64_t m = direct ? hi - at : std::min(tile, hi - at);
      const int64_t out = at - begin;
      if (direct) {
        weights.read(plan.sources[s], at - base, m, dst.scalar_type(),
                     static_cast<char*>(dst.data_ptr()) + out * dst.element_size());
      } else {
        if (!host.defined()) host = torch::empty({std::min(tile, n)}, dst.options().device(torch::kCPU));
        weights.read(plan.sources[s], at - base, m, dst.scalar_type(), host.data_ptr());
        dst.narrow(0, out, m).copy_(host.narrow(0, 0, m));
      }
      bytes += m * int64_t(c10::elementSize(weights.find(plan.sources[s])->dtype));
      at += m;
      done = at - begin;
    }
    base += plan.source_numel[s];
  }
  return bytes;
}

}  // namespace

ImportReport import_weights(torch::nn::Module& module, const HfWeights& weights,
                            const ImportOptions& options) {
  torch::NoGradGuard no_grad;
  std::map<std::string, const FusedWeight*> fused;
  for (const auto& f : options.fused) fused[f.target] = &f;
  const std::set<std::string> ignored(options.ignored.begin(), options.ignored.end());

  // Each tensor once; a second name of a tied tensor may be in the file (its copy is not read).
  std::vector<Plan> plans;
  std::set<std::string> used;
  std::vector<std::string> missing, misshaped, bad_dtype;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto plan_of = [&](const std::string& name, const torch::Tensor& t) {
    const auto it = fused.find(name);
    const auto sources = it != fused.end() ? it->second->sources : std::vector<std::string>{name};
    const auto* shapes = it != fused.end() && !it->second->shapes.empty() ? &it->second->shapes : nullptr;
    if (!seen.insert(t.unsafeGetTensorImpl()).second) {
      for (const auto& s : sources) used.insert(s);
      return;
    }
    Plan plan{name, t, sources, {}, it != fused.end() && it->second->combine ? it->second : nullptr};
    if (plan.fused && !shapes)
      throw Error(fmt::format("import_weights: the fused weight '{}' has a combine function but "
                              "no source shapes", name));
    std::vector<const TensorSpec*> specs;
    std::vector<std::string> absent;
    for (size_t k = 0; k < sources.size(); ++k) {
      const auto& s = sources[k];
      used.insert(s);
      const auto* spec = weights.find(s);
      if (!spec) {
        absent.push_back(s);
        continue;
      }
      if (shapes && (shapes->size() != sources.size() || (*shapes)[k] != spec->shape))
        misshaped.push_back(fmt::format("{}: the file's {}, the map's {}", s,
                                        shape_text(spec->shape),
                                        k < shapes->size() ? shape_text((*shapes)[k]) : "none"));
      specs.push_back(spec);
      int64_t numel = 1;
      for (auto d : spec->shape) numel *= d;
      plan.source_numel.push_back(numel);
      if (!HfWeights::convertible(spec->dtype, t.scalar_type()))
        bad_dtype.push_back(fmt::format("{}: the file's {} for the model's {}", s,
                                        dtype_name(spec->dtype), c10::toString(t.scalar_type())));
    }
    if (!absent.empty()) {
      missing.push_back(sources.size() == 1 && sources[0] == name
                            ? name
                            : fmt::format("{} (from {})", name, fmt::join(absent, ", ")));
      return;
    }
    int64_t total = 0;
    for (auto n : plan.source_numel) total += n;
    if (plan.fused ? total != t.numel() : !fits(t.sizes().vec(), specs)) {
      std::vector<std::string> shapes;
      for (const auto* s : specs) shapes.push_back(shape_text(s->shape));
      misshaped.push_back(fmt::format("{}: the model's {}, the file's {}", name,
                                      shape_text(t.sizes().vec()), fmt::join(shapes, " + ")));
      return;
    }
    plans.push_back(std::move(plan));
  };
  for (const auto& p : module.named_parameters()) plan_of(p.key(), p.value());
  for (const auto& b : module.named_buffers()) plan_of(b.key(), b.value());
  std::vector<std::string> unexpected;
  for (const auto& name : weights.names())
    if (!used.count(name) && !ignored.count(name)) unexpected.push_back(name);

  if (!missing.empty() || !unexpected.empty() || !misshaped.empty() || !bad_dtype.empty()) {
    std::string what;
    if (!missing.empty()) what += fmt::format("\n  missing from the files:{}", listed(missing));
    if (!unexpected.empty())
      what += fmt::format("\n  in the files but not in the model:{}", listed(unexpected));
    if (!misshaped.empty()) what += fmt::format("\n  shapes that differ:{}", listed(misshaped));
    if (!bad_dtype.empty())
      what += fmt::format("\n  dtypes the model cannot take:{}", listed(bad_dtype));
    throw Error(fmt::format("Hugging Face weights '{}' do not fit the model (nothing was "
                            "loaded):{}\n  (a model of another size or family: check its "
                            "config.json; names that differ: ImportOptions::fused / ignored)",
                            weights.path(), what));
  }

  // Where each plan's elements go: the whole tensor, or this rank's shard of it.
  struct Target {
    torch::Tensor dst;  // flat
    int64_t begin = 0;
  };
  std::vector<Target> targets;
  for (const auto& plan : plans) {
    const auto& t = plan.tensor;
    if (plan.fused && options.partitioned && options.partitioned->shard_of(t))
      throw Error(fmt::format("import_weights: '{}' is built in shards and its layout needs the "
                              "sources whole (FusedWeight::combine): build it outside the "
                              "PartitionedInit", plan.name));
    if (options.partitioned) {
      if (const auto shard = options.partitioned->shard_of(t)) {
        const int64_t lo = std::min(shard->numel, options.partitioned->rank() * shard->chunk);
        const int64_t hi = std::min(shard->numel, lo + shard->chunk);
        targets.push_back({shard->shard.narrow(0, 0, hi - lo), lo});
        continue;
      }
    }
    if (t.numel() > 0 && (!t.has_storage() || t.storage().nbytes() == 0))
      throw Error(fmt::format("import_weights: '{}' holds no bytes (a model built inside a "
                              "PartitionedInit?): pass that scope as ImportOptions::partitioned",
                              plan.name));
    if (!t.is_contiguous())
      throw Error(fmt::format("import_weights: '{}' is not contiguous", plan.name));
    targets.push_back({t.view({-1}), 0});
  }
  ImportReport report;
  for (size_t i = 0; i < plans.size(); ++i) {
    if (const auto* f = plans[i].fused) {
      std::vector<torch::Tensor> parts;
      for (size_t k = 0; k < f->sources.size(); ++k) {
        auto part = torch::empty(f->shapes[k], plans[i].tensor.options().device(torch::kCPU));
        weights.read(f->sources[k], 0, part.numel(), part.scalar_type(), part.data_ptr());
        report.bytes_read += int64_t(part.numel()) *
                             int64_t(c10::elementSize(weights.find(f->sources[k])->dtype));
        parts.push_back(std::move(part));
      }
      const auto value = f->combine(parts);
      if (value.sizes() != plans[i].tensor.sizes())
        throw Error(fmt::format("import_weights: the fused weight '{}' combined into {}, the "
                                "model's is {}", plans[i].name, c10::str(value.sizes()),
                                c10::str(plans[i].tensor.sizes())));
      plans[i].tensor.copy_(value);
      ++report.tensors;
      continue;
    }
    report.bytes_read += read_range(weights, plans[i], targets[i].begin, targets[i].dst.numel(),
                                    targets[i].dst);
    ++report.tensors;
  }
  return report;
}

}  // namespace strata::checkpoint
