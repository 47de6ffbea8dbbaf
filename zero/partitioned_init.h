// DeepSpeed's zero.Init for LibTorch: the user's model is built inside a scope, unchanged, and
// every large tensor it creates is partitioned as soon as the construction moves on, so that no
// rank ever holds the whole model, not even before strata::initialize.
//
//   auto init = strata::zero::PartitionedInit::create(group, {torch::kBFloat16});
//   GPT model(cfg);                       // the user's constructor, as it is
//   init->finish();                       // (or let the scope object go)
//   auto engine = strata::initialize(model, config, {.partitioned_init = init, ...});
//
// How, without hooks: an op callback records the tensors that factory ops (empty, zeros, randn,
// ...) create, and those other ops create in storages of their own (`randn(...) * 0.02`). When the
// next factory op starts, the construction has moved past the tensors recorded so far: each one at
// least `min_numel` elements large is broadcast from rank 0 (the ranks agree whatever their RNG
// did), cast to the model's dtype, cut to this rank's chunk, and its bytes are released (the tensor
// keeps its TensorImpl, as ZeRO-3's units do). An op that touches a released tensor later in the
// construction (LibTorch's Linear allocates its bias before it initialises its weight) all-gathers
// it first, in the tensor's own dtype, and records it again: the tensors take the model's dtype
// and device only at finish(), so that a constructor's in-place initialisation draws in fp32 as
// it would without partitioning (the model is the one built whole and then cast). Every rank runs the same constructor, so every rank makes the same
// collectives in the same order. strata::initialize at stage 3 then builds its units from the
// shards, one tensor at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>

#include "comm/process_group.h"

namespace at {
class RecordFunction;
}

namespace strata::zero {

struct PartitionedInitOptions {
  // The dtype and device the shards (and later the model) have: the mixed-precision dtype.
  std::optional<torch::ScalarType> dtype;
  std::optional<torch::Device> device;
  int64_t min_numel = 100000;  // smaller tensors stay whole (stage3_param_persistence_threshold)
  int64_t alignment = 64;
};

class PartitionedInit {
 public:
  // The group may be null (one process: tensors are still released and kept as one shard).
  static std::shared_ptr<PartitionedInit> create(comm::GroupPtr group,
                                                 PartitionedInitOptions options = {});
  ~PartitionedInit();

  // The construction is over: what is still recorded is partitioned (a collective).
  void finish();
  // A partitioned tensor's shard (this rank's chunk of its flattened elements), or nullopt.
  struct Shard {
    torch::Tensor shard;
    int64_t numel = 0, chunk = 0;
  };
  std::optional<Shard> shard_of(const torch::Tensor& t) const;
  // This rank's shard of a tensor is elements [rank() * chunk, (rank() + 1) * chunk) of its
  // flattened elements (zero past numel).
  int64_t rank() const { return rank_; }
  int64_t parts() const { return parts_; }
  // The whole tensor, all-gathered from the shards (a collective), in its shape.
  torch::Tensor full_value(const torch::Tensor& t) const;
  // The same, and the shard is dropped: the engine's units take the tensors one at a time, so
  // that the shards and the units' partition never both hold the whole model.
  torch::Tensor take_full_value(const torch::Tensor& t);
  // Every partitioned tensor but `keep` (the parameters) gets its bytes back for good: buffers
  // and other tensors the model holds (a collective, in the order they were partitioned).
  void restore_except(const std::vector<torch::Tensor>& keep);
  // The engine has built its units: stop watching ops, drop the shards.
  void release();
  // Bytes of shards held now.
  int64_t shard_bytes() const;

  // `inputs`: the storages of the op's tensor inputs. While an op runs, its inputs are not
  // partitioned: a factory op inside it (the output TensorIterator allocates) must not free the
  // bytes the op is about to read (`torch::rand(...) * scale` would read freed memory).
  void on_op_start(const at::RecordFunction& fn, const std::vector<const c10::StorageImpl*>& inputs);
  void on_op_end(const at::RecordFunction& fn, const std::vector<const c10::StorageImpl*>& inputs);

 private:
  void unwatch();  // leaves the list the op callback serves (the last one removes it)
  PartitionedInit(comm::GroupPtr group, PartitionedInitOptions options);
  void seal_pending();        // partition what the construction has moved past
  void seal(torch::Tensor t);
  void regather(const c10::StorageImpl* storage);
  // t takes the shard's dtype and device (no bytes).
  static void adopt_shard_type(const torch::Tensor& t, const Shard& shard);
  void remember(const torch::Tensor& t, Shard shard, uint64_t order);

  comm::GroupPtr group_;
  PartitionedInitOptions options_;
  int64_t parts_ = 1, rank_ = 0;
  mutable std::recursive_mutex mutex_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> pending_;
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor;
    Shard shard;
    uint64_t order = 0;  // when it was partitioned: the same on every rank
  };
  std::unordered_map<const c10::StorageImpl*, Entry> sealed_;
  std::unordered_multiset<const c10::StorageImpl*> held_;  // inputs of the ops running now
  uint64_t sealed_count_ = 0;
  bool active_ = false;
  bool finished_ = false;
};

}  // namespace strata::zero
