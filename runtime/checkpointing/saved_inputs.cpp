#include "runtime/checkpointing/saved_inputs.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "offload/aligned_buffer.h"
#include "offload/nvme_store.h"
#include "runtime/checkpointing/settings.h"
#include "runtime/error.h"
#include "runtime/log.h"

#if STRATA_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::checkpointing {
namespace {

enum class Where { kAsIs, kHost, kArena, kNvme };

constexpr int64_t kArenaAlign = 64;

int64_t aligned(int64_t n) { return (n + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }

struct Arena {
  torch::Tensor buffer;  // uint8
  int64_t used = 0;
  int64_t live = 0;  // checkpoints with a slice in it
};

struct Stores {
  std::mutex mu;
  uint64_t generation = 1;  // bumped by release_stores(): older entries own nothing any more
  std::shared_ptr<offload::NvmeStore> nvme;
  std::multimap<uint64_t, offload::NvmeStore::FileId> free_files;  // by size
  int64_t files = 0;
  std::map<std::string, Arena> arenas;  // by the device the slices live on
  std::vector<SavedInputs*> live;       // in the order they were kept
};

Stores& stores() {
  static Stores s;
  return s;
}

int64_t nbytes_of(const torch::Tensor& t) { return t.numel() * int64_t(t.element_size()); }

torch::TensorOptions host_options(const torch::Tensor& t) {
  // Page-locked only for a GPU's tensors (and only a CUDA build can pin).
  return t.options().device(torch::kCPU).pinned_memory(t.is_cuda());
}

#if STRATA_HAS_CUDA
// cpu_checkpointing's copies between a GPU and page-locked host memory run on one side stream
// per device, so they overlap the kernels of the compute stream; events order them against it.
c10::cuda::CUDAStream side_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::map<int, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(index);
  if (it == streams.end())
    it = streams.emplace(index, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index))
             .first;
  return it->second;
}
#endif

// dst <- src where one of them is a GPU's and the other page-locked host memory: on the side
// stream after what the compute stream queued; `done` (CUDA only) is recorded after the copy.
// Otherwise a plain copy.
template <class Event>
void copy_beside_compute(torch::Tensor& dst, const torch::Tensor& src, Event& done) {
#if STRATA_HAS_CUDA
  const torch::Tensor& gpu = src.is_cuda() ? src : dst;
  const torch::Tensor& host = src.is_cuda() ? dst : src;
  if (gpu.is_cuda() && host.is_pinned()) {
    const auto index = gpu.device().index();
    auto side = side_stream(index);
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(index));
    ready.block(side);
    // The compute stream may free or reuse the GPU tensor's memory once its own work is done:
    // the allocator waits for the side stream's use too.
    c10::cuda::CUDACachingAllocator::recordStream(gpu.storage().data_ptr(), side);
    c10::cuda::CUDAStreamGuard guard(side);
    dst.copy_(src, /*non_blocking=*/true);
    done.emplace();
    done->record(side);
    return;
  }
#endif
  (void)done;
  dst.copy_(src);
}

}  // namespace

struct SavedInputs::Entry {
  Where where = Where::kAsIs;
  uint64_t generation = 0;
  torch::Tensor kept;  // kAsIs: the tensor; kHost: the host copy; kArena: the slice
  torch::Tensor back;  // kHost: the copy back, started by prefetch()
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<int64_t> sizes;
  int64_t nbytes = 0;
  std::string arena;  // kArena: its key
  // kNvme
  offload::NvmeStore::FileId file = -1;
  uint64_t file_bytes = 0;
  offload::AlignedBuffer staging;  // the write's source until done, then the read's target
  offload::NvmeTicket write, read;
  bool writing = false, reading = false;
#if STRATA_HAS_CUDA
  std::optional<at::cuda::CUDAEvent> copied;  // kHost: the side stream's last copy
#else
  std::optional<int> copied;
#endif
};

std::shared_ptr<SavedInputs> SavedInputs::keep(const std::vector<torch::Tensor>& inputs) {
  const Settings s = settings();
  std::shared_ptr<SavedInputs> out(new SavedInputs());
  auto& st = stores();
  std::lock_guard<std::mutex> lock(st.mu);
  out->generation_ = st.generation;
  // Writes finished since the last checkpoint free their staging buffers (written behind).
  for (SavedInputs* live : st.live)
    for (auto& e : live->entries_)
      if (e->writing && e->write.done()) {
        st.nvme->wait(e->write);
        e->writing = false;
        e->staging = offload::AlignedBuffer();
      }
  Where where = Where::kAsIs;
  if (!s.nvme_path.empty())
    where = Where::kNvme;
  else if (s.contiguous)
    where = Where::kArena;
  else if (s.cpu_checkpointing)
    where = Where::kHost;
  if (where == Where::kArena && s.number_checkpoints < 1)
    throw Error(fmt::format(
        "{}: activation_checkpointing.contiguous_memory_optimization needs number_checkpoints "
        "(how many checkpoints one forward makes, to size the buffer); add it, e.g. the number "
        "of checkpointed blocks",
        s.source));
  // contiguous_memory_optimization: one arena per device the slices live on (a GPU's, or the
  // host's with cpu_checkpointing; a mask kept on the CPU beside a GPU's hidden state gets the
  // host's). Each arena is reset here, once for the whole checkpoint, when no live checkpoint
  // has a slice in it, and sized at its first use for number_checkpoints of this checkpoint's
  // bytes in it.
  auto arena_options = [&](const torch::Tensor& t) {
    return (s.cpu_checkpointing ? host_options(t) : t.options()).dtype(torch::kUInt8);
  };
  auto arena_key = [](const torch::TensorOptions& on) {
    return on.device().str() + (on.pinned_memory() ? "/pinned" : "");
  };
  // This checkpoint's bytes per arena, and the arena's memory.
  std::map<std::string, std::pair<int64_t, torch::TensorOptions>> arena_need;
  if (where == Where::kArena) {
    for (const auto& t : inputs) {
      if (!t.defined()) continue;
      const auto on = arena_options(t);
      auto& need = arena_need.try_emplace(arena_key(on), 0, on).first->second;
      need.first += aligned(nbytes_of(t));
    }
    for (const auto& [key, need] : arena_need) {
      Arena& a = st.arenas[key];
      if (a.live == 0) a.used = 0;
      if (!a.buffer.defined())
        a.buffer = torch::empty({need.first * std::max<int64_t>(1, s.number_checkpoints)},
                                need.second);
    }
  }
  for (const auto& t : inputs) {
    auto e = std::make_unique<Entry>();
    e->generation = st.generation;
    if (!t.defined()) {
      out->entries_.push_back(std::move(e));
      continue;
    }
    const auto c = t.detach();
    e->device = c.device();
    e->dtype = c.scalar_type();
    e->sizes = c.sizes().vec();
    e->nbytes = nbytes_of(c);
    out->bytes_ += e->nbytes;
    e->where = where;
    switch (where) {
      case Where::kAsIs:
        e->kept = c;
        break;
      case Where::kHost:
        e->kept = torch::empty(e->sizes, host_options(c));
        copy_beside_compute(e->kept, c, e->copied);
        break;
      case Where::kArena: {
        e->arena = arena_key(arena_options(c));
        Arena& a = st.arenas[e->arena];
        const int64_t need = aligned(e->nbytes);
        if (a.used + need > a.buffer.numel())
          throw Error(fmt::format(
              "{}: activation_checkpointing.contiguous_memory_optimization: a checkpoint needs "
              "{} more bytes but the buffer of {} bytes (number_checkpoints = {} times the first "
              "checkpoint's {} bytes) holds only {} more: the forward makes more (or larger) "
              "checkpoints than number_checkpoints says; raise number_checkpoints",
              s.source, need, a.buffer.numel(), s.number_checkpoints,
              a.buffer.numel() / std::max<int64_t>(1, s.number_checkpoints),
              a.buffer.numel() - a.used));
        e->kept = a.buffer.narrow(0, a.used, e->nbytes).view(e->dtype).view(e->sizes);
        a.used += need;
        // A GPU's tensor into the host's arena (cpu_checkpointing): on the side stream, as
        // kHost's copies; take() brings it back to the device.
        copy_beside_compute(e->kept, c, e->copied);
        break;
      }
      case Where::kNvme: {
        if (!st.nvme) {
          st.nvme = std::make_shared<offload::NvmeStore>(
              s.nvme_path, fmt::format("actckpt-{}", getpid()), s.rank, s.nvme);
          log::info("[strata] activation checkpointing: checkpointed inputs in swap files under "
                    "{}{}",
                    st.nvme->folder(), st.nvme->direct() ? "" : " (buffered I/O)");
        }
        const uint64_t size = offload::round_up_io(uint64_t(e->nbytes));
        auto it = st.free_files.lower_bound(size);
        if (it != st.free_files.end()) {
          e->file = it->second;
          e->file_bytes = it->first;
          st.free_files.erase(it);
        } else {
          e->file = st.nvme->create(fmt::format("activations-{}", st.files++), size);
          e->file_bytes = size;
        }
        e->staging = offload::AlignedBuffer(size_t(e->nbytes));
        auto staged = torch::from_blob(e->staging.data(), e->sizes,
                                       torch::TensorOptions().dtype(e->dtype));
        staged.copy_(c);
        e->write = st.nvme->write(e->file, 0, e->staging.data(), uint64_t(e->nbytes));
        e->writing = true;
        break;
      }
    }
    out->entries_.push_back(std::move(e));
  }
  for (const auto& entry : arena_need) {  // once per arena it has slices in
    ++st.arenas[entry.first].live;
    out->arenas_.push_back(entry.first);
  }
  st.live.push_back(out.get());
  return out;
}

void SavedInputs::prefetch() {
  auto& st = stores();
  std::lock_guard<std::mutex> lock(st.mu);
  for (auto& e : entries_) {
    if (e->generation != st.generation) continue;
    if ((e->where == Where::kHost || (e->where == Where::kArena && e->kept.device() != e->device)) &&
        !e->back.defined()) {
      // After the copy out on the same side stream (stream order), before its use (take()).
      e->back = torch::empty(e->sizes, torch::TensorOptions().dtype(e->dtype).device(e->device));
      copy_beside_compute(e->back, e->kept, e->copied);
    } else if (e->where == Where::kNvme && !e->writing && !e->reading) {
      e->staging = offload::AlignedBuffer(size_t(e->nbytes));
      e->read = st.nvme->read(e->file, 0, e->staging.data(), uint64_t(e->nbytes));
      e->reading = true;
    }
  }
}

std::vector<torch::Tensor> SavedInputs::take() {
  if (taken_)
    throw Error("activation checkpointing: a checkpoint's inputs were asked for twice (a second "
                "backward through a checkpointed region); call backward once, or pass "
                "retain_graph only to regions that are not checkpointed");
  taken_ = true;
  prefetch();
  auto& st = stores();
  std::vector<torch::Tensor> out;
  SavedInputs* previous = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    for (auto& e : entries_) {
      if (e->generation != st.generation && e->where != Where::kAsIs)
        throw Error("activation checkpointing: the engine that configured the checkpoints was "
                    "destroyed before their backward; run backward before dropping the engine");
      switch (e->where) {
        case Where::kAsIs:
          out.push_back(e->kept);
          break;
        case Where::kArena:
          if (!e->back.defined()) {  // the slice is on the tensor's own device
            out.push_back(e->kept);
            break;
          }
#if STRATA_HAS_CUDA
          if (e->copied) e->copied->block(c10::cuda::getCurrentCUDAStream(e->device.index()));
#endif
          out.push_back(e->back);
          e->back = torch::Tensor();
          break;
        case Where::kHost:
#if STRATA_HAS_CUDA
          // The compute stream waits for the copy back (the host does not).
          if (e->copied) e->copied->block(c10::cuda::getCurrentCUDAStream(e->device.index()));
#endif
          out.push_back(e->back);
          e->kept = torch::Tensor();
          e->back = torch::Tensor();
          break;
        case Where::kNvme: {
          if (e->writing) {
            st.nvme->wait(e->write);  // the bytes are still in the staging buffer
            e->writing = false;
          } else {
            st.nvme->wait(e->read);
            e->reading = false;
          }
          auto staged = torch::from_blob(e->staging.data(), e->sizes,
                                         torch::TensorOptions().dtype(e->dtype));
          out.push_back(staged.to(e->device, /*non_blocking=*/false, /*copy=*/true));
          e->staging = offload::AlignedBuffer();
          st.free_files.emplace(e->file_bytes, e->file);
          e->file = -1;
          break;
        }
      }
    }
    // In backward order the checkpoint kept before this one comes next: bring it back now.
    auto self = std::find(st.live.begin(), st.live.end(), this);
    for (auto it = st.live.begin(); it != self; ++it)
      if (!(*it)->taken_) previous = *it;
  }
  if (previous) previous->prefetch();
  return out;
}

SavedInputs::~SavedInputs() {
  auto& st = stores();
  std::lock_guard<std::mutex> lock(st.mu);
  st.live.erase(std::remove(st.live.begin(), st.live.end(), this), st.live.end());
  // The arenas it was counted in (none when keep() threw before the count).
  if (generation_ == st.generation)
    for (const auto& key : arenas_) --st.arenas[key].live;
  for (auto& e : entries_) {
    if (e->generation != st.generation) continue;
    if (e->where == Where::kNvme && e->file >= 0) {
      // Never taken (no backward): let its I/O finish before the buffer goes.
      try {
        if (e->writing) st.nvme->wait(e->write);
        if (e->reading) st.nvme->wait(e->read);
      } catch (const std::exception& ex) {
        log::info("[strata] warning: activation checkpointing: {}", ex.what());
      }
      st.free_files.emplace(e->file_bytes, e->file);
    }
  }
}

void release_stores() {
  auto& st = stores();
  std::lock_guard<std::mutex> lock(st.mu);
  ++st.generation;
  if (st.nvme) {
    try {
      st.nvme->wait_all();
    } catch (const std::exception& e) {
      log::info("[strata] warning: activation checkpointing: {}", e.what());
    }
  }
  st.nvme.reset();  // removes its folder
  st.free_files.clear();
  st.files = 0;
  st.arenas.clear();
}

StoreStats store_stats() {
  auto& st = stores();
  std::lock_guard<std::mutex> lock(st.mu);
  StoreStats s;
  s.live = int64_t(st.live.size());
  for (auto* l : st.live)
    for (auto& e : l->entries_)
      if (e->where == Where::kHost && e->kept.defined()) s.host_bytes += e->nbytes;
  s.nvme_files = st.files;
  if (st.nvme) s.nvme_folder = st.nvme->folder();
  return s;
}

}  // namespace strata::checkpointing
