// ParamUnits' offload_param (ZeRO-Infinity's parameter offload at stage 3): where the trainable
// shards live between gathers, and how a gather and the optimizer's step reach them there.
//
// NVMe: the partition is one swap file laid out as partition() is (UnitOptions::alignment is one
// 4 KiB page then, so every unit's shard starts on the file's page grid). A gather reads the
// unit's shard into one of a few 4096-aligned slots (page-locked for a GPU model) as soon as the
// gather is launched (the coordinator launches prefetches ahead along its trace), and only the
// wait for the gather copies the slot to the model's device (on the copy stream for a GPU) and
// all-gathers: the disk works while the layers before the unit run.
//
// The step's new weights arrive one of two ways. With the optimizer offloaded too, its CPU step
// sends each tile from host memory (write_partition: copied in, or written asynchronously to the
// swap file). With the optimizer on the device (DeepSpeed allows offload_param alone at stage 3:
// the fp32 master and the moments stay on the device), the step updates the device's master and
// store_partition() casts it into the 16-bit shards a unit at a time, as DeepSpeed copies its
// fp32 partition into the offloaded fp16 one (stage3.py, _reassign_or_swap_out_partitioned_
// parameters).
//
// Host memory: a gather copies the unit's page-locked shard on the device's copy stream
// (host_copy.h's SideStream), the all-gather follows there, and the compute stream waits only
// where it reads the unit, so a prefetched unit's copy overlaps the layers before it; the host
// waits for those copies before it rewrites the shards (the step's new weights).
#include <cstring>
#include <exception>

#include <fmt/format.h>

#include "runtime/error.h"
#include "runtime/log.h"
#include "zero/host_copy.h"
#include "zero/param_units.h"
#include "zero/storage.h"

namespace strata::zero {

int64_t ParamUnits::partition_offset(const Unit& unit) const {
  return unit.shard.storage_offset() - partition_.storage_offset();
}

int64_t ParamUnits::swap_grain() const {
  return offload_ == "nvme" ? int64_t(offload::kIoAlign) / partition_.element_size() : 1;
}

void ParamUnits::offload_partition(const std::string& device, bool pin,
                                   std::shared_ptr<offload::NvmeStore> store,
                                   const std::string& file_name) {
  if (device == "none") return;
  if (offload_ != "none") throw Error("ParamUnits::offload_partition: the partition left already");
  if (device != "cpu" && device != "nvme")
    throw Error(fmt::format("offload_param.device \"{}\": expected none, cpu or nvme", device));
  torch::NoGradGuard no_grad;
  at::DisableRecordFunctionGuard no_callbacks;
  int64_t largest = 0;
  for (const auto& u : units_)
    if (u.trainable) largest = std::max(largest, u.chunk);
  const int64_t element = partition_.element_size();
  if (device == "cpu") {
    // The same layout in host memory; every trainable shard becomes a view of it again.
    // Page-locked where it can be (exactly its bytes: zero/host_copy.h), else pageable.
    auto host = pin && device_.is_cuda()
                    ? page_locked_empty(partition_.numel(), partition_.scalar_type(), device_)
                    : torch::Tensor();
    if (!host.defined()) {
      if (pin && device_.is_cuda())
        log::info("[strata] warning: offload_param: the CUDA driver could not page-lock {} MB of "
                  "host memory for the parameters; they are pageable (correct, slower copies)",
                  (partition_.numel() * element) >> 20);
      host = torch::empty({partition_.numel()}, partition_.options().device(torch::kCPU));
    }
    host.copy_(partition_);
    for (auto& u : units_)
      if (u.trainable) u.shard = host.narrow(0, partition_offset(u), u.chunk);
    partition_ = host;
    offload_ = device;
    return;
  }
  if (!store) throw Error("offload_param.device \"nvme\": no NVMe store was given");
  for (const auto& u : units_)
    if (u.trainable && (partition_offset(u) * element) % int64_t(offload::kIoAlign) != 0)
      throw Error(fmt::format("offload_param nvme: unit '{}' starts at byte {} of the partition, "
                              "off the 4 KiB grid (UnitOptions::alignment must be one page)",
                              u.name, partition_offset(u) * element));
  store_ = std::move(store);
  const uint64_t bytes = uint64_t(partition_.numel() * element);
  file_ = store_->create(file_name, bytes);
  bounce_ = offload::AlignedBuffer(size_t(largest * element));
  slots_.resize(kNvmeReadSlots);
  for (auto& slot : slots_) {
    slot.buffer = offload::AlignedBuffer(size_t(largest * element));
    slot.pinned = HostRegistration(slot.buffer.data(), offload::round_up_io(slot.buffer.size()),
                                   device_);
  }
  write_shards(partition_);  // then the partition's bytes are freed
  offload_ = device;
  release_bytes(partition_);
}

void ParamUnits::write_shards(const torch::Tensor& values) {
  // A unit at a time through the bounce buffer: each shard starts on the file's page grid and
  // spans whole pages (its chunk is aligned to one page of elements).
  const int64_t element = partition_.element_size();
  for (const auto& u : units_) {
    if (!u.trainable) continue;
    const auto shard = values.narrow(0, partition_offset(u), u.chunk)
                           .to(torch::kCPU, partition_.scalar_type())
                           .contiguous();
    std::memcpy(bounce_.data(), shard.data_ptr(), size_t(u.chunk * element));
    store_->wait(store_->write(file_, uint64_t(partition_offset(u) * element), bounce_.data(),
                               uint64_t(u.chunk * element)));
  }
}

void ParamUnits::store_partition(const torch::Tensor& values) {
  if (values.dim() != 1 || values.numel() != partition_.numel() || !values.is_floating_point())
    throw Error(fmt::format("ParamUnits::store_partition: {} values of {} for a partition of {} "
                            "elements (one flat floating-point tensor)",
                            values.numel(), c10::toString(values.scalar_type()),
                            partition_.numel()));
  torch::NoGradGuard no_grad;
  at::DisableRecordFunctionGuard no_callbacks;
  if (offload_ == "nvme") {
    flush_writes();
    write_shards(values);
    return;
  }
  wait_for_host_reads();
  // In place (host memory or the device): cast and copied a unit's shard at a time, so the
  // temporary a cast across devices needs is one shard, not the partition.
  for (const auto& u : units_)
    if (u.trainable) u.shard.copy_(values.narrow(0, partition_offset(u), u.chunk));
}

torch::Tensor ParamUnits::writable_host_partition() {
  if (offload_ != "cpu") return {};
  wait_for_host_reads();
  return partition_;
}

void ParamUnits::wait_for_host_reads() {
  if (!host_reads_pending_) return;
  host_reads_pending_ = false;
  for (const auto& u : units_)
    if (u.trainable) return SideStream::synchronize(u.full.device());
}

const torch::Tensor& ParamUnits::gather_source(Unit& unit) {
  if (offload_ == "none" || !unit.trainable) return unit.shard;
  host_to_device_bytes_ += unit.chunk * int64_t(partition_.element_size());
  if (offload_ == "cpu") {
    if (unit.shard.device() == unit.full.device()) return unit.shard;
    unit.staging = unit.shard.to(unit.full.device(), /*non_blocking=*/unit.shard.is_pinned());
    return unit.staging;
  }
  throw Error("ParamUnits::gather_source: an NVMe shard is read by gather_from_nvme");
}

// A gather whose shard is being read from the swap file into a slot. Finishing it (once) copies
// the slot to the device, or to the staging the all-gather reads, and launches the all-gather;
// waiting for it then waits for that.
class ParamUnits::NvmeGather : public comm::Work {
 public:
  NvmeGather(ParamUnits* units, size_t unit, size_t slot, offload::NvmeTicket read)
      : units(units), unit(unit), slot(slot), read(std::move(read)) {}
  void wait() override {  // once: a release may have waited for it before its user does
    if (!finished) units->finish_nvme_gather(*this);
    if (failure) std::rethrow_exception(failure);  // every wait: the unit holds no weights
    if (result && !waited) result->wait();
    waited = true;
  }
  bool is_completed() override {
    return finished ? (!result || result->is_completed()) : false;
  }
  ParamUnits* units;
  size_t unit, slot;
  offload::NvmeTicket read;
  bool finished = false, waited = false;
  comm::WorkPtr result;  // the copy's event or the all-gather (null: done on the host)
  std::exception_ptr failure;  // the read's error, for this gather's waiter (not another's)
};

ParamUnits::~ParamUnits() {
  for (auto& slot : slots_) {
    if (!slot.reader) continue;
    try {
      store_->wait(slot.reader->read);  // the read must not land in a freed buffer
    } catch (const std::exception&) {
      // its error belongs to a gather nobody waits for any more
    }
  }
  if (!slots_.empty() && device_.is_cuda()) SideStream::synchronize(device_);
}

void ParamUnits::finish_reads_of(size_t u) {
  for (auto& slot : slots_)
    if (slot.reader && slot.reader->unit == u) {
      const auto reader = slot.reader;
      reader->wait();
    }
}

size_t ParamUnits::take_slot() {
  const size_t s = next_slot_;
  next_slot_ = (next_slot_ + 1) % slots_.size();
  auto& slot = slots_[s];
  if (slot.reader) finish_nvme_gather(*slot.reader);  // in the order the reads were issued
  if (slot.copying) {
    SideStream::synchronize(device_);
    slot.copying = false;
  }
  return s;
}

comm::WorkPtr ParamUnits::gather_from_nvme(size_t u) {
  auto& unit = units_[u];
  flush_writes();  // the last step's weights first
  const size_t s = take_slot();
  auto& slot = slots_[s];
  const int64_t element = partition_.element_size();
  const uint64_t bytes = uint64_t(unit.chunk * element);
  host_to_device_bytes_ += int64_t(bytes);
  slot.reader = std::make_shared<NvmeGather>(
      this, u, s, store_->read(file_, uint64_t(partition_offset(unit) * element), slot.buffer.data(), bytes));
  return slot.reader;
}

void ParamUnits::finish_nvme_gather(NvmeGather& g) {
  if (g.finished) return;
  g.finished = true;
  auto& slot = slots_[g.slot];
  const auto keep = slot.reader;  // g lives on while this runs
  slot.reader.reset();
  try {
    store_->wait(g.read);  // a failed checksum names file and offset
  } catch (...) {
    // Kept for the gather's own wait: finishing it may be another unit's gather taking the slot.
    g.failure = std::current_exception();
    return;
  }
  at::DisableRecordFunctionGuard no_callbacks;
  torch::NoGradGuard no_grad;
  auto& unit = units_[g.unit];
  const auto host = torch::from_blob(slot.buffer.data(), {unit.chunk},
                                     unit.full.options().device(torch::kCPU));
  SideStream side(unit.full.device());  // a GPU model: the copy beside the compute stream
  side.uses(unit.full);
  const bool async = side.active() && slot.pinned.active();
  slot.copying = async;
  if (!group_) {
    unit.full.copy_(host, async);
    g.result = side.done();
    return;
  }
  unit.staging = torch::empty({unit.chunk}, unit.full.options());
  unit.staging.copy_(host, async);  // the all-gather reads the staging, the slot is free after
  g.result = group_->all_gather_async(unit.full, unit.staging);
}

void ParamUnits::write_partition(int64_t lo, const torch::Tensor& values) {
  const int64_t n = values.numel();
  if (lo < 0 || lo + n > partition_.numel() || !values.is_cpu() || !values.is_contiguous() ||
      values.scalar_type() != partition_.scalar_type())
    throw Error(fmt::format("ParamUnits::write_partition: [{}, {}) of {} elements from a {} {} "
                            "tensor",
                            lo, lo + n, partition_.numel(), values.device().str(),
                            c10::toString(values.scalar_type())));
  if (offload_ != "nvme") {
    torch::NoGradGuard no_grad;
    wait_for_host_reads();
    partition_.narrow(0, lo, n).copy_(values, /*non_blocking=*/values.is_pinned());
    return;
  }
  const auto address = reinterpret_cast<uintptr_t>(values.data_ptr());
  if (lo % swap_grain() != 0 || address % offload::kIoAlign != 0)
    throw Error(fmt::format("ParamUnits::write_partition: offset {} / address {:#x} off the swap "
                            "file's 4 KiB grid", lo, address));
  const int64_t element = partition_.element_size();
  writes_.emplace_back(values.data_ptr(), store_->write(file_, uint64_t(lo * element), values.data_ptr(),
                                  uint64_t(n * element)));
}

void ParamUnits::flush_writes() {
  if (writes_.empty()) return;
  auto pending = std::move(writes_);
  writes_.clear();
  for (const auto& w : pending) store_->wait(w.second);
}

void ParamUnits::flush_writes_from(const void* buffer) {
  // The others stay in flight: a double buffer refills one while the other is still written.
  std::vector<std::pair<const void*, offload::NvmeTicket>> rest;
  std::vector<offload::NvmeTicket> mine;
  for (auto& w : writes_) {
    if (w.first == buffer)
      mine.push_back(w.second);
    else
      rest.push_back(w);
  }
  writes_ = std::move(rest);
  for (const auto& t : mine) store_->wait(t);
}

}  // namespace strata::zero
