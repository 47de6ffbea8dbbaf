// offload_optimizer.max_in_cpu at stage 3 with the optimizer on NVMe: the partitions' first tiles
// keep their fp32 master and moments in host memory and only the rest has swap files. The step is
// the same elementwise Adam wherever a tile lives, so runs with none, part and all of the state in
// host memory train bit for bit alike (gas 2, parameters offloaded too); the files and the state
// bytes hold only the swapped part; a checkpoint resumes exactly under another max_in_cpu and
// under device "cpu"; the key without NVMe is refused by name.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/engine.h"
#include "runtime/error.h"

namespace {

using strata::json;
namespace fs = std::filesystem;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 6; ++i) blocks->push_back(torch::nn::Linear(48, 48));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = x;
    for (auto& b : *blocks) h = torch::tanh(b->as<torch::nn::Linear>()->forward(h));
    return (h - y).pow(2).mean();
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

// 6 x (48 x 48 + 48) = 14,112 parameters; the partition pads each unit's shard to the swap files'
// 4 KiB grid (14,336 elements): tiles of 4,096, the last of 2,048.

json config(const std::string& nvme, const json& max_in_cpu, const std::string& device = "nvme") {
  json offload = {{"device", device}};
  if (device == "nvme") offload["nvme_path"] = nvme;
  if (!max_in_cpu.is_null()) offload["max_in_cpu"] = max_in_cpu;
  return {{"train_micro_batch_size_per_gpu", 4},
          {"gradient_accumulation_steps", 2},
          {"steps_per_print", 1000000},
          {"gradient_clipping", 1.0},
          {"zero_optimization",
           {{"stage", 3},
            {"sub_group_size", 4096},
            {"offload_optimizer", offload},
            {"offload_param", {{"device", "cpu"}}}}},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}}};
}

template <class E>
void train(E& engine, int64_t from, int64_t to) {
  for (int64_t s = from; s < to; ++s)
    for (int64_t m = 0; m < 2; ++m) {
      torch::manual_seed(1000 + 2 * s + m);
      const auto x = torch::randn({4, 48}), y = torch::randn({4, 48}) * 0.5;
      engine.backward(engine.forward(x, y));
      engine.step();
    }
}

std::vector<torch::Tensor> weights(Net& net) {
  std::vector<torch::Tensor> w;
  for (const auto& p : net->parameters()) w.push_back(p.detach().clone());
  return w;
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << what << ", parameter " << i;
}

int64_t file_bytes_under(const std::string& dir, const std::string& suffix) {
  int64_t bytes = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().string().size() >= suffix.size() &&
        e.path().string().compare(e.path().string().size() - suffix.size(), suffix.size(), suffix) == 0)
      bytes += int64_t(e.file_size());
  return bytes;
}

class NvmeHostShare : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir() + "/nvme_host_share_" + std::to_string(::getpid());
    strata::checkpoint::remove_tree(dir_);
    strata::checkpoint::make_directories(dir_ + "/nvme");
  }
  void TearDown() override { strata::checkpoint::remove_tree(dir_); }
  std::string dir_;
};

TEST_F(NvmeHostShare, NonePartAndAllInHostMemoryTrainBitForBitAlike) {
  std::vector<torch::Tensor> first;
  // 0, 10,000 elements (two whole tiles: 8,192), more than the partition (all 14,112).
  for (const int64_t max_in_cpu : {int64_t(0), int64_t(10000), int64_t(1) << 40}) {
    SCOPED_TRACE("max_in_cpu " + std::to_string(max_in_cpu));
    torch::manual_seed(7);
    Net net;
    auto engine = strata::initialize(net, config(dir_ + "/nvme", max_in_cpu));
    train(*engine, 0, 4);
    const int64_t n = engine->stage3_units()->shards().partition_numel();
    EXPECT_EQ(n, 14336);
    const int64_t resident = max_in_cpu == 0 ? 0 : max_in_cpu == 10000 ? 8192 : n;
    const auto bytes = engine->model_state_bytes();
    EXPECT_EQ(bytes.nvme, 12 * (n - resident));
    // The fp32 master and both moments of the resident tiles (and nothing of the swapped ones).
    EXPECT_EQ(bytes.master, 4 * resident);
    EXPECT_EQ(bytes.host, bytes.total());  // on the CPU, every state is in host memory
    // Each swap file holds the swapped elements only (rounded up to the 4 KiB grid).
    const int64_t master_file = file_bytes_under(dir_ + "/nvme", ".master");
    EXPECT_GE(master_file, 4 * (n - resident));
    EXPECT_LT(master_file, 4 * (n - resident) + 4096);
    const auto w = weights(net);
    if (first.empty())
      first = w;
    else
      expect_equal(w, first, "against max_in_cpu 0");
  }
}

// Saved with part of the state in host memory; resumed with none of it there, and with the
// optimizer wholly in host memory (device "cpu"): both continue the straight run exactly.
TEST_F(NvmeHostShare, ACheckpointResumesUnderAnotherShareAndInHostMemory) {
  torch::manual_seed(7);
  Net straight_net;
  auto straight = strata::initialize(straight_net, config(dir_ + "/nvme", 10000));
  train(*straight, 0, 2);
  straight->save_checkpoint(dir_ + "/ckpt", "t");
  train(*straight, 2, 4);
  const auto want = weights(straight_net);
  straight.reset();
  for (const auto& [max_in_cpu, device] :
       std::vector<std::pair<json, std::string>>{{json(0), "nvme"}, {json(), "cpu"}}) {
    SCOPED_TRACE("resumed with " + device + (max_in_cpu.is_null() ? "" : ", max_in_cpu 0"));
    torch::manual_seed(99);  // other initial weights: all of them come from the checkpoint
    Net net;
    auto engine = strata::initialize(net, config(dir_ + "/nvme", max_in_cpu, device));
    engine->load_checkpoint(dir_ + "/ckpt", "t");
    train(*engine, 2, 4);
    expect_equal(weights(net), want, "resumed");
  }
}

TEST_F(NvmeHostShare, TheKeyWithoutNvmeIsRefusedByName) {
  torch::manual_seed(7);
  Net net;
  std::string message = "(no error)";
  try {
    strata::initialize(net, config(dir_ + "/nvme", 10000, "cpu"));
  } catch (const strata::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("offload_optimizer.max_in_cpu"), std::string::npos) << message;
  EXPECT_NE(message.find("device \"nvme\""), std::string::npos) << message;
}

}  // namespace
