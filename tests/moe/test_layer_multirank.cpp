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
// tokens (6 and 40: a last short batch): the capacity is computed from the group's largest count,
// so every rank's buffers have one shape; with a capacity factor that drops nothing the outputs
// are the 1-rank layer's on each micro-batch.
// Every rank computes the reference itself and checks its own share.
#include <gtest/gtest.h>

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
    // DeepSpeed's semantics: the capacity is the largest load over the EP group.
    const int64_t agreed = std::max(want[0].capacity, want[1].capacity);
    if (got.capacity != agreed || got.dropped != 0)
      throw Error(fmt::format("capacity {} (want {}), dropped {}", got.capacity, agreed,
                              got.dropped));
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
