// Running the real train_gpt binary, directly or under strata-run, as the example tests do.
#pragma once

#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace train_gpt_runs {

struct Run {
  int exit_code;
  std::string output;
};

// Runs a shell command, returning its exit code and its output (stdout and stderr).
inline Run capture(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string output;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

inline Run run(const std::string& args) {
  // CPU: these tests check the trainer's behaviour and bit-for-bit determinism, which CUDA
  // kernels with atomics do not promise; the GPU suite runs the trainer on GPUs.
  return capture(std::string(STRATA_BIN_DIR) + "/train_gpt --device cpu " + args);
}

inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// train_gpt on `ranks` processes through strata-run: "" on success, else the output.
inline std::string launch(int ranks, const std::string& args) {
  const auto r = capture(std::string(STRATA_BIN_DIR) + "/strata-run --num_gpus " +
                         std::to_string(ranks) + " -- " + STRATA_BIN_DIR +
                         "/train_gpt --device cpu " + args);
  return r.exit_code == 0 ? std::string() : r.output;
}

// The Hugging Face fixtures' folder (tests/models/fixtures: save_pretrained's output).
inline std::string hf_fixture(const std::string& family) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/models/fixtures/" + family;
}

// A token file at `path` (written once): 20,000 uint16 ids below the fixtures' vocabulary (128),
// from a linear congruential stream seeded with `seed`.
inline std::string fixture_tokens(const std::string& path, uint32_t seed) {
  if (!std::ifstream(path).good()) {
    std::ofstream out(path, std::ios::binary);
    uint32_t x = seed;
    for (int i = 0; i < 20000; ++i) {
      x = x * 1664525u + 1013904223u;
      const uint16_t id = uint16_t((x >> 16) % 128);
      out.write(reinterpret_cast<const char*>(&id), 2);
    }
  }
  return path;
}

}  // namespace train_gpt_runs
