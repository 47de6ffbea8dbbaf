// A Hugging Face model folder's weights: `model.safetensors`, or shards listed by
// `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {name: shard file}}), as
// transformers' save_pretrained writes them and from_pretrained reads them.
//
//   HfWeights weights("Llama-3.2-1B");                  // every header read and checked
//   weights.read("model.norm.weight", 0, n, torch::kFloat, dst);   // a range, converted
//
// Reading is by range: a rank reads only the bytes of its own shard of each tensor, converted to
// the dtype it keeps on the way (tile by tile), so no process ever holds the file. Opening checks
// everything a load could trip on later, so that nothing is half-installed: the index (JSON, file
// names inside the folder, every listed shard present), each shard's header (safetensors.h: a
// truncated shard is refused here), every listed name in its shard and every shard tensor listed.
//
// Writing (HfFolderWriter): shards of at most `max_shard_bytes` (a tensor larger than that gets a
// shard of its own, as transformers does), named model-0000k-of-0000n.safetensors with the index,
// or one model.safetensors when one shard holds everything; each tensor streamed a tile at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/checkpoint/safetensors.h"

namespace strata::checkpoint {

constexpr const char* kHfWeightsFile = "model.safetensors";
constexpr const char* kHfIndexFile = "model.safetensors.index.json";
constexpr int64_t kHfDefaultShardBytes = 5'000'000'000;  // transformers' max_shard_size "5GB"

class HfWeights {
 public:
  // `path`: a folder holding model.safetensors.index.json or model.safetensors, or one
  // .safetensors file. strata::Error naming the file and what is wrong.
  explicit HfWeights(const std::string& path);

  const std::string& path() const { return path_; }
  // Every tensor, in name order.
  std::vector<std::string> names() const;
  const TensorSpec* find(const std::string& name) const;
  uint64_t total_bytes() const { return total_bytes_; }
  size_t shard_count() const { return shards_.size(); }

  // Elements [begin, begin + n) of `name` in C order into `dst`, as n elements of `dtype`: the
  // stored dtype converted (floating point to floating point, else the same dtype: callers check
  // convertible() first), kStreamTileBytes of source at a time.
  void read(const std::string& name, int64_t begin, int64_t n, torch::ScalarType dtype,
            void* dst) const;
  // Whether a tensor stored as `from` can be read as `to`.
  static bool convertible(torch::ScalarType from, torch::ScalarType to);

 private:
  struct Located {
    size_t shard;
    const SafetensorsEntry* entry;
  };
  const Located& locate(const std::string& name) const;

  std::string path_;
  std::vector<std::unique_ptr<SafetensorsReader>> shards_;
  std::map<std::string, Located> tensors_;
  uint64_t total_bytes_ = 0;
};

// The shards a folder of `specs` (the model's order) is cut into, each in its data order: the
// tensors' order of writing, which every rank of a collective save (stage 3) walks alike.
std::vector<std::vector<TensorSpec>> hf_shard_plan(const std::vector<TensorSpec>& specs,
                                                   int64_t max_shard_bytes);

class HfFolderWriter {
 public:
  // `specs` in the model's order: shards are filled in that order.
  HfFolderWriter(const std::string& dir, const std::vector<TensorSpec>& specs,
                 int64_t max_shard_bytes = kHfDefaultShardBytes);
  // The order write() takes the tensors in (each shard's data order, shard after shard).
  const std::vector<TensorSpec>& order() const { return order_; }
  // The folder's files, in order.
  const std::vector<std::string>& file_names() const { return file_names_; }
  // The next tensor of order() (safetensors.h's SafetensorsWriter::write: floating point cast).
  void write(const torch::Tensor& tensor);
  // The last shard and the index; the files are in place once this returns.
  void commit();
  size_t shard_count() const { return plan_.size(); }

 private:
  void open_next();

  std::string dir_;
  std::vector<std::vector<TensorSpec>> plan_;  // per shard
  std::vector<std::string> file_names_;
  std::vector<TensorSpec> order_;
  std::unique_ptr<SafetensorsWriter> current_;
  size_t shard_ = 0, written_in_shard_ = 0;
  uint64_t total_bytes_ = 0;
};

// Writes `specs` with their values (value_of(name) is called once per tensor, in the writer's
// order) into a Hugging Face folder.
void write_hf_folder(const std::string& dir, const std::vector<TensorSpec>& specs,
                     const std::function<torch::Tensor(const std::string&)>& value_of,
                     int64_t max_shard_bytes = kHfDefaultShardBytes);

// Parses "5GB", "500MB", "2GiB", "1000" (bytes) as transformers' max_shard_size does (KB/MB/GB
// decimal, KiB/MiB/GiB binary); strata::Error naming `what` otherwise.
int64_t parse_shard_size(const std::string& text, const std::string& what);

}  // namespace strata::checkpoint
