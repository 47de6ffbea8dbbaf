// The optimizer swapper over a real NvmeStore on the build's file system (O_DIRECT, io_uring):
// arrays round-trip through the swap files, a pipelined pass of the CPU Adam over swapped tiles
// equals the same Adam over memory bit for bit (with and without pipelining), and a flipped byte
// in a swap file is refused naming the file and offset.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "offload/cpu_adam.h"
#include "offload/optimizer_swapper.h"
#include "runtime/error.h"
#include "tests/offload/build_fs_dir.h"

namespace {

using strata::offload::NvmeStore;
using strata::offload::OptimizerSwapper;
using strata::offload::SwapperOptions;

class OptimizerSwapperTest : public strata::test_support::BuildFsDirTest {
 protected:
  OptimizerSwapperTest() : BuildFsDirTest("swap-test") {}
};

std::vector<float> random_floats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(gen);
  return v;
}

// 5000 elements in tiles of 1024: five tiles, the last of 904.
constexpr int64_t kNumel = 5000;

TEST_F(OptimizerSwapperTest, ArraysRoundTripAndEveryTileIsVisitedOnce) {
  NvmeStore store(dir_.string(), "job", 0);
  SwapperOptions o;
  o.tile_numel = 1000;  // rounded up to the 4 KiB grid: 1024
  OptimizerSwapper swapper(store, "part0", kNumel, o);
  EXPECT_EQ(swapper.tile_numel(), 1024);
  EXPECT_EQ(swapper.tiles(), 5);
  const auto master = random_floats(kNumel, 1), m = random_floats(kNumel, 2);
  swapper.write_array(OptimizerSwapper::kMaster, master.data());
  swapper.write_array(OptimizerSwapper::kExpAvg, m.data());
  swapper.fill_array(OptimizerSwapper::kExpAvgSq, 0.5f);
  std::vector<int64_t> seen(kNumel, 0);
  swapper.for_each_tile([&](int64_t offset, int64_t n, float* p, float* a, float* b) {
    for (int64_t i = 0; i < n; ++i) {
      ++seen[offset + i];
      EXPECT_EQ(p[i], master[offset + i]);
      EXPECT_EQ(b[i], 0.5f);
      p[i] += 1.0f;
      a[i] *= 2.0f;
    }
  });
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(seen[i], 1) << i;
  std::vector<float> back(kNumel);
  swapper.read_array(OptimizerSwapper::kMaster, back.data());
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(back[i], master[i] + 1.0f) << i;
  swapper.read_array(OptimizerSwapper::kExpAvg, back.data());
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(back[i], m[i] * 2.0f) << i;
}

// Three AdamW steps through the swap files equal three over memory, bit for bit: the same
// elementwise step, each element once per pass, whatever the pipelining and however many of the
// first tiles stay in host memory (offload_optimizer.max_in_cpu).
TEST_F(OptimizerSwapperTest, AdamOverSwappedTilesEqualsAdamInMemory) {
  strata::optim::AdamScalars s;
  s.lr = 1e-2f, s.beta1 = 0.9f, s.beta2 = 0.999f, s.one_minus_beta1 = 0.1f,
  s.one_minus_beta2 = 0.001f, s.eps = 1e-8f, s.weight_decay = 0.01f, s.adam_w_mode = true,
  s.decay_factor = 1.0f - 1e-2f * 0.01f, s.grad_scale = 0.5f;
  auto scalars_at = [&](int step) {
    auto t = s;
    const double c1 = 1 - std::pow(0.9, step), c2 = 1 - std::pow(0.999, step);
    t.step_size = static_cast<float>(1e-2 / c1);
    t.sqrt_c2 = static_cast<float>(std::sqrt(c2));
    return t;
  };
  auto p = random_floats(kNumel, 3), m = std::vector<float>(kNumel, 0.0f), v = m;
  const auto p0 = p;
  std::vector<std::vector<float>> grads;
  std::vector<uint16_t> out_ref(kNumel);  // the same kernel variant as below (with a bf16 copy)
  for (int step = 1; step <= 3; ++step) {
    grads.push_back(random_floats(kNumel, 10 + step, 0.1f));
    strata::offload::cpu_adam_step(p.data(), m.data(), v.data(), grads.back().data(),
                                   strata::offload::Float::kF32, out_ref.data(),
                                   strata::offload::Float::kBF16, kNumel, scalars_at(step), 1);
  }
  // offload_optimizer.max_in_cpu: none, 2500 elements (the first 2 tiles), more than all.
  for (const int64_t resident : {int64_t(0), int64_t(2500), int64_t(1) << 40})
  for (const bool pipelined : {true, false}) {
    SCOPED_TRACE(std::string(pipelined ? "pipelined" : "one tile at a time") + ", resident " +
                 std::to_string(resident));
    NvmeStore store(dir_.string(), std::string(pipelined ? "p" : "s") + std::to_string(resident), 0);
    SwapperOptions o;
    o.tile_numel = 1024;
    o.pipeline_read = o.pipeline_write = pipelined;
    o.resident_numel = resident;
    OptimizerSwapper swapper(store, "adam", kNumel, o);
    const int64_t want_resident = resident == 0 ? 0 : resident == 2500 ? 2048 : kNumel;
    EXPECT_EQ(swapper.resident_numel(), want_resident);
    EXPECT_EQ(swapper.swapped_numel(), kNumel - want_resident);
    // Only the swapped elements have files, each sized for them.
    if (want_resident == kNumel) {
      EXPECT_EQ(swapper.path(OptimizerSwapper::kMaster), "");
    } else {
      const auto bytes = std::filesystem::file_size(swapper.path(OptimizerSwapper::kMaster));
      EXPECT_GE(bytes, uint64_t(kNumel - want_resident) * 4);
      EXPECT_LT(bytes, uint64_t(kNumel - want_resident) * 4 + 4096);
    }
    swapper.write_array(OptimizerSwapper::kMaster, p0.data());
    swapper.fill_array(OptimizerSwapper::kExpAvg, 0.0f);
    swapper.fill_array(OptimizerSwapper::kExpAvgSq, 0.0f);
    std::vector<uint16_t> out(kNumel);  // the bf16 weights each tile sends on
    for (int step = 1; step <= 3; ++step) {
      const auto& g = grads[step - 1];
      swapper.for_each_tile([&](int64_t offset, int64_t n, float* tp, float* tm, float* tv) {
        strata::offload::cpu_adam_step(tp, tm, tv, g.data() + offset, strata::offload::Float::kF32,
                                       out.data() + offset, strata::offload::Float::kBF16, n,
                                       scalars_at(step), 1);
      });
    }
    std::vector<float> got(kNumel);
    swapper.read_array(OptimizerSwapper::kMaster, got.data());
    for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(got[i], p[i]) << i;
    swapper.read_array(OptimizerSwapper::kExpAvgSq, got.data());
    for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(got[i], v[i]) << i;
    EXPECT_EQ(out, out_ref);
    EXPECT_GE(swapper.last_times().compute_ms, 0.0);
  }
}

// A byte changed in a swap file behind the store's back is found when the page is read back.
TEST_F(OptimizerSwapperTest, AFlippedByteInASwapFileIsNamed) {
  NvmeStore store(dir_.string(), "job", 0);
  SwapperOptions o;
  o.tile_numel = 1024;
  OptimizerSwapper swapper(store, "part0", kNumel, o);
  const auto master = random_floats(kNumel, 4);
  swapper.write_array(OptimizerSwapper::kMaster, master.data());
  swapper.fill_array(OptimizerSwapper::kExpAvg, 0.0f);
  swapper.fill_array(OptimizerSwapper::kExpAvgSq, 0.0f);
  const auto path = swapper.path(OptimizerSwapper::kExpAvg);
  const off_t where = 3 * 4096 + 17;  // tile 3
  {
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0) << path;
    unsigned char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, where), 1);
    byte ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &byte, 1, where), 1);
    ::fsync(fd);
    ::close(fd);
  }
  std::string message = "(no error)";
  try {
    swapper.for_each_tile([](int64_t, int64_t, float*, float*, float*) {});
  } catch (const strata::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(3 * 4096)), std::string::npos) << message;
}

}  // namespace
