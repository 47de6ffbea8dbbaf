// PartitionedOptimizer's state in NVMe swap files (offload_optimizer.device "nvme"), as
// checkpoints read and write it: whole arrays, a tile at a time, or filled with one value.
#include <fmt/format.h>

#include "runtime/error.h"
#include "zero/partitioned_optimizer.h"

namespace strata::zero {

torch::Tensor PartitionedOptimizer::read_swapped(offload::OptimizerSwapper::Array a) const {
  if (!swapper_) throw Error("PartitionedOptimizer::read_swapped: the state is not on NVMe");
  auto t = torch::empty({swapper_->numel()}, torch::kFloat);
  swapper_->read_array(a, t.data_ptr<float>());
  return t;
}

void PartitionedOptimizer::fill_swapped(offload::OptimizerSwapper::Array a, float value) {
  settle();
  if (!swapper_) throw Error("PartitionedOptimizer::fill_swapped: the state is not on NVMe");
  swapper_->fill_array(a, value);
}

void PartitionedOptimizer::read_swapped_tiles(offload::OptimizerSwapper::Array a,
                                              const offload::OptimizerSwapper::TileIn& consume) const {
  if (!swapper_) throw Error("PartitionedOptimizer::read_swapped_tiles: the state is not on NVMe");
  swapper_->read_tiles(a, consume);
}

void PartitionedOptimizer::write_swapped_tiles(offload::OptimizerSwapper::Array a,
                                               const offload::OptimizerSwapper::TileOut& produce) {
  settle();
  if (!swapper_) throw Error("PartitionedOptimizer::write_swapped_tiles: the state is not on NVMe");
  swapper_->write_tiles(a, produce);
}

void PartitionedOptimizer::write_swapped(offload::OptimizerSwapper::Array a,
                                         const torch::Tensor& values) {
  if (!swapper_) throw Error("PartitionedOptimizer::write_swapped: the state is not on NVMe");
  if (values.numel() != swapper_->numel())
    throw Error(fmt::format("optimizer offload to NVMe: {} elements given for a swapped array of {}",
                            values.numel(), swapper_->numel()));
  const auto v = values.to(torch::kCPU, torch::kFloat).contiguous();
  swapper_->write_array(a, v.data_ptr<float>());
}

}  // namespace strata::zero
