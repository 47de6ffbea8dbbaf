// zero::WeightArrival on the CPU: ops that read a range of the flat buffer wait until the tiles
// holding it have arrived, other ops never wait, and a failure of the step reaches finish().
#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "zero/weight_arrival.h"

namespace {

using strata::zero::WeightArrival;
using namespace std::chrono_literals;

// Tile k writes the value k + 1 into flat [ends[k-1], ends[k]) after `delay`.
std::function<void(size_t)> slow_tiles(torch::Tensor flat, std::vector<int64_t> ends,
                                       std::chrono::milliseconds delay) {
  return [flat, ends, delay](size_t k) {
    std::this_thread::sleep_for(delay);
    const int64_t lo = k == 0 ? 0 : ends[k - 1];
    flat.narrow(0, lo, ends[k] - lo).fill_(double(k + 1));
  };
}

TEST(WeightArrival, AnOpWaitsForTheTilesItReads) {
  auto flat = torch::zeros({1000});
  auto first = flat.narrow(0, 0, 300), last = flat.narrow(0, 700, 300);
  WeightArrival arrival(flat);
  arrival.start({300, 700, 1000}, slow_tiles(flat, {300, 700, 1000}, 40ms));
  EXPECT_TRUE(arrival.in_flight());
  // Read at once: without the wait these sums would be 0.
  EXPECT_EQ(first.sum().item<double>(), 300.0);
  EXPECT_EQ((last * 2).sum().item<double>(), 2 * 3 * 300.0);
  EXPECT_GE(arrival.waits(), 2);
  arrival.finish();
  EXPECT_FALSE(arrival.in_flight());
  EXPECT_EQ(flat.sum().item<double>(), 300.0 + 2 * 400 + 3 * 300);
}

TEST(WeightArrival, AViewAcrossTilesWaitsForItsHighestElement) {
  auto flat = torch::zeros({1200});
  // A 2-d parameter over [200, 1200), read transposed: its last element is in the last tile.
  auto weight = flat.narrow(0, 200, 1000).view({10, 100});
  WeightArrival arrival(flat);
  arrival.start({400, 800, 1200}, slow_tiles(flat, {400, 800, 1200}, 30ms));
  const auto t = weight.t().contiguous();
  EXPECT_EQ(t.min().item<double>(), 1.0);
  EXPECT_EQ(t.max().item<double>(), 3.0);
  arrival.finish();
}

TEST(WeightArrival, OpsOnOtherTensorsDoNotWait) {
  auto flat = torch::zeros({100});
  auto other = torch::ones({100});
  std::promise<void> other_op_done;
  auto done = other_op_done.get_future();
  std::atomic<bool> timed_out{false};
  WeightArrival arrival(flat);
  arrival.start({100}, [&](size_t) {
    // The tile holds back until the main thread's op on `other` has run: if that op waited for
    // the tile, this would time out.
    if (done.wait_for(10s) != std::future_status::ready) timed_out = true;
    flat.fill_(5.0);
  });
  EXPECT_EQ(other.sum().item<double>(), 100.0);
  other_op_done.set_value();
  EXPECT_EQ(flat.sum().item<double>(), 500.0);
  arrival.finish();
  EXPECT_FALSE(timed_out.load());
}

TEST(WeightArrival, AFailedStepIsThrownByFinishAndOpsDoNotHang) {
  auto flat = torch::zeros({100});
  WeightArrival arrival(flat);
  arrival.start({50, 100}, [&](size_t k) {
    if (k == 1) throw std::runtime_error("tile 1 failed");
    flat.narrow(0, 0, 50).fill_(1.0);
  });
  flat.sum().item<double>();  // waits for tile 1, which never arrives: must return
  try {
    arrival.finish();
    FAIL() << "finish() did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "tile 1 failed");
  }
  // A new step after a failed one works.
  arrival.start({100}, slow_tiles(flat, {100}, 1ms));
  EXPECT_EQ(flat.sum().item<double>(), 100.0);
  arrival.finish();
}

TEST(WeightArrival, NothingIsWatchedOutsideAStep) {
  auto flat = torch::zeros({10});
  WeightArrival arrival(flat);
  arrival.finish();  // no step: nothing to do
  EXPECT_EQ(flat.sum().item<double>(), 0.0);
  EXPECT_EQ(arrival.waits(), 0);
  EXPECT_THROW(arrival.start({6, 3}, [](size_t) {}), std::exception);  // ends must not decrease
}

}  // namespace
