// The safetensors format (https://github.com/huggingface/safetensors), so a consolidated
// checkpoint can leave Strata for any tool that reads it:
//
//   u64 little-endian N | N bytes of JSON header, padded with spaces so that 8 + N is a multiple
//   of 8 | the tensors' raw little-endian bytes, back to back.
//
// The header maps each tensor name to {"dtype": "F32"|"BF16"|"F16"|"F64"|"I64"|"I32"|"I16"|
// "I8"|"U8"|"BOOL"|"C64", "shape": [...], "data_offsets": [begin, end]} (offsets into the data
// section), plus an optional "__metadata__" object of string values. The writer orders the data
// by element size, largest first, then by name (as the reference implementation does), so every
// tensor is aligned to its element size. The reader checks what the reference reader checks:
// known dtypes, sizes that agree with shapes, and offsets that cover the data exactly.
#pragma once

#include <map>
#include <string>

#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

using Metadata = std::map<std::string, std::string>;

// Writes atomically. Names must be unique and not "__metadata__"; tensors may live on any
// device and be non-contiguous (each is copied to contiguous CPU memory as it is written).
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata = {});

struct SafetensorsFile {
  std::string path;
  NamedTensors tensors;  // in the order of their data in the file
  Metadata metadata;

  const torch::Tensor& at(const std::string& name) const;
};

SafetensorsFile load_safetensors(const std::string& path);

}  // namespace strata::checkpoint
