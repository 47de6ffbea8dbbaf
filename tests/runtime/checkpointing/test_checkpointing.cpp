// The checkpoint mechanism (runtime/checkpointing/checkpoint.h) against plain autograd: the same
// function run without checkpointing is the reference, gradients to 1e-6.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <limits>
#include <tuple>

#include <ATen/record_function.h>
#include <torch/torch.h>

#include "moe/layer.h"
#include "runtime/checkpointing/checkpoint.h"
#include "runtime/checkpointing/saved_inputs.h"
#include "runtime/checkpointing/settings.h"
#include "runtime/util/recompute.h"
#include "../../offload/build_fs_dir.h"

namespace {

namespace ckpt = strata::checkpointing;
namespace F = torch::nn::functional;

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined() ? 0.0 : 1e30;
  return (a - b).abs().max().item<double>();
}

// A block with dropout, a GELU and two linear layers.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc = register_module("fc", torch::nn::Linear(16, 32));
    proj = register_module("proj", torch::nn::Linear(32, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = F::dropout(F::gelu(fc(norm(x))), F::DropoutFuncOptions().p(0.3).training(true));
    return x + proj(h);
  }
  torch::nn::Linear fc{nullptr}, proj{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Block);

std::vector<torch::Tensor> param_grads(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) {
    g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    p.mutable_grad() = torch::Tensor();
  }
  return g;
}

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LE(max_diff(a[i], b[i]), 1e-6) << what << " #" << i;
}

TEST(Checkpoint, PolicyParses) {
  EXPECT_EQ(ckpt::CheckpointPolicy::parse("every:3").every, 3);
  EXPECT_TRUE(ckpt::CheckpointPolicy::parse("every:3").checkpoints_block(2));
  EXPECT_FALSE(ckpt::CheckpointPolicy::parse("every:3").checkpoints_block(0));
  EXPECT_TRUE(ckpt::CheckpointPolicy::parse("selective").selective());
  EXPECT_EQ(ckpt::CheckpointPolicy::parse("").str(), "none");
  EXPECT_THROW(ckpt::CheckpointPolicy::parse("every:0"), std::exception);
  EXPECT_THROW(ckpt::CheckpointPolicy::parse("sometimes"), std::exception);
}

// Dropout draws the same numbers in the recomputation; the generator continues where the plain
// run's does; gradients of input and parameters as without checkpointing, under backward() and
// under torch::autograd::grad (which leaves .grad alone).
TEST(Checkpoint, GradientsEqualThePlainRunUnderBackwardAndGrad) {
  torch::manual_seed(1);
  Block block;
  const auto x0 = torch::randn({4, 5, 16});
  for (bool use_grad : {false, true}) {
    std::vector<torch::Tensor> ref, got;
    torch::Tensor after_ref, after_got;
    for (bool checkpointed : {false, true}) {
      auto x = x0.clone().requires_grad_(true);
      torch::manual_seed(42);
      auto y = checkpointed ? ckpt::checkpoint(block, x) : block->forward(x);
      auto loss = (y * y).sum();
      std::vector<torch::Tensor> grads;
      if (use_grad) {
        std::vector<torch::Tensor> wrt{x};
        for (auto& p : block->parameters()) wrt.push_back(p);
        grads = torch::autograd::grad({loss}, wrt);
        for (auto& p : block->parameters()) EXPECT_FALSE(p.grad().defined());
      } else {
        loss.backward();
        grads = param_grads(*block);
        grads.push_back(x.grad());
      }
      (checkpointed ? got : ref) = grads;
      (checkpointed ? after_got : after_ref) = torch::rand({3});
    }
    expect_same(ref, got, use_grad ? "autograd::grad" : "backward");
    EXPECT_TRUE(torch::equal(after_ref, after_got)) << "the generator moved on differently";
  }
}

// checkpoint_residual_into_linear: the block r + proj(g) checkpointed whole, with dropout inside
// fn, gives the plain run's gradients (backward and autograd::grad, under autocast-free fp32),
// and its backward runs one linear product fewer than a plain checkpoint of the block: the
// last product is never recomputed.
TEST(Checkpoint, AResidualBlockIntoALinearLayerSkipsItsLastProductInBackward) {
  torch::manual_seed(11);
  Block block;
  const auto x0 = torch::randn({4, 5, 16});
  auto fn = [&](const torch::Tensor& x) {
    auto g = F::dropout(F::gelu(block->fc(block->norm(x))), F::DropoutFuncOptions().p(0.3).training(true));
    return std::make_pair(g, x);
  };
  // Linear layers' products while backward runs, nothing else running meanwhile: aten::linear on
  // these shapes runs aten::matmul (LibTorch 1.13) or aten::addmm (2.x); the backward's own
  // products are aten::mm.
  static std::atomic<int64_t> linears{0};
  auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& f) -> std::unique_ptr<at::ObserverContext> {
        const std::string name = f.name();
        if (name == "aten::matmul" || name == "aten::addmm") ++linears;
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  std::vector<torch::Tensor> ref, got;
  int64_t plain_checkpoint_linears = 0, tail_linears = 0;
  for (int variant = 0; variant < 3; ++variant) {  // plain, checkpoint(block), into the linear
    auto x = x0.clone().requires_grad_(true);
    torch::manual_seed(42);
    auto y = variant == 0   ? block->forward(x)
             : variant == 1 ? ckpt::checkpoint(block, x)
                            : ckpt::checkpoint_residual_into_linear("block", fn, block->parameters(), x,
                                                                    block->proj);
    auto loss = (y * y).sum();
    linears = 0;
    loss.backward();
    if (variant == 1) plain_checkpoint_linears = linears;
    if (variant == 2) tail_linears = linears;
    auto grads = param_grads(*block);
    grads.push_back(x.grad());
    if (variant == 0) ref = grads;
    if (variant == 2) got = grads;
  }
  at::removeCallback(handle);
  expect_same(ref, got, "into the linear layer");
  EXPECT_EQ(plain_checkpoint_linears, 2);  // fc and proj recomputed
  EXPECT_EQ(tail_linears, 1);              // fc only
}

// A first block fed by a frozen embedding: no input requires grad, the parameters still get theirs.
TEST(Checkpoint, WorksWhenNoInputRequiresGrad) {
  torch::manual_seed(2);
  Block block;
  const auto x = torch::randn({2, 3, 16});
  std::vector<torch::Tensor> ref, got;
  for (bool checkpointed : {false, true}) {
    torch::manual_seed(5);
    auto y = checkpointed ? ckpt::checkpoint(block, x) : block->forward(x);
    EXPECT_TRUE(y.requires_grad());
    y.pow(2).sum().backward();
    (checkpointed ? got : ref) = param_grads(*block);
  }
  expect_same(ref, got, "frozen input");
}

// Non-tensor arguments, several outputs (a tuple with an integer tensor and a double), nesting.
TEST(Checkpoint, NestedWithNonTensorArgumentsAndSeveralOutputs) {
  torch::manual_seed(3);
  Block inner, outer;
  auto fn = [&](const torch::Tensor& x, double scale, const std::string& tag, const torch::Tensor& m) {
    EXPECT_EQ(tag, "t");
    auto h = ckpt::checkpoint(inner, outer->forward(x) * scale);  // nested checkpoint
    return std::make_tuple(h * m, h.argmax(-1), scale * 2);
  };
  std::vector<torch::Tensor> params = inner->parameters();
  for (auto& p : outer->parameters()) params.push_back(p);
  const auto x0 = torch::randn({2, 4, 16});
  const auto mask = torch::rand({2, 4, 16}).requires_grad_(true);
  std::vector<torch::Tensor> ref, got;
  for (bool checkpointed : {false, true}) {
    auto x = x0.clone().requires_grad_(true);
    torch::manual_seed(9);
    std::tuple<torch::Tensor, torch::Tensor, double> r =
        checkpointed ? ckpt::checkpoint_function(fn, params, x, 0.5, std::string("t"), mask)
                     : fn(x, 0.5, "t", mask);
    EXPECT_EQ(std::get<1>(r).scalar_type(), torch::kLong);
    EXPECT_EQ(std::get<2>(r), 1.0);
    std::get<0>(r).pow(2).sum().backward();
    auto g = param_grads(*inner);
    for (auto& t : param_grads(*outer)) g.push_back(t);
    g.push_back(x.grad());
    g.push_back(mask.grad().clone());
    mask.mutable_grad() = torch::Tensor();
    (checkpointed ? got : ref) = g;
  }
  expect_same(ref, got, "nested");
}

// A layer's side output (the MoE l_aux pattern) carries its gradient; remember() replays.
TEST(Checkpoint, SideOutputsAndRememberedValuesReplay) {
  torch::manual_seed(4);
  torch::nn::Linear lin(8, 8);
  int64_t counter = 0;
  torch::Tensor aux;
  auto fn = [&](const torch::Tensor& x) {
    const uint64_t c = strata::recompute::remember([&] { return uint64_t(counter++); });
    auto y = lin(x) * double(c + 1);
    auto a = y.pow(2).mean();
    aux = a;
    strata::recompute::side_output(a, [&](const torch::Tensor& t) { aux = t; });
    return y;
  };
  const auto x0 = torch::randn({3, 8});
  std::vector<torch::Tensor> ref, got;
  for (bool checkpointed : {false, true}) {
    counter = 0;
    auto x = x0.clone().requires_grad_(true);
    auto y = checkpointed ? ckpt::checkpoint_function(fn, lin->parameters(), x) : fn(x);
    (y.sum() + 3.0 * aux).backward();
    EXPECT_EQ(counter, 1) << "the counter advances once per real forward";
    std::vector<torch::Tensor> g{x.grad(), lin->weight.grad().clone(), lin->bias.grad().clone()};
    lin->weight.mutable_grad() = torch::Tensor();
    lin->bias.mutable_grad() = torch::Tensor();
    (checkpointed ? got : ref) = g;
  }
  expect_same(ref, got, "side output");
}

TEST(Checkpoint, ATensorCapturedWithoutBeingAnArgumentIsNamed) {
  torch::nn::Linear lin(4, 4);
  auto hidden = torch::randn({4}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& x) { return lin(x) * hidden; };
  auto y = ckpt::checkpoint_function(fn, lin->parameters(), torch::randn({2, 4}));
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("neither one of its arguments nor one of its parameters"),
              std::string::npos)
        << e.what();
  }
}

// The MoE layer with noise (Jitter, the 2nd expert sampled): the recomputed gate routes as the
// forward did, its call counter and expert loads advance once per real forward, l_aux's gradient
// flows through the checkpoint.
TEST(Checkpoint, MoELayerReplaysItsNoiseAndKeepsItsStatistics) {
  strata::moe::MoEOptions o;
  o.hidden_size = 16;
  o.ffn_size = 32;
  o.num_experts = 4;
  o.k = 2;
  o.capacity_factor = 1.0;
  o.noisy_gate_policy = strata::moe::NoisyGatePolicy::Jitter;
  o.seed = 11;
  strata::moe::MoE ref_layer(o), layer(o);
  const auto x0 = torch::randn({24, 16});
  std::vector<torch::Tensor> ref, got, ref_counts;
  for (bool checkpointed : {false, true}) {
    auto& m = checkpointed ? layer : ref_layer;
    for (int step = 0; step < 2; ++step) {
      auto x = x0.clone().requires_grad_(true);
      auto y = checkpointed ? ckpt::checkpoint(m, x) : m->forward(x);
      const auto counts = m->last().exp_counts.clone();
      (y.pow(2).mean() + m->loss()).backward();
      EXPECT_TRUE(torch::equal(counts, m->last().exp_counts)) << "recomputation changed the loads";
      if (!checkpointed) ref_counts.push_back(counts);
      else EXPECT_TRUE(torch::equal(counts, ref_counts.at(size_t(step)))) << "step " << step;
      auto g = param_grads(*m);
      g.push_back(x.grad());
      (checkpointed ? got : ref).insert((checkpointed ? got : ref).end(), g.begin(), g.end());
    }
    EXPECT_EQ(m->call_index(), 2);
  }
  expect_same(ref, got, "MoE");
}

// The MoE layer keeps its l_aux, an output of the checkpoint's Function: the checkpoint must
// not own the layer in turn (a cycle nothing frees; LeakSanitizer found it in CI). With and
// without a backward the layer goes with its last holder; a backward after the module is gone
// is refused by name.
TEST(Checkpoint, ALayerKeepingItsOutputIsFreedWithItsLastHolder) {
  strata::moe::MoEOptions o;
  o.hidden_size = 16;
  o.ffn_size = 32;
  o.num_experts = 4;
  o.k = 1;
  for (bool backward : {false, true}) {
    std::weak_ptr<strata::moe::MoEImpl> weak;
    {
      strata::moe::MoE layer(o);
      weak = layer.ptr();
      auto x = torch::randn({8, 16}, torch::requires_grad());
      auto y = ckpt::checkpoint(layer, x);
      if (backward) (y.sum() + layer->loss()).backward();
    }
    EXPECT_TRUE(weak.expired()) << (backward ? "after a backward" : "without a backward");
  }
  torch::Tensor y;
  {
    Block block;
    y = ckpt::checkpoint(block, torch::randn({2, 16}, torch::requires_grad()));
  }
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("was destroyed between its checkpointed forward and the "
                                         "backward"),
              std::string::npos)
        << e.what();
  }
}

// Where the checkpointed inputs wait (cpu_checkpointing, one contiguous buffer, NVMe swap
// files): the same gradients; the NVMe folder is gone after release.
class CheckpointStores : public strata::test_support::BuildFsDirTest {
 protected:
  CheckpointStores() : BuildFsDirTest("checkpoint-stores") {}
};

TEST_F(CheckpointStores, HostContiguousAndNvmeGiveTheSameGradients) {
  torch::manual_seed(6);
  torch::nn::ModuleList blocks;
  for (int i = 0; i < 3; ++i) blocks->push_back(Block());
  const auto x0 = torch::randn({4, 8, 16});
  std::string where;
  auto run = [&](bool checkpointed) {
    auto x = x0.clone().requires_grad_(true);
    torch::manual_seed(8);
    ckpt::CheckpointPolicy p;
    if (checkpointed) p.kind = ckpt::CheckpointPolicy::Kind::kEvery;
    auto loss = ckpt::checkpoint_blocks<Block>(blocks, x, p).pow(2).sum();
    if (checkpointed) {  // between forward and backward: three checkpoints, kept where asked
      const auto stats = ckpt::store_stats();
      EXPECT_EQ(stats.live, 3) << where;
      EXPECT_EQ(stats.host_bytes, where == "host" ? 3 * x0.numel() * 4 : 0) << where;
      if (where == "nvme") EXPECT_FALSE(stats.nvme_folder.empty());
    }
    loss.backward();
    auto g = param_grads(*blocks);
    g.push_back(x.grad());
    return g;
  };
  const auto ref = run(false);
  int owner = 0;
  const auto swap = dir_ / "swap";
  std::filesystem::create_directories(swap);
  for (const std::string w : {"host", "contiguous", "contiguous-host", "nvme"}) {
    where = w;
    ckpt::Settings s;
    s.cpu_checkpointing = where == "host" || where == "contiguous-host";
    s.contiguous = where.rfind("contiguous", 0) == 0;
    s.number_checkpoints = 3;
    s.profile = true;
    if (where == "nvme") s.nvme_path = swap.string();
    ckpt::configure(&owner, s);
    for (int step = 0; step < 2; ++step) {  // the second reuses buffers and files
      expect_same(ref, run(true), where);
      const auto profile = ckpt::end_backward();
      ASSERT_EQ(profile.lines.size(), 4u) << where;  // a summary and one line per checkpoint
      EXPECT_EQ(profile.checkpoints, 3);
      EXPECT_EQ(profile.input_bytes, 3 * 4 * 8 * 16 * 4);
      EXPECT_GT(profile.recompute_ms, 0.0);
    }
    const auto stats = ckpt::store_stats();
    EXPECT_EQ(stats.live, 0) << where;
    if (where == "nvme") EXPECT_EQ(stats.nvme_files, 3) << "files are reused by the next step";
    ckpt::release(&owner);
  }
  EXPECT_TRUE(strata::util::list_folder(swap.string()).empty()) << "the NVMe folder is removed at release";
}

TEST(Checkpoint, ContiguousBufferTooSmallIsNamed) {
  int owner = 0;
  ckpt::Settings s;
  s.contiguous = true;
  s.number_checkpoints = 1;
  ckpt::configure(&owner, s);
  Block a, b;
  auto x = torch::randn({2, 16}, torch::requires_grad());
  auto y = ckpt::checkpoint(a, x);
  try {
    ckpt::checkpoint(b, y);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("raise number_checkpoints"), std::string::npos) << e.what();
  }
  ckpt::release(&owner);
  // Without the count the first checkpoint is refused by name (configure accepts it: a config
  // may carry the block for a program that never checkpoints, as DeepSpeed's does).
  s.number_checkpoints = 0;
  ckpt::configure(&owner, s);
  try {
    ckpt::checkpoint(a, x);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("needs number_checkpoints"), std::string::npos) << e.what();
  }
  ckpt::release(&owner);
}

}  // namespace

// Megatron-DeepSpeed's signature checkpoint(fn, hidden, mask, ...): a checkpoint of two and of
// three tensor inputs (an additive -inf mask among them) in every store, the contiguous buffer
// included, gives the gradients of the run without checkpointing. Every input keeps a slice of
// its own: the contiguous buffer once wrote the inputs of the forward's first checkpoint over
// each other at offset 0 (the mask over the hidden state: NaN through the -inf entries) and
// started the next checkpoint inside the first one's slice.
class CheckpointMaskedBlocks : public strata::test_support::BuildFsDirTest {
 protected:
  CheckpointMaskedBlocks() : BuildFsDirTest("checkpoint-masked") {}
};

TEST_F(CheckpointMaskedBlocks, TwoAndThreeInputCheckpointsGiveThePlainGradientsInEveryStore) {
  torch::manual_seed(21);
  torch::nn::ModuleList blocks;
  for (int i = 0; i < 3; ++i) blocks->push_back(Block());
  const int64_t B = 2, T = 6, D = 16;
  const auto x0 = torch::randn({B, T, D});
  // A causal additive mask: -inf above the diagonal; and a per-position scale (a third input
  // that requires grad).
  const auto mask = torch::full({T, T}, -std::numeric_limits<float>::infinity()).triu(1);
  const auto scale0 = torch::rand({T, 1}) + 0.5;
  // hidden, mask [, scale]: attention-like mixing under the mask, then the block.
  auto layer = [](Block& block, const torch::Tensor& h, const torch::Tensor& m,
                  const torch::Tensor& scale) {
    auto scores = torch::matmul(h, h.transpose(1, 2)) / 4.0 + m;
    auto mixed = torch::matmul(torch::softmax(scores, -1), h);
    if (scale.defined()) mixed = mixed * scale;
    return block->forward(mixed);
  };
  for (const int inputs : {2, 3}) {
    std::string where;
    auto run = [&](bool checkpointed) {
      auto x = x0.clone().requires_grad_(true);
      auto scale = scale0.clone().requires_grad_(true);
      torch::manual_seed(8);
      torch::Tensor h = x;
      for (size_t i = 0; i < blocks->size(); ++i) {
        auto block = blocks->ptr<BlockImpl>(i);
        Block held(block);
        if (!checkpointed) {
          h = layer(held, h, mask, inputs == 3 ? scale : torch::Tensor());
        } else if (inputs == 2) {
          h = ckpt::checkpoint_function(
              [held, &layer](const torch::Tensor& a, const torch::Tensor& m) mutable {
                return layer(held, a, m, torch::Tensor());
              },
              block->parameters(), h, mask);
        } else {
          h = ckpt::checkpoint_function(
              [held, &layer](const torch::Tensor& a, const torch::Tensor& m,
                             const torch::Tensor& s) mutable { return layer(held, a, m, s); },
              block->parameters(), h, mask, scale);
        }
      }
      h.pow(2).sum().backward();
      auto g = param_grads(*blocks);
      g.push_back(x.grad());
      if (inputs == 3) g.push_back(scale.grad());
      return g;
    };
    const auto ref = run(false);
    for (const auto& g : ref) ASSERT_TRUE(torch::isfinite(g).all().item<bool>());
    int owner = 0;
    const auto swap = dir_ / "swap";
    std::filesystem::create_directories(swap);
    for (const std::string w : {"as-is", "host", "contiguous", "contiguous-host", "nvme"}) {
      where = w + " with " + std::to_string(inputs) + " inputs";
      ckpt::Settings s;
      s.cpu_checkpointing = w == "host" || w == "contiguous-host";
      s.contiguous = w.rfind("contiguous", 0) == 0;
      s.number_checkpoints = 3;
      if (w == "nvme") s.nvme_path = swap.string();
      ckpt::configure(&owner, s);
      for (int step = 0; step < 2; ++step) expect_same(ref, run(true), where);  // reuse, too
      EXPECT_EQ(ckpt::store_stats().live, 0) << where;
      ckpt::release(&owner);
    }
  }
}
