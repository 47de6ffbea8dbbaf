// Helpers of the hostile-file tests: bytes in and out of files, and tensor files rebuilt from
// their parts with a valid checksum (so a crafted footer gets past the CRC to the parser).
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>

#include <unistd.h>

#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/util/crc32c.h"
#include "tests/runtime/checkpoint/test_util.h"

namespace strata::test {

// The damaged copies of `good` every hostile-file test tries: each truncation (every length
// shorter than the file), then each single flipped bit; run(label, bytes, byte index or -1).
template <class Run>
void for_each_cut_and_flip(const std::string& good, const Run& run) {
  for (size_t n = 0; n < good.size(); ++n)
    run("cut at " + std::to_string(n), good.substr(0, n), int64_t(-1));
  for (size_t i = 0; i < good.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = good;
      bad[i] = char(bad[i] ^ (1 << bit));
      run("byte " + std::to_string(i) + " bit " + std::to_string(bit), bad,
          bit == 0 ? int64_t(i) : int64_t(-1));
    }
}

inline std::string le_bytes(uint64_t v, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
  return out;
}

inline uint64_t le_value(const std::string& bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  return v;
}

// A tensor file's parts (tensor_file.h):
//   payload | meta | u64 meta length | u32 crc | u32 0 | magic.
struct TensorFileParts {
  std::string payload, meta;

  static TensorFileParts of(const std::string& file) {
    const uint64_t meta_bytes = le_value(file, file.size() - 24, 8);
    const size_t payload = file.size() - 24 - size_t(meta_bytes);
    return {file.substr(0, payload), file.substr(payload, size_t(meta_bytes))};
  }
  // The file, its CRC computed over what precedes it; `meta_length` overrides the length field.
  std::string sealed(uint64_t meta_length) const {
    std::string out = payload + meta + le_bytes(meta_length, 8);
    out += le_bytes(crc32c(out), 4) + le_bytes(0, 4) + std::string("STRATA\x01T", 8);
    return out;
  }
  std::string sealed() const { return sealed(meta.size()); }
};

// A 2-rank ZeRO checkpoint as the engine lays it out (flat master partitions with their pieces),
// small enough to fuzz byte by byte, whole enough for strata-ckpt to consolidate. `edit` may
// change each rank's optim_states before it is written.
using EditPartition =
    std::function<void(int rank, checkpoint::json& scalars, checkpoint::NamedTensors& tensors)>;
inline void save_small_checkpoint(const std::string& dir, const std::string& tag,
                                  const EditPartition& edit = {}) {
  std::vector<checkpoint::CheckpointWriter> writers;
  for (int r = 0; r < 2; ++r) writers.emplace_back(dir, tag, r, 2);
  writers[0].write_shared("model_states",
                          {{"param.fc.weight", torch::ones({2, 3})},
                           {"param.fc.bias", torch::ones({2})},
                           {"buffer.steps", torch::tensor({int64_t(7)})}},
                          {{"global_steps", 7}});
  for (int r = 0; r < 2; ++r) {
    checkpoint::json scalars = {{"layout", "flat"},
                                {"flat_numel", 8},
                                {"flat_params", {"fc.weight", "fc.bias"}},
                                {"shard_pieces", {{4 * r, 4, 0}}},
                                {"state.type", "adam"}};
    checkpoint::NamedTensors tensors = {{"master", torch::arange(4.0f) + 4 * r}};
    if (edit) edit(r, scalars, tensors);
    writers[r].write_partition("optim_states", tensors, scalars);
  }
  checkpoint::RunInfo info;
  info.zero_stage = 2;
  writers[0].commit(info);
}

// What strata-ckpt and a resume read: the reader (every checksum), each file, the consolidation.
inline void read_small_checkpoint(const std::string& dir) {
  const checkpoint::CheckpointReader reader(dir);
  reader.load_shared("model_states");
  for (int r = 0; r < reader.world_size(); ++r) reader.load_partition("optim_states", r);
  checkpoint::consolidate(dir, "latest", torch::kFloat);
}

}  // namespace strata::test
