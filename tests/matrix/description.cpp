#include "description.h"

#include <algorithm>
#include <sstream>

namespace matrix {

namespace {

// splitmix64: the same stream on every compiler and library (std's distributions are not).
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return int(next() % uint64_t(n)); }
  bool chance(int percent) { return below(100) < percent; }
  template <class T>
  T pick(const std::vector<T>& v) { return v[size_t(below(int(v.size())))]; }
  // Weighted: pairs of (weight, value).
  template <class T>
  T weighted(const std::vector<std::pair<int, T>>& v) {
    int total = 0;
    for (const auto& p : v) total += p.first;
    int r = below(total);
    for (const auto& p : v) {
      if (r < p.first) return p.second;
      r -= p.first;
    }
    return v.back().second;
  }
};

// (world, gas) pairs with world * gas = per_step, world <= max_world, gas <= 3.
std::vector<std::pair<int, int>> layouts(int per_step, int max_world) {
  std::vector<std::pair<int, int>> out;
  for (int w = 1; w <= max_world; ++w)
    if (per_step % w == 0 && per_step / w <= 3) out.push_back({w, per_step / w});
  return out;
}

Phase draw_phase(Rng& rng, const Description& d, int max_world) {
  Phase p;
  auto ls = layouts(d.per_step, max_world);
  // A resume mostly moves to another world size (and so another accumulation) when there is one.
  if (!d.phases.empty() && ls.size() > 1 && rng.chance(80)) {
    const int before = d.phases[0].world;
    ls.erase(std::remove_if(ls.begin(), ls.end(), [&](const auto& l) { return l.first == before; }),
             ls.end());
  }
  const auto l = rng.pick(ls);
  p.world = l.first, p.gas = l.second;
  p.stage = rng.below(4);
  if (p.stage > 0)
    p.offload_optimizer = rng.weighted<std::string>({{6, "none"}, {3, "cpu"}, {p.stage == 3 ? 2 : 1, "nvme"}});
  if (p.stage == 3)
    p.offload_param = rng.weighted<std::string>({{6, "none"}, {2, "cpu"}, {1, "nvme"}});
  if (d.model == "tiny-moe") {
    // Mostly an ep_size that divides the world and the 4 experts; now and then one that does not
    // (the refusal is part of what is tested).
    std::vector<int> fits;
    for (int e : {1, 2, 4})
      if (p.world % e == 0) fits.push_back(e);
    p.ep_size = rng.chance(90) ? rng.pick(fits) : rng.pick(std::vector<int>{2, 3, 4});
  }
  p.threads = rng.weighted<int>({{4, 0}, {2, 1}, {2, 2}, {1, 3}});
  // The CPU Adam (offloaded optimizers) splits a tile over threads only past 2^16 elements per
  // thread, more than most of these small models' partitions hold: half the offloaded phases
  // lower that to 4096, so that their tiles take the threaded split too.
  // (A lowered grain matters only with several threads: such a phase sets 2 or 3.)
  if (p.offload_optimizer != "none" && rng.chance(50)) {
    p.adam_grain = 4096;
    if (p.threads < 2) p.threads = 2 + int(rng.below(2));
  }
  // Every model in every dtype: a constructor's in-place draws (Linear's kaiming_uniform_, the
  // tied embedding's normal_) run in fp32 inside a 16-bit PartitionedInit too (docs/matrix.md).
  p.zero_init = p.stage == 3 ? rng.chance(30) : rng.chance(3);
  return p;
}

}  // namespace

Description generate(uint64_t seed, int max_world) {
  Rng rng{seed * 0x2545f4914f6cdd1dull + 0x1234567};
  Description d;
  d.seed = 1000 + seed % 100000;
  // tiny-zoo: a frozen parameter, an unused one, a block used twice, an odd size (131073).
  d.model = rng.weighted<std::string>(
      {{3, "tiny"}, {3, "tiny-tied"}, {2, "tiny-zoo"}, {3, "tiny-moe"}});
  d.dtype = rng.weighted<std::string>({{10, "fp32"}, {6, "bf16"}, {1, "fp16"}, {3, "autocast"}});
  d.optimizer = rng.weighted<std::string>(
      {{10, "AdamW"}, {7, "Adam"}, {7, "SGD"}, {1, "Lamb"}, {1, "Lion"}});
  d.scheduler = rng.weighted<std::string>(
      {{3, "none"}, {2, "WarmupLR"}, {2, "WarmupDecayLR"}, {2, "WarmupCosineLR"}});
  d.clip = rng.weighted<double>({{3, 0.0}, {2, 1.0}, {2, 0.05}});
  d.micro = 1 + rng.below(3);
  std::vector<int> per_steps;
  for (int ps : {1, 2, 3, 4, 6, 8, 9, 12})
    if (!layouts(ps, max_world).empty()) per_steps.push_back(ps);
  d.per_step = rng.pick(per_steps);
  d.steps = 4 + rng.below(4);
  d.save_at = rng.chance(60) ? 1 + rng.below(d.steps - 1) : 0;
  d.phases.push_back(draw_phase(rng, d, max_world));
  if (d.save_at > 0) d.phases.push_back(draw_phase(rng, d, max_world));
  // Streamed experts (issue 37), drawn from a stream of their own so that every other draw of a
  // seed stays what it was before they existed.
  Rng stream_rng{seed * 0x9e3779b97f4a7c15ull + 0x37};
  for (auto& p : d.phases)
    if (d.model == "tiny-moe" && p.stage == 3 && stream_rng.chance(50)) {
      p.expert_unit = 1 + int(stream_rng.below(3));  // 1-3 of a rank's 1, 2 or 4 experts
      p.expert_window = stream_rng.weighted<int>({{2, 0}, {1, 1}, {1, 2}, {1, 3}});
    }
  // The expert exchange's chunks (issue 53), from a stream of its own for the same reason: a
  // phase with expert parallelism cuts its exchange in 1-3 chunks of local experts (or leaves
  // the key out).
  Rng chunk_rng{seed * 0xbf58476d1ce4e5b9ull + 0x53};
  for (auto& p : d.phases)
    if (d.model == "tiny-moe" && p.ep_size > 1 && chunk_rng.chance(60))
      p.exchange_chunks = 1 + int(chunk_rng.below(3));
  // The speculative offloaded step (issue 55), from a stream of its own for the same reason: half
  // the phases whose optimizer is Strata's Adam in host memory speculate it.
  Rng spec_rng{seed * 0x94d049bb133111ebull + 0x55};
  for (auto& p : d.phases)
    if (p.offload_optimizer == "cpu" && (d.optimizer == "Adam" || d.optimizer == "AdamW") &&
        spec_rng.chance(50))
      p.super_offload = true;
  // Activation checkpointing (issue 32), from a stream of its own for the same reason. Each phase
  // draws its own: a resume may switch it on, off or to another store (checkpoints of training
  // state carry none of it).
  Rng ckpt_rng{seed * 0xd1b54a32d192ed03ull + 0x32};
  for (auto& p : d.phases)
    if (ckpt_rng.chance(40)) {
      p.checkpointing =
          ckpt_rng.weighted<std::string>({{3, "every"}, {1, "every:2"}, {2, "selective"}});
      p.checkpoint_store = ckpt_rng.weighted<std::string>(
          {{2, ""}, {2, "cpu"}, {1, "nvme"}, {1, "contiguous"}, {1, "extras"}});
    } else if (ckpt_rng.chance(10)) {
      // The block alone: it must change nothing.
      p.checkpoint_store = ckpt_rng.pick<std::string>({"cpu", "nvme"});
    }
  for (const auto& p : d.phases)
    if (!p.checkpointing.empty()) {
      d.dropout = ckpt_rng.chance(30);
      break;
    }
  // Tiled feed-forward (issue 58; tiny-moe: its experts' rows), a stream of its own; per phase,
  // so that a resume switches it on or off (a checkpoint carries none of it).
  Rng tile_rng{seed * 0x8ebc6af09c88c6e3ull + 0x58};
  for (auto& p : d.phases)
    if (tile_rng.chance(25)) p.mlp_tiles = tile_rng.pick<int>({0, 2, 3, 7});
  // The masked model (issue 51): a block checkpointed whole keeps its mask beside x, two inputs
  // per checkpoint in every store. Half the descriptions that checkpoint; a stream of its own.
  Rng mask_rng{seed * 0xa0761d6478bd642full + 0x51};
  for (const auto& p : d.phases)
    if (!p.checkpointing.empty()) {
      d.masked = mask_rng.chance(50);
      break;
    }
  // Small sizes cut through parameters (tiny's matrices are 4096-16384 elements); 131073 and 4099
  // are odd tile lengths. The CPU Adam cuts a tile of at least 2^16 elements per thread over its
  // threads in 64-element blocks: 131073 = 2^17 + 1 (2 threads) and 196609 = 3 x 2^16 + 1 (2 or
  // 3 threads) sit one element past that split's boundary (tiny holds ~137k parameters, tiny-zoo
  // ~270k, so a partition of 1-2 ranks has such a tile); 12289 = 3 x 2^12 + 1 is the same for a
  // phase that lowers the split's grain to 4096 (adam_grain), and fits every partition. A tile
  // splits only on a rank with several threads (one rank alone, or OMP_NUM_THREADS set), at
  // stages 1-2 (stage 3 rounds tiles up to its 4 KiB grid).
  d.persistence_threshold = rng.pick<int64_t>({0, -1, 64, 1000, 5000});
  d.reduce_bucket_size = rng.pick<int64_t>({0, 500, 5000, 20000});
  // Streamed experts' gradient buckets keep to 2 x max(reduce_bucket_size, the largest unit's
  // elements x ranks), checked on every row (runner.cpp): a finite bucket size, so that the
  // bound is the units' and not DeepSpeed's default of 5e8 elements.
  for (const auto& p : d.phases)
    if (p.expert_unit > 0 && d.reduce_bucket_size == 0)
      d.reduce_bucket_size = stream_rng.pick<int64_t>({500, 5000, 20000});
  d.allgather_bucket_size = rng.pick<int64_t>({0, 1000, 20000});
  d.prefetch_bucket_size = rng.pick<int64_t>({0, 1, 5000, 50000});
  d.max_live_parameters = rng.pick<int64_t>({0, 20000, 100000});
  d.max_reuse_distance = rng.pick<int64_t>({-1, 0, 10000});
  d.sub_group_size = rng.pick<int64_t>({0, 0, 1000, 4099, 12289, 12289, 12289, 65536, 131073, 196609});
  if (d.model == "tiny-moe") {
    d.top_k = 1 + rng.below(2);
    d.capacity_factor = rng.pick<double>({1.0, 1.25, 2.0});
    d.drop_tokens = rng.chance(60);
    d.noisy_gate_policy = rng.weighted<std::string>({{3, "None"}, {2, "RSample"}, {1, "Jitter"}});
  }
  // used_token padding (top-1 only, on the capped and the dropless path alike) and the grouped
  // kernel, whose packed routes replace the padded buffer at ep_size 1 (held against the
  // oracle's default kernel): issue 51, a stream of their own.
  Rng pad_rng{seed * 0xe7037ed1a0b428dbull + 0x52};
  if (d.model == "tiny-moe") {
    if (d.top_k == 1 && pad_rng.chance(50)) d.moe_padding = pad_rng.pick<int>({1, 8, 32});
    if (pad_rng.chance(50)) d.expert_kernel = "grouped";
  }
  // Token files (issue 66), a stream of their own.
  Rng data_rng{seed * 0x94d049bb133111ebull + 0x66};
  d.token_data = data_rng.chance(25);
  // Ulysses (issue 62), a stream of its own: a fifth of the dense models' phases split each
  // sample's 64 positions over 2 or 4 ranks where the ranks fit (tiny's 4 heads split either
  // way), the world growing by that factor; a resume may switch it on, off or to another size.
  Rng sp_rng{seed * 0xc2b2ae3d27d4eb4full + 0x62};
  for (auto& p : d.phases) {
    if (d.model == "tiny-moe" || !sp_rng.chance(20)) continue;
    std::vector<int> fits;
    for (int sp : {2, 4})
      if (p.world * sp <= max_world) fits.push_back(sp);
    if (fits.empty()) continue;
    p.sp = sp_rng.pick(fits);
    p.world *= p.sp;
  }
  // ZenFlow (issue 61), a stream of its own: most phases where Strata runs it (stages 1-2,
  // the optimizer in host memory without super_offload, Adam/AdamW, a dense model, no sequence
  // parallelism), on their ranks.
  Rng zf_rng{seed * 0xd6e8feb86659fd93ull + 0x61};
  for (auto& p : d.phases) {
    const bool fits = (p.stage == 1 || p.stage == 2) && p.offload_optimizer == "cpu" &&
                      !p.super_offload && d.model != "tiny-moe" && p.sp == 1 &&
                      (d.optimizer == "Adam" || d.optimizer == "AdamW");
    if (!fits || !zf_rng.chance(80)) continue;
    p.zenflow = zf_rng.pick<double>({0.1, 0.25, 0.5, 1.0});
    p.zenflow_select = zf_rng.pick<int>({0, 1, 2, 3});
    p.zenflow_warmup = zf_rng.pick<int>({0, 0, 1, 2});
  }
  // offload_optimizer.max_in_cpu (issue 60), a stream of its own: with the optimizer on NVMe, part
  // of the state (a tile or a few; the tiny models hold tens of thousands of elements) or all of it
  // in host memory.
  Rng host_rng{seed * 0x9e3779b97f4a7c15ull + 0x60};
  for (auto& p : d.phases)
    if (p.offload_optimizer == "nvme" && host_rng.chance(50))
      p.nvme_in_cpu = host_rng.pick<int64_t>({1, 15000, 40000, int64_t(1) << 40});
  return d;
}

Description generate(uint64_t seed) { return generate(seed, 4); }

nlohmann::json to_json(const Description& d) {
  nlohmann::json phases = nlohmann::json::array();
  for (const auto& p : d.phases)
    phases.push_back({{"world", p.world}, {"gas", p.gas}, {"stage", p.stage},
                      {"offload_optimizer", p.offload_optimizer}, {"offload_param", p.offload_param},
                      {"ep_size", p.ep_size}, {"threads", p.threads}, {"zero_init", p.zero_init},
                      {"adam_grain", p.adam_grain}, {"expert_unit", p.expert_unit},
                      {"expert_window", p.expert_window}, {"exchange_chunks", p.exchange_chunks},
                      {"super_offload", p.super_offload},
                      {"checkpointing", p.checkpointing},
                      {"checkpoint_store", p.checkpoint_store}, {"mlp_tiles", p.mlp_tiles},
                      {"sp", p.sp}, {"zenflow", p.zenflow}, {"zenflow_select", p.zenflow_select},
                      {"zenflow_warmup", p.zenflow_warmup}, {"nvme_in_cpu", p.nvme_in_cpu}});
  return {{"seed", d.seed}, {"model", d.model}, {"dropout", d.dropout}, {"masked", d.masked},
          {"dtype", d.dtype},
          {"optimizer", d.optimizer},
          {"scheduler", d.scheduler}, {"clip", d.clip}, {"micro", d.micro},
          {"per_step", d.per_step}, {"steps", d.steps}, {"save_at", d.save_at},
          {"phases", phases}, {"persistence_threshold", d.persistence_threshold},
          {"reduce_bucket_size", d.reduce_bucket_size},
          {"allgather_bucket_size", d.allgather_bucket_size},
          {"prefetch_bucket_size", d.prefetch_bucket_size},
          {"max_live_parameters", d.max_live_parameters},
          {"max_reuse_distance", d.max_reuse_distance}, {"sub_group_size", d.sub_group_size},
          {"top_k", d.top_k}, {"capacity_factor", d.capacity_factor},
          {"drop_tokens", d.drop_tokens}, {"noisy_gate_policy", d.noisy_gate_policy},
          {"moe_padding", d.moe_padding}, {"expert_kernel", d.expert_kernel},
          {"token_data", d.token_data}};
}

Description from_json(const nlohmann::json& j) {
  Description d;
  const Description def;
  d.seed = j.value("seed", def.seed);
  d.model = j.value("model", def.model);
  d.dropout = j.value("dropout", def.dropout);
  d.masked = j.value("masked", def.masked);
  d.dtype = j.value("dtype", def.dtype);
  d.optimizer = j.value("optimizer", def.optimizer);
  d.scheduler = j.value("scheduler", def.scheduler);
  d.clip = j.value("clip", def.clip);
  d.micro = j.value("micro", def.micro);
  d.per_step = j.value("per_step", def.per_step);
  d.steps = j.value("steps", def.steps);
  d.save_at = j.value("save_at", def.save_at);
  for (const auto& pj : j.value("phases", nlohmann::json::array())) {
    Phase p;
    p.world = pj.value("world", 1);
    p.sp = pj.value("sp", 1);
    p.gas = pj.value("gas", d.per_step / (p.world / p.sp));
    p.stage = pj.value("stage", 0);
    p.offload_optimizer = pj.value("offload_optimizer", std::string("none"));
    p.offload_param = pj.value("offload_param", std::string("none"));
    p.ep_size = pj.value("ep_size", 1);
    p.threads = pj.value("threads", 0);
    p.adam_grain = pj.value("adam_grain", 0);
    p.zero_init = pj.value("zero_init", false);
    p.expert_unit = pj.value("expert_unit", 0);
    p.expert_window = pj.value("expert_window", 0);
    p.exchange_chunks = pj.value("exchange_chunks", 0);
    p.super_offload = pj.value("super_offload", false);
    p.checkpointing = pj.value("checkpointing", std::string());
    p.checkpoint_store = pj.value("checkpoint_store", std::string());
    p.mlp_tiles = pj.value("mlp_tiles", -1);
    p.zenflow = pj.value("zenflow", 0.0);
    p.zenflow_select = pj.value("zenflow_select", 0);
    p.zenflow_warmup = pj.value("zenflow_warmup", 0);
    p.nvme_in_cpu = pj.value("nvme_in_cpu", int64_t(0));
    d.phases.push_back(p);
  }
  if (d.phases.empty()) d.phases.push_back(Phase{1, d.per_step});
  d.persistence_threshold = j.value("persistence_threshold", def.persistence_threshold);
  d.reduce_bucket_size = j.value("reduce_bucket_size", def.reduce_bucket_size);
  d.allgather_bucket_size = j.value("allgather_bucket_size", def.allgather_bucket_size);
  d.prefetch_bucket_size = j.value("prefetch_bucket_size", def.prefetch_bucket_size);
  d.max_live_parameters = j.value("max_live_parameters", def.max_live_parameters);
  d.max_reuse_distance = j.value("max_reuse_distance", def.max_reuse_distance);
  d.sub_group_size = j.value("sub_group_size", def.sub_group_size);
  d.top_k = j.value("top_k", def.top_k);
  d.capacity_factor = j.value("capacity_factor", def.capacity_factor);
  d.drop_tokens = j.value("drop_tokens", def.drop_tokens);
  d.noisy_gate_policy = j.value("noisy_gate_policy", def.noisy_gate_policy);
  d.moe_padding = j.value("moe_padding", def.moe_padding);
  d.expert_kernel = j.value("expert_kernel", def.expert_kernel);
  d.token_data = j.value("token_data", def.token_data);
  return d;
}

std::string summary(const Description& d) {
  std::ostringstream s;
  s << d.model << (d.masked ? "-masked" : "") << (d.dropout ? "-dropout" : "") << " " << d.dtype << " " << d.optimizer
    << " sched=" << d.scheduler
    << " clip=" << d.clip << " micro=" << d.micro << " steps=" << d.steps;
  for (size_t i = 0; i < d.phases.size(); ++i) {
    const auto& p = d.phases[i];
    s << (i == 0 ? " | " : " | resume@" + std::to_string(d.save_at) + " ") << "w" << p.world
      << " gas" << p.gas << " z" << p.stage;
    if (p.offload_optimizer != "none") s << " oo=" << p.offload_optimizer;
    if (p.super_offload) s << "+so";
    if (p.offload_param != "none") s << " op=" << p.offload_param;
    if (d.model == "tiny-moe") s << " ep" << p.ep_size;
    if (p.threads) s << " t" << p.threads;
    if (p.adam_grain) s << " g" << p.adam_grain;
    if (p.zero_init) s << " zinit";
    if (p.expert_unit) s << " eu" << p.expert_unit;
    if (p.expert_window) s << " ew" << p.expert_window;
    if (p.exchange_chunks) s << " xc" << p.exchange_chunks;
    if (!p.checkpointing.empty())
      s << " ac=" << p.checkpointing
        << (p.checkpoint_store.empty() ? "" : "/" + p.checkpoint_store);
    else if (!p.checkpoint_store.empty())
      s << " ac-block=" << p.checkpoint_store;
    if (p.mlp_tiles >= 0) s << " tiles=" << (p.mlp_tiles == 0 ? "auto" : std::to_string(p.mlp_tiles));
    if (p.sp > 1) s << " sp" << p.sp;
    if (p.zenflow > 0)
      s << " zf" << p.zenflow << "/s" << p.zenflow_select << "/w" << p.zenflow_warmup;
    if (p.nvme_in_cpu > 0) s << " in_cpu=" << p.nvme_in_cpu;
  }
  if (d.model == "tiny-moe")
    s << " | k" << d.top_k << " cf" << d.capacity_factor << (d.drop_tokens ? " drop" : " dropless")
      << " " << d.noisy_gate_policy << (d.moe_padding ? " pad" + std::to_string(d.moe_padding) : "")
      << (d.expert_kernel.empty() ? "" : " " + d.expert_kernel);
  if (d.sub_group_size) s << " sub=" << d.sub_group_size;
  if (d.token_data) s << " tokens";
  return s.str();
}

int64_t complexity(const Description& d) {
  int64_t c = d.steps + d.micro + d.per_step + 10 * int64_t(d.phases.size());
  c += d.model == "tiny" ? 0 : d.model == "tiny-tied" || d.model == "tiny-zoo" ? 1 : 3;
  c += d.dtype == "fp32" ? 0 : 2;
  c += d.dropout + d.masked + (d.moe_padding != 0) + !d.expert_kernel.empty() + d.token_data;
  c += d.optimizer == "AdamW" ? 0 : 1;
  c += d.scheduler == "none" ? 0 : 1;
  c += d.clip == 0.0 ? 0 : 1;
  for (const auto& p : d.phases) {
    c += 3 * p.world + p.gas + p.stage + (p.offload_optimizer != "none") * 2 +
         (p.offload_param != "none") * 2 + p.ep_size + (p.threads != 0) + p.zero_init +
         (p.adam_grain != 0) + (p.expert_unit != 0) + (p.expert_window != 0) +
         (p.exchange_chunks > 1) + p.super_offload +
         (p.checkpointing.empty() ? 0 : p.checkpointing == "every" ? 1 : 2) +
         !p.checkpoint_store.empty() + (p.mlp_tiles >= 0) + (p.sp > 1) + (p.zenflow > 0) +
         (p.zenflow_select > 0) + (p.zenflow_warmup > 0) + (p.nvme_in_cpu > 0);
  }
  c += (d.persistence_threshold != 0) + (d.reduce_bucket_size != 0) +
       (d.allgather_bucket_size != 0) + (d.prefetch_bucket_size != 0) +
       (d.max_live_parameters != 0) + (d.max_reuse_distance != -1) + (d.sub_group_size != 0);
  if (d.model == "tiny-moe")
    c += d.top_k + (d.capacity_factor != 1.0) + !d.drop_tokens + (d.noisy_gate_policy != "None");
  return c;
}

std::vector<Description> simplifications(const Description& d) {
  std::vector<Description> out;
  auto with = [&](auto&& change) {
    Description s = d;
    change(s);
    if (complexity(s) < complexity(d)) out.push_back(s);
  };
  // Whole features first: the resume (keeping either phase's layout), the MoE model, the dtype.
  if (d.phases.size() == 2) {
    with([](Description& s) { s.phases.pop_back(), s.save_at = 0; });
    with([](Description& s) { s.phases.erase(s.phases.begin()), s.save_at = 0; });
  }
  if (d.save_at > 1) with([](Description& s) { s.save_at -= 1, s.steps -= 1; });
  if (d.steps > d.save_at + 1 && d.steps > 2) with([](Description& s) { s.steps -= 1; });
  if (d.model != "tiny")
    with([](Description& s) {
      s.model = "tiny";
      s.moe_padding = 0, s.expert_kernel.clear();
      for (auto& p : s.phases)
        p.ep_size = 1, p.expert_unit = 0, p.expert_window = 0, p.exchange_chunks = 0;
    });
  if (d.dtype != "fp32") with([](Description& s) { s.dtype = "fp32"; });
  if (d.token_data) with([](Description& s) { s.token_data = false; });
  if (d.dropout) with([](Description& s) { s.dropout = false; });
  if (d.masked) with([](Description& s) { s.masked = false; });
  if (d.optimizer != "AdamW") with([](Description& s) { s.optimizer = "AdamW"; });
  if (d.scheduler != "none") with([](Description& s) { s.scheduler = "none"; });
  if (d.clip != 0.0) with([](Description& s) { s.clip = 0.0; });
  // The layout: fewer micro-batches per step (and so fewer ranks), a smaller micro-batch.
  for (int ps = 1; ps < d.per_step; ++ps) {
    with([ps](Description& s) {
      s.per_step = ps;
      for (auto& p : s.phases) {
        p.world /= p.sp, p.sp = 1;  // the sample-drawing ranks alone
        if (ps % p.world != 0 || ps / p.world > 3) p.world = 1;
        p.gas = ps / p.world;
        if (p.world % p.ep_size != 0) p.ep_size = 1;
      }
    });
  }
  if (d.micro > 1) with([](Description& s) { s.micro -= 1; });
  for (size_t i = 0; i < d.phases.size(); ++i) {
    const auto& p = d.phases[i];
    auto on = [&](auto&& change) { with([&](Description& s) { change(s.phases[i]); }); };
    if (p.sp > 1) on([](Phase& q) { q.world /= q.sp, q.sp = 1; });
    for (int w = 1; w < p.world && p.sp == 1; ++w)
      if (d.per_step % w == 0 && d.per_step / w <= 3)
        on([&](Phase& q) { q.world = w, q.gas = d.per_step / w, q.ep_size = w % q.ep_size ? 1 : q.ep_size; });
    if (p.offload_param != "none") on([](Phase& q) { q.offload_param = "none"; });
    if (p.offload_optimizer != "none") on([](Phase& q) { q.offload_optimizer = "none", q.super_offload = false; });
    if (p.super_offload) on([](Phase& q) { q.super_offload = false; });
    if (p.offload_optimizer == "nvme") on([](Phase& q) { q.offload_optimizer = "cpu", q.nvme_in_cpu = 0; });
    if (p.offload_param == "nvme") on([](Phase& q) { q.offload_param = "cpu"; });
    for (int st = 0; st < p.stage; ++st)
      on([st](Phase& q) {
        q.stage = st;
        if (st < 3) q.offload_param = "none", q.zero_init = false, q.expert_unit = 0, q.expert_window = 0;
        if (st == 0) q.offload_optimizer = "none", q.super_offload = false;
      });
    if (p.ep_size > 1) on([](Phase& q) { q.ep_size = 1, q.exchange_chunks = 0; });
    if (p.exchange_chunks) on([](Phase& q) { q.exchange_chunks = 0; });
    if (p.threads != 0) on([](Phase& q) { q.threads = 0; });
    if (p.adam_grain != 0) on([](Phase& q) { q.adam_grain = 0; });
    if (p.zero_init) on([](Phase& q) { q.zero_init = false; });
    if (p.expert_unit) on([](Phase& q) { q.expert_unit = 0, q.expert_window = 0; });
    if (p.expert_window) on([](Phase& q) { q.expert_window = 0; });
    if (!p.checkpointing.empty())
      on([](Phase& q) { q.checkpointing.clear(), q.checkpoint_store.clear(); });
    if (p.checkpointing != "" && p.checkpointing != "every")
      on([](Phase& q) { q.checkpointing = "every"; });
    if (!p.checkpoint_store.empty()) on([](Phase& q) { q.checkpoint_store.clear(); });
    if (p.mlp_tiles >= 0) on([](Phase& q) { q.mlp_tiles = -1; });
    if (p.zenflow > 0) on([](Phase& q) { q.zenflow = 0, q.zenflow_select = 0, q.zenflow_warmup = 0; });
    if (p.zenflow_select > 0) on([](Phase& q) { q.zenflow_select = 0; });
    if (p.zenflow_warmup > 0) on([](Phase& q) { q.zenflow_warmup = 0; });
    if (p.nvme_in_cpu > 0) on([](Phase& q) { q.nvme_in_cpu = 0; });
  }
  if (d.persistence_threshold) with([](Description& s) { s.persistence_threshold = 0; });
  if (d.reduce_bucket_size) with([](Description& s) { s.reduce_bucket_size = 0; });
  if (d.allgather_bucket_size) with([](Description& s) { s.allgather_bucket_size = 0; });
  if (d.prefetch_bucket_size) with([](Description& s) { s.prefetch_bucket_size = 0; });
  if (d.max_live_parameters) with([](Description& s) { s.max_live_parameters = 0; });
  if (d.max_reuse_distance != -1) with([](Description& s) { s.max_reuse_distance = -1; });
  if (d.sub_group_size) with([](Description& s) { s.sub_group_size = 0; });
  if (d.model == "tiny-moe") {
    if (d.top_k > 1) with([](Description& s) { s.top_k = 1; });
    if (d.capacity_factor != 1.0) with([](Description& s) { s.capacity_factor = 1.0; });
    if (!d.drop_tokens) with([](Description& s) { s.drop_tokens = true; });
    if (d.noisy_gate_policy != "None") with([](Description& s) { s.noisy_gate_policy = "None"; });
    if (d.moe_padding) with([](Description& s) { s.moe_padding = 0; });
    if (!d.expert_kernel.empty()) with([](Description& s) { s.expert_kernel.clear(); });
  }
  return out;
}

}  // namespace matrix
