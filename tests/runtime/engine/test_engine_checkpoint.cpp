// Exact resume: 10 steps, save, a fresh engine on a differently initialised model loads and
// trains 10 more; the parameters equal 20 straight steps bit for bit, at every stage, with the
// LR schedule, the step counters and the program's data position restored.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/tensor_file.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "tests/alloc_meter.h"

namespace {

using strata::json;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto out = fc2(norm(torch::tanh(fc1(x.to(fc1->weight.scalar_type())))));
    return (out.to(torch::kFloat) - y).pow(2).mean();
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Net);

struct RunSetup {
  int stage;
  bool bf16;
  const char* optimizer;
};

// The case as its CTest name shows it (without this, gtest prints the struct's bytes, a pointer
// among them, and the name changes from build to build).
void PrintTo(const RunSetup& s, std::ostream* os) {
  *os << "stage" << s.stage << (s.bf16 ? "_bf16_" : "_fp32_") << s.optimizer;
}

json config_for(const RunSetup& s) {
  json c = {{"train_micro_batch_size_per_gpu", 8},
            {"gradient_accumulation_steps", 2},
            {"steps_per_print", 1000},
            {"gradient_clipping", 1.0},
            {"zero_optimization", {{"stage", s.stage}}},
            {"optimizer", {{"type", s.optimizer}, {"params", {{"lr", 1e-2}}}}},
            {"scheduler",
             {{"type", "WarmupCosineLR"},
              {"params", {{"total_num_steps", 20}, {"warmup_num_steps", 5}}}}}};
  if (std::string(s.optimizer) == "SGD") c["optimizer"]["params"]["momentum"] = 0.9;
  if (s.bf16) c["bf16"] = {{"enabled", true}};
  return c;
}

// Trains steps [from, to) of a fixed data stream.
template <class E>
void train(E& engine, int64_t from, int64_t to) {
  for (int64_t step = from; step < to; ++step) {
    torch::manual_seed(900 + step);
    auto x = torch::randn({16, 8});
    auto y = x.sum(1, true).cos();
    for (int64_t m = 0; m < 2; ++m) {
      engine->backward(engine->forward(x.narrow(0, 8 * m, 8), y.narrow(0, 8 * m, 8)));
      engine->step();
    }
  }
}

class ExactResume : public testing::TestWithParam<RunSetup> {};

TEST_P(ExactResume, TenPlusTenEqualsTwentyBitForBit) {
  const RunSetup setup = GetParam();
  const std::string dir = testing::TempDir() + "/resume_" + std::to_string(getpid()) + "_" +
                          std::to_string(setup.stage) + (setup.bf16 ? "bf16" : "") +
                          setup.optimizer;
  strata::checkpoint::remove_tree(dir);  // not std::filesystem: pip LibTorch 2.x exports a clashing copy

  torch::manual_seed(1);
  Net straight;
  auto a = strata::initialize(straight, config_for(setup));
  train(a, 0, 20);

  {
    torch::manual_seed(1);
    Net first;
    auto b = strata::initialize(first, config_for(setup));
    train(b, 0, 10);
    b->save_checkpoint(dir, "", {{"data_step", 10}});
  }
  EXPECT_TRUE(std::filesystem::exists(dir + "/global_step10/manifest.json"));
  torch::manual_seed(2);  // another initialisation: everything must come from the checkpoint
  Net resumed;
  auto c = strata::initialize(resumed, config_for(setup));
  const json client = c->load_checkpoint(dir);
  ASSERT_EQ(client.at("data_step").get<int64_t>(), 10);
  EXPECT_EQ(c->global_steps(), 10);
  EXPECT_EQ(c->get_lr(), [&] {
    torch::manual_seed(1);
    Net probe;
    auto p = strata::initialize(probe, config_for(setup));
    train(p, 0, 10);
    return p->get_lr();
  }());
  train(c, client.at("data_step").get<int64_t>(), 20);

  auto pa = straight->parameters(), pc = resumed->parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::equal(pa[i], pc[i])) << "parameter " << i << " differs by "
                                            << (pa[i] - pc[i]).abs().max().item<double>();
  EXPECT_EQ(a->global_steps(), c->global_steps());
  EXPECT_EQ(a->get_lr(), c->get_lr());
}

INSTANTIATE_TEST_SUITE_P(
    Stages, ExactResume,
    testing::Values(RunSetup{0, false, "AdamW"}, RunSetup{0, false, "SGD"}, RunSetup{0, true, "AdamW"},
                    RunSetup{1, false, "AdamW"}, RunSetup{2, false, "AdamW"}, RunSetup{2, true, "SGD"}));

TEST(CheckpointErrors, MissingOrMismatchedCheckpointsNameTheFile) {
  const std::string dir = testing::TempDir() + "/ckpt_errors_" + std::to_string(getpid());
  strata::checkpoint::remove_tree(dir);  // not std::filesystem: pip LibTorch 2.x exports a clashing copy
  torch::manual_seed(1);
  Net net;
  auto engine = strata::initialize(net, config_for({0, false, "AdamW"}));
  try {
    engine->load_checkpoint(dir);
    FAIL() << "expected strata::Error";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
  }
  train(engine, 0, 2);
  engine->save_checkpoint(dir, "t");
  // A model of another shape: the error names the tensor.
  struct OtherImpl : torch::nn::Module {
    OtherImpl() { fc1 = register_module("fc1", torch::nn::Linear(8, 16)); }
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
      return (fc1(x).sum(1, true) - y).pow(2).mean();
    }
    torch::nn::Linear fc1{nullptr};
  };
  auto other = std::make_shared<OtherImpl>();
  auto e2 = strata::initialize(torch::nn::ModuleHolder<OtherImpl>(other),
                               config_for({0, false, "AdamW"}));
  try {
    e2->load_checkpoint(dir, "t");
    FAIL() << "expected strata::Error";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fc1.weight"), std::string::npos) << e.what();
  }
}

// Three layers, one of them frozen: which one is part of what a checkpoint's optimizer state
// means (it is stored by position).
struct ThreeNetImpl : torch::nn::Module {
  explicit ThreeNetImpl(const std::string& frozen) {
    for (const char* name : {"a", "b", "c"}) {
      auto layer = register_module(name, torch::nn::Linear(8, 8));
      if (frozen == name)
        for (auto& p : layer->parameters()) p.set_requires_grad(false);
      layers.push_back(layer);
    }
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = x.to(layers[0]->weight.scalar_type());
    for (auto& l : layers) h = torch::tanh(l(h));
    return (h.to(torch::kFloat).sum(1, true) - y).pow(2).mean();
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(ThreeNet);

std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_unchanged(torch::nn::Module& m, const std::vector<torch::Tensor>& before,
                      const std::string& what) {
  auto now = m.parameters();
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(torch::equal(now[i], before[i])) << what << ": parameter " << i << " changed";
}

// A save inside an accumulation window (one micro-step of two) would lose the window's partial
// gradient: refused by name at every stage, nothing written; after the window it saves.
TEST(CheckpointErrors, ASaveInsideAnAccumulationWindowIsRefusedByName) {
  for (const RunSetup& setup : {RunSetup{0, false, "AdamW"}, RunSetup{1, true, "AdamW"},
                                RunSetup{2, false, "AdamW"}, RunSetup{3, false, "AdamW"}}) {
    const std::string dir = testing::TempDir() + "/ckpt_window_" + std::to_string(getpid()) +
                            "_" + std::to_string(setup.stage);
    strata::checkpoint::remove_tree(dir);
    torch::manual_seed(1);
    Net net;
    auto engine = strata::initialize(net, config_for(setup));
    train(engine, 0, 1);
    const auto x = torch::randn({8, 8});
    engine->backward(engine->forward(x, x.sum(1, true)));
    engine->step();  // micro-step 1 of the window of 2
    try {
      engine->save_checkpoint(dir, "t");
      ADD_FAILURE() << "stage " << setup.stage << ": saved inside a window";
    } catch (const strata::Error& e) {
      EXPECT_NE(std::string(e.what()).find("inside a gradient accumulation window (micro-step 1 of 2"),
                std::string::npos) << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(dir + "/t")) << "stage " << setup.stage;
    engine->backward(engine->forward(x, x.sum(1, true)));
    engine->step();
    engine->save_checkpoint(dir, "t");
    EXPECT_TRUE(std::filesystem::exists(dir + "/t/manifest.json")) << "stage " << setup.stage;
  }
}

// Saved with layer c frozen, resumed with b frozen (as many trainable elements): the optimizer
// state of b must not land in c. The load is refused by name and changes nothing.
TEST(CheckpointErrors, AnotherSetOfTrainableParametersIsRefusedByName) {
  for (const RunSetup& setup : {RunSetup{0, false, "AdamW"}, RunSetup{1, true, "AdamW"},
                                RunSetup{2, false, "SGD"}}) {
    const std::string dir = testing::TempDir() + "/ckpt_frozen_" + std::to_string(getpid()) +
                            "_" + std::to_string(setup.stage);
    strata::checkpoint::remove_tree(dir);
    {
      torch::manual_seed(1);
      ThreeNet saved("c");
      auto engine = strata::initialize(saved, config_for(setup));
      train(engine, 0, 2);
      engine->save_checkpoint(dir, "t");
    }
    torch::manual_seed(2);
    ThreeNet resumed("b");
    auto engine = strata::initialize(resumed, config_for(setup));
    const auto before = snapshot(*resumed);
    try {
      engine->load_checkpoint(dir, "t");
      ADD_FAILURE() << "stage " << setup.stage << ": b's state was loaded into c";
    } catch (const strata::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'b.weight'"), std::string::npos) << what;
      EXPECT_NE(what.find("'c.weight'"), std::string::npos) << what;
    }
    expect_unchanged(*resumed, before, "after the refused load at stage " +
                                           std::to_string(setup.stage));
    // The engine still trains from its own state.
    train(engine, 0, 1);
    EXPECT_EQ(engine->global_steps(), 1);
  }
}

// A checkpoint whose optimizer state does not fit (SGD's momentum into Adam) fails before any
// weight is copied: the model keeps its own weights, not the checkpoint's.
TEST(CheckpointErrors, AFailedLoadLeavesTheModelAsItWas) {
  for (const auto& [stage, bf16] : {std::pair{0, false}, std::pair{1, true}, std::pair{2, false}}) {
    const std::string dir = testing::TempDir() + "/ckpt_txn_" + std::to_string(getpid()) + "_" +
                            std::to_string(stage);
    strata::checkpoint::remove_tree(dir);
    {
      torch::manual_seed(1);
      Net saved;
      auto engine = strata::initialize(saved, config_for({stage, bf16, "SGD"}));
      train(engine, 0, 2);
      engine->save_checkpoint(dir, "t");
    }
    torch::manual_seed(2);
    Net other;
    auto engine = strata::initialize(other, config_for({stage, bf16, "AdamW"}));
    const auto before = snapshot(*other);
    EXPECT_THROW(engine->load_checkpoint(dir, "t"), strata::Error) << "stage " << stage;
    expect_unchanged(*other, before, "after the failed load at stage " + std::to_string(stage));
    EXPECT_EQ(engine->global_steps(), 0);
  }
}

}  // namespace

// Issue 28, defect 6: a stage-3 model whose master, moments and shards live on NVMe saves and
// resumes through tiles: the host bytes the save and the load allocate (counted at malloc,
// tests/alloc_meter.h) stay within a few units' bytes, far below one array of the partition
// (the save read each array whole, the load held the whole model and the master and moments).
namespace {

struct BlocksImpl : torch::nn::Module {
  explicit BlocksImpl(int64_t width) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 16; ++i) blocks->push_back(torch::nn::Linear(width, width));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = x;
    for (auto& b : *blocks) h = torch::tanh(b->as<torch::nn::Linear>()->forward(h));
    return (h - y).pow(2).mean();
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Blocks);

}  // namespace

// Saves and loads of stage 3 with the parameters and the optimizer state offloaded, at malloc:
// the host holds a few units' worth of buffers beside the states, never a second copy of an array
// (issue 60: the largest models fill host memory with the states themselves).
void expect_checkpoint_host_bytes_bounded(const std::string& device) {
  const std::string dir = testing::TempDir() + "/host_bytes_" + device + "_" + std::to_string(getpid());
  const std::string nvme = dir + "/nvme", ckpt = dir + "/ckpt";
  strata::checkpoint::remove_tree(dir);
  strata::checkpoint::make_directories(nvme);
  constexpr int64_t kWidth = 512;
  json offload = {{"device", device}};
  if (device == "nvme") offload["nvme_path"] = nvme;
  json config = {{"train_micro_batch_size_per_gpu", 4},
                 {"gradient_accumulation_steps", 1},
                 {"steps_per_print", 1000},
                 {"zero_optimization",
                  {{"stage", 3},
                   {"sub_group_size", 65536},
                   {"offload_optimizer", offload},
                   {"offload_param", offload}}},
                 {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
  auto run = [&](bool save) {
    torch::manual_seed(save ? 1 : 2);
    Blocks net(kWidth);
    auto engine = strata::initialize(net, config);
    torch::manual_seed(3);
    const auto x = torch::randn({4, kWidth}), y = torch::randn({4, kWidth});
    engine->backward(engine->forward(x, y));
    engine->step();
    const int64_t unit_bytes = engine->stage3_units()->largest_unit_bytes();
    const int64_t array_bytes = engine->stage3_units()->shards().partition_numel() * 4;
    strata::test::AllocMeter::reset_peak();
    if (save)
      engine->save_checkpoint(ckpt, "t");
    else
      engine->load_checkpoint(ckpt, "t");
    const int64_t peak = strata::test::AllocMeter::peak_since_reset();
    std::printf("[          ] %s, %s: host peak %.2f MB; largest unit %.2f MB, one array %.2f MB\n",
                device.c_str(), save ? "save" : "load", peak / 1e6, unit_bytes / 1e6, array_bytes / 1e6);
    EXPECT_LT(peak, 3 * unit_bytes + (int64_t(2) << 20)) << (save ? "save" : "load");
    EXPECT_LT(peak, array_bytes / 2) << (save ? "save" : "load");
    // The loaded engine trains on from the saved state: its next loss is the saving run's.
    torch::manual_seed(4);
    const auto x2 = torch::randn({4, kWidth}), y2 = torch::randn({4, kWidth});
    return engine->forward(x2, y2).item<double>();
  };
  const double saved_next = run(true);
  const double loaded_next = run(false);
  EXPECT_EQ(saved_next, loaded_next);
  strata::checkpoint::remove_tree(dir);
}

TEST(CheckpointHostBytes, Stage3OnNvmeSavesAndLoadsInTilesNotWholeArrays) {
  if (!strata::test::AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  expect_checkpoint_host_bytes_bounded("nvme");
}

TEST(CheckpointHostBytes, Stage3InHostMemorySavesAndLoadsWithoutASecondCopy) {
  if (!strata::test::AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  expect_checkpoint_host_bytes_bounded("cpu");
}

// Checkpoints written before tensor-file version 2 (LibTorch archive payloads) still load: the
// same checkpoint rewritten file by file as version 1 resumes a stage-3 NVMe engine exactly as
// the version-2 original does.
TEST(CheckpointHostBytes, AVersionOneCheckpointStillLoads) {
  namespace ckpt = strata::checkpoint;
  const std::string dir = testing::TempDir() + "/v1_" + std::to_string(getpid());
  const std::string nvme = dir + "/nvme", v2 = dir + "/v2", v1 = dir + "/v1";
  ckpt::remove_tree(dir);
  ckpt::make_directories(nvme);
  json config = {{"train_micro_batch_size_per_gpu", 4},
                 {"gradient_accumulation_steps", 1},
                 {"steps_per_print", 1000},
                 {"zero_optimization",
                  {{"stage", 3},
                   {"sub_group_size", 4096},
                   {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", nvme}}},
                   {"offload_param", {{"device", "nvme"}, {"nvme_path", nvme}}}}},
                 {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
  auto next_loss = [&](auto& engine) {
    torch::manual_seed(4);
    const auto x = torch::randn({4, 64}), y = torch::randn({4, 64});
    engine->backward(engine->forward(x, y));
    engine->step();
    return engine->forward(x, y).template item<double>();
  };
  double expected = 0;
  {
    torch::manual_seed(1);
    Blocks net(64);
    auto engine = strata::initialize(net, config);
    torch::manual_seed(3);
    engine->backward(engine->forward(torch::randn({4, 64}), torch::randn({4, 64})));
    engine->step();
    engine->save_checkpoint(v2, "t");
    expected = next_loss(engine);
  }
  // The same files as version 1, and a manifest that vouches for them.
  ckpt::link_folder(v2 + "/t", dir + "/copy", /*allow_link=*/false);
  ckpt::make_directories(v1);
  ckpt::rename_durable(dir + "/copy", v1 + "/t");
  ckpt::write_file_atomic(v1 + "/latest", "t");
  auto manifest = ckpt::CheckpointReader(v1, "t").manifest();
  for (auto& f : manifest.files) {
    const std::string path = v1 + "/t/" + f.file;
    const auto file = ckpt::load_tensor_file(path);
    const auto info = ckpt::save_tensor_file(path, file.tensors, file.scalars);
    ASSERT_EQ(info.version, 1);
    f.bytes = info.bytes;
    f.crc32c = info.crc32c;
  }
  ckpt::write_file_atomic(v1 + "/t/manifest.json", manifest.to_json().dump(1) + "\n");
  for (const auto& from : {v2, v1}) {
    torch::manual_seed(2);
    Blocks net(64);
    auto engine = strata::initialize(net, config);
    engine->load_checkpoint(from, "t");
    EXPECT_EQ(next_loss(engine), expected) << from;
  }
  ckpt::remove_tree(dir);
}
