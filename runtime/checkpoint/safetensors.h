// The safetensors format (https://github.com/huggingface/safetensors), so weights move between
// Strata and any tool that reads it:
//
//   u64 little-endian N | N bytes of JSON header, padded with spaces so that 8 + N is a multiple
//   of 8 | the tensors' raw little-endian bytes, back to back.
//
// The header maps each tensor name to {"dtype": "F32"|"BF16"|"F16"|"F64"|"I64"|"I32"|"I16"|
// "I8"|"U8"|"BOOL"|"C64", "shape": [...], "data_offsets": [begin, end]} (offsets into the data
// section), plus an optional "__metadata__" object of string values. The writer orders the data
// by element size, largest first, then by name (as the reference implementation does), so every
// tensor is aligned to its element size, and streams it: the header comes from the tensors'
// specs, then each tensor's bytes a tile at a time (a model larger than host memory is written
// as it is gathered). The reader checks what the reference reader checks (known dtypes, sizes
// that agree with shapes, offsets that cover the data exactly: a truncated file is refused when
// it is opened) and then reads any range of any tensor through pread.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

using Metadata = std::map<std::string, std::string>;

// Writes atomically. Names must be unique and not "__metadata__"; tensors may live on any
// device and be non-contiguous (each is copied to contiguous CPU memory as it is written).
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata = {});

// The order a file's data takes (the reference writer's: element size, largest first, then name).
std::vector<TensorSpec> safetensors_order(std::vector<TensorSpec> specs);

// The streamed writer: the header from `specs`, then write() each tensor in order() (the file's
// data order), commit(). A tensor of another floating-point dtype than its spec is cast a tile
// at a time (an fp32 master written as bf16).
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::vector<TensorSpec>& specs,
                    const Metadata& metadata = {});
  const std::vector<TensorSpec>& order() const { return order_; }
  // The next tensor of order(): its shape must match, its dtype match or both be floating point.
  void write(const torch::Tensor& tensor);
  void commit();
  const std::string& path() const { return file_.path(); }

 private:
  AtomicFile file_;
  std::vector<TensorSpec> order_;
  size_t next_ = 0;
};

// One tensor's entry in a file's header.
struct SafetensorsEntry {
  TensorSpec spec;
  uint64_t offset = 0;  // of its first byte in the file
  uint64_t bytes = 0;
};

class SafetensorsReader {
 public:
  // Reads and checks the header; strata::Error naming the file for anything the format forbids.
  explicit SafetensorsReader(const std::string& path);

  const std::string& path() const { return file_->path(); }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // file order
  const Metadata& metadata() const { return metadata_; }
  const SafetensorsEntry* find(const std::string& name) const;
  // Elements [begin, begin + n) of tensor `name` in C order into `dst` (n elements of its dtype).
  void read(const std::string& name, int64_t begin, int64_t n, void* dst) const;
  torch::Tensor at(const std::string& name) const;  // whole, in its own dtype

 private:
  std::unique_ptr<FileReader> file_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
  Metadata metadata_;
};

struct SafetensorsFile {
  std::string path;
  NamedTensors tensors;  // in the order of their data in the file
  Metadata metadata;

  const torch::Tensor& at(const std::string& name) const;
};

SafetensorsFile load_safetensors(const std::string& path);

}  // namespace strata::checkpoint
