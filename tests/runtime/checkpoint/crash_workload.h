// The workloads that tests/runtime/checkpoint kills with SIGKILL: saved by checkpoint_tool
// (a separate process, so the kill can land anywhere) and verified by the tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/error.h"

namespace strata::test {

// --- one file, rewritten atomically ------------------------------------------------------------

constexpr size_t kAtomicWords = size_t(1) << 20;  // 8 MiB per version

// Version v: kAtomicWords little-endian copies of v.
inline void write_atomic_version(const std::string& path, uint64_t v) {
  std::vector<uint64_t> words(kAtomicWords, v);
  checkpoint::write_file_atomic(
      path, std::string_view(reinterpret_cast<const char*>(words.data()), words.size() * 8));
}

// The version the file holds; throws when it is torn (wrong size, mixed words).
inline uint64_t read_atomic_version(const std::string& path) {
  const std::string bytes = checkpoint::read_file(path);
  if (bytes.size() != kAtomicWords * 8)
    throw Error("torn file: " + std::to_string(bytes.size()) + " bytes");
  uint64_t first;
  std::memcpy(&first, bytes.data(), 8);
  for (size_t i = 1; i < kAtomicWords; ++i)
    if (std::memcmp(bytes.data() + 8 * i, &first, 8) != 0)
      throw Error("torn file: mixed versions at word " + std::to_string(i));
  return first;
}

// --- a whole checkpoint -----------------------------------------------------------------------

constexpr int kCrashWorld = 4;
constexpr int64_t kCrashFloats = int64_t(1) << 20;  // 4 MiB per tensor: 40 MiB per save
constexpr int64_t kSmallCrashFloats = 4096;          // for saves killed at chosen points

// Tags repeat (t0, t0, t1, t1, t0, ...): saves land both on the tag `latest` names and on
// the other one.
inline std::string crash_tag(int64_t step) { return "t" + std::to_string((step / 2) % 2); }

// Step `step` of a 4-rank checkpoint, every rank written by this one process: the model file
// holds `step` everywhere, rank r's optimizer partition 10 * step + r and -step.
inline void save_crash_step(const std::string& dir, int64_t step,
                            checkpoint::WriteOptions options = {},
                            int64_t floats = kCrashFloats) {
  const auto full = [floats](double v) { return torch::full({floats}, v); };
  const checkpoint::json scalars = {{"step", step}};
  std::vector<checkpoint::CheckpointWriter> writers;
  for (int r = 0; r < kCrashWorld; ++r)
    writers.emplace_back(dir, crash_tag(step), r, kCrashWorld, options);
  const int64_t bias = std::min<int64_t>(floats, 1000);
  writers[0].write_shared("model_states",
                          {{"w", full(double(step))}, {"b", full(double(step)).narrow(0, 0, bias)}},
                          scalars);
  for (int r = 0; r < kCrashWorld; ++r)
    writers[r].write_partition(
        "optim_states", {{"exp_avg", full(10.0 * step + r)}, {"exp_avg_sq", full(-double(step))}},
        scalars);
  checkpoint::RunInfo info;
  info.zero_stage = 2;
  info.extra = scalars;
  writers[0].commit(info);
}

inline bool all_equal(const torch::Tensor& t, double v) { return (t == v).all().item<bool>(); }

// Loads and checks `latest` (or `tag`) completely; returns its step. Throws on anything
// inconsistent.
inline int64_t verify_crash_latest(const std::string& dir, const std::string& tag = "latest") {
  checkpoint::CheckpointReader reader(dir, tag);  // verifies every checksum
  reader.check_world_size(kCrashWorld);
  const auto model = reader.load_shared("model_states");
  const int64_t step = model.scalars.at("step").get<int64_t>();
  if (reader.tag() != crash_tag(step) || reader.manifest().info.extra.at("step") != step)
    throw Error("tag / manifest disagree with the model file's step " + std::to_string(step));
  if (!all_equal(model.at("w"), double(step)) || !all_equal(model.at("b"), double(step)))
    throw Error("model file values are not step " + std::to_string(step));
  for (int r = 0; r < kCrashWorld; ++r) {
    const auto part = reader.load_partition("optim_states", r);
    if (part.scalars.at("step").get<int64_t>() != step)
      throw Error("rank " + std::to_string(r) + "'s partition is from another step");
    if (!all_equal(part.at("exp_avg"), 10.0 * step + r) ||
        !all_equal(part.at("exp_avg_sq"), -double(step)))
      throw Error("rank " + std::to_string(r) + "'s partition values are wrong");
  }
  return step;
}

}  // namespace strata::test
