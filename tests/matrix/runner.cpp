#include "runner.h"

#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <algorithm>
#include <set>
#include <sstream>

namespace matrix {

namespace {

struct Captured {
  int exit_code;
  std::string output;
};

Captured capture(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string output;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line, nullptr, false));
  return rows;
}

std::string tail_lines(const std::string& text, int lines) {
  size_t pos = text.size();
  for (int i = 0; i <= lines && pos > 0; ++i) {
    pos = text.rfind('\n', pos - 1);
    if (pos == std::string::npos) return text;
  }
  return text.substr(pos + 1);
}

double lr_of(const Description& d) { return d.optimizer == "SGD" ? 0.05 : 3e-3; }

double rel(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0.0 : INFINITY;
  const double scale = std::max(std::abs(a), std::abs(b));
  return scale == 0.0 ? 0.0 : std::abs(a - b) / scale;
}

// Every parameter group follows the one schedule (train_gpt gives every group the config's LR;
// the experts' groups are DeepSpeed-MoE's own): each step's "lrs" all equal its "lr", in the
// description and in the oracle. The oracle runs the experts' optimizer through the same code,
// so only this invariant, not the comparison, sees a group that stopped following the schedule.
// (An older train_gpt writes no "lrs": nothing to check.)
void check_group_lrs(const Description& d, const std::vector<nlohmann::json>& oracle,
                            const std::vector<nlohmann::json>& mine, double bound, Verdict* v) {
  for (const auto* rows : {&mine, &oracle})
    for (size_t s = 0; s < rows->size(); ++s) {
      const auto& row = (*rows)[s];
      if (!row.contains("lrs") || !row.contains("lr") || v->outcome != Outcome::kPass) continue;
      const double lr = row.at("lr").get<double>();
      const auto& lrs = row.at("lrs");
      for (size_t g = 0; g < lrs.size(); ++g) {
        const double e = rel(lr, lrs[g].get<double>());
        if (e <= bound) continue;
        v->outcome = Outcome::kMismatch;
        std::ostringstream s_;
        s_.precision(9);
        s_ << (rows == &oracle ? "the oracle's " : "") << "step " << s + 1
           << (rows == &mine && d.save_at && int(s) >= d.save_at ? " (after the resume)" : "")
           << ": parameter group " << g << " steps at lr " << lrs[g].get<double>()
           << ", the schedule's lr is " << lr << " (every group follows one schedule)";
        v->detail = s_.str();
        return;
      }
    }
}

// Streamed experts on 2+ ranks (issue 51), on every metrics row of the phase: the gathered units
// stay within their window (expert_bytes_peak <= expert_window_bytes), the experts' gradient
// buckets within their bound (2 x max(reduce_bucket_size, the largest unit x ranks)), and the
// experts' reducer launched reductions while backward still ran. The last only over an
// expert-data-parallel group of 2+ ranks (world / ep_size): a group of one reduces nothing. The
// oracle streams nothing, so only these invariants see a window or a bound overrun. (An older
// train_gpt writes no reducer fields: nothing to check there.)
void check_streamed_experts(const Description& d, size_t i, const std::vector<nlohmann::json>& rows,
                            Verdict* v) {
  const Phase& p = d.phases[i];
  if (d.model != "tiny-moe" || p.expert_unit <= 0 || p.world < 2) return;
  const bool reduces = p.world / p.ep_size >= 2;
  for (const auto& row : rows) {
    if (v->outcome != Outcome::kPass) return;
    auto fail = [&](const std::string& what) {
      v->outcome = Outcome::kMismatch;
      v->detail = "phase " + std::to_string(i) + " (streamed experts, " + std::to_string(p.world) +
                  " ranks, ep_size " + std::to_string(p.ep_size) + "), step " +
                  std::to_string(row.value("step", 0)) + ": " + what;
    };
    auto number = [&](const char* key) { return row.at(key).get<int64_t>(); };
    if (!row.contains("expert_bytes_peak") || !row.contains("expert_window_bytes")) {
      fail("no expert_bytes_peak / expert_window_bytes in the metrics row");
    } else if (number("expert_bytes_peak") > number("expert_window_bytes")) {
      fail("expert_bytes_peak " + std::to_string(number("expert_bytes_peak")) +
           " > expert_window_bytes " + std::to_string(number("expert_window_bytes")));
    } else if (row.contains("expert_reducer_peak_bytes") && row.contains("expert_reducer_bound_bytes") &&
               number("expert_reducer_peak_bytes") > number("expert_reducer_bound_bytes")) {
      fail("expert_reducer_peak_bytes " + std::to_string(number("expert_reducer_peak_bytes")) +
           " > expert_reducer_bound_bytes " + std::to_string(number("expert_reducer_bound_bytes")) +
           " (reduce_bucket_size " + std::to_string(d.reduce_bucket_size) + ")");
    } else if (reduces && row.contains("expert_reductions_during_backward") &&
               number("expert_reductions_during_backward") <= 0) {
      fail("expert_reductions_during_backward " +
           std::to_string(number("expert_reductions_during_backward")) +
           ": the experts' reducer launched nothing before backward ended (" +
           std::to_string(row.value("expert_reducer_buckets", int64_t(-1))) + " buckets)");
    }
  }
}

}  // namespace

// Tolerances (docs/matrix.md says why). fp32: the example tests' 1e-5 relative on the loss (the
// same math summed in another order; the matrix measured <= 1.4e-7 on the loss and 4.7e-7 on the
// gradient norm), 1e-4 on the norm (one sum of squares over differently cut partitions). bf16:
// 2e-3 on the loss, 2x the examples' bound for stage 3 against stage 0 over 12 steps (1e-3,
// measured 1.3e-4) since a description also resumes, ~12x the matrix's measured worst (1.7e-4);
// 1e-2 on the norm (measured 9.1e-4). autocast (bf16 ops, fp32 parameters): 5e-4 and 5e-3,
// 2.5x the examples' 2e-4 and ~14x / ~30x the measured 3.7e-5 / 1.7e-4. The LR is a function of
// the step alone: 1e-9.
// The parameters after the last step (the fp32 master, consolidated), max |difference| in units
// of lr x steps, about how far Adam moves an element in that many steps. fp32 0.25: most
// descriptions differ by 1e-5 (rounding), but an element whose gradient is within rounding of
// zero moves by up to ~0.1 lr per step through Adam's eps in one run and not the other
// (measured 0.0185: one element of 16384, 2 ranks against 1); an element that missed a step or
// kept a stale value is about a unit away. In 16 bits an element whose gradient is near zero can
// take Adam's whole normalised step the other way (measured up to 0.63 units): 4 units, which
// still catches values no step could reach (garbage, a wrong load).
// autocast with MoE: bf16's bounds. Top-k routing with capacity drops turns bf16 rounding into
// other routes: the CPU Adam's rounding against the device Adam's moved tiny-moe's step-6 loss by
// 8.2e-4 (k 2, capacity factor 1), as far as autocast itself is from fp32 there (9.1e-4).
// autocast at a world size that is not a power of two: bf16's bounds too. The oracle backpropagates
// loss / (world x gas) through bf16 products where each rank backpropagates loss / gas and the
// ranks average in fp32 afterwards; scaling by 1/3 changes bf16 mantissas (1/2 and 1/4 do not), so
// every bf16 intermediate of the backward rounds differently: measured on tiny-tied, 3 ranks
// against the oracle's 3 micro-steps, one SGD step moved elements up to 3% of the step apart and
// AdamW's step-2 loss 7.2e-4 apart, where 2 and 4 ranks are bit-exact (1e-9).
static bool scales_exactly_in_bf16(const Description& d) {
  for (const Phase& p : d.phases)
    if (p.world & (p.world - 1)) return false;
  return true;
}

// Ulysses in 16 bits: each rank's weight gradients sum its shard's rows and round to 16 bits
// before the ranks add them in fp32, where the oracle rounds one sum over the whole sequence once.
// The oracle is then the noisier run: measured on tiny-tied bf16 at sp 4 (seed 1208, 5 Adam
// steps), the gradient norm against an fp32 run drifted +0.4% to +2.5% for the oracle and -0.04%
// to -0.6% for the sequence-parallel run, 3.0% apart at step 5 (losses within 1e-4 of each other).
static bool splits_sequences_in_16_bits(const Description& d) {
  if (d.dtype == "fp32") return false;
  for (const Phase& p : d.phases)
    if (p.sp > 1) return true;
  return false;
}

Tolerance tolerance_for(const Description& d) {
  if (d.dtype == "fp32") return {1e-5, 1e-4, 1e-9, 0.25};
  if (splits_sequences_in_16_bits(d)) return {2e-3, 5e-2, 1e-9, 4.0};
  if (d.dtype == "autocast" && d.model != "tiny-moe" && scales_exactly_in_bf16(d))
    return {5e-4, 5e-3, 1e-9, 4.0};
  return {2e-3, 1e-2, 1e-9, 4.0};  // bf16 (and fp16 where it trains)
}

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::kPass: return "pass";
    case Outcome::kRefusedAsPredicted: return "refused-as-predicted";
    case Outcome::kMismatch: return "MISMATCH";
    case Outcome::kCrash: return "CRASH";
    case Outcome::kNotRefused: return "NOT-REFUSED";
    case Outcome::kWrongRefusal: return "WRONG-REFUSAL";
    case Outcome::kOracleFailed: return "ORACLE-FAILED";
  }
  return "?";
}

nlohmann::json config_for(const Description& d, const Phase& p, const std::string& nvme_path) {
  const double lr = lr_of(d);
  nlohmann::json c = {{"train_micro_batch_size_per_gpu", d.micro},
                      {"gradient_accumulation_steps", p.gas},
                      {"steps_per_print", 1000},
                      {"gradient_clipping", d.clip}};
  if (d.optimizer == "SGD")
    c["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", lr}, {"momentum", 0.9}}}};
  else
    c["optimizer"] = {{"type", d.optimizer},
                      {"params", {{"lr", lr}, {"betas", {0.9, 0.95}},
                                  {"weight_decay", d.optimizer == "AdamW" ? 0.1 : 0.0}}}};
  if (d.scheduler == "WarmupLR")
    c["scheduler"] = {{"type", "WarmupLR"},
                      {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", lr}, {"warmup_num_steps", 3}}}};
  else if (d.scheduler == "WarmupDecayLR")
    c["scheduler"] = {{"type", "WarmupDecayLR"},
                      {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", lr},
                                  {"warmup_num_steps", 2}, {"total_num_steps", d.steps + 2}}}};
  else if (d.scheduler == "WarmupCosineLR")
    c["scheduler"] = {{"type", "WarmupCosineLR"},
                      {"params", {{"warmup_num_steps", 2}, {"total_num_steps", d.steps + 2}}}};
  if (d.dtype == "bf16") c["bf16"] = {{"enabled", true}};
  if (d.dtype == "fp16") c["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}};
  if (d.dtype == "autocast") c["torch_autocast"] = {{"enabled", true}, {"dtype", "bfloat16"}};
  nlohmann::json z = {{"stage", p.stage}};
  if (d.persistence_threshold) z["stage3_param_persistence_threshold"] = std::max<int64_t>(0, d.persistence_threshold);
  if (d.reduce_bucket_size) z["reduce_bucket_size"] = d.reduce_bucket_size;
  if (d.allgather_bucket_size) z["allgather_bucket_size"] = d.allgather_bucket_size;
  if (d.prefetch_bucket_size) z["stage3_prefetch_bucket_size"] = d.prefetch_bucket_size;
  if (d.max_live_parameters) z["stage3_max_live_parameters"] = d.max_live_parameters;
  if (d.max_reuse_distance >= 0) z["stage3_max_reuse_distance"] = d.max_reuse_distance;
  if (d.sub_group_size) z["sub_group_size"] = d.sub_group_size;
  if (p.offload_optimizer != "none") {
    z["offload_optimizer"] = {{"device", p.offload_optimizer}};
    if (p.offload_optimizer == "nvme") z["offload_optimizer"]["nvme_path"] = nvme_path;
    if (p.nvme_in_cpu > 0 && p.offload_optimizer == "nvme") z["offload_optimizer"]["max_in_cpu"] = p.nvme_in_cpu;
    if (p.super_offload) z["offload_optimizer"]["super_offload"] = true;
  }
  if (p.offload_param != "none") {
    z["offload_param"] = {{"device", p.offload_param}};
    if (p.offload_param == "nvme") z["offload_param"]["nvme_path"] = nvme_path;
  }
  c["zero_optimization"] = z;
  if (d.model == "tiny-moe")
    c["moe"] = {{"num_experts", 4},           {"ep_size", p.ep_size},
                {"top_k", d.top_k},           {"capacity_factor", d.capacity_factor},
                {"min_capacity", 4},          {"drop_tokens", d.drop_tokens},
                {"noisy_gate_policy", d.noisy_gate_policy}, {"aux_loss_coef", 0.01}};
  if (d.model == "tiny-moe" && p.expert_unit > 0) c["moe"]["expert_unit_size"] = p.expert_unit;
  if (d.model == "tiny-moe" && p.expert_window > 0) c["moe"]["expert_window"] = p.expert_window;
  if (d.model == "tiny-moe" && p.exchange_chunks > 0) c["moe"]["exchange_chunks"] = p.exchange_chunks;
  // The activation_checkpointing block (docs/activation_checkpointing.md). With a policy it
  // always asks for the profile, whose log lines show that checkpoints ran (the runner checks);
  // the block without a policy must change nothing.
  nlohmann::json ac = nlohmann::json::object();
  const std::string& store = p.checkpoint_store;
  if (!p.checkpointing.empty()) ac["profile"] = true;
  if (store == "cpu") ac["cpu_checkpointing"] = true;
  if (store == "nvme") ac["nvme_path"] = nvme_path;
  // More than the models' checkpoints per micro-step (two per block under every, a few per
  // block under selective; the models have 2 blocks): the buffer never overflows.
  if (store == "contiguous") ac["contiguous_memory_optimization"] = true, ac["number_checkpoints"] = 64;
  if (store == "extras") ac["synchronize_checkpoint_boundary"] = true, ac["partition_activations"] = true;
  if (p.mlp_tiles >= 0) ac["mlp_tiles"] = p.mlp_tiles;
  if (!ac.empty()) c["activation_checkpointing"] = ac;
  if (p.sp > 1) c["sequence_parallel_size"] = p.sp;
  if (p.zenflow > 0) {
    nlohmann::json zf = {{"topk_ratio", p.zenflow}, {"update_interval", 1},
                         {"full_warm_up_rounds", p.zenflow_warmup}};
    if (p.zenflow_select > 0) zf["select_strategy"] = "step", zf["select_interval"] = p.zenflow_select;
    c["zero_optimization"]["zenflow"] = zf;
  }
  return c;
}

Description oracle_of(const Description& d) {
  Description o = d;
  o.save_at = 0;
  o.phases = {Phase{}};
  o.phases[0].world = 1;
  o.phases[0].gas = d.per_step;
  // ZeRO's knobs do nothing at stage 0: left out, so that descriptions share their oracle.
  o.persistence_threshold = o.reduce_bucket_size = o.allgather_bucket_size = 0;
  o.prefetch_bucket_size = o.max_live_parameters = o.sub_group_size = 0;
  o.max_reuse_distance = -1;
  // The default expert kernel (batched on the CPU): a description that forces the grouped one
  // (its packed routes at ep_size 1) is held against the padded-buffer path.
  o.expert_kernel.clear();
  return o;
}

Description reference_of(const Description& d) {
  if (!d.dropout) return oracle_of(d);
  Description twin = d;
  for (auto& p : twin.phases) p.checkpointing.clear(), p.checkpoint_store.clear(), p.mlp_tiles = -1;
  return twin;
}

std::string phase_flags(const Description& d, size_t i, const std::string& folder) {
  const bool saves = d.save_at > 0 && i == 0;
  std::string flags = " --steps " + std::to_string(saves ? d.save_at : d.steps);
  if (saves) flags += " --save-dir " + folder + "/ckpt";
  if (i > 0) flags += " --resume " + folder + "/ckpt";
  if (!saves && i + 1 == d.phases.size()) flags += " --save-dir " + folder + "/final";
  return flags;
}

Runner::Runner(RunnerOptions options) : o_(std::move(options)) {
  if (o_.tools.empty()) o_.tools = o_.bin;
  capture("mkdir -p '" + o_.work + "/oracle' '" + o_.work + "/nvme'");
}

// 30,000 uint16 ids below the tiny models' vocabulary of 256, drawn from the seed: the same file
// for a description and its oracle.
std::string Runner::token_file(uint64_t seed) const {
  const std::string path = o_.work + "/tokens_" + std::to_string(seed) + ".bin";
  std::ifstream exists(path);
  if (exists) return path;
  const std::string part = path + ".part";
  {
    std::ofstream out(part, std::ios::binary);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int i = 0; i < 30000; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
      const unsigned id = unsigned(x % 256);
      out.put(char(id & 0xff));
      out.put(char(id >> 8));
    }
  }
  std::rename(part.c_str(), path.c_str());
  return path;
}

Runner::Launch Runner::launch(const Description& d, const Phase& p, int index,
                              const std::string& folder, const std::string& jsonl,
                              const std::string& extra) {
  const std::string config = folder + "/phase" + std::to_string(index) + ".json";
  std::ofstream(config) << config_for(d, p, o_.work + "/nvme").dump(1) << "\n";
  std::ostringstream cmd;
  if (p.threads) cmd << "OMP_NUM_THREADS=" << p.threads << " ";
  if (p.adam_grain) cmd << "STRATA_CPU_ADAM_GRAIN=" << p.adam_grain << " ";
  cmd << "timeout " << o_.timeout_s << " ";
  if (p.world > 1) cmd << o_.bin << "/strata-run --num_gpus " << p.world << " -- ";
  cmd << o_.bin << "/train_gpt --device cpu --model " << d.model << (d.masked ? "-masked" : "")
      << (d.dropout ? "-dropout" : "") << " --config " << config
      << " --seed " << d.seed << " --metrics-jsonl " << jsonl << (p.zero_init ? " --zero-init" : "")
      << (p.checkpointing.empty() ? "" : " --activation-checkpointing " + p.checkpointing);
  if (d.model == "tiny-moe" && d.moe_padding > 0) cmd << " --moe-padding " << d.moe_padding;
  if (d.model == "tiny-moe" && !d.expert_kernel.empty()) cmd << " --expert-kernel " << d.expert_kernel;
  if (d.token_data) cmd << " --data tokens:" << token_file(d.seed);
  cmd << extra;
  const auto r = capture(cmd.str());
  std::ofstream(folder + "/phase" + std::to_string(index) + ".log") << cmd.str() << "\n" << r.output;
  return {r.exit_code, r.output, cmd.str()};
}

bool Runner::oracle_rows(const Description& d, std::vector<nlohmann::json>* rows, Verdict* v,
                         std::string* final_dir) {
  const Description o = reference_of(d);
  const std::string key = to_json(o).dump();
  const size_t hash = std::hash<std::string>()(key);
  const std::string folder = o_.work + "/oracle/" + std::to_string(hash);
  *final_dir = folder + "/final";
  v->commands.push_back(d.dropout ? "# its twin without activation checkpointing" : "# oracle");
  auto cached = oracle_cache_.find(key);
  if (cached != oracle_cache_.end()) {
    *rows = cached->second;
    v->commands.push_back("(cached) " + folder);
    return true;
  }
  capture("rm -rf '" + folder + "' && mkdir -p '" + folder + "'");
  rows->clear();
  for (size_t i = 0; i < o.phases.size(); ++i) {
    const std::string jsonl =
        folder + (i == 0 ? "/metrics.jsonl" : "/metrics" + std::to_string(i) + ".jsonl");
    const auto r = launch(o, o.phases[i], int(i), folder, jsonl, phase_flags(o, i, folder));
    v->commands.push_back(r.command);
    const auto got = read_jsonl(jsonl);
    rows->insert(rows->end(), got.begin(), got.end());
    if (r.exit_code != 0) {
      v->outcome = Outcome::kOracleFailed;
      v->detail = std::string(d.dropout ? "the twin without checkpointing" : "the stage-0 oracle") +
                  " exited " + std::to_string(r.exit_code) + ":\n" + tail_lines(r.output, 6);
      return false;
    }
  }
  if (int(rows->size()) != o.steps) {
    v->outcome = Outcome::kOracleFailed;
    v->detail = "the reference run wrote " + std::to_string(rows->size()) + " metrics rows for " +
                std::to_string(o.steps) + " steps";
    return false;
  }
  oracle_cache_[key] = *rows;
  return true;
}

bool Runner::probe_cpu_fp16() {
  Description d;
  d.dtype = "fp16";
  d.steps = 1;
  d.per_step = 1;
  d.phases = {Phase{}};
  const std::string folder = o_.work + "/probe_fp16";
  capture("mkdir -p '" + folder + "'");
  return launch(d, d.phases[0], 0, folder, folder + "/m.jsonl", " --steps 1").exit_code == 0;
}

Verdict Runner::run(const Description& d) {
  if (!d.dropout) return run_against_reference(d);
  // With dropout: first the same description without it against the stage-0 oracle (what
  // every description checks), then with it against its twin without activation checkpointing.
  Description plain = d;
  plain.dropout = false;
  Verdict v = run_against_reference(plain);
  if (v.outcome != Outcome::kPass) return v;
  Verdict t = run_against_reference(d);
  t.commands.insert(t.commands.begin(), v.commands.begin(), v.commands.end());
  t.seconds += v.seconds;
  t.worst_loss = std::max(t.worst_loss, v.worst_loss);
  t.worst_grad_norm = std::max(t.worst_grad_norm, v.worst_grad_norm);
  t.worst_param = std::max(t.worst_param, v.worst_param);
  return t;
}

Verdict Runner::run_against_reference(const Description& d) {
  const auto start = std::chrono::steady_clock::now();
  Verdict v;
  auto finish = [&]() {
    v.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return v;
  };
  const std::string folder = o_.work + "/d" + std::to_string(counter_++);
  capture("rm -rf '" + folder + "' && mkdir -p '" + folder + "'");
  const auto refusal = predict_refusal(d);

  std::vector<nlohmann::json> reference;
  std::string oracle_final;
  if (!refusal && !oracle_rows(d, &reference, &v, &oracle_final)) return finish();

  // The description's phases: the first saves after save_at steps, the second resumes.
  std::vector<nlohmann::json> rows;
  v.commands.push_back("# description");
  for (size_t i = 0; i < d.phases.size(); ++i) {
    const std::string jsonl = folder + "/phase" + std::to_string(i) + ".jsonl";
    const auto r = launch(d, d.phases[i], int(i), folder, jsonl, phase_flags(d, i, folder));
    v.commands.push_back(r.command);
    if (refusal && refusal->phase == int(i)) {
      if (r.exit_code == 0) {
        v.outcome = Outcome::kNotRefused;
        v.detail = "predicted refused (" + refusal->why + ", naming " + refusal->key +
                   ") but phase " + std::to_string(i) + " trained";
      } else if (r.output.find(refusal->key) == std::string::npos) {
        v.outcome = Outcome::kWrongRefusal;
        v.detail = "exited " + std::to_string(r.exit_code) + " without naming " + refusal->key +
                   ":\n" + tail_lines(r.output, 6);
      } else {
        v.outcome = Outcome::kRefusedAsPredicted;
        v.detail = refusal->key + ": " + refusal->why;
      }
      if (!o_.keep) capture("rm -rf '" + folder + "'");
      return finish();
    }
    if (r.exit_code != 0) {
      v.outcome = Outcome::kCrash;
      v.detail = "phase " + std::to_string(i) + " exited " + std::to_string(r.exit_code) + ":\n" +
                 tail_lines(r.output, 8);
      return finish();
    }
    const auto got = read_jsonl(jsonl);
    rows.insert(rows.end(), got.begin(), got.end());
    check_streamed_experts(d, i, got, &v);
    // A policy checkpoints something (its profile says so); the block alone checkpoints nothing.
    const bool profiled = r.output.find("activation checkpointing, micro-step") != std::string::npos;
    if (profiled != !d.phases[i].checkpointing.empty() && v.outcome == Outcome::kPass) {
      v.outcome = Outcome::kMismatch;
      v.detail = "phase " + std::to_string(i) +
                 (profiled ? " checkpointed without a policy"
                           : " checkpointed nothing under --activation-checkpointing " +
                                 d.phases[i].checkpointing);
    }
    // ZenFlow past its warm-up steps some elements on the device (train_gpt's metrics say so).
    if (d.phases[i].zenflow > 0 && int(got.size()) > d.phases[i].zenflow_warmup &&
        v.outcome == Outcome::kPass &&
        std::none_of(got.begin(), got.end(), [](const nlohmann::json& row) {
          return row.value("zenflow_device_elements", int64_t(0)) > 0;
        })) {
      v.outcome = Outcome::kMismatch;
      v.detail = "phase " + std::to_string(i) + " ran ZenFlow for " + std::to_string(got.size()) +
                 " steps without stepping anything on the device";
    }
    // Checkpointed inputs on NVMe: the engine removes its swap folder when it is destroyed.
    const auto left = capture("(ls -d '" + o_.work + "/nvme'/strata-actckpt-* 2>/dev/null)");
    if (!left.output.empty() && v.outcome == Outcome::kPass) {
      v.outcome = Outcome::kMismatch;
      v.detail = "phase " + std::to_string(i) + " left activation checkpoint swap files:\n" +
                 tail_lines(left.output, 4);
      capture("rm -rf '" + o_.work + "/nvme'/strata-actckpt-*");
    }
  }
  if (int(rows.size()) != d.steps) {
    v.outcome = Outcome::kCrash;
    v.detail = "wrote " + std::to_string(rows.size()) + " metrics rows for " + std::to_string(d.steps) + " steps";
    return finish();
  }
  // Per step: the loss (parameters after the steps before it), the gradient norm and the LR.
  const Tolerance tol = tolerance_for(d);
  for (int s = 0; s < d.steps; ++s) {
    const auto& a = reference[size_t(s)];
    const auto& b = rows[size_t(s)];
    struct Metric { const char* name; double bound; double* worst; };
    double worst_lr = 0;
    for (const Metric m : {Metric{"loss", tol.loss, &v.worst_loss},
                           Metric{"grad_norm", tol.grad_norm, &v.worst_grad_norm},
                           Metric{"lr", tol.lr, &worst_lr}}) {
      if (!a.contains(m.name) || !b.contains(m.name)) continue;
      const double x = a.at(m.name).get<double>(), y = b.at(m.name).get<double>();
      const double e = rel(x, y);
      *m.worst = std::max(*m.worst, e);
      if (e > m.bound && v.outcome == Outcome::kPass) {
        v.outcome = Outcome::kMismatch;
        std::ostringstream s_;
        s_.precision(9);
        s_ << "step " << s + 1 << (d.save_at && s >= d.save_at ? " (after the resume)" : "") << ": "
           << m.name << " " << y << (d.dropout ? " vs the twin's " : " vs the oracle's ") << x
           << " (relative " << e << " > " << m.bound << ")";
        v.detail = s_.str();
      }
    }
  }
  check_group_lrs(d, reference, rows, tol.lr, &v);
  compare_parameters(d, folder + "/final", oracle_final, &v);
  if (!o_.keep && !is_failure(v.outcome)) capture("rm -rf '" + folder + "'");
  return finish();
}

void Runner::compare_parameters(const Description& d, const std::string& mine,
                                const std::string& oracle, Verdict* v) {
  const std::string cmd = o_.tools + "/strata-ckpt compare '" + oracle + "' '" + mine + "'";
  const auto r = capture(cmd);
  v->commands.push_back(cmd);
  const auto out = nlohmann::json::parse(r.output.substr(std::min(r.output.find('{'), r.output.size())),
                                         nullptr, false);
  if (r.exit_code != 0 || out.is_discarded() || !out.contains("worst")) {
    if (v->outcome == Outcome::kPass) {
      v->outcome = Outcome::kMismatch;
      v->detail = "the final checkpoints could not be compared (" + cmd + "):\n" +
                  tail_lines(r.output, 4);
    }
    return;
  }
  const auto& worst = out.at("worst");
  const double scale = lr_of(d) * d.steps;
  const double e = worst.at("max_abs").get<double>() / scale;
  v->worst_param = e;
  if (e > tolerance_for(d).param && v->outcome == Outcome::kPass) {
    v->outcome = Outcome::kMismatch;
    std::ostringstream s_;
    s_.precision(6);
    s_ << "after step " << d.steps << ": parameter '" << worst.at("name").get<std::string>()
       << "' differs from the " << (d.dropout ? "twin's" : "oracle's") << " by up to "
       << worst.at("max_abs").get<double>() << " = " << e << " x lr x steps (> " << tolerance_for(d).param << ")";
    v->detail = s_.str();
  }
}

ShrinkResult shrink(Runner& runner, const Description& failing, const Verdict& failure,
                    int max_trials, bool verbose) {
  ShrinkResult r{failing, failure, 0};
  std::set<std::string> tried = {to_json(failing).dump()};  // each description runs once
  bool progress = true;
  while (progress && r.trials < max_trials) {
    progress = false;
    for (const auto& candidate : simplifications(r.minimal)) {
      if (r.trials >= max_trials) break;
      // A simplification the matrix predicts refused tests the refusal, not the defect.
      if (predict_refusal(candidate).has_value() != predict_refusal(r.minimal).has_value()) continue;
      if (!tried.insert(to_json(candidate).dump()).second) continue;
      ++r.trials;
      const Verdict v = runner.run(candidate);
      if (verbose)
        std::cerr << "  shrink trial " << r.trials << ": " << outcome_name(v.outcome) << "  "
                  << summary(candidate) << "\n";
      if (v.outcome == failure.outcome) {
        r.minimal = candidate, r.verdict = v, progress = true;
        break;
      }
    }
  }
  return r;
}

std::string replay_command(const std::string& driver, const std::string& bin, const Description& d) {
  return driver + " --bin " + bin + " --replay '" + to_json(d).dump() + "'";
}

}  // namespace matrix
