#include "zero/gradient_swap.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::zero {
namespace {

// Host staging per write: big enough for the disk's queue, small beside the partition.
constexpr int64_t kStageBytes = 8 << 20;

}  // namespace

GradientSwap::GradientSwap(offload::NvmeStore& store, const std::string& name, int64_t numel,
                           torch::ScalarType dtype)
    : store_(store),
      numel_(numel),
      dtype_(dtype),
      element_(int64_t(c10::elementSize(dtype))) {
  file_ = store_.create(name, uint64_t(numel * element_));
  for (auto& b : stage_) b = offload::AlignedBuffer(size_t(kStageBytes));
}

GradientSwap::~GradientSwap() {
  for (auto& p : pending_)
    if (p.copied) p.copied();  // no copy may land in freed staging
  for (auto* tickets : {staged_, reading_})
    for (int i = 0; i < 2; ++i)
      if (tickets[i]) {
        try {
          store_.wait(*tickets[i]);
        } catch (...) {  // a destructor reports nothing; the step that failed did
        }
      }
}

void GradientSwap::write(int64_t offset, const torch::Tensor& chunk) {
  if (chunk.scalar_type() != dtype_ || offset < 0 || offset + chunk.numel() > numel_ ||
      (offset * element_) % int64_t(offload::kIoAlign) != 0)
    throw Error(fmt::format("GradientSwap::write: {} elements of {} at {} do not fit a swap of {} "
                            "elements of {} on the 4 KiB grid",
                            chunk.numel(), c10::toString(chunk.scalar_type()), offset, numel_,
                            c10::toString(dtype_)));
  torch::NoGradGuard no_grad;
  const auto flat = chunk.reshape({-1});
  if (flat.is_cuda() && !pinned_[0].active())
    for (int s = 0; s < 2; ++s)
      pinned_[s] = HostRegistration(stage_[s].data(), size_t(kStageBytes), flat.device());
  const int64_t per = kStageBytes / element_;
  for (int64_t lo = 0; lo < flat.numel(); lo += per) {
    const int64_t n = std::min(per, flat.numel() - lo);
    const int s = next_stage_;
    next_stage_ ^= 1;
    send(s);  // the piece this buffer held goes to disk (if it has not yet),
    if (staged_[s]) store_.wait(*std::exchange(staged_[s], std::nullopt));  // and has landed
    const auto stage = torch::from_blob(stage_[s].data(), {n}, torch::TensorOptions().dtype(dtype_));
    pending_[s] = {true, copy_to_host_tracked(stage, flat.narrow(0, lo, n)), offset + lo, n};
    if (!pending_[s].copied) send(s);  // copied already (host memory): to disk at once
  }
}

void GradientSwap::send(int stage) {
  auto& p = pending_[stage];
  if (!p.pending) return;
  if (p.copied) std::exchange(p.copied, {})();
  p.pending = false;
  staged_[stage] = store_.write(file_, uint64_t(p.offset * element_), stage_[stage].data(),
                                uint64_t(p.n * element_));
}

void GradientSwap::flush() {
  // The older piece first, as the writes were issued.
  send(next_stage_);
  send(next_stage_ ^ 1);
  for (auto& t : staged_)
    if (t) store_.wait(*std::exchange(t, std::nullopt));
}

void GradientSwap::begin_pass(int64_t tile_numel) {
  flush();
  tile_numel_ = std::max<int64_t>(1, std::min(tile_numel, numel_));
  for (auto& b : tiles_)
    if (b.size() < size_t(tile_numel_ * element_))
      b = offload::AlignedBuffer(size_t(tile_numel_ * element_));
  current_ = 0;
  read_ahead(0, 0);
}

void GradientSwap::read_ahead(int slot, int64_t lo) {
  tile_lo_[slot] = lo;
  if (lo >= numel_) return;
  const int64_t n = std::min(tile_numel_, numel_ - lo);
  reading_[slot] = store_.read(file_, uint64_t(lo * element_), tiles_[slot].data(),
                               uint64_t(n * element_));
}

const void* GradientSwap::tile(int64_t lo, int64_t n) {
  const int s = current_;
  if (tile_lo_[s] != lo || n > tile_numel_)
    throw Error(fmt::format("GradientSwap::tile: asked for [{}, {}) out of order (next is {})", lo,
                            lo + n, tile_lo_[s]));
  store_.wait(*std::exchange(reading_[s], std::nullopt));
  current_ ^= 1;
  read_ahead(current_, lo + tile_numel_);  // into the other buffer, while this one is stepped
  return tiles_[s].data();
}

void GradientSwap::end_pass() {
  for (auto& t : reading_)
    if (t) store_.wait(*std::exchange(t, std::nullopt));
  tile_lo_[0] = tile_lo_[1] = -1;
}

}  // namespace strata::zero
