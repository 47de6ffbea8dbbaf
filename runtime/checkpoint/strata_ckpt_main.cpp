// strata-ckpt: a Strata checkpoint as one file of full weights, or as a Hugging Face folder.
//   strata-ckpt consolidate DIR [--tag TAG] [--dtype fp32|bf16|fp16] [--out FILE]
//                               [--safetensors FILE] [--hf-folder OUT [--hf-source HF_DIR]
//                               [--max-shard-size 5GB]]
//   strata-ckpt compare DIR_A DIR_B [--tag-a TAG] [--tag-b TAG]
// --out writes LibTorch's module archive (torch::load(model, FILE) in plain LibTorch);
// --safetensors writes the safetensors format; --hf-folder a Hugging Face folder (sharded
// safetensors with their index, the config.json and tokenizer files of --hf-source or of the
// folder the trainer recorded; dtype: --dtype, else config.json's), streamed per tensor. compare prints, as one JSON object, how far apart
// the two checkpoints' full weights are (per tensor max |a - b| and max |b|; "worst" the tensor
// furthest apart), and refuses checkpoints of different models. Exit 0 done, 1 error, 2 bad
// command line.
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "runtime/checkpoint/compare.h"
#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/hf_export.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/error.h"
#include "strata/version.h"

namespace {

const char* kUsage =
    "usage: strata-ckpt consolidate DIR [--tag TAG] [--dtype fp32|bf16|fp16] [--out FILE]\n"
    "                               [--safetensors FILE] [--hf-folder OUT [--hf-source HF_DIR]\n"
    "                               [--max-shard-size 5GB]]\n"
    "       strata-ckpt compare DIR_A DIR_B [--tag-a TAG] [--tag-b TAG]\n"
    "       strata-ckpt --version\n";

struct Usage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int compare(const std::vector<std::string>& args) {
  if (args.size() < 3) throw Usage("compare: expected DIR_A DIR_B");
  std::string tag_a = "latest", tag_b = "latest";
  for (size_t i = 3; i < args.size(); i += 2) {
    if (i + 1 >= args.size()) throw Usage(args[i] + ": missing value");
    if (args[i] == "--tag-a") tag_a = args[i + 1];
    else if (args[i] == "--tag-b") tag_b = args[i + 1];
    else throw Usage("unknown option " + args[i]);
  }
  const auto distance = strata::checkpoint::compare_checkpoints(args[1], tag_a, args[2], tag_b);
  std::puts(distance.to_json().dump().c_str());
  return 0;
}

int run(const std::vector<std::string>& args) {
  if (args.size() == 1 && args[0] == "--version") {
    std::puts(strata::version_line());
    return 0;
  }
  if (!args.empty() && args[0] == "compare") return compare(args);
  if (args.size() < 2 || args[0] != "consolidate")
    throw Usage("expected: consolidate DIR or compare DIR_A DIR_B");
  const std::string dir = args[1];
  std::string tag = "latest", dtype_name, out, safetensors, hf_folder, hf_source, shard_size;
  for (size_t i = 2; i < args.size(); i += 2) {
    if (i + 1 >= args.size()) throw Usage(args[i] + ": missing value");
    const auto& flag = args[i];
    const auto& value = args[i + 1];
    if (flag == "--tag") tag = value;
    else if (flag == "--dtype") dtype_name = value;
    else if (flag == "--out") out = value;
    else if (flag == "--safetensors") safetensors = value;
    else if (flag == "--hf-folder") hf_folder = value;
    else if (flag == "--hf-source") hf_source = value;
    else if (flag == "--max-shard-size") shard_size = value;
    else throw Usage("unknown option " + flag);
  }
  if (out.empty() && safetensors.empty() && hf_folder.empty())
    throw Usage("give --out FILE, --safetensors FILE, --hf-folder OUT or several");
  if (hf_folder.empty() && (!hf_source.empty() || !shard_size.empty()))
    throw Usage("--hf-source and --max-shard-size go with --hf-folder OUT");
  const bool dtype_given = !dtype_name.empty();
  if (!dtype_given) dtype_name = "fp32";
  torch::ScalarType dtype;
  if (dtype_name == "fp32") dtype = torch::kFloat;
  else if (dtype_name == "bf16") dtype = torch::kBFloat16;
  else if (dtype_name == "fp16") dtype = torch::kHalf;
  else throw Usage("--dtype " + dtype_name + ": expected fp32, bf16 or fp16");

  if (!hf_folder.empty()) {
    const strata::checkpoint::FullWeights weights(dir, tag);
    strata::checkpoint::HfExportOptions options;
    options.source = hf_source;
    if (dtype_given) options.dtype = dtype;
    if (!shard_size.empty())
      options.max_shard_bytes = strata::checkpoint::parse_shard_size(shard_size, "--max-shard-size");
    const auto r = strata::checkpoint::export_hf_folder(weights, hf_folder, options);
    std::printf("strata-ckpt: %zu tensors (%s, %.1f MB) in %zu shard(s) to %s%s\n", r.tensors,
                c10::toString(r.dtype), r.bytes / 1e6, r.shards, hf_folder.c_str(),
                r.source.empty() ? " (no --hf-source: weights only, no config.json)"
                                 : fmt::format(", with {} file(s) of {}", r.copied.size(),
                                               r.source).c_str());
    if (out.empty() && safetensors.empty()) return 0;
  }
  const auto tensors = strata::checkpoint::consolidate(dir, tag, dtype);
  strata::checkpoint::NamedTensors params, buffers, flat;
  for (const auto& [key, t] : tensors) {
    const bool param = key.rfind("param.", 0) == 0;
    const auto name = key.substr(key.find('.') + 1);
    (param ? params : buffers).emplace_back(name, t);
    flat.emplace_back(name, t);
  }
  if (!out.empty()) {
    // torch::load reads every child module; a checkpoint saved before the list was kept names
    // only those with tensors.
    const auto submodules = strata::checkpoint::saved_submodules(dir, tag);
    if (!submodules)
      std::fprintf(stderr, "strata-ckpt: note: %s/%s does not list its submodules (saved by an "
                   "earlier Strata): %s holds the modules with parameters or buffers only, and "
                   "torch::load refuses a model with parameter-free children (a ReLU in a "
                   "Sequential); re-save the checkpoint with this Strata, or load the "
                   "--safetensors file\n",
                   dir.c_str(), tag.c_str(), out.c_str());
    strata::checkpoint::save_module_archive(out, params, buffers, submodules.value_or(
                                                                      std::vector<std::string>{}));
  }
  if (!safetensors.empty())
    strata::checkpoint::save_safetensors(safetensors, flat, {{"format", "pt"}});
  std::printf("strata-ckpt: %zu parameters, %zu buffers (%s) from %s/%s\n", params.size(),
              buffers.size(), dtype_name.c_str(), dir.c_str(), tag.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const Usage& e) {
    std::fprintf(stderr, "strata-ckpt: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-ckpt: error: %s\n", e.what());
    return 1;
  }
}
