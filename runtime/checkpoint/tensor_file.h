// One checkpoint file: a named list of tensors plus a JSON object of scalars, checksummed.
//
// Layout (all integers little-endian):
//
//   [payload]  version 2 (what checkpoints write, tensor_stream.h): each tensor's raw bytes
//              (C order, little-endian) at the offset its footer entry records;
//              version 1 (save_tensor_file, and every checkpoint before version 2): LibTorch's
//              own archive (torch::serialize::OutputArchive, a zip) holding the tensors under
//              keys "t0", "t1", ... in list order (names live in the footer, so any string is
//              a valid name);
//   [meta]     UTF-8 JSON: {"format": "strata-tensors", "version": 1 or 2, "payload_bytes": P,
//              "tensors": [{"name", "dtype", "shape"}...], "scalars": {...}}; version 2's
//              tensor entries add "offset" (bytes into the payload) and "crc32c" (of the
//              tensor's bytes);
//   [tail]     u64 meta length | u32 CRC32C of every byte before this field | u32 0 |
//              8-byte magic "STRATA\x01T".
//
// The tail comes last so that the file streams into an AtomicFile with no second copy in
// memory; a truncated file has no magic at its end, and any flipped byte fails the CRC. Loading
// checks the CRC first (one streaming pass), then reads the payload through pread, then (when
// given) the expected names, shapes and dtypes, before any tensor is built. Version 2 exists so
// that a tensor can be written and read in pieces (a partition streamed from NVMe swap files);
// a whole tensor read from it is checked against its own CRC too. Tensors are saved from, and
// loaded to, the CPU; a tensor that is a view into a larger storage (a shard of a flat buffer)
// is saved as its own bytes, never its whole storage.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/checkpoint/bounded_json.h"

namespace strata::checkpoint {

using json = nlohmann::json;
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Dtype names, shared by the manifest and safetensors: "BOOL", "U8", "I8", "I16", "I32", "I64",
// "F16", "BF16", "F32", "F64", "C64", "C128".
std::string dtype_name(torch::ScalarType dtype);
// Throws strata::Error naming `where` for a name outside the list.
torch::ScalarType dtype_from_name(const std::string& name, const std::string& where);

struct TensorSpec {
  std::string name;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<int64_t> shape;

  bool operator==(const TensorSpec& o) const {
    return name == o.name && dtype == o.dtype && shape == o.shape;
  }
};
std::vector<TensorSpec> specs_of(const NamedTensors& tensors);
json spec_to_json(const TensorSpec& spec);
TensorSpec spec_from_json(const json& j, const std::string& where);
std::string shape_text(const std::vector<int64_t>& shape);  // "[4, 8]"
// The bytes of a tensor of `shape` and `dtype`; strata::Error naming `where` for a negative
// dimension or a size past 2^62 (a hostile header's dimensions that overflow when multiplied).
uint64_t tensor_bytes(const std::vector<int64_t>& shape, torch::ScalarType dtype,
                      const std::string& where);

// Integers from a file's JSON, checked: strata::Error naming `where` for a float, a string, or
// a value outside the type (nlohmann's get<> would cast it, out of range: undefined behaviour).
int64_t json_int(const json& value, const std::string& where);
uint64_t json_uint(const json& value, const std::string& where);
std::vector<int64_t> json_ints(const json& value, const std::string& where);

// Checks `actual` (what `path` holds) against `expected`: the same names, and for each the same
// shape and dtype. Throws strata::Error naming the file and the first tensor that differs.
void check_specs(const std::string& path, const std::vector<TensorSpec>& actual,
                 const std::vector<TensorSpec>& expected);

// Where a version-2 tensor's bytes lie in the payload, and their CRC32C.
struct StoredBytes {
  uint64_t offset = 0, bytes = 0;
  uint32_t crc32c = 0;
};

// What a file's footer says, read without touching the payload.
struct TensorFileInfo {
  std::string path;
  uint64_t bytes = 0;    // file size
  uint32_t crc32c = 0;   // the checksum in its tail
  int version = 0;       // 1: LibTorch archive payload; 2: raw bytes at offsets
  std::vector<TensorSpec> tensors;
  std::vector<StoredBytes> stored;  // version 2: tensors[i]'s bytes; empty for version 1
  json scalars = json::object();
};

struct TensorFile {
  std::string path;
  uint32_t crc32c = 0;  // the checksum in its tail, verified
  NamedTensors tensors;
  json scalars = json::object();

  // The tensor called `name`; strata::Error naming the file and the tensor when it is absent.
  const torch::Tensor& at(const std::string& name) const;
  // Copies each tensor into the target of the same name (under NoGradGuard), after checking
  // that names, shapes and dtypes match exactly (check_specs).
  void copy_to(const NamedTensors& targets) const;
};

// Writes `path` atomically (AtomicFile) and returns what its footer says.
TensorFileInfo save_tensor_file(const std::string& path, const NamedTensors& tensors,
                                const json& scalars = json::object());

// Verifies the checksum, then loads. With `expected`, the file must hold exactly those tensors
// (check_specs) before anything is deserialised.
TensorFile load_tensor_file(const std::string& path);
TensorFile load_tensor_file(const std::string& path, const std::vector<TensorSpec>& expected);

// The footer alone (cheap: the tail and the meta JSON). Checks the structure, not the checksum.
TensorFileInfo read_tensor_file_info(const std::string& path);
// The footer, after checking the whole file's checksum.
TensorFileInfo verify_tensor_file(const std::string& path);

class AtomicFile;
class FileReader;
// For the writers of both versions: `meta` as the footer and the tail, after the payload.
// Returns the checksum in the tail. Throws strata::Error naming the file for names or scalars
// that are not UTF-8.
uint32_t seal_tensor_file(AtomicFile& file, const json& meta);
// For the readers: the footer of an open file, checking the whole file's CRC when `verify`.
TensorFileInfo read_footer(const FileReader& file, bool verify);

}  // namespace strata::checkpoint
