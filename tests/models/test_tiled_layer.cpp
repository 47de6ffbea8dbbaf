// DecoderConfig::mlp_tiles (ALST's TiledMLP and more, models/causal_lm.cpp tiled_forward): a dense
// decoder layer runs everything but attention itself over tiles of the sequence. Its output and
// gradients are the untiled layer's (1e-6, fp32), and between forward and backward it keeps, at
// malloc (tests/alloc_meter), what attention keeps for its backward plus q, k, v and attention's
// output, nothing of the norms, products or MLP: the untiled layer keeps the normed inputs (2 x d
// per position), the residual's middle value (d) and the MLP's intermediates (gate and up, 2 x
// ffn) on top.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "models/causal_lm.h"
#include "models/rope.h"
#include "tests/alloc_meter.h"

namespace {

using namespace strata;

models::DecoderConfig layer_config(int64_t tiles, bool qk_norm) {
  models::DecoderConfig c;
  c.family = qk_norm ? models::Family::kQwen3 : models::Family::kLlama;
  c.vocab_size = 64;
  c.hidden_size = 64;
  c.intermediate_size = 256;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 4096;
  c.qk_norm = qk_norm;
  c.init_weights = true;
  c.mlp_tiles = tiles;
  return c;
}

struct Pass {
  torch::Tensor out, dx;
  std::vector<torch::Tensor> grads;
  int64_t kept = 0;  // bytes held between forward and backward, beyond the output
};

Pass run(int64_t tiles, bool qk_norm, int64_t S) {
  const auto c = layer_config(tiles, qk_norm);
  torch::manual_seed(5);
  models::DecoderLayer layer(c);
  const auto [cos, sin] = models::rope_cos_sin(models::rope_inverse_frequencies(c), S, torch::kCPU,
                                               torch::kFloat);
  torch::manual_seed(6);
  const auto x = torch::randn({1, S, c.hidden_size}).requires_grad_();
  const auto gy = torch::randn({1, S, c.hidden_size});
  Pass p;
  const int64_t base = test::AllocMeter::live();
  p.out = layer(x, cos, sin);
  p.kept = test::AllocMeter::live() - base - p.out.numel() * 4;
  p.out.backward(gy);
  p.dx = x.grad().clone();
  for (const auto& w : layer->parameters()) p.grads.push_back(w.grad().clone());
  return p;
}

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

TEST(TiledLayer, EveryPositionWisePartTiledGivesTheUntiledLayer) {
  for (const bool qk_norm : {false, true}) {
    const auto plain = run(-1, qk_norm, 96);
    for (const int64_t tiles : {0, 1, 3, 7}) {
      SCOPED_TRACE((qk_norm ? "qwen3, " : "llama, ") + std::to_string(tiles) + " tiles");
      const auto tiled = run(tiles, qk_norm, 96);
      EXPECT_LE(rel(tiled.out, plain.out), 1e-6);
      EXPECT_LE(rel(tiled.dx, plain.dx), 1e-6);
      ASSERT_EQ(tiled.grads.size(), plain.grads.size());
      for (size_t i = 0; i < plain.grads.size(); ++i) EXPECT_LE(rel(tiled.grads[i], plain.grads[i]), 1e-6) << i;
    }
  }
}

TEST(TiledLayer, KeepsOnlyWhatAttentionNeeds) {
  if (!test::AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  const int64_t S = 512, tiles = 8;
  const auto c = layer_config(tiles, false);
  const int64_t d = c.hidden_size, ffn = c.intermediate_size;
  const int64_t qw = c.num_attention_heads * c.head_dim, kw = c.num_key_value_heads * c.head_dim;
  const auto plain = run(-1, false, S);
  const auto tiled = run(tiles, false, S);
  // Attention alone, from q, k, v it does not own: what its backward keeps (on a CPU the
  // probabilities, S x S per head).
  torch::manual_seed(5);
  models::Attention attention(c);
  const auto q = torch::randn({1, c.num_attention_heads, S, c.head_dim}).requires_grad_();
  const auto k = torch::randn({1, c.num_key_value_heads, S, c.head_dim}).requires_grad_();
  const auto v = torch::randn({1, c.num_key_value_heads, S, c.head_dim}).requires_grad_();
  const int64_t base = test::AllocMeter::live();
  const auto out = attention->attend(q, k, v);
  const int64_t attention_kept = test::AllocMeter::live() - base - out.numel() * 4;
  const int64_t f = 4, tile = (S + tiles - 1) / tiles;
  // Tiled: attention's own, q/k/v and attention's output (the second tiled call's input), and
  // the Functions' bookkeeping (less than a quarter of one tile's [tile, ffn]).
  const int64_t bound = attention_kept + S * (qw + 2 * kw) * f + S * qw * f + tile * ffn * f / 4;
  std::printf("decoder layer S %lld, d %lld, ffn %lld, %lld tiles: kept %.3f MB untiled, %.3f MB "
              "tiled; attention alone %.3f MB; bound %.3f MB\n",
              (long long)S, (long long)d, (long long)ffn, (long long)tiles, plain.kept / 1e6,
              tiled.kept / 1e6, attention_kept / 1e6, bound / 1e6);
  EXPECT_LE(tiled.kept, bound);
  EXPECT_GE(plain.kept - tiled.kept, S * (3 * d + 2 * ffn) * f);
}

}  // namespace
