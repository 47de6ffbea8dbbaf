// Training data for the example trainer: byte-level tokens from a text file, or, by default, from
// a small synthetic language generated in code (no download). Batches are a pure function of
// (seed, step, sample index), so a run is reproducible, a resumed run sees the same data, and
// the samples of one global batch split across ranks without coordination.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace strata::examples {

class TokenData {
 public:
  // A deterministic corpus of `bytes` bytes of the synthetic language (the same for every seed).
  static TokenData synthetic(size_t bytes = size_t{4} << 20);
  // The bytes of a file; Error when it is missing, unreadable or shorter than one sample.
  static TokenData from_file(const std::string& path);

  struct Batch {
    torch::Tensor tokens;   // [count, seq_len] int64
    torch::Tensor targets;  // tokens shifted by one
  };
  // Samples [first, first + count) of the global batch of optimizer step `step`.
  Batch batch(uint64_t seed, int64_t step, int64_t first, int64_t count, int64_t seq_len) const;

  size_t size() const { return bytes_.size(); }
  const std::string& description() const { return description_; }

 private:
  std::vector<uint8_t> bytes_;
  std::string description_;
};

// train_gpt --data: "tokens:A.bin[,B.bin...]" names flat uint16 token files, "tokens32:..." uint32
// ones (runtime/data/token_dataset.h); anything else is a text file read as bytes (token_bytes 0).
struct TokenFiles {
  int64_t token_bytes = 0;
  std::vector<std::string> files;
};
TokenFiles parse_token_files(const std::string& data);

// One sentence of the synthetic language at a time (exposed for tests).
std::string synthetic_text(uint64_t seed, size_t bytes);

}  // namespace strata::examples
