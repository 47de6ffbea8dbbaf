// Storage surgery shared by ZeRO's layouts (flat_params, param_units, partitioned_init): a
// parameter keeps its TensorImpl (the module, autograd and optimizers hold it) while its bytes
// move into a flat buffer, are freed, or come back (FSDP2's resize_(0)).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <c10/core/StorageImpl.h>
#include <torch/torch.h>

namespace strata::zero {

// `p` becomes a contiguous view of `flat`'s storage starting at element `offset` of `flat`.
inline void view_into(torch::Tensor& p, const torch::Tensor& flat, int64_t offset) {
  const std::vector<int64_t> sizes = p.sizes().vec();
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(sizes[d], 1);
  // A host-built parameter whose unit lives on the GPU (InitOptions::device): LibTorch 2.x's
  // set_ refuses a storage of another device, so the tensor moves first, as Module::to moves it
  // (set_data keeps the TensorImpl).
  if (p.device() != flat.device()) p.set_data(torch::empty({0}, flat.options()));
  p.set_(flat.storage(), flat.storage_offset() + offset, sizes, strides);
}

// Frees the bytes of `t`'s storage; every tensor on it keeps its metadata.
inline void release_bytes(const torch::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

// Gives `t`'s storage `nbytes` fresh (uninitialised) bytes from its own allocator (the CUDA
// caching allocator for a CUDA tensor), or the device's default one.
inline void refill_bytes(const torch::Tensor& t, size_t nbytes) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = storage->allocator();
  if (allocator == nullptr) allocator = c10::GetAllocator(t.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

}  // namespace strata::zero
