#include "runtime/checkpoint/hf_export.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/bounded_json.h"
#include "runtime/error.h"

namespace strata::checkpoint {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Files of a Hugging Face folder that hold weights (any framework's): not copied beside new ones.
bool is_weights_file(const std::string& name) {
  for (const char* tail : {".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json",
                           ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf"})
    if (ends_with(name, tail)) return true;
  return false;
}

std::string source_of(const FullWeights& weights, const HfExportOptions& options) {
  if (!options.source.empty()) return options.source;
  const json& scalars = weights.model_scalars();
  if (scalars.contains("client_state") && scalars.at("client_state").is_object() &&
      scalars.at("client_state").contains(kHfSourceKey) &&
      scalars.at("client_state").at(kHfSourceKey).is_string())
    return scalars.at("client_state").at(kHfSourceKey).get<std::string>();
  return "";
}

}  // namespace

std::optional<torch::ScalarType> hf_config_dtype(const std::string& config_json) {
  json j;
  try {
    j = parse_json_bounded(read_file(config_json), config_json);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: not valid JSON ({})", config_json, e.what()));
  }
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (!j.is_object() || !j.contains(key) || !j.at(key).is_string()) continue;
    const auto name = j.at(key).get<std::string>();
    if (name == "float32") return torch::kFloat;
    if (name == "bfloat16") return torch::kBFloat16;
    if (name == "float16") return torch::kHalf;
    throw Error(fmt::format("{}: {} \"{}\": expected float32, bfloat16 or float16", config_json,
                            key, name));
  }
  return std::nullopt;
}

std::vector<std::string> copy_hf_side_files(const std::string& source, const std::string& out) {
  if (source.empty()) return {};
  struct stat st {};
  if (::stat((source + "/config.json").c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw Error(fmt::format("Hugging Face folder '{}': no config.json to export beside the "
                            "weights", source));
  std::vector<std::string> names;
  DIR* dir = ::opendir(source.c_str());
  if (!dir) throw Error(fmt::format("Hugging Face folder '{}': cannot be listed", source));
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    const std::string path = source + "/" + name;
    if (name.empty() || name[0] == '.' || is_weights_file(name)) continue;
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;  // folders stay
    names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  make_directories(out);
  for (const auto& name : names) write_file_atomic(out + "/" + name, read_file(source + "/" + name));
  return names;
}

HfExportReport export_hf_folder(const FullWeights& weights, const std::string& out,
                                HfExportOptions options) {
  HfExportReport report;
  report.source = source_of(weights, options);
  if (!options.dtype && !report.source.empty())
    options.dtype = hf_config_dtype(report.source + "/config.json");
  report.dtype = options.dtype.value_or(torch::kFloat);

  // The file's tensors: the checkpoint's, named as the module names them, fused ones split.
  std::map<std::string, const FusedWeight*> fused;
  for (const auto& f : options.fused) {
    if (f.shapes.size() != f.sources.size())
      throw Error(fmt::format("export of '{}': the fused weight '{}' needs the shape of each of "
                              "its {} sources", weights.folder(), f.target, f.sources.size()));
    fused[f.target] = &f;
  }
  std::vector<TensorSpec> specs;
  struct Part {
    std::string key;
    int64_t offset = -1;  // of a concatenated source in the model's tensor; -1: the whole
    const FusedWeight* fused = nullptr;  // with split: source k of its split
    size_t k = 0;
  };
  std::map<std::string, Part> part_of;  // file name -> where its values come from
  for (const auto& s : weights.specs()) {
    const auto name = s.name.substr(s.name.find('.') + 1);
    const bool cast = c10::isFloatingType(s.dtype) && weights.casts(s.name);
    const auto dtype = cast ? report.dtype : s.dtype;
    const auto it = fused.find(name);
    if (it == fused.end()) {
      specs.push_back({name, dtype, s.shape});
      part_of[name] = {s.name, -1, nullptr, 0};
      continue;
    }
    int64_t offset = 0, total = 1;
    for (auto d : s.shape) total *= d;
    for (size_t k = 0; k < it->second->sources.size(); ++k) {
      int64_t numel = 1;
      for (auto d : it->second->shapes[k]) numel *= d;
      specs.push_back({it->second->sources[k], dtype, it->second->shapes[k]});
      part_of[it->second->sources[k]] = {s.name, offset, it->second, k};
      offset += numel;
    }
    if (offset != total)
      throw Error(fmt::format("export of '{}': the fused weight '{}' holds {} elements, its "
                              "sources' shapes hold {}", weights.folder(), name, total, offset));
  }
  make_directories(out);
  HfFolderWriter writer(out, specs, options.max_shard_bytes);
  // A split tensor's parts, kept until each has been written (the file's order interleaves the
  // sources of several: experts.0.down_proj, experts.0.gate_proj, experts.0.up_proj, ...).
  struct Split {
    std::vector<torch::Tensor> parts;
    size_t left = 0;
  };
  std::map<std::string, Split> splits;
  for (const auto& spec : writer.order()) {
    const auto& [key, offset, f, k] = part_of.at(spec.name);
    torch::Tensor t;
    if (f && f->split) {
      auto it = splits.find(key);
      if (it == splits.end()) {
        auto parts = f->split(weights.at(key, report.dtype));
        if (parts.size() != f->sources.size())
          throw Error(fmt::format("export of '{}': the fused weight '{}' split into {} tensors, "
                                  "its map names {}", weights.folder(), f->target, parts.size(),
                                  f->sources.size()));
        it = splits.emplace(key, Split{std::move(parts), f->sources.size()}).first;
      }
      t = it->second.parts.at(k).contiguous();
      if (--it->second.left == 0) splits.erase(it);
    } else {
      t = weights.at(key, report.dtype);
    }
    if (offset >= 0 && !(f && f->split)) {
      int64_t numel = 1;
      for (auto d : spec.shape) numel *= d;
      t = t.reshape({-1}).narrow(0, offset, numel).view(spec.shape);
    }
    writer.write(t);
    report.bytes += tensor_bytes(spec.shape, spec.dtype, out);
  }
  writer.commit();
  report.tensors = specs.size();
  report.shards = writer.shard_count();
  report.copied = copy_hf_side_files(report.source, out);
  return report;
}

}  // namespace strata::checkpoint
