// Version-2 tensor files (tensor_file.h) written and read in pieces: state that never exists
// whole in host memory (a ZeRO-Infinity partition in NVMe swap files, a stage-3 model gathered
// one unit at a time) goes to and from a checkpoint a tile at a time.
//
// Writing: begin() a tensor, write() its bytes in any number of pieces (exactly its size), end();
// each tensor's CRC32C is computed as its bytes pass, and the file's as the AtomicFile writes.
// Reading: the reader checks the whole file's CRC in one streaming pass before it hands out any
// range (so a flipped byte or a truncation is found before anything is installed), then reads
// ranges through pread. A version-1 file (LibTorch archive, checkpoints before version 2) cannot
// be read in pieces: the reader loads it whole and serves ranges from memory, so old checkpoints
// still load, with the memory they always needed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

// Host bytes a piece of a tensor moves through when it is copied (device tensors, casts, the
// streamed state): bounds the checkpoint path's memory, not the model's size.
constexpr int64_t kStreamTileBytes = int64_t(8) << 20;

class TensorFileWriter {
 public:
  explicit TensorFileWriter(const std::string& path);

  // Starts tensor `spec`: exactly tensor_bytes(spec) bytes follow through write().
  void begin(const TensorSpec& spec);
  void write(const void* data, size_t bytes);
  void end();
  // A whole tensor: from its own bytes when it is a contiguous CPU tensor, else copied to host
  // memory kStreamTileBytes at a time.
  void add(const std::string& name, const torch::Tensor& tensor);

  // The footer, tensors listed in `order` (every name once; empty: as written), then commit.
  TensorFileInfo commit(const json& scalars, const std::vector<std::string>& order = {});
  const std::string& path() const { return file_.path(); }

 private:
  AtomicFile file_;
  std::vector<TensorSpec> specs_;
  std::vector<StoredBytes> stored_;
  std::set<std::string> names_;
  bool open_ = false;
  uint64_t written_ = 0;  // of the open tensor
};

// Writes `tensors` as a version-2 file (what checkpoints write).
TensorFileInfo save_tensor_file_v2(const std::string& path, const NamedTensors& tensors,
                                   const json& scalars = json::object());

class TensorFileReader {
 public:
  // Reads the footer; with `verify`, checks the whole file's CRC32C first.
  TensorFileReader(const std::string& path, bool verify = true);
  // The whole file's CRC32C against its tail, once (a streaming pass); strata::Error naming the
  // file on a mismatch. Call it before any range is used when the reader was opened without.
  void verify() const;

  const TensorFileInfo& info() const { return info_; }
  const std::string& path() const { return info_.path; }
  const json& scalars() const { return info_.scalars; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // strata::Error naming the file and the tensor when it is absent.
  const TensorSpec& spec(const std::string& name) const;
  int64_t numel(const std::string& name) const;

  // Elements [begin, begin + n) of tensor `name` in C order into `dst` (n elements of its dtype).
  // strata::Error naming file and tensor for a range outside it.
  void read(const std::string& name, int64_t begin, int64_t n, void* dst) const;
  // The whole tensor (its own CRC32C checked, version 2).
  torch::Tensor at(const std::string& name) const;

 private:
  size_t index_of(const std::string& name) const;

  std::unique_ptr<FileReader> file_;
  TensorFileInfo info_;
  std::map<std::string, size_t> index_;
  std::optional<TensorFile> whole_;  // version 1: loaded whole
  mutable bool verified_ = false;
};

// The bytes `stored` says of `spec` in `file`, checked against their CRC32C.
torch::Tensor read_stored_tensor(const FileReader& file, const TensorSpec& spec,
                                 const StoredBytes& stored);

}  // namespace strata::checkpoint
