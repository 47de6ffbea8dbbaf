#include "zero/partitioned_init.h"

#include <malloc.h>

#include <algorithm>
#include <set>
#include <string>

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>

#include "runtime/error.h"
#include "zero/storage.h"

namespace strata::zero {
namespace {

// One callback serves every live PartitionedInit (RecordFunction takes plain function pointers):
// installed with the first, removed with the last.
std::mutex g_inits_mutex;
std::vector<PartitionedInit*>& live_init_list() {
  static std::vector<PartitionedInit*> inits;
  return inits;
}
at::CallbackHandle g_init_callback = 0;

std::vector<PartitionedInit*> live_inits() {
  std::lock_guard<std::mutex> lock(g_inits_mutex);
  return live_init_list();
}

// The storages of an op's tensor inputs, from its start to its end.
struct Inputs : at::ObserverContext {
  std::vector<const c10::StorageImpl*> storages;
};

std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
  auto inputs = std::make_unique<Inputs>();
  for (const auto& input : fn.inputs()) {
    if (!input.isTensor()) continue;
    const auto& t = input.toTensor();
    if (t.defined() && t.has_storage()) inputs->storages.push_back(t.storage().unsafeGetStorageImpl());
  }
  for (auto* init : live_inits()) init->on_op_start(fn, inputs->storages);
  return inputs;
}

void end(const at::RecordFunction& fn, at::ObserverContext* context) {
  static const std::vector<const c10::StorageImpl*> none;
  const auto* inputs = static_cast<const Inputs*>(context);
  for (auto* init : live_inits()) init->on_op_end(fn, inputs ? inputs->storages : none);
}

// The ops that bring a new tensor into the world.
bool creates_tensor(const char* name) {
  static const std::set<std::string> factories = {
      "aten::empty",      "aten::empty_strided", "aten::empty_like", "aten::zeros",
      "aten::zeros_like", "aten::ones",          "aten::ones_like",  "aten::full",
      "aten::full_like",  "aten::rand",          "aten::randn",      "aten::randint",
      "aten::arange",     "aten::eye",           "aten::tensor",     "aten::scalar_tensor"};
  return factories.count(name) > 0;
}

}  // namespace

std::shared_ptr<PartitionedInit> PartitionedInit::create(comm::GroupPtr group,
                                                         PartitionedInitOptions options) {
  std::shared_ptr<PartitionedInit> init(new PartitionedInit(std::move(group), options));
  init->active_ = true;
  std::lock_guard<std::mutex> lock(g_inits_mutex);
  live_init_list().push_back(init.get());
  if (live_init_list().size() == 1)
    g_init_callback = at::addGlobalCallback(at::RecordFunctionCallback(&start, &end)
                                           .needsInputs(true)
                                           .needsOutputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
  return init;
}

PartitionedInit::PartitionedInit(comm::GroupPtr group, PartitionedInitOptions options)
    : group_(group && group->size() > 1 ? std::move(group) : nullptr),
      options_(options),
      parts_(group_ ? group_->size() : 1),
      rank_(group_ ? group_->rank() : 0) {}

PartitionedInit::~PartitionedInit() { unwatch(); }

void PartitionedInit::unwatch() {
  std::lock_guard<std::mutex> lock(g_inits_mutex);
  auto& r = live_init_list();
  const auto it = std::find(r.begin(), r.end(), this);
  if (it == r.end()) return;
  r.erase(it);
  if (r.empty()) {
    at::removeCallback(g_init_callback);
    g_init_callback = 0;
  }
}

void PartitionedInit::on_op_start(const at::RecordFunction& fn,
                                  const std::vector<const c10::StorageImpl*>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!active_) return;
  held_.insert(inputs.begin(), inputs.end());
  // A new tensor: the construction has moved past the ones recorded so far.
  if (creates_tensor(fn.name())) seal_pending();
  for (const auto* storage : inputs) regather(storage);
}

void PartitionedInit::on_op_end(const at::RecordFunction& fn,
                                const std::vector<const c10::StorageImpl*>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!active_) return;
  for (const auto* storage : inputs)  // (an op that started before this scope held nothing)
    if (auto it = held_.find(storage); it != held_.end()) held_.erase(it);
  // Once the construction is over, a tensor an op had to gather is partitioned right after it.
  if (finished_) return seal_pending();
  // What a factory op made, and what any other op made in a storage of its own (`randn(...) *
  // 0.02` kept as a parameter; not a view of something else): a temporary is gone by the time
  // it would be partitioned, a kept tensor is partitioned as the construction moves on.
  const bool factory = creates_tensor(fn.name());
  for (const auto& output : fn.outputs())
    if (output.isTensor()) {
      const auto& t = output.toTensor();
      if (t.defined() && t.has_storage() && t.is_floating_point() && t.numel() >= options_.min_numel &&
          (factory || t.storage().use_count() == 1))
        pending_.push_back(c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
            t.getIntrusivePtr()));
    }
}

void PartitionedInit::seal_pending() {
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& weak : pending) {
    auto impl = weak.lock();
    if (!impl) continue;
    // An input of an op still running stays whole until a later op (the op reads it).
    if (impl->has_storage() && held_.count(impl->storage().unsafeGetStorageImpl())) {
      pending_.push_back(std::move(weak));
      continue;
    }
    seal(torch::Tensor(std::move(impl)));
  }
}

void PartitionedInit::seal(torch::Tensor t) {
  at::DisableRecordFunctionGuard no_callbacks;  // the partitioning's own ops
  torch::NoGradGuard no_grad;
  if (!t.has_storage() || t.storage().nbytes() == 0) return;
  // Only a tensor that owns its storage whole: views and shared storages stay as they are.
  if (!t.is_contiguous() || t.storage_offset() != 0 ||
      t.storage().nbytes() != size_t(t.numel()) * t.element_size())
    return;
  auto data = t.detach();
  if (group_) group_->broadcast(data, 0);  // the ranks agree, whatever their RNG did
  // The model's dtype for floating-point tensors only: an integer or bool buffer keeps its own.
  const auto dtype = t.is_floating_point() ? options_.dtype.value_or(t.scalar_type()) : t.scalar_type();
  const auto device = options_.device.value_or(t.device());
  const auto opts = t.options().dtype(dtype).device(device);
  int64_t chunk = (t.numel() + parts_ - 1) / parts_;
  chunk = (chunk + options_.alignment - 1) / options_.alignment * options_.alignment;
  // This rank's chunk only (zero past the tensor's end): no copy of the whole tensor is made.
  Shard shard{torch::zeros({chunk}, opts), t.numel(), chunk};
  const int64_t lo = std::min(t.numel(), rank_ * chunk), hi = std::min(t.numel(), lo + chunk);
  if (hi > lo) shard.shard.narrow(0, 0, hi - lo).copy_(data.reshape({-1}).narrow(0, lo, hi - lo));
  // Until the construction is over the tensor keeps its own dtype and device (no bytes): an op of
  // the constructor that comes back to it (Linear's kaiming_uniform_ after its bias's empty())
  // then runs as without partitioning, in fp32, and the 16-bit shard takes the result. Cast at
  // once, a 16-bit weight would be drawn in 16 bits (uniform_ on bf16 takes 8 random bits), a
  // model other than the one built whole and cast. finish() gives every tensor the model's.
  if (finished_) adopt_shard_type(t, shard);
  release_bytes(t);
  data = torch::Tensor();
#ifdef __GLIBC__
  // The whole tensor's bytes back to the system now: between the small shards kept, the heap
  // would otherwise keep a hole of each freed tensor in the process's memory.
  malloc_trim(0);
#endif
  remember(t, std::move(shard), sealed_count_++);
}

void PartitionedInit::adopt_shard_type(const torch::Tensor& t, const Shard& shard) {
  const auto& s = shard.shard;
  if (s.scalar_type() != t.scalar_type() || s.device() != t.device())
    t.set_data(torch::empty(t.sizes(), s.options()));  // the model's dtype and device
}

void PartitionedInit::remember(const torch::Tensor& t, Shard shard, uint64_t order) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  sealed_.erase(storage);
  sealed_.emplace(storage, Entry{t.storage().getWeakStorageImpl(),
                                 c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
                                     t.getIntrusivePtr()),
                                 std::move(shard), order});
}

void PartitionedInit::regather(const c10::StorageImpl* storage) {
  auto it = sealed_.find(storage);
  if (it == sealed_.end()) return;
  auto impl = it->second.tensor.lock();
  if (!impl || it->second.storage.expired()) {
    sealed_.erase(it);
    return;
  }
  torch::Tensor t(std::move(impl));
  const auto values = full_value(t);
  {
    at::DisableRecordFunctionGuard no_callbacks;
    torch::NoGradGuard no_grad;
    refill_bytes(t, size_t(t.numel()) * t.element_size());
    t.detach().copy_(values);
  }
  sealed_.erase(storage);
  pending_.push_back(
      c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()));
}

std::optional<PartitionedInit::Shard> PartitionedInit::shard_of(const torch::Tensor& t) const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!t.defined() || !t.has_storage()) return std::nullopt;
  auto it = sealed_.find(t.storage().unsafeGetStorageImpl());
  if (it == sealed_.end()) return std::nullopt;
  return it->second.shard;
}

torch::Tensor PartitionedInit::full_value(const torch::Tensor& t) const {
  const auto shard = shard_of(t);
  if (!shard) throw Error("PartitionedInit::full_value: the tensor was not partitioned");
  at::DisableRecordFunctionGuard no_callbacks;
  torch::NoGradGuard no_grad;
  auto all = torch::empty({parts_ * shard->chunk}, shard->shard.options());
  if (group_)
    group_->all_gather(all, shard->shard);
  else
    all.copy_(shard->shard);
  return all.narrow(0, 0, shard->numel).view(t.sizes());
}

torch::Tensor PartitionedInit::take_full_value(const torch::Tensor& t) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  torch::Tensor value;
  if (group_) {
    value = full_value(t);
  } else {
    // One process: the one shard is the value; hand it over rather than copy it.
    const auto shard = shard_of(t);
    if (!shard) throw Error("PartitionedInit::take_full_value: the tensor was not partitioned");
    value = shard->shard.narrow(0, 0, shard->numel).view(t.sizes());
  }
  sealed_.erase(t.storage().unsafeGetStorageImpl());
  return value;
}

void PartitionedInit::finish() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!active_) return;
  seal_pending();
  finished_ = true;
  // The model's dtype and device for what was partitioned during the construction (a new
  // storage each, without bytes: the entries move to it).
  at::DisableRecordFunctionGuard no_callbacks;
  torch::NoGradGuard no_grad;
  std::vector<std::pair<uint64_t, const c10::StorageImpl*>> order;
  for (const auto& [storage, entry] : sealed_) order.emplace_back(entry.order, storage);
  std::sort(order.begin(), order.end());
  for (const auto& [n, storage] : order) {
    auto node = sealed_.extract(storage);
    auto impl = node.mapped().tensor.lock();
    if (!impl || node.mapped().storage.expired()) continue;
    torch::Tensor t(std::move(impl));
    adopt_shard_type(t, node.mapped().shard);
    release_bytes(t);
    remember(t, std::move(node.mapped().shard), n);
  }
}

void PartitionedInit::restore_except(const std::vector<torch::Tensor>& keep) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  std::set<const c10::StorageImpl*> kept;
  for (const auto& t : keep)
    if (t.defined() && t.has_storage()) kept.insert(t.storage().unsafeGetStorageImpl());
  std::vector<std::pair<uint64_t, const c10::StorageImpl*>> others;
  for (const auto& [storage, entry] : sealed_)
    if (!kept.count(storage)) others.emplace_back(entry.order, storage);
  std::sort(others.begin(), others.end());
  for (const auto& [order, storage] : others) regather(storage);
  pending_.clear();  // back for good, not to be partitioned again
}

void PartitionedInit::release() {
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    active_ = false;
    sealed_.clear();
    pending_.clear();
    held_.clear();
  }
  // Nothing is watched any more: the op callback (which reads every op's inputs and outputs)
  // goes now, not when the last handle to this scope does.
  unwatch();
}

int64_t PartitionedInit::shard_bytes() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  int64_t bytes = 0;
  for (const auto& [s, e] : sealed_) bytes += e.shard.shard.numel() * e.shard.shard.element_size();
  return bytes;
}

}  // namespace strata::zero
