// A user's own CNN through the engine (issue 28): BatchNorm, dropout, ReLU / MaxPool / Dropout as
// parameter-free children of a Sequential, a bool mask buffer and an int64 counter buffer.
//   - bf16 casts floating-point tensors only: the bool and int64 buffers (and BatchNorm's
//     num_batches_tracked) keep their dtypes and count past 256, in the model and the checkpoint;
//     a checkpoint written before (16-bit integer buffers, no generator states, no submodule list)
//     still loads;
//   - `strata-ckpt consolidate` and save_16bit_model write archives that plain torch::load reads
//     into a freshly built model, which then gives the trained model's outputs exactly;
//   - dropout resumes bit for bit (the generators are in the checkpoint), in one process and on
//     2 ranks;
//   - broadcast_buffers: before each training forward every rank holds rank 0's BatchNorm
//     statistics (checked against a BatchNorm run by hand); by default each rank keeps its own;
//   - zero_force_ds_cpu_optimizer: a client optimizer under CPU offload is refused, and runs (with
//     the log naming what steps) when the key is false.
// The multi-rank cases re-run this binary as ranks through strata-run.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <string>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/tensor_file.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "tests/runtime/engine/launch_workers.h"

namespace {

using strata::json;
namespace nn = torch::nn;

constexpr const char* kWorker = "STRATA_USER_MODEL_WORKER";
bool is_worker() { return strata::test_support::is_worker(kWorker); }

struct UserCnnImpl : nn::Module {
  UserCnnImpl() {
    features = register_module(
        "features", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 4, 3).padding(1)),
                                   nn::BatchNorm2d(4), nn::ReLU(), nn::MaxPool2d(2),
                                   nn::Dropout(0.3)));
    head = register_module("head", nn::Linear(64, 3));
    mask = register_buffer("mask", torch::rand({64}) > 0.2);
    calls = register_buffer("calls", torch::zeros({}, torch::kLong));
  }
  torch::Tensor logits(const torch::Tensor& x) {
    auto h = features->forward(x.to(head->weight.scalar_type())).flatten(1);
    return head(h * mask.to(h.scalar_type()));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    if (is_training()) calls.add_(1);
    return nn::functional::cross_entropy(logits(x).to(torch::kFloat), y);
  }
  nn::BatchNorm2d bn() {
    return nn::BatchNorm2d(std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(features->ptr(1)));
  }
  nn::Sequential features{nullptr};
  nn::Linear head{nullptr};
  torch::Tensor mask, calls;
};
TORCH_MODULE(UserCnn);

json config(int stage, bool bf16, int world = 1, int micro = 4) {
  json c = {{"train_batch_size", micro * world},
            {"steps_per_print", 100000},
            {"gradient_clipping", 1.0},
            {"zero_optimization", {{"stage", stage}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}}};
  if (bf16) c["bf16"] = {{"enabled", true}};
  return c;
}

// This rank's batch of step `step`, from a generator of its own: the global one is dropout's.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int rank = 0, int micro = 4) {
  auto gen = at::detail::createCPUGenerator(uint64_t(1000 + 16 * step + rank));
  auto x = torch::randn({micro, 1, 8, 8}, gen);
  auto y = torch::randint(0, 3, {micro}, gen, torch::kLong);
  return {x, y};
}

template <class E>
void train(E& engine, int64_t from, int64_t to, int rank = 0) {
  for (int64_t step = from; step < to; ++step) {
    auto [x, y] = batch(step, rank);
    engine->backward(engine->forward(x, y));
    engine->step();
  }
}

// Under strata-run the ranks share strata-run's process id, and so the folder.
std::string scratch(const std::string& name) {
  const auto dir = testing::TempDir() + "/user_model_" +
                   std::to_string(is_worker() ? getppid() : getpid()) + "_" + name;
  strata::checkpoint::remove_tree(dir);
  return dir;
}

bool equal_parameters(nn::Module& a, nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (const auto& p : pa)
    if (!torch::equal(p.value(), pb[p.key()])) return false;
  for (const auto& buf : a.named_buffers())
    if (!torch::equal(buf.value(), b.named_buffers()[buf.key()])) return false;
  return true;
}

// ---- 9: integer and bool buffers keep their dtypes under bf16 -------------------------------

TEST(UserCnn, Bf16CastsFloatingPointTensorsOnlyAndCountsPast256) {
  if (is_worker()) GTEST_SKIP();
  torch::manual_seed(1);
  UserCnn model;
  const auto mask = model->mask.clone();
  auto engine = strata::initialize(model, config(1, true));
  EXPECT_EQ(model->head->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(model->bn()->running_mean.scalar_type(), torch::kBFloat16);  // as DeepSpeed's .bfloat16()
  ASSERT_EQ(model->mask.scalar_type(), torch::kBool);
  EXPECT_TRUE(torch::equal(model->mask, mask));
  ASSERT_EQ(model->calls.scalar_type(), torch::kLong);
  ASSERT_EQ(model->bn()->num_batches_tracked.scalar_type(), torch::kLong);
  train(engine, 0, 300);
  EXPECT_EQ(model->calls.item<int64_t>(), 300);
  EXPECT_EQ(model->bn()->num_batches_tracked.item<int64_t>(), 300);
  const auto dir = scratch("bf16_counts");
  engine->save_checkpoint(dir, "t");
  strata::checkpoint::CheckpointReader reader(dir, "t");
  const auto states = reader.load_shared("model_states");
  EXPECT_EQ(states.at("buffer.features.1.num_batches_tracked").scalar_type(), torch::kLong);
  EXPECT_EQ(states.at("buffer.features.1.num_batches_tracked").item<int64_t>(), 300);
  EXPECT_EQ(states.at("buffer.mask").scalar_type(), torch::kBool);
  strata::checkpoint::remove_tree(dir);
}

// A checkpoint as Strata wrote it before issue 28's fixes: the same files, with integer and bool
// buffers in bf16, no generator states and no list of submodules.
void rewrite_as_before(const std::string& dir, const std::string& out) {
  using namespace strata::checkpoint;
  CheckpointReader reader(dir, "t");
  CheckpointWriter writer(out, "t", 0, 1);
  for (const auto& f : reader.manifest().files) {
    if (f.kind == "rng_states") continue;
    auto file = f.rank < 0 ? reader.load_shared(f.kind) : reader.load_partition(f.kind, f.rank);
    if (f.kind == "model_states") {
      file.scalars.erase("submodules");
      for (auto& [name, t] : file.tensors)
        if (name.rfind("buffer.", 0) == 0 && !t.is_floating_point()) t = t.to(torch::kBFloat16);
    }
    if (f.rank < 0)
      writer.write_shared(f.kind, file.tensors, file.scalars);
    else
      writer.write_partition(f.kind, file.tensors, file.scalars);
  }
  writer.commit(reader.manifest().info);
}

TEST(UserCnn, CheckpointWrittenBeforeTheFixesStillLoads) {
  if (is_worker()) GTEST_SKIP();
  torch::manual_seed(1);
  UserCnn model;
  auto engine = strata::initialize(model, config(2, true));
  train(engine, 0, 5);
  const auto dir = scratch("old_new"), old = scratch("old");
  engine->save_checkpoint(dir, "t");
  rewrite_as_before(dir, old);
  torch::manual_seed(2);
  UserCnn fresh;
  auto resumed = strata::initialize(fresh, config(2, true));
  testing::internal::CaptureStdout();
  resumed->load_checkpoint(old);
  const auto log = testing::internal::GetCapturedStdout();
  EXPECT_NE(log.find("the random generators were not restored (saved before checkpoints kept them)"),
            std::string::npos) << log;
  EXPECT_NE(log.find("buffer.features.1.num_batches_tracked was saved as BFloat16"), std::string::npos)
      << log;
  ASSERT_EQ(fresh->bn()->num_batches_tracked.scalar_type(), torch::kLong);
  EXPECT_EQ(fresh->bn()->num_batches_tracked.item<int64_t>(), 5);
  EXPECT_EQ(fresh->calls.item<int64_t>(), 5);
  EXPECT_TRUE(torch::equal(fresh->mask, model->mask));
  EXPECT_TRUE(torch::equal(fresh->head->weight, model->head->weight));
  // strata-ckpt still consolidates it, saying why the archive may not load.
  FILE* pipe = popen((std::string(STRATA_BIN_DIR) + "/strata-ckpt consolidate " + old +
                      " --out " + old + "/model.pt 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  EXPECT_EQ(pclose(pipe), 0) << out;
  EXPECT_NE(out.find("does not list its submodules"), std::string::npos) << out;
  strata::checkpoint::remove_tree(dir);
  strata::checkpoint::remove_tree(old);
}

// ---- 10: plain torch::load reads what strata-ckpt and save_16bit_model write -----------------

torch::Tensor eval_logits(UserCnn& model, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto out = model->logits(x);
  model->train();
  return out;
}

TEST(UserCnn, ConsolidatedAndSixteenBitFilesLoadWithPlainTorchLoad) {
  if (is_worker()) GTEST_SKIP();
  const auto x = batch(99).first;
  {  // fp32 at stage 2: the consolidated fp32 master is the model's weights.
    torch::manual_seed(1);
    UserCnn model;
    auto engine = strata::initialize(model, config(2, false));
    train(engine, 0, 6);
    const auto dir = scratch("consolidate");
    engine->save_checkpoint(dir, "t");
    const auto file = dir + "/model.pt";
    ASSERT_EQ(std::system((std::string(STRATA_BIN_DIR) + "/strata-ckpt consolidate " + dir +
                           " --out " + file + " > /dev/null").c_str()), 0);
    torch::manual_seed(7);
    UserCnn fresh;
    torch::load(fresh, file);
    EXPECT_TRUE(equal_parameters(*model, *fresh));
    EXPECT_TRUE(torch::equal(eval_logits(fresh, x), eval_logits(model, x)));
    strata::checkpoint::remove_tree(dir);
  }
  for (int stage : {1, 3}) {  // bf16: the 16-bit weights as trained, gathered at stage 3
    SCOPED_TRACE("stage " + std::to_string(stage));
    torch::manual_seed(1);
    UserCnn model;
    auto c = config(stage, true);
    c["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true;
    c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    auto engine = strata::initialize(model, c);
    train(engine, 0, 6);
    const auto dir = scratch("16bit" + std::to_string(stage));
    engine->save_16bit_model(dir);
    torch::manual_seed(7);
    UserCnn fresh;
    {  // the user's model in bf16 first, as they would train it (floating-point tensors only)
      torch::NoGradGuard no_grad;
      for (auto& t : fresh->parameters()) t.set_data(t.to(torch::kBFloat16));
      for (auto& t : fresh->buffers())
        if (t.is_floating_point()) t.set_data(t.to(torch::kBFloat16));
    }
    torch::load(fresh, dir + "/model.pt");
    EXPECT_EQ(fresh->head->weight.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(fresh->bn()->num_batches_tracked.item<int64_t>(), 6);
    torch::Tensor want;
    {
      auto whole = engine->gathered_parameters();
      want = eval_logits(model, x);
    }
    EXPECT_TRUE(torch::equal(eval_logits(fresh, x), want));
    strata::checkpoint::remove_tree(dir);
  }
}

// ---- 11: dropout resumes bit for bit ---------------------------------------------------------

// 6 steps straight against 3, save, a fresh process's state (the same seed, a new model and
// engine), load, 3 more. Without the generators in the checkpoint the second half drew other
// dropout masks.
void expect_dropout_resume(int stage, bool bf16, int rank, int world) {
  const auto dir = scratch("dropout_" + std::to_string(stage) + (bf16 ? "bf16" : ""));
  auto c = config(stage, bf16, world);
  torch::manual_seed(1);
  UserCnn straight;
  auto a = strata::initialize(straight, c);
  train(a, 0, 6, rank);
  torch::manual_seed(1);
  UserCnn first;
  auto b = strata::initialize(first, c);
  train(b, 0, 3, rank);
  b->save_checkpoint(dir, "t");
  torch::manual_seed(1);
  UserCnn resumed;
  auto r = strata::initialize(resumed, c);
  r->load_checkpoint(dir);
  train(r, 3, 6, rank);
  // The parameters on every rank; the buffers on rank 0 only: the checkpoint keeps rank 0's
  // BatchNorm statistics (as DeepSpeed), which another rank resumes from.
  auto want = straight->named_parameters();
  for (const auto& p : resumed->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key() << ", stage " << stage;
  if (rank == 0)
    EXPECT_TRUE(equal_parameters(*straight, *resumed)) << "stage " << stage << (bf16 ? " bf16" : "");
  if (rank == 0) strata::checkpoint::remove_tree(dir);
}

TEST(UserCnn, DropoutResumesBitForBit) {
  if (is_worker()) GTEST_SKIP();
  expect_dropout_resume(0, false, 0, 1);
  expect_dropout_resume(2, true, 0, 1);
}

TEST(UserCnnWorker, DropoutResumesBitForBitOnTwoRanks) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see UserCnnRanks.*)";
  expect_dropout_resume(1, false, strata::test_support::env_int("RANK"), 2);
}

// ---- 12: broadcast_buffers --------------------------------------------------------------------

TEST(UserCnnWorker, BroadcastBuffersGivesEveryRankRankZerosStatistics) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see UserCnnRanks.*)";
  const int rank = strata::test_support::env_int("RANK");
  for (bool broadcast : {false, true}) {
    SCOPED_TRACE(broadcast ? "broadcast_buffers" : "default");
    auto c = config(0, false, 2);
    c["broadcast_buffers"] = broadcast;
    torch::manual_seed(1);
    UserCnn model;
    auto engine = strata::initialize(model, c);
    auto group = engine->data_parallel_group();
    ASSERT_TRUE(group);
    auto bn = model->bn();
    bool differed = false;
    for (int64_t step = 0; step < 4; ++step) {
      auto [x, y] = batch(step, rank);
      // What the forward should start from: rank 0's statistics (the default: this rank's own).
      auto mean = bn->running_mean.clone(), var = bn->running_var.clone();
      auto count = bn->num_batches_tracked.clone();
      auto mean0 = mean.clone(), var0 = var.clone();
      group->broadcast(mean0, 0);
      group->broadcast(var0, 0);
      group->broadcast(count, 0);
      differed = differed || !torch::equal(mean0, mean);
      // The statistics' update by hand: a BatchNorm of the same options on the conv's output.
      nn::BatchNorm2d twin(bn->options);
      torch::Tensor want_mean, want_var;
      {
        torch::NoGradGuard no_grad;
        twin->running_mean.copy_(broadcast ? mean0 : mean);
        twin->running_var.copy_(broadcast ? var0 : var);
        twin->forward(model->features[0]->as<nn::Conv2d>()->forward(x));
      }
      engine->backward(engine->forward(x, y));
      engine->step();
      EXPECT_TRUE(torch::equal(bn->running_mean, twin->running_mean)) << "step " << step;
      EXPECT_TRUE(torch::equal(bn->running_var, twin->running_var)) << "step " << step;
      EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), count.item<int64_t>() + 1);
    }
    // Rank 1's statistics differed from rank 0's before its forwards (each rank's batches moved
    // them), so the two references above are different numbers and the checks tell them apart.
    if (rank == 1) EXPECT_TRUE(differed);
  }
}

TEST(UserCnn, BroadcastBuffersIsAStrictBool) {
  if (is_worker()) GTEST_SKIP();
  torch::manual_seed(1);
  UserCnn model;
  auto c = config(0, false);
  c["broadcast_buffers"] = "yes";
  EXPECT_THROW(strata::initialize(model, c), strata::Error);
}

TEST(UserCnnRanks, EveryWorkerCasePassesOnTwoRanks) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers(kWorker, 2, "UserCnnWorker.*", &output), 0) << output;
  EXPECT_EQ(output.find("[  FAILED  ]"), std::string::npos) << output;
  EXPECT_NE(output.find("[  PASSED  ] 2 tests"), std::string::npos) << output;
}

// ---- 13: zero_force_ds_cpu_optimizer ----------------------------------------------------------

TEST(UserCnn, ClientOptimizerUnderCpuOffloadIsRefusedUnlessAllowed) {
  if (is_worker()) GTEST_SKIP();
  auto sgd = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9));
  };
  auto c = config(2, false);
  c.erase("optimizer");
  c["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  {
    torch::manual_seed(1);
    UserCnn model;
    strata::InitOptions options;
    options.optimizer_builder = sgd;
    try {
      strata::initialize(model, c, options);
      ADD_FAILURE() << "a client optimizer under CPU offload was accepted";
    } catch (const strata::Error& e) {
      EXPECT_NE(std::string(e.what()).find("\"zero_force_ds_cpu_optimizer\": false"), std::string::npos)
          << e.what();
    }
  }
  // Allowed: it steps the host master itself (the log says so), as the same SGD on the device.
  std::vector<torch::Tensor> finals[2];
  for (bool offload : {false, true}) {
    auto cc = c;
    cc["zero_force_ds_cpu_optimizer"] = false;
    if (!offload) cc["zero_optimization"].erase("offload_optimizer");
    torch::manual_seed(1);
    UserCnn model;
    strata::InitOptions options;
    options.optimizer_builder = sgd;
    testing::internal::CaptureStdout();
    auto engine = strata::initialize(model, cc, options);
    const auto log = testing::internal::GetCapturedStdout();
    if (offload)
      EXPECT_NE(log.find("stepped on the CPU by torch::optim::SGD's own step"), std::string::npos) << log;
    train(engine, 0, 4);
    for (const auto& p : model->parameters()) finals[offload].push_back(p.detach().clone());
  }
  // The same SGD over the same gradients; the clipping norm is summed on the host or the device.
  for (size_t i = 0; i < finals[0].size(); ++i)
    EXPECT_TRUE(torch::allclose(finals[0][i], finals[1][i], 1e-6, 1e-7)) << "parameter " << i;
}

}  // namespace
