#include "zero/param_units.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <unordered_set>

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>

#include "runtime/error.h"
#include "zero/host_copy.h"
#include "zero/storage.h"

namespace strata::zero {
namespace {

bool is_container(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::ModuleListImpl*>(&m) ||
         dynamic_cast<const torch::nn::SequentialImpl*>(&m) ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&m);
}

bool holds_container(const torch::nn::Module& m) {
  for (const auto& child : m.children())
    if (is_container(*child) || holds_container(*child)) return true;
  return false;
}

std::string join(const std::string& path, const std::string& name) {
  return path.empty() ? name : path + "." + name;
}

// Collects units, each tensor once (the first unit that registers a tied tensor owns it).
class Planner {
 public:
  void unit(const std::string& name, const torch::nn::Module& m, bool recurse) {
    UnitSpec spec;
    spec.name = name;
    for (const auto& p : m.named_parameters(recurse)) {
      if (!seen_.insert(p.value().unsafeGetTensorImpl()).second) continue;
      spec.param_names.push_back(join(name == "(root)" ? "" : name, p.key()));
      spec.params.push_back(p.value());
    }
    if (!spec.params.empty()) specs_.push_back(std::move(spec));
  }
  // `m` at `path`: the children of a container are units; a child holding no container is a
  // unit; others are walked further; the module's own parameters form a unit.
  void walk(const torch::nn::Module& m, const std::string& path, bool top) {
    if (!top && !holds_container(m)) return unit(path, m, true);
    for (const auto& child : m.named_children()) {
      const std::string child_path = join(path, child.key());
      if (is_container(*child.value())) {
        for (const auto& item : child.value()->named_children())
          walk(*item.value(), join(child_path, item.key()), false);
      } else {
        walk(*child.value(), child_path, false);
      }
    }
    // Own parameters last: a tensor tied to a child's (a head reusing the embedding) is the
    // child's.
    unit(path.empty() ? "(root)" : path, m, false);
  }
  std::vector<UnitSpec> take() { return std::move(specs_); }

 private:
  std::unordered_set<const c10::TensorImpl*> seen_;
  std::vector<UnitSpec> specs_;
};

int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

}  // namespace

std::vector<UnitSpec> plan_units(torch::nn::Module& root,
                                 const std::vector<std::string>& unit_modules) {
  Planner planner;
  if (unit_modules.empty()) {
    planner.walk(root, "", /*top=*/true);
    return planner.take();
  }
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& m : root.named_modules()) modules[m.key()] = m.value();
  for (const auto& path : unit_modules) {
    auto it = modules.find(path);
    if (it == modules.end() || path.empty())
      throw Error(fmt::format("ZeRO-3 unit '{}' is not a submodule of the model (a unit is "
                              "named by its module path, e.g. 'blocks.0')",
                              path));
    planner.unit(path, *it->second, true);
  }
  planner.unit("(rest)", root, true);
  return planner.take();
}

ParamUnits::ParamUnits(std::vector<UnitSpec> specs, comm::GroupPtr group, UnitOptions options,
                       const ValueOf& value_of)
    : group_(group && group->size() > 1 ? std::move(group) : nullptr),
      parts_(group_ ? group_->size() : 1),
      rank_(group_ ? group_->rank() : 0) {
  // Persistent parameters, decided in module order (DeepSpeed's mark_persistent_parameters):
  // each one at most persistence_threshold elements is kept whole while the total stays under
  // model_persistence_threshold; one that would pass it is skipped, later smaller ones may still
  // fit. The order is the model's, the same on every rank: nothing here may depend on where a
  // rank's allocator put a tensor (ordering equal sizes by address let ranks keep different
  // parameters whole and mix their weights).
  std::unordered_set<const c10::TensorImpl*> persistent;
  int64_t persistent_numel = 0;
  for (const auto& s : specs)
    for (const auto& p : s.params) {
      const int64_t n = p.numel();
      if (n > options.persistence_threshold ||
          persistent_numel + n > options.model_persistence_threshold)
        continue;
      persistent_numel += n;
      persistent.insert(p.unsafeGetTensorImpl());
    }

  // Units: each spec's trainable and frozen parameters, then the persistent ones.
  Unit kept_trainable, kept_frozen;
  kept_trainable.name = "(persistent)";
  kept_frozen.name = "(persistent, frozen)";
  kept_trainable.persistent = kept_frozen.persistent = true;
  kept_frozen.trainable = false;
  auto add = [](Unit& u, const torch::Tensor& p, const std::string& name) {
    u.params.push_back(p);
    u.names.push_back(name);
    u.offsets.push_back(u.numel);
    u.numel += p.numel();
  };
  for (const auto& s : specs) {
    Unit trainable, frozen;
    trainable.name = s.name;
    frozen.name = s.name + " (frozen)";
    frozen.trainable = false;
    for (size_t i = 0; i < s.params.size(); ++i) {
      const auto& p = s.params[i];
      const bool keep = persistent.count(p.unsafeGetTensorImpl()) > 0;
      add(keep ? (p.requires_grad() ? kept_trainable : kept_frozen)
               : (p.requires_grad() ? trainable : frozen),
          p, s.param_names[i]);
    }
    for (auto* u : {&trainable, &frozen})
      if (u->numel > 0) units_.push_back(std::move(*u));
  }
  for (auto* u : {&kept_trainable, &kept_frozen})
    if (u->numel > 0) units_.push_back(std::move(*u));
  if (units_.empty()) throw Error("ZeRO-3: the model has no parameters to partition");
  for (auto& u : units_) {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](const void* data, size_t n) {
      for (size_t i = 0; i < n; ++i) {
        h ^= static_cast<const unsigned char*>(data)[i];
        h *= 1099511628211ull;
      }
    };
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t sizes[2] = {u.params[i].numel(), u.offsets[i]};
      mix(u.names[i].data(), u.names[i].size() + 1);
      mix(sizes, sizeof sizes);
    }
    u.layout_digest = h;
  }

  const auto& first = units_.front().params.front();
  for (const auto& u : units_)
    for (size_t i = 0; i < u.params.size(); ++i)
      if (u.params[i].scalar_type() != first.scalar_type() ||
          u.params[i].device() != first.device())
        throw Error(fmt::format("ZeRO-3: parameters '{}' ({} on {}) and '{}' ({} on {}) differ in "
                                "dtype or device; move the model to one device and dtype",
                                units_.front().names.front(), c10::toString(first.scalar_type()),
                                first.device().str(), u.names[i],
                                c10::toString(u.params[i].scalar_type()),
                                u.params[i].device().str()));

  // The trainable units' flat layout and its ShardMap: buckets are the units, last unit first.
  std::vector<size_t> trainable_units;
  int64_t flat = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!units_[u].trainable) continue;
    trainable_units.push_back(u);
    units_[u].flat_base = flat;
    int64_t chunk = (units_[u].numel + parts_ - 1) / parts_;
    chunk = (chunk + options.alignment - 1) / options.alignment * options.alignment;
    flat += parts_ * chunk;
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t k = trainable_units.size(); k-- > 0;) {
    const auto& u = units_[trainable_units[k]];
    ranges.emplace_back(u.flat_base, u.flat_base + u.numel);
  }
  shards_ = ShardMap::bucketed(ranges, parts_, options.alignment);
  device_ = options.device.value_or(first.device());
  const auto opts = first.options().device(device_);
  partition_ = torch::empty({shards_.partition_numel()},
                            opts.device(options.partition_device.value_or(device_)));
  for (size_t k = trainable_units.size(); k-- > 0;) {
    const size_t b = trainable_units.size() - 1 - k;
    auto& u = units_[trainable_units[k]];
    const auto& bucket = shards_.buckets()[b];
    u.chunk = bucket.chunk;
    u.shard = partition_.narrow(0, bucket.base, bucket.chunk);
    plan_.emplace_back();
    persistent_buckets_.push_back(u.persistent);
  }
  for (size_t k = 0; k < trainable_units.size(); ++k) {
    auto& u = units_[trainable_units[k]];
    auto& bucket_params = plan_[trainable_units.size() - 1 - k];
    for (size_t i = 0; i < u.params.size(); ++i) {
      bucket_params.push_back(trainable_params_.size());
      trainable_params_.push_back(u.params[i]);
      flat_offsets_.push_back(u.flat_base + u.offsets[i]);
    }
  }

  live_slot_.assign(units_.size(), -1);
  // Move every parameter into its unit's storage; keep this rank's chunk.
  at::DisableRecordFunctionGuard no_callbacks;  // these ops are the layout's own
  torch::NoGradGuard no_grad;
  for (auto& u : units_) {
    if (!u.trainable) {
      u.chunk = (u.numel + parts_ - 1) / parts_;
      u.chunk = (u.chunk + options.alignment - 1) / options.alignment * options.alignment;
      u.shard = torch::empty({u.chunk}, opts);
    }
    u.full = torch::zeros({parts_ * u.chunk}, opts);
    for (size_t i = 0; i < u.params.size(); ++i) {
      auto& p = u.params[i];
      const auto value = value_of ? value_of(p) : p;
      u.full.narrow(0, u.offsets[i], p.numel()).copy_(value.reshape({-1}));
      p.mutable_grad() = torch::Tensor();
      view_into(p, u.full, u.offsets[i]);  // same TensorImpl: module and autograd keep it
    }
    u.shard.copy_(u.full.narrow(0, rank_ * u.chunk, u.chunk));
    const size_t index = size_t(&u - units_.data());
    unit_of_storage_[u.full.storage().unsafeGetStorageImpl()] = index;
    gathered_bytes_ += bytes_of(u.full);
    release(index);
  }
}

int64_t ParamUnits::unit_of(const c10::StorageImpl* storage) const {
  const auto it = unit_of_storage_.find(storage);
  return it == unit_of_storage_.end() ? -1 : static_cast<int64_t>(it->second);
}

void ParamUnits::fill(Unit& unit) { refill_bytes(unit.full, size_t(bytes_of(unit.full))); }

void ParamUnits::gather(size_t u) {
  if (auto work = gather_async(u)) {
    at::DisableRecordFunctionGuard no_callbacks;
    work->wait();
  }
}

comm::WorkPtr ParamUnits::gather_async(size_t u) {
  auto& unit = units_.at(u);
  at::DisableRecordFunctionGuard no_callbacks;
  torch::NoGradGuard no_grad;
  if (!unit.gathered) {
    fill(unit);
    set_gathered(u, true);
  }
  ++unit.gathers;
  if (offload_ == "cpu" && unit.trainable && unit.full.is_cuda() && unit.shard.is_pinned()) {
    // From page-locked host memory: the copy, and the all-gather after it, on the copy stream,
    // beside the compute stream; the caller's wait on the returned work orders its reads after.
    SideStream side(unit.full.device());
    side.uses(unit.full);
    host_reads_pending_ = true;
    host_to_device_bytes_ += bytes_of(unit.shard);
    if (!group_) {  // one process: straight into the unit, no copy on the device
      unit.full.copy_(unit.shard, /*non_blocking=*/true);
      return side.done();
    }
    unit.staging = torch::empty({unit.chunk}, unit.full.options());
    unit.staging.copy_(unit.shard, /*non_blocking=*/true);
    return group_->all_gather_async(unit.full, unit.staging);
  }
  if (offload_ == "nvme" && unit.trainable) return gather_from_nvme(u);
  const auto& source = gather_source(unit);
  if (group_) return group_->all_gather_async(unit.full, source);  // reads it until done
  unit.full.copy_(source);
  unit.staging = torch::Tensor();  // one process: the copy is the unit, nothing reads it later
  return nullptr;
}

void ParamUnits::release(size_t u) {
  auto& unit = units_.at(u);
  if (unit.persistent || !unit.gathered) return;
  finish_reads_of(u);  // a read for it still in a slot: finished before its bytes go
  release_bytes(unit.full);
  unit.staging = torch::Tensor();
  set_gathered(u, false);
}

void ParamUnits::set_gathered(size_t u, bool gathered) {
  auto& unit = units_[u];
  unit.gathered = gathered;
  gathered_bytes_ += gathered ? bytes_of(unit.full) : -bytes_of(unit.full);
  gathered_peak_ = std::max(gathered_peak_, gathered_bytes_);
  if (unit.persistent) return;
  auto& slot = live_slot_[u];
  if (gathered && slot < 0) {
    slot = int64_t(live_units_.size());
    live_units_.push_back(u);
    live_numel_ += unit.numel;
  } else if (!gathered && slot >= 0) {
    live_slot_[live_units_.back()] = slot;  // the last one takes its place
    live_units_[size_t(slot)] = live_units_.back();
    live_units_.pop_back();
    slot = -1;
    live_numel_ -= unit.numel;
  }
}

void ParamUnits::poison(size_t u) {
  auto& unit = units_.at(u);
  if (unit.gathered) return;
  at::DisableRecordFunctionGuard no_callbacks;
  torch::NoGradGuard no_grad;
  fill(unit);
  unit.full.fill_(std::numeric_limits<double>::quiet_NaN());
  set_gathered(u, true);
}

ShardMap ParamUnits::shards_over(const std::vector<int64_t>& offsets) const {
  if (offsets.size() != trainable_params_.size())
    throw Error("ParamUnits::shards_over: one offset per trainable parameter");
  std::vector<std::vector<ShardPiece>> pieces(parts_);
  size_t k = 0;  // trainable parameters in unit order, as the constructor listed them
  for (const auto& u : units_) {
    if (!u.trainable) continue;
    const int64_t base = partition_offset(u);
    for (int64_t r = 0; r < parts_; ++r) {
      const int64_t a = r * u.chunk, b = std::min((r + 1) * u.chunk, u.numel);
      for (size_t i = 0; i < u.params.size(); ++i) {
        const int64_t lo = std::max(a, u.offsets[i]);
        const int64_t hi = std::min(b, u.offsets[i] + u.params[i].numel());
        if (hi > lo) pieces[r].push_back({offsets[k + i] + lo - u.offsets[i], hi - lo, base + lo - a});
      }
    }
    k += u.params.size();
  }
  return ShardMap::from_pieces(std::move(pieces), shards_.partition_numel());
}

void ParamUnits::assign(size_t u, const std::vector<torch::Tensor>& values) {
  auto& unit = units_.at(u);
  if (values.size() != unit.params.size())
    throw Error(fmt::format("ParamUnits::assign: unit '{}' has {} parameters, {} values given",
                            unit.name, unit.params.size(), values.size()));
  at::DisableRecordFunctionGuard no_callbacks;
  torch::NoGradGuard no_grad;
  auto flat = torch::zeros({parts_ * unit.chunk}, unit.shard.options());
  for (size_t i = 0; i < values.size(); ++i)
    flat.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(values[i].reshape({-1}));
  const auto mine = flat.narrow(0, rank_ * unit.chunk, unit.chunk);
  if (offload_ == "nvme" && unit.trainable) {
    std::memcpy(bounce_.data(), mine.data_ptr(), size_t(bytes_of(mine)));
    const uint64_t at = uint64_t(partition_offset(unit) * partition_.element_size());
    store_->wait(store_->write(file_, at, bounce_.data(), uint64_t(bytes_of(mine))));
  } else {
    wait_for_host_reads();
    unit.shard.copy_(mine);
  }
  if (unit.gathered) unit.full.copy_(flat);
}

void ParamUnits::refresh_persistent() {
  flush_writes();
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u].persistent && units_[u].trainable) gather(u);
}

int64_t ParamUnits::resident_bytes(bool host_only) const {
  auto count = [&](const torch::Tensor& t) { return !host_only || t.is_cpu() ? bytes_of(t) : 0; };
  int64_t bytes = offload_ == "nvme" ? 0 : count(partition_);
  for (const auto& u : units_) {
    if (!u.trainable) bytes += count(u.shard);
    if (u.persistent) bytes += count(u.full);
  }
  return bytes;
}

int64_t ParamUnits::largest_unit_bytes() const {
  int64_t most = 0;
  for (const auto& u : units_)
    if (!u.persistent) most = std::max(most, bytes_of(u.full));
  return most;
}

}  // namespace strata::zero
