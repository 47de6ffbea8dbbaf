// offload_param nvme's reads ahead (zero/param_offload.cpp): a gather's read is issued when the
// gather is launched, into one of a few slots, and finished when it is waited for or when its slot
// is needed by a later gather. A read that fails must be reported by its own gather, every time
// it is waited for, never by the gather that happened to take its slot.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "offload/nvme_store.h"
#include "tests/offload/build_fs_dir.h"
#include "zero/param_units.h"

namespace {

using strata::zero::ParamUnits;

class ParamNvmeReads : public strata::test_support::BuildFsDirTest {
 protected:
  ParamNvmeReads() : BuildFsDirTest("param-nvme-reads") {}
};

TEST_F(ParamNvmeReads, AFailedReadIsReportedByItsOwnGatherNotByTheOneThatTookItsSlot) {
  // Four units of 2048 fp32 elements on one process (more units than read slots), shards on NVMe.
  constexpr int kUnits = 4;
  std::vector<strata::zero::UnitSpec> specs;
  std::vector<torch::Tensor> values;
  for (int u = 0; u < kUnits; ++u) {
    auto p = torch::full({2048}, float(u + 1)).requires_grad_();
    values.push_back(p.detach().clone());
    specs.push_back({"u" + std::to_string(u), {"w"}, {p}});
  }
  strata::zero::UnitOptions options;
  options.persistence_threshold = 0;
  options.alignment = 1024;  // 4 KiB of fp32: every shard on the swap file's page grid
  auto units = std::make_shared<ParamUnits>(specs, nullptr, options);
  auto store = std::make_shared<strata::offload::NvmeStore>(dir_.string(), "reads", 0);
  units->offload_partition("nvme", /*pin=*/false, store);

  // Unit 0's shard: where its bucket sits in the partition (the swap file's layout).
  int64_t base = -1;
  for (const auto& b : units->shards().buckets())
    if (b.lo == units->unit(0).flat_base) base = b.base;
  ASSERT_GE(base, 0);
  {  // another writer flips a byte of unit 0's first page behind the store's back
    const std::string file = store->path(store->file("params"));
    const int fd = open(file.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t at = off_t(base * 4 + 100);
    char x = 0;
    ASSERT_EQ(pread(fd, &x, 1, at), 1);
    x = char(~x);
    ASSERT_EQ(pwrite(fd, &x, 1, at), 1);
    fsync(fd);
    close(fd);
  }

  std::vector<strata::comm::WorkPtr> works;
  for (int u = 0; u < kUnits; ++u) works.push_back(units->gather_async(size_t(u)));
  // The fourth gather took unit 0's slot, finishing unit 0's gather on the way: its own data
  // arrived, and unit 0's failure waits for unit 0.
  for (int u = 1; u < kUnits; ++u) {
    ASSERT_NO_THROW(works[size_t(u)]->wait()) << "unit " << u;
    EXPECT_TRUE(torch::equal(units->unit(size_t(u)).params[0].detach(), values[size_t(u)])) << u;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      works[0]->wait();
      ADD_FAILURE() << "unit 0's gather read a flipped page and reported nothing (wait " << attempt << ")";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    }
  }
  for (int u = 0; u < kUnits; ++u) units->release(size_t(u));
}

}  // namespace
