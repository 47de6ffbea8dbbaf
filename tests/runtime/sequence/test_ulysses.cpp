// Ulysses' attention exchange over real processes (Gloo, loopback), sequence_parallel_size 2 and
// 4, against attention over the whole sequence in one process: each rank holds its shard of
// q, k, v; the output shard and the gradients of its q, k, v shards equal the whole run's
// (1e-6, fp32), with as many kv heads as query heads, fewer (a multiple of the ranks), and fewer
// than the ranks (replicated, DeepSpeed's way), down to one. The bytes each rank hands to
// all_to_all, counted in the communication layer, are what the shapes say, forward and backward.
// In one process: shards, shifted labels and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "comm/process_group.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/sequence/ulysses.h"
#include "tests/comm/ranks.h"

// Named: this binary also holds tests/models/test_ulysses_models.cpp, and a unity build compiles
// them as one translation unit.
namespace strata::test::ulysses_layer {
namespace {

constexpr int64_t kB = 2, kH = 8, kS = 16, kHd = 4;

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v) throw Error(fmt::format("{} is not set", name));
  return std::atoi(v);
}

// Causal attention with grouped kv heads (query head i reads kv head i / (H / KV)), in fp64
// arithmetic on fp32 tensors' values: the reference and the ranks run the same function.
torch::Tensor causal_gqa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t n = q.size(1) / k.size(1), t = q.size(2);
  const auto kk = k.repeat_interleave(n, 1), vv = v.repeat_interleave(n, 1);
  auto scores = torch::matmul(q, kk.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  const auto above = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
  scores = scores.masked_fill(above, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), vv);
}

void check_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  if (got.sizes() != want.sizes())
    throw Error(fmt::format("{}: shape {} against {}", what, c10::str(got.sizes()),
                            c10::str(want.sizes())));
  const double diff = (got - want).abs().max().item<double>();
  if (!(diff <= 1e-6 * (1 + want.abs().max().item<double>())))
    throw Error(fmt::format("{}: max difference {}", what, diff));
}

STRATA_SCENARIO(ulysses_attention) {
  auto world = comm::init_process_group();
  const int64_t P = world->size(), r = world->rank(), KV = env_int("ULYSSES_KV");
  torch::manual_seed(7);
  const auto q = torch::randn({kB, kH, kS, kHd}), k = torch::randn({kB, KV, kS, kHd}),
             v = torch::randn({kB, KV, kS, kHd}), probe = torch::randn({kB, kH, kS, kHd});
  // The whole sequence in this process.
  auto qw = q.clone().requires_grad_(true), kw = k.clone().requires_grad_(true),
       vw = v.clone().requires_grad_(true);
  const auto want = causal_gqa(qw, kw, vw);
  (want * probe).sum().backward();
  // This rank's shard through the exchange.
  auto shard = [&](const torch::Tensor& x) {
    return sequence::shard_sequence(x, world, 2).clone().requires_grad_(true);
  };
  auto qs = shard(q), ks = shard(k), vs = shard(v);
  const auto before = world->all_to_all_traffic();
  const auto got = sequence::ulysses_attention(qs, ks, vs, world, causal_gqa);
  const auto forward = world->all_to_all_traffic();
  (got * sequence::shard_sequence(probe, world, 2)).sum().backward();
  const auto backward = world->all_to_all_traffic();
  const std::string at = fmt::format("P {} KV {} rank {}", P, KV, r);
  check_close(got, sequence::shard_sequence(want.detach(), world, 2), at + ": output");
  check_close(qs.grad(), sequence::shard_sequence(qw.grad(), world, 2), at + ": d q");
  check_close(ks.grad(), sequence::shard_sequence(kw.grad(), world, 2), at + ": d k");
  check_close(vs.grad(), sequence::shard_sequence(vw.grad(), world, 2), at + ": d v");
  // Forward: q, k and v (kv heads replicated up to P) go out, the output comes back; each hands
  // (P - 1) / P of its elements to the other ranks. Backward: the same exchanges reversed.
  const int64_t kv_sent = std::max(KV, P);
  const int64_t per_head = kB * (kS / P) * kHd * int64_t(sizeof(float));
  const int64_t expect = (2 * kH + 2 * kv_sent) * per_head * (P - 1) / P;
  const int64_t fwd = forward.bytes_to_others - before.bytes_to_others;
  const int64_t bwd = backward.bytes_to_others - forward.bytes_to_others;
  if (fwd != expect || bwd != expect)
    throw Error(fmt::format("{}: {} bytes to others forward and {} backward; the shapes say {}", at,
                            fwd, bwd, expect));
  std::printf("MESSAGE: %s: %lld bytes to other ranks per direction = (2 x %lld query + 2 x %lld "
              "kv heads) x %lld bytes x (P - 1) / P\n",
              at.c_str(), (long long)fwd, (long long)kH, (long long)kv_sent, (long long)per_head);
}

TEST(Ulysses, AttentionOverShardsEqualsTheWholeSequenceAtTwoAndFourRanks) {
  // kv heads: as many as the query heads, fewer (a multiple of P), fewer than P (replicated).
  for (const int P : {2, 4})
    for (const int kv : {8, 4, 2, 1}) {
      // CI's sanitized suite: the replicated case.
      if (kSanitized && !(P == 4 && kv == 2)) continue;
      LaunchSpec spec;
      spec.scenario = "ulysses_attention";
      spec.world = P;
      spec.env = {{"ULYSSES_KV", std::to_string(kv)}};
      spec.timeout_s = 60;
      auto l = run_ranks(spec);
      l.print_messages();
      EXPECT_TRUE(l.all_ok()) << "P " << P << " kv " << kv << ": " << l.report();
    }
}

// A model under sequence_parallel_size 2 that never exchanges attends within its shard: the
// engine refuses it after the first backward, before any step, on every rank.
STRATA_SCENARIO(ulysses_unexchanged) {
  auto world = comm::init_process_group();
  torch::manual_seed(1);
  torch::nn::Linear model(4, 4);
  InitOptions options;
  options.group = world;
  auto engine = initialize(model, nlohmann::json::parse(R"({"train_micro_batch_size_per_gpu": 1,
      "sequence_parallel_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})"),
                           options);
  const auto loss = engine->forward(torch::randn({1, 4})).sum();
  try {
    engine->backward(loss);
  } catch (const Error& e) {
    if (std::string(e.what()).find("ran no Ulysses attention exchange") == std::string::npos)
      throw Error(std::string("unexpected error: ") + e.what());
    return;
  }
  throw Error("a model that never exchanged trained under sequence_parallel_size 2");
}

TEST(Ulysses, AModelThatNeverExchangesIsRefused) {
  LaunchSpec spec;
  spec.scenario = "ulysses_unexchanged";
  spec.world = 2;
  auto l = run_ranks(spec);
  EXPECT_TRUE(l.all_ok()) << l.report();
}

TEST(Ulysses, ShardsAndShiftedLabels) {
  const auto x = torch::arange(12).view({1, 12});
  EXPECT_TRUE(sequence::shard_sequence(x, nullptr).equal(x));
  const auto labels = torch::tensor({{5, 6, 7, 8}}, torch::kLong);
  EXPECT_TRUE(sequence::shift_labels(labels).equal(torch::tensor({{6, 7, 8, -100}}, torch::kLong)));
  EXPECT_TRUE(
      sequence::shift_labels(labels, -1).equal(torch::tensor({{6, 7, 8, -1}}, torch::kLong)));
  const auto q = torch::randn({1, 2, 4, 4});
  // Without a group, the attention runs as given.
  const auto out = sequence::ulysses_attention(q, q, q, nullptr, causal_gqa);
  EXPECT_TRUE(out.equal(causal_gqa(q, q, q)));
  try {
    sequence::ulysses_attention(q, torch::randn({1, 2, 3, 4}), q, nullptr, causal_gqa);
    ADD_FAILURE() << "mismatched shards accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be [batch, heads, sequence shard, head_dim]"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace strata::test::ulysses_layer

int main(int argc, char** argv) { return strata::test::test_main(argc, argv); }
