// ZeRO-3's parameter layout: the model's parameters grouped into units (blocks of the model that
// are gathered and released together), each unit one flat storage that its parameters are views
// of, and this rank's shard of every unit.
//
// A unit's full storage holds parts x chunk elements (chunk = ceil(numel / parts), aligned);
// rank r keeps elements [r*chunk, (r+1)*chunk) as its shard, so an all-gather of the shards,
// rank after rank, is the unit's flat layout. Releasing a unit frees its storage's bytes while
// every parameter keeps its TensorImpl, its views and its place in autograd's saved state
// (FSDP2's resize_(0)); gathering allocates the bytes again and all-gathers into them.
//
// Trainable units are laid out one after another in a flat layout (unit u at flat_base(u)); their
// shards are the pieces of one bucketed ShardMap (shard_map.h) whose buckets are the units in
// reverse order (backward's order), so the gradient reducer's per-bucket reduce-scatter is a
// per-unit reduce-scatter, and the fp32 master of stages 1-2 covers the trainable partition.
// Frozen parameters form units of their own (a block with adapters is a trainable and a frozen
// unit), sharded the same way, outside the optimizer. Persistent parameters (numel at most
// stage3_param_persistence_threshold) form one unit that is never released.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "offload/aligned_buffer.h"
#include "offload/nvme_store.h"
#include "zero/host_copy.h"
#include "zero/shard_map.h"

namespace c10 {
struct StorageImpl;
}

namespace strata::zero {

// Which parameters go together. Each tensor appears in exactly one spec (the first unit that
// uses a tied tensor owns it; later uses gather that unit again).
struct UnitSpec {
  std::string name;  // a module path ("blocks.3"), or "(root)" for the root's own parameters
  std::vector<std::string> param_names;
  std::vector<torch::Tensor> params;
};

// The default policy: the children of every ModuleList / Sequential / ModuleDict are units, and
// so is every other module met on the way down that holds no such container (with its whole
// subtree); a module's own parameters beside containers form a unit named by its path.
// `unit_modules`, when not empty, names the units instead (module paths); parameters outside
// all of them form the unit "(rest)". Throws strata::Error for a path that is not a module.
std::vector<UnitSpec> plan_units(torch::nn::Module& root,
                                 const std::vector<std::string>& unit_modules = {});

struct UnitOptions {
  int64_t persistence_threshold = 100000;  // a parameter this small is never released
  int64_t model_persistence_threshold = INT64_MAX;  // total persistent elements, at most
  int64_t alignment = 64;
  // Where the units live when gathered, if not where the parameters are: a model built in host
  // memory moves to the device one unit at a time (never whole there). Where the partition (this
  // rank's shards) is built, if not there too: in host memory for offload_param, so that the
  // device never holds it. Unset: the parameters' device.
  std::optional<torch::Device> device, partition_device;
};

class ParamUnits {
 public:
  struct Unit {
    std::string name;
    std::vector<torch::Tensor> params;  // views of `full`
    std::vector<std::string> names;
    std::vector<int64_t> offsets;  // each parameter's place in the unit's flat layout
    int64_t numel = 0, chunk = 0;  // the unit's elements; this rank's share (parts x chunk)
    bool trainable = true, persistent = false;
    int64_t flat_base = 0;  // trainable: the unit's place in the flat layout
    torch::Tensor full;     // the unit's storage (no bytes while released)
    torch::Tensor shard;    // this rank's chunk: persistent, a view of partition() if trainable
    torch::Tensor staging;  // offload_param: the shard on the gather's device while gathered
    bool gathered = true;
    int64_t gathers = 0;  // all-gathers since creation
    // FNV-1a over the parameters' names, sizes and offsets: equal on every rank only when the
    // ranks laid the unit out alike (the coordinator's per-step check compares it).
    uint64_t layout_digest = 0;
  };

  // Moves the parameters (identical on every rank: rank 0's, broadcast) into unit storages,
  // keeps this rank's shards and releases every unit but the persistent one, one unit at a time
  // (the extra memory is one unit). One dtype and one device for all parameters. `value_of`
  // gives a parameter's values when the parameter holds none itself (partitioned_init.h).
  using ValueOf = std::function<torch::Tensor(const torch::Tensor&)>;
  ParamUnits(std::vector<UnitSpec> specs, comm::GroupPtr group, UnitOptions options,
             const ValueOf& value_of = {});
  ~ParamUnits();  // waits for reads still going into its buffers
  ParamUnits(const ParamUnits&) = delete;
  ParamUnits& operator=(const ParamUnits&) = delete;

  size_t size() const { return units_.size(); }
  // Where the units are gathered (the model's device), and a tensor options of it in the model's
  // dtype (the partition may live elsewhere: UnitOptions::partition_device, offload_param).
  const torch::Device& device() const { return device_; }
  torch::TensorOptions options() const {
    return partition_.options().device(device_).pinned_memory(false);
  }
  const Unit& unit(size_t u) const { return units_[u]; }
  int64_t parts() const { return parts_; }
  // The unit whose storage this is, or -1.
  int64_t unit_of(const c10::StorageImpl* storage) const;

  // Collective over the group: every rank must gather the same unit at the same point.
  void gather(size_t u);
  // The same, launched: the unit counts as gathered at once; wait on the returned work (null
  // when there is nothing to wait for) before its bytes are read.
  comm::WorkPtr gather_async(size_t u);
  // Frees the unit's bytes (a persistent unit stays).
  void release(size_t u);
  // Gives a released unit bytes filled with NaN, without a collective (an op that must not
  // gather is about to read it).
  void poison(size_t u);
  // Bytes of gathered (full) parameters that exist now, persistent ones included.
  int64_t gathered_bytes() const { return gathered_bytes_; }
  // The most gathered_bytes() held at any moment since reset_gathered_peak() (or creation).
  int64_t gathered_bytes_peak() const { return gathered_peak_; }
  void reset_gathered_peak() { gathered_peak_ = gathered_bytes_; }
  // The units that are gathered now, persistent ones aside (in no particular order), and their
  // elements: kept up to date by gather, release and poison, so a caller never scans every unit.
  const std::vector<size_t>& live_units() const { return live_units_; }
  int64_t live_numel() const { return live_numel_; }

  // The trainable units' shards, in ShardMap order (model dtype): what the master covers.
  const torch::Tensor& partition() const { return partition_; }
  const ShardMap& shards() const { return shards_; }
  // For the gradient reducer: trainable parameters, each one's flat offset, and the parameters
  // of each ShardMap bucket (= trainable unit, reverse order).
  const std::vector<torch::Tensor>& trainable_params() const { return trainable_params_; }
  const std::vector<int64_t>& flat_offsets() const { return flat_offsets_; }
  const std::vector<std::vector<size_t>>& plan() const { return plan_; }
  // Per bucket of plan(): whether it is a persistent unit (its parameters are spread over the
  // whole model, so its gradients arrive over the whole backward).
  const std::vector<bool>& persistent_buckets() const { return persistent_buckets_; }
  // The trainable shards as pieces of another flat layout in which trainable parameter k (of
  // trainable_params()) starts at offsets[k]: checkpoints record partitions in the gap-free
  // layout of stages 0-2, so that any stage and world size can read them.
  ShardMap shards_over(const std::vector<int64_t>& offsets) const;
  // Sets unit u's shard (and whole copy, if persistent) from its parameters' full values.
  void assign(size_t u, const std::vector<torch::Tensor>& values);
  // After the optimizer wrote new shards: the persistent unit is gathered again.
  void refresh_persistent();
  // Resident bytes: shards, frozen shards and the persistent unit's full copy.
  int64_t resident_bytes(bool host_only = false) const;
  // The largest unit's full bytes (the memory bound is stated in them).
  int64_t largest_unit_bytes() const;

  // offload_param (ZeRO-Infinity; zero/param_offload.cpp), once the optimizer has read
  // partition(): the trainable shards leave the model's device. "cpu": into host memory
  // (page-locked when `pin` and the model is on a GPU), copied to the device for each gather.
  // "nvme": into one swap file (`file_name`) of `store`, read back for each gather (the persistent
  // unit's after each step); partition() then keeps its shape and no bytes. Frozen units' shards
  // and the persistent unit's whole copy stay where they are. The step's new weights come in
  // through write_partition() (an offloaded optimizer's host tiles) or store_partition() (the
  // master of an optimizer on the device).
  void offload_partition(const std::string& device, bool pin,
                         std::shared_ptr<offload::NvmeStore> store,
                         const std::string& file_name = "params");
  const std::string& partition_offload() const { return offload_; }
  // offload_param: bytes of shards brought to the model's device for gathers, since creation.
  int64_t host_to_device_bytes() const { return host_to_device_bytes_; }
  // New weights for partition elements [lo, lo + values.numel()) from host memory (the
  // optimizer's tiles): copied into the partition, or written to its swap file, where lo is a
  // multiple of swap_grain(), `values` 4096-aligned and unchanged until flush_writes() returns.
  void write_partition(int64_t lo, const torch::Tensor& values);
  // The whole partition's new weights from `values` (partition-shaped, any floating dtype, on any
  // device: the optimizer's fp32 master when it stays on the device), cast to the model's dtype
  // and stored where the shards live, a unit's shard at a time; synchronous.
  void store_partition(const torch::Tensor& values);
  void flush_writes();
  // The writes whose values came from `buffer` (write_partition's data_ptr()) have landed; the
  // others may still be in flight.
  void flush_writes_from(const void* buffer);
  // offload_param "cpu": the host partition, once no gather's copy still reads it, for the
  // optimizer to write the step's new weights into directly (same layout as partition()).
  // Undefined otherwise.
  torch::Tensor writable_host_partition();
  // Partition elements per 4 KiB (the swap file's grid); 1 without NVMe.
  int64_t swap_grain() const;

 private:
  void fill(Unit& unit);  // allocate the storage's bytes again
  void set_gathered(size_t u, bool gathered);  // the flag, the byte count and the live list
  // What a gather all-gathers from: the shard, or (offload_param) its copy on the model's device.
  const torch::Tensor& gather_source(Unit& unit);
  int64_t partition_offset(const Unit& unit) const;  // the shard's place in partition()
  void write_shards(const torch::Tensor& values);     // NVMe: every trainable shard to the file
  // offload_param "cpu": before the host rewrites shards, the copies still reading them finish.
  void wait_for_host_reads();

  comm::GroupPtr group_;
  torch::Device device_{torch::kCPU};
  int64_t parts_ = 1, rank_ = 0;
  std::vector<Unit> units_;
  std::unordered_map<const c10::StorageImpl*, size_t> unit_of_storage_;
  ShardMap shards_;
  torch::Tensor partition_;
  std::vector<torch::Tensor> trainable_params_;
  std::vector<int64_t> flat_offsets_;
  std::vector<std::vector<size_t>> plan_;
  std::vector<bool> persistent_buckets_;
  int64_t gathered_bytes_ = 0, gathered_peak_ = 0;
  std::vector<size_t> live_units_;
  std::vector<int64_t> live_slot_;  // per unit: its place in live_units_, or -1
  int64_t live_numel_ = 0;
  // offload_param
  std::string offload_ = "none";
  std::shared_ptr<offload::NvmeStore> store_;
  offload::NvmeStore::FileId file_ = -1;
  offload::AlignedBuffer bounce_;  // one shard, 4096-aligned, for the swap file's writes
  // NVMe gathers read ahead (param_offload.cpp): a gather's read goes into a slot at once, and the
  // work it returns finishes the gather (the copy to the device, the all-gather) when waited for,
  // or when its slot is needed again, in the order the reads were issued.
  class NvmeGather;
  static constexpr size_t kNvmeReadSlots = 3;  // reads ahead, at most
  struct NvmeSlot {
    offload::AlignedBuffer buffer;
    HostRegistration pinned;             // page-locked for a GPU model: its copy is asynchronous
    std::shared_ptr<NvmeGather> reader;  // the gather reading into it, not finished yet
    bool copying = false;                // a copy out of it may still run on the copy stream
  };
  comm::WorkPtr gather_from_nvme(size_t u);
  void finish_nvme_gather(NvmeGather& g);
  void finish_reads_of(size_t u);
  size_t take_slot();
  std::vector<NvmeSlot> slots_;
  size_t next_slot_ = 0;
  std::vector<std::pair<const void*, offload::NvmeTicket>> writes_;  // source buffer, write
  bool host_reads_pending_ = false;
  int64_t host_to_device_bytes_ = 0;  // gathers' copies from host shards issued on a side stream
};

}  // namespace strata::zero
