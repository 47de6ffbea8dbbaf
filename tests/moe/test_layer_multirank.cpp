// Expert parallelism over real processes (Gloo, loopback): ep_size 2 on 2 ranks against ep_size
// 1 in one process. Each rank's gate sees only its own micro-batch, so the reference runs the
// 1-rank layer on each rank's micro-batch separately, at the same call index (the same noise):
//   - outputs and input gradients equal the reference's for that micro-batch;
//   - each rank's expert gradients equal the reference's (summed over both micro-batches) for
//     the experts the rank holds, since the all_to_all brings both ranks' tokens to them;
//   - the gate weight's gradient, summed over the ranks (what data-parallel reduction does),
//     equals the reference's sum; l_aux per rank equals the reference's for its micro-batch.
// With drop_tokens true and false, at k = 1 (RTS, Jitter) and k = 2 (2nd-expert sampling), and
// with the grouped expert kernel (k = 2, drop_tokens). And ranks that route different numbers of
// tokens (6 and 40: a last short batch): drop_tokens' capacity is computed from the group's
// largest count, so every rank drops alike; with a capacity factor that drops nothing the outputs
// are the 1-rank layer's on each micro-batch.
// The variable-split exchange (issue 53; moe_exchange below): ep_size 2 and 4, 1 and several
// chunks, every route sent to the first rank's experts (the others' experts and ranks receive
// nothing) and a rank without tokens; the bytes each rank hands to all_to_all, counted in the
// communication layer, are exactly its routed rows' (plus the counts), beside what the padded
// exchange sent.
// Every rank computes the reference itself and checks its own share.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "comm/process_group.h"
#include "comm/topology.h"
#include "moe/layer.h"
#include "runtime/error.h"
#include "tests/comm/ranks.h"
#include "tests/sanitized.h"

namespace strata::test {
namespace {

using namespace strata::moe;

constexpr int64_t kD = 8, kFfn = 16, kE = 4, kS = 24;

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v) throw Error(fmt::format("{} is not set", name));
  return std::atoi(v);
}

void check_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  if (!got.defined() || !want.defined() || got.sizes() != want.sizes()) {
    throw Error(fmt::format("{}: shapes differ or undefined", what));
  }
  const double diff = (got - want).abs().max().item<double>();
  const double tol = 1e-5 * (1 + want.abs().max().item<double>());
  if (!(diff <= tol)) throw Error(fmt::format("{}: max difference {} > {}", what, diff, tol));
}

MoEOptions options() {
  MoEOptions o;
  o.hidden_size = kD;
  o.ffn_size = kFfn;
  o.num_experts = kE;
  o.k = env_int("MOE_K");
  o.drop_tokens = env_int("MOE_DROP") != 0;
  // Uneven token counts: a factor at which no expert overflows (the capacity then decides nothing).
  o.capacity_factor = env_int("MOE_UNEVEN") ? 4.0 : 0.75;
  o.min_capacity = 0;
  o.use_rts = true;
  o.noisy_gate_policy = o.k == 1 ? NoisyGatePolicy::Jitter : NoisyGatePolicy::None;
  o.top2_2nd_expert_sampling = true;
  o.router_z_loss_coef = 0.01;
  o.aux_loss_coef = 0.5;
  o.seed = 21;
  o.layer_id = 1;
  return o;
}

struct Run {
  torch::Tensor y, x_grad;
  int64_t capacity, dropped;
  torch::Tensor l_aux;
};

Run step(MoE& m, const torch::Tensor& x_in, const torch::Tensor& probe) {
  m->set_call_index(9);
  auto x = x_in.clone().requires_grad_(true);
  auto y = m->forward(x);
  ((y * probe).sum() + m->loss()).backward();
  return {y.detach(), x.grad(), m->last().capacity, m->last().dropped_count(),
          m->last().l_aux.detach()};
}

STRATA_SCENARIO(moe_ep2) {
  auto world = comm::init_process_group();
  const int r = world->rank();
  auto groups = comm::create_expert_groups(world, 2, kE);

  const bool uneven = env_int("MOE_UNEVEN") != 0;
  const int64_t tokens[2] = {uneven ? 6 : kS, uneven ? 40 : kS};
  torch::manual_seed(100);
  std::vector<torch::Tensor> xs, probes;
  for (int q = 0; q < 2; ++q) {
    xs.push_back(torch::randn({tokens[q], kD}));
    probes.push_back(torch::randn({tokens[q], kD}));
  }

  auto o = options();
  o.ep_size = 2;
  o.ep_group = groups.expert_parallel;
  MoE m(o);
  // The grouped expert kernel packs rows by the kept counts that came with the tokens.
  if (env_int("MOE_GROUPED")) m->experts->set_kernel(ExpertKernel::Grouped);
  const Run got = step(m, xs[r], probes[r]);

  auto o1 = options();
  MoE ref(o1);
  std::vector<Run> want;
  for (int q = 0; q < 2; ++q) want.push_back(step(ref, xs[q], probes[q]));

  check_close(got.y, want[r].y, "output");
  check_close(got.x_grad, want[r].x_grad, "d input");
  check_close(got.l_aux, want[r].l_aux, "l_aux");
  if (o.drop_tokens && uneven) {
    // From the group's largest token count, on both ranks; nothing dropped on either.
    const int64_t agreed = gate_capacity(tokens[1], kE, o.capacity_factor * o.k, o.min_capacity);
    if (got.capacity != agreed || got.dropped != 0 || want[r].dropped != 0)
      throw Error(fmt::format("capacity {} (want {}), dropped {} (reference {})", got.capacity,
                              agreed, got.dropped, want[r].dropped));
  } else if (o.drop_tokens) {
    if (got.capacity != want[r].capacity || got.dropped != want[r].dropped)
      throw Error(fmt::format("capacity/dropped {}/{} vs {}/{}", got.capacity, got.dropped,
                              want[r].capacity, want[r].dropped));
    if (o.k == 1 && want[0].dropped + want[1].dropped == 0)
      throw Error("the drop_tokens case should drop routes");
  } else {
    // Dropless under expert parallelism: no capacity (the variable-split exchange sends every
    // route's row); the reported bound is this rank's routes.
    if (got.capacity != tokens[r] * o.k || got.dropped != 0)
      throw Error(fmt::format("capacity {} (want {} routes), dropped {}", got.capacity,
                              tokens[r] * o.k, got.dropped));
  }
  const auto rows = torch::indexing::Slice(2 * r, 2 * r + 2);
  check_close(m->experts->w1.grad(), ref->experts->w1.grad().index({rows}), "d w1");
  check_close(m->experts->b1.grad(), ref->experts->b1.grad().index({rows}), "d b1");
  check_close(m->experts->w2.grad(), ref->experts->w2.grad().index({rows}), "d w2");
  check_close(m->experts->b2.grad(), ref->experts->b2.grad().index({rows}), "d b2");
  auto gate_grad = m->gate->weight.grad().clone();
  world->all_reduce(gate_grad);
  check_close(gate_grad, ref->gate->weight.grad(), "d gate weight (summed over ranks)");
}

// A rank with no tokens (an empty last micro-batch, packed variable-length data): it routes zero
// tokens, joining every collective of the layer with empty buffers, forward and backward, for
// three training steps (plain SGD on both ranks and on the reference). Rank 0 is empty; the
// reference is the 1-rank layer on rank 1's tokens alone (it skips rank 0's): rank 1's outputs,
// input gradients and l_aux equal it; each rank's expert gradients equal the reference's for
// the experts it holds; the gate's gradient summed over the ranks equals the reference's; the
// empty rank's output is empty and its auxiliary losses 0 (a mean over no tokens is not NaN).
STRATA_SCENARIO(moe_ep2_empty) {
  auto world = comm::init_process_group();
  const int r = world->rank();
  auto groups = comm::create_expert_groups(world, 2, kE);
  auto o = options();
  o.ep_size = 2;
  o.ep_group = groups.expert_parallel;
  MoE m(o);
  if (env_int("MOE_GROUPED")) m->experts->set_kernel(ExpertKernel::Grouped);
  auto o1 = options();
  MoE ref(o1);
  const auto rows = torch::indexing::Slice(2 * r, 2 * r + 2);
  for (int it = 0; it < 3; ++it) {
    torch::manual_seed(200 + it);
    const auto x1 = torch::randn({kS, kD}), probe1 = torch::randn({kS, kD});
    const auto x = r == 0 ? torch::zeros({0, kD}) : x1;
    const auto probe = r == 0 ? torch::zeros({0, kD}) : probe1;
    const Run got = step(m, x, probe);
    const Run want = step(ref, x1, probe1);
    const std::string at = fmt::format("step {}: ", it);
    if (r == 0) {
      if (got.y.size(0) != 0 || (got.x_grad.defined() && got.x_grad.size(0) != 0) ||
          got.l_aux.item<double>() != 0.0 ||
          got.dropped != 0)
        throw Error(at + "the empty rank's output, gradient, l_aux or drops are not empty / 0");
    } else {
      check_close(got.y, want.y, at + "output");
      check_close(got.x_grad, want.x_grad, at + "d input");
      check_close(got.l_aux, want.l_aux, at + "l_aux");
    }
    if (o.drop_tokens && got.capacity != want.capacity)
      throw Error(fmt::format("{}capacity {} (reference {})", at, got.capacity, want.capacity));
    check_close(m->experts->w1.grad(), ref->experts->w1.grad().index({rows}), at + "d w1");
    check_close(m->experts->b2.grad(), ref->experts->b2.grad().index({rows}), at + "d b2");
    auto gate_grad = m->gate->weight.grad().clone();
    world->all_reduce(gate_grad);
    check_close(gate_grad, ref->gate->weight.grad(), at + "d gate weight (summed over ranks)");
    // One SGD step everywhere: the gate by the summed gradient (data parallelism's sum), each
    // rank's experts by their own (they saw every token routed to them).
    torch::NoGradGuard no_grad;
    m->gate->weight.sub_(0.1 * gate_grad);
    for (auto& p : m->experts->parameters()) p.sub_(0.1 * p.grad());
    for (auto& p : ref->parameters()) p.sub_(0.1 * p.grad());
    for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
    for (auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
  }
}

// ep_size = world (2 or 4), 8 experts. Rank q routes 8 + 8q tokens (16 with drops), the last rank
// none. With
// MOE_SKEW every token's choices are the first rank's experts 0 and 1 (a gate that sees only
// them), so the other experts and ranks receive nothing and, with drops, most routes are dropped
// before the exchange.
STRATA_SCENARIO(moe_exchange) {
  auto world = comm::init_process_group();
  const int r = world->rank(), ep = world->size();
  constexpr int64_t E = 8;
  const int64_t El = E / ep;
  auto groups = comm::create_expert_groups(world, ep, E);
  const bool skew = env_int("MOE_SKEW") != 0;
  std::vector<torch::Tensor> xs, probes;
  torch::manual_seed(300);
  for (int q = 0; q < ep; ++q) {
    // drop_tokens' capacity comes from the group's largest count, the reference's from its own:
    // equal counts (but the empty rank) keep them one.
    const int64_t n = q == ep - 1 ? 0 : env_int("MOE_DROP") ? 16 : 8 + 8 * q;
    xs.push_back(torch::randn({n, kD}) + (skew ? 2.0 : 0.0));
    probes.push_back(torch::randn({n, kD}));
  }
  auto o = options();
  o.num_experts = E;
  o.capacity_factor = 1.0;
  o.noisy_gate_policy = NoisyGatePolicy::None;
  auto skewed = [&](MoE& m) {
    if (!skew) return;
    torch::NoGradGuard no_grad;
    m->gate->weight.zero_();
    m->gate->weight[0].fill_(1.0);
    m->gate->weight[1].fill_(0.8);
  };
  auto oe = o;
  oe.ep_size = ep;
  oe.ep_group = groups.expert_parallel;
  oe.exchange_chunks = env_int("MOE_CHUNKS");
  MoE m(oe);
  skewed(m);
  const auto before = groups.expert_parallel->all_to_all_traffic();
  const Run got = step(m, xs[r], probes[r]);
  const auto after = groups.expert_parallel->all_to_all_traffic();
  MoE ref(o);
  skewed(ref);
  std::vector<Run> want;
  for (int q = 0; q < ep; ++q) want.push_back(step(ref, xs[q], probes[q]));

  const auto at = fmt::format("ep {} k {} drop {} chunks {} skew {}: ", ep, o.k, o.drop_tokens,
                              oe.exchange_chunks, skew);
  if (xs[r].size(0) > 0) {
    check_close(got.y, want[r].y, at + "output");
    check_close(got.x_grad, want[r].x_grad, at + "d input");
  }
  check_close(got.l_aux, want[r].l_aux, at + "l_aux");
  const auto rows = torch::indexing::Slice(r * El, (r + 1) * El);
  torch::Tensor ref_grads[] = {ref->experts->w1.grad(), ref->experts->b2.grad()};
  torch::Tensor got_grads[] = {m->experts->w1.grad(), m->experts->b2.grad()};
  for (int i = 0; i < 2; ++i) {
    // The reference's expert gradients are summed over every rank's micro-batch.
    check_close(got_grads[i], ref_grads[i].index({rows}), at + "d expert");
  }
  auto gate_grad = m->gate->weight.grad().clone();
  world->all_reduce(gate_grad);
  check_close(gate_grad, ref->gate->weight.grad(), at + "d gate (summed over ranks)");

  // The bytes: the counts once ((E - El) x 8 to the others), then each row sent to another rank
  // and each row received from one, twice each (forward, and its gradient in backward).
  const auto& sent = m->last().sent_to;
  const auto& recv = m->last().received_from;
  int64_t rows_out = 0, rows_in = 0, sent_total = 0;
  for (int p = 0; p < ep; ++p) {
    sent_total += sent[size_t(p)];
    if (p == r) continue;
    rows_out += sent[size_t(p)];
    rows_in += recv[size_t(p)];
  }
  const int64_t routes = xs[r].size(0) * o.k;
  if (sent_total != routes - got.dropped)
    throw Error(fmt::format("{}sent {} rows for {} routes of which {} dropped", at, sent_total,
                            routes, got.dropped));
  const int64_t row_bytes = kD * 4;
  const int64_t expected = (E - El) * 8 + 2 * (rows_out + rows_in) * row_bytes;
  const int64_t counted = after.bytes_to_others - before.bytes_to_others;
  if (counted != expected)
    throw Error(fmt::format("{}counted {} bytes to other ranks, expected {}", at, counted, expected));
  const int64_t calls = after.calls - before.calls;
  const int64_t chunks = std::min<int64_t>(oe.exchange_chunks, El);
  if (calls != 1 + 4 * chunks)
    throw Error(fmt::format("{}{} all_to_all calls, expected {}", at, calls, 1 + 4 * chunks));
  // What the padded exchange sent for the same call: E x C rows each way, forward and backward,
  // C the capacity (drop_tokens) or the group's largest load, of which (ep - 1) / ep to others.
  auto load = torch::tensor({m->last().exp_counts.max().item<int64_t>()}, torch::kLong);
  groups.expert_parallel->all_reduce(load, comm::ReduceOp::Max);
  const int64_t C = o.drop_tokens ? got.capacity : load.item<int64_t>();
  const int64_t padded = 4 * E * C * row_bytes * (ep - 1) / ep;
  std::printf("MESSAGE: %srank %d sent %lld rows (%lld to others), received %lld from others: %lld bytes "
              "to others counted = expected; the padded exchange: %lld\n",
              at.c_str(), r, (long long)sent_total, (long long)rows_out, (long long)rows_in,
              (long long)counted, (long long)padded);
}

Launched run_exchange(int ep, int k, bool drop, int chunks, bool skew) {
  LaunchSpec spec;
  spec.scenario = "moe_exchange";
  spec.world = ep;
  spec.env = {{"MOE_K", std::to_string(k)}, {"MOE_DROP", drop ? "1" : "0"},
              {"MOE_GROUPED", "0"}, {"MOE_UNEVEN", "0"}, {"MOE_CHUNKS", std::to_string(chunks)},
              {"MOE_SKEW", skew ? "1" : "0"}};
  spec.timeout_s = 120;
  Launched l = run_ranks(spec);
  l.print_messages();
  return l;
}

TEST(MoeExchange, ExactlyTheRoutedRowsTravelAtEpSizesTwoAndFour) {
  for (const int ep : {2, 4})
    for (const auto& [k, drop] : {std::tuple{1, true}, std::tuple{2, false}, std::tuple{2, true}})
      for (const int chunks : {1, 2}) {
        if (kSanitized && chunks == 1) continue;  // CI's sanitized suite: the chunked half
        auto r = run_exchange(ep, k, drop, chunks, /*skew=*/false);
        EXPECT_TRUE(r.all_ok()) << "ep " << ep << " k " << k << " drop " << drop << " chunks "
                                << chunks << ": " << r.report();
      }
}

TEST(MoeExchange, ExpertsAndRanksThatReceiveNothing) {
  for (const int ep : {2, 4})
    for (const bool drop : {true, false}) {
      if (kSanitized && ep == 2) continue;  // CI's sanitized suite: ep 4 (three idle ranks)
      auto r = run_exchange(ep, 2, drop, 2, /*skew=*/true);
      EXPECT_TRUE(r.all_ok()) << "ep " << ep << " drop " << drop << ": " << r.report();
    }
}

Launched run_empty(int k, bool drop, bool grouped) {
  LaunchSpec spec;
  spec.scenario = "moe_ep2_empty";
  spec.world = 2;
  spec.env = {{"MOE_K", std::to_string(k)}, {"MOE_DROP", drop ? "1" : "0"},
              {"MOE_GROUPED", grouped ? "1" : "0"}, {"MOE_UNEVEN", "1"}};
  spec.timeout_s = 120;
  Launched l = run_ranks(spec);
  l.print_messages();
  return l;
}

TEST(MoeExpertParallel, ARankWithNoTokensTrainsWithItsPeers) {
  for (const auto& [k, drop, grouped] :
       {std::tuple{1, true, false}, std::tuple{1, false, false}, std::tuple{2, true, true},
        std::tuple{2, false, false}}) {
    auto r = run_empty(k, drop, grouped);
    EXPECT_TRUE(r.all_ok()) << "k " << k << " drop_tokens " << drop << ": " << r.report();
  }
}

Launched run(int k, bool drop, bool grouped = false, bool uneven = false) {
  LaunchSpec spec;
  spec.scenario = "moe_ep2";
  spec.world = 2;
  spec.env = {{"MOE_K", std::to_string(k)}, {"MOE_DROP", drop ? "1" : "0"},
              {"MOE_GROUPED", grouped ? "1" : "0"}, {"MOE_UNEVEN", uneven ? "1" : "0"}};
  spec.timeout_s = 120;
  Launched l = run_ranks(spec);
  l.print_messages();
  return l;
}

TEST(MoeExpertParallel, Top1DropTokensEp2MatchesEp1) {
  auto r = run(1, true);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(MoeExpertParallel, Top1NoDropEp2MatchesEp1) {
  auto r = run(1, false);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(MoeExpertParallel, Top2DropTokensEp2MatchesEp1) {
  auto r = run(2, true);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(MoeExpertParallel, Top2NoDropEp2MatchesEp1) {
  auto r = run(2, false);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(MoeExpertParallel, Top2GroupedExpertKernelEp2MatchesEp1) {
  auto r = run(2, true, /*grouped=*/true);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

// A last short batch: 6 tokens on rank 0, 40 on rank 1 (a size error or a Gloo abort before the
// capacity was agreed from the group's token count).
TEST(MoeExpertParallel, Top1UnevenTokenCountsDropTokens) {
  auto r = run(1, true, false, /*uneven=*/true);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(MoeExpertParallel, Top1UnevenTokenCountsNoDrop) {
  auto r = run(1, false, false, /*uneven=*/true);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(MoeExpertParallel, Top2UnevenTokenCountsDropTokens) {
  auto r = run(2, true, false, /*uneven=*/true);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace strata::test

int main(int argc, char** argv) { return strata::test::test_main(argc, argv); }
