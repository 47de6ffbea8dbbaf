// A prototype of the mechanism ZeRO-3 will stand on (ARCHITECTURE.md, "ZeRO-3 without hooks"),
// checked on the LibTorch this tree builds against: a global RecordFunction callback sees every
// op that reads a parameter's storage, in forward and in backward, and can refill that storage
// before the op runs; freeing a parameter's bytes and refilling them keeps its TensorImpl, its
// views and autograd's saved references valid. The engine's design (parameters held by
// reference, optimizer over the module's own tensors) must not need to change for it.
//
// RecordFunction::inputs() asserts a debug-only flag that release builds of LibTorch never set:
// this file, like every Strata target, must be compiled with NDEBUG (CMake's Release and
// RelWithDebInfo define it).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>

#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace {

// A "unit" whose bytes are released between uses: its parameter's storage and the full value
// (here a local copy, later an all-gather of the shards).
struct ReleasedUnit {
  c10::StorageImpl* storage = nullptr;
  torch::Tensor full_copy;
  size_t nbytes = 0;
  std::vector<std::string> gathered_by;  // ops that found the storage empty and refilled it
  std::vector<std::string> seen_by;      // every op that had the storage among its inputs
};

ReleasedUnit* g_unit = nullptr;
std::mutex g_mutex;

void release(ReleasedUnit& unit) {
  unit.storage->set_data_ptr_noswap(at::DataPtr(nullptr, unit.full_copy.device()));
  unit.storage->set_nbytes(0);
}

void refill(ReleasedUnit& unit) {
  auto* allocator = c10::GetAllocator(unit.full_copy.device().type());
  unit.storage->set_data_ptr_noswap(allocator->allocate(unit.nbytes));
  unit.storage->set_nbytes(unit.nbytes);
  // DataPtr::get() is void* in LibTorch 1.13 and 2.x alike (StorageImpl::data() became const).
  std::memcpy(unit.storage->data_ptr().get(), unit.full_copy.data_ptr(), unit.nbytes);
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_unit == nullptr) return nullptr;
  for (const auto& input : fn.inputs()) {
    if (!input.isTensor()) continue;
    const auto& t = input.toTensor();
    if (!t.defined() || !t.has_storage()) continue;
    if (t.storage().unsafeGetStorageImpl() != g_unit->storage) continue;
    g_unit->seen_by.emplace_back(fn.name());
    if (g_unit->storage->nbytes() == 0) {
      refill(*g_unit);
      g_unit->gathered_by.emplace_back(fn.name());
    }
  }
  return nullptr;
}

TEST(Stage3Mechanism, ReleasedParameterIsRefilledOnUseInForwardAndBackward) {
  torch::manual_seed(0);
  torch::nn::Linear layer(torch::nn::LinearOptions(16, 8).bias(false));
  // x needs a gradient too, so that backward reads the weight (dx = dy @ W).
  auto x = torch::randn({4, 16}).requires_grad_(true);

  // Reference: forward and backward with the parameter resident.
  auto reference_out = layer(x);
  reference_out.sum().backward();
  const auto reference_grad = layer->weight.grad().clone();
  const auto reference_x_grad = x.grad().clone();
  layer->weight.mutable_grad() = torch::Tensor();
  x.mutable_grad() = torch::Tensor();

  ReleasedUnit unit;
  unit.storage = layer->weight.storage().unsafeGetStorageImpl();
  unit.full_copy = layer->weight.detach().clone();
  unit.nbytes = unit.storage->nbytes();
  auto* impl_before = layer->weight.unsafeGetTensorImpl();

  auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_op_start).needsInputs(true).scopes(
          {at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_unit = &unit;
  }
  release(unit);
  ASSERT_EQ(layer->weight.storage().nbytes(), 0u);

  auto out = layer(x);  // forward: some op finds the bytes gone and refills them
  EXPECT_FALSE(unit.gathered_by.empty());
  EXPECT_TRUE(torch::equal(out, reference_out));

  release(unit);  // "after its last use in forward"
  const size_t forward_gathers = unit.gathered_by.size();
  out.sum().backward();  // backward reads the saved (transposed) weight: refilled again
  EXPECT_GT(unit.gathered_by.size(), forward_gathers);
  ASSERT_TRUE(layer->weight.grad().defined());
  EXPECT_TRUE(torch::allclose(layer->weight.grad(), reference_grad));
  EXPECT_TRUE(torch::allclose(x.grad(), reference_x_grad));

  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_unit = nullptr;
  }
  at::removeCallback(handle);
  EXPECT_EQ(layer->weight.unsafeGetTensorImpl(), impl_before);  // same TensorImpl throughout
  std::string ops;
  for (const auto& op : unit.seen_by) ops += op + " ";
  RecordProperty("ops_seen", ops);
  std::printf("ops that read the parameter: %s\n", ops.c_str());
}

}  // namespace
