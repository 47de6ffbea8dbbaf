// Pre-tokenized training data: flat binary token files (nanoGPT's .bin, a tokenizer's output
// written once), read in place through mmap and served as samples of seq_len + 1 tokens (the
// inputs and, shifted by one, the targets).
//
//   strata::data::TokenDatasetOptions o;
//   o.files = {"train.bin"};  o.token_bytes = 2;  o.seq_len = 2048;  o.vocab_size = 128256;
//   strata::data::TokenDataset data(o);
//   auto first = strata::data::TokenDataset::first_position(step, micro, rank, world, micro_batch, gas);
//   auto batch = data.batch(first, micro_batch);   // batch.tokens, batch.targets [micro_batch, seq_len]
//
// Samples: each file is cut into windows of seq_len + 1 tokens at a stride of seq_len (the last
// token of a window is the first of the next: every token is a target once); windows do not cross
// files. Sample ids count the windows of all files in order.
//
// Order: one global sequence of positions 0, 1, 2, ...; position p is sample perm_e(p mod N) of
// epoch e = p / N (N samples per epoch), perm_e a seeded permutation of [0, N) drawn anew each epoch
// (a keyed Feistel network, so no table of N entries is held), or the identity without shuffle. No
// sample repeats within an epoch. The order depends on the seed alone: rank r of w takes its share
// of each global batch by position (first_position, the engine's convention: micro-step m of rank
// r holds the batch's chunk m * world + r), so a run's data does not depend on the number of ranks,
// the micro-batch or the accumulation, and a resume continues at the position it saved.
//
// Megatron-LM's preprocessed data (PREFIX.bin with PREFIX.idx): a .idx beside a .bin is read and
// held against it (dtype, pointers, lengths covering the .bin exactly); the tokens are then read as
// a flat file (documents concatenated, as Megatron's GPT dataset samples across them).
//
// Bad files are refused by name and byte offset: a size that is not a multiple of the token width,
// a file too short for one sample (with every file so), an id at or above vocab_size (checked as
// each sample is read: the message names the file and the byte offset of the id).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace strata::data {

struct TokenDatasetOptions {
  std::vector<std::string> files;  // flat little-endian token ids, in this order
  int64_t token_bytes = 2;         // 2 (uint16) or 4 (uint32)
  int64_t seq_len = 0;             // tokens per sample's input
  int64_t vocab_size = 0;          // ids must be below it; 0: not checked
  uint64_t seed = 0;
  bool shuffle = true;             // false: positions in file order
};

class TokenDataset {
 public:
  explicit TokenDataset(TokenDatasetOptions options);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  int64_t samples_per_epoch() const { return samples_; }
  const TokenDatasetOptions& options() const { return options_; }
  // The sample id at global position `position` (>= 0).
  int64_t sample_at(int64_t position) const;

  struct Batch {
    torch::Tensor tokens;   // [count, seq_len] int64
    torch::Tensor targets;  // [count, seq_len] int64: tokens shifted by one
    std::vector<int64_t> ids;  // the samples, for tests and logs
  };
  // Positions [first, first + count).
  Batch batch(int64_t first, int64_t count) const;

  // The first position of the micro-batch that rank `rank` of `world` takes at micro-step
  // `micro` (0 .. gas - 1) of optimizer step `step` (0-based), with `micro_batch` samples each,
  // counted from `start` (the position the run began at, for a resume that changed the batch).
  static int64_t first_position(int64_t step, int64_t micro, int64_t rank, int64_t world,
                                int64_t micro_batch, int64_t gas, int64_t start = 0);

 private:
  struct File;
  void read_sample(int64_t id, int64_t* out) const;  // seq_len + 1 ids

  TokenDatasetOptions options_;
  std::vector<std::unique_ptr<File>> files_;
  std::vector<int64_t> first_sample_;  // per file: its first sample id; then the total
  int64_t samples_ = 0;
};

}  // namespace strata::data
