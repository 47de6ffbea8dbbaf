// A Strata checkpoint of any stage, world size or ep_size as a Hugging Face folder: the weights
// in safetensors shards with their index (hf_folder.h), names and layouts as transformers' classes
// expect, beside the config.json the model came from and the tokenizer files that were with it.
// Streamed: one tensor at a time is read from the checkpoint (consolidate.h's FullWeights), cast
// and written, so a model larger than host memory exports.
//
//   strata-ckpt consolidate ckpt --hf-folder out [--hf-source Llama-3.2-1B] [--dtype bf16]
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/checkpoint/import_weights.h"

namespace strata::checkpoint {

// The key of a checkpoint's client state under which a trainer records the Hugging Face folder
// its model came from (the export's default source).
constexpr const char* kHfSourceKey = "hf_model";

struct HfExportOptions {
  // The Hugging Face folder the model came from: its config.json (required there) and every
  // other file that is not weights (tokenizer, generation config, chat template) are copied.
  // Empty: the checkpoint's client_state[kHfSourceKey], else no file is copied.
  std::string source;
  // The weights' dtype; unset: config.json's torch_dtype (or transformers 5's dtype), else fp32.
  std::optional<torch::ScalarType> dtype;
  int64_t max_shard_bytes = kHfDefaultShardBytes;
  // The import's map read backwards: a fused model tensor is split into the file's tensors by
  // rows, each of `shapes` (FusedWeight::shapes, required here).
  std::vector<FusedWeight> fused;
};

struct HfExportReport {
  size_t tensors = 0, shards = 0;
  uint64_t bytes = 0;
  torch::ScalarType dtype = torch::kFloat;
  std::string source;               // where config.json came from ("" if none was copied)
  std::vector<std::string> copied;  // the source's files copied along
};

HfExportReport export_hf_folder(const FullWeights& weights, const std::string& out,
                                HfExportOptions options = {});

// The dtype a Hugging Face config.json says its weights are in (torch_dtype / dtype), or nullopt.
std::optional<torch::ScalarType> hf_config_dtype(const std::string& config_json);

// Copies the files of Hugging Face folder `source` that are not weights into `out` (config.json
// must be among them); returns their names.
std::vector<std::string> copy_hf_side_files(const std::string& source, const std::string& out);

}  // namespace strata::checkpoint
