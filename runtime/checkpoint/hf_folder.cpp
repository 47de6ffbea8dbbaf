#include "runtime/checkpoint/hf_folder.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <set>

#include <fmt/format.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/bounded_json.h"
#include "runtime/checkpoint/tensor_stream.h"
#include "runtime/error.h"

namespace strata::checkpoint {
namespace {

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A shard named by the index: a plain file name inside the folder (no path, no "..").
void check_shard_name(const std::string& name, const std::string& index) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos)
    throw Error(fmt::format("{}: weight_map names the file '{}', which is not a file name inside "
                            "the folder", index, name));
}

}  // namespace

bool HfWeights::convertible(torch::ScalarType from, torch::ScalarType to) {
  return from == to || (c10::isFloatingType(from) && c10::isFloatingType(to));
}

HfWeights::HfWeights(const std::string& path) : path_(path) {
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;  // from the index, when there is one
  std::string index;
  if (!is_dir(path)) {
    if (!exists(path))
      throw Error(fmt::format("Hugging Face weights '{}': no such folder or file", path));
    files.push_back(path);
  } else if (exists(path + "/" + kHfIndexFile)) {
    index = path + "/" + kHfIndexFile;
    json j;
    try {
      j = parse_json_bounded(read_file(index), index);
    } catch (const json::exception& e) {
      throw Error(fmt::format("{}: not valid JSON ({})", index, e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
      throw Error(fmt::format("{}: expected an object with a \"weight_map\" object of tensor name "
                              "-> shard file", index));
    std::set<std::string> shard_names;
    for (const auto& [name, file] : j.at("weight_map").items()) {
      if (!file.is_string())
        throw Error(fmt::format("{}: weight_map[\"{}\"] is {}, not a file name", index, name,
                                file.dump()));
      const auto f = file.get<std::string>();
      check_shard_name(f, index);
      weight_map.emplace(name, f);
      if (shard_names.insert(f).second) {
        if (!exists(path + "/" + f))
          throw Error(fmt::format("{}: weight_map names the shard '{}' (for '{}'), which is not "
                                  "in {}", index, f, name, path));
        files.push_back(path + "/" + f);
      }
    }
    if (weight_map.empty()) throw Error(fmt::format("{}: weight_map lists no tensor", index));
  } else if (exists(path + "/" + kHfWeightsFile)) {
    files.push_back(path + "/" + kHfWeightsFile);
  } else {
    throw Error(fmt::format("Hugging Face weights '{}': the folder holds neither {} nor {} (only "
                            "safetensors weights are read; convert pytorch_model.bin with "
                            "transformers' save_pretrained(safe_serialization=True))",
                            path, kHfIndexFile, kHfWeightsFile));
  }
  for (const auto& f : files) shards_.push_back(std::make_unique<SafetensorsReader>(f));
  for (size_t s = 0; s < shards_.size(); ++s) {
    const auto& shard = *shards_[s];
    const auto file_name = shard.path().substr(shard.path().rfind('/') + 1);
    for (const auto& e : shard.entries()) {
      const auto& name = e.spec.name;
      if (!index.empty()) {
        const auto it = weight_map.find(name);
        if (it == weight_map.end())
          throw Error(fmt::format("{}: shard '{}' holds '{}', which the index does not list",
                                  index, file_name, name));
        if (it->second != file_name) continue;  // listed in another shard: that copy is read
      }
      if (!tensors_.emplace(name, Located{s, &e}).second)
        throw Error(fmt::format("Hugging Face weights '{}': '{}' is stored twice", path, name));
      total_bytes_ += e.bytes;
    }
  }
  for (const auto& [name, file] : weight_map)
    if (!tensors_.count(name))
      throw Error(fmt::format("{}: weight_map puts '{}' in '{}', whose header has no such tensor",
                              index, name, file));
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, located] : tensors_) out.push_back(name);
  return out;
}

const TensorSpec* HfWeights::find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second.entry->spec;
}

const HfWeights::Located& HfWeights::locate(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end())
    throw Error(fmt::format("Hugging Face weights '{}': no tensor '{}'", path_, name));
  return it->second;
}

void HfWeights::read(const std::string& name, int64_t begin, int64_t n, torch::ScalarType dtype,
                     void* dst) const {
  const auto& at = locate(name);
  const auto from = at.entry->spec.dtype;
  const auto& shard = *shards_[at.shard];
  if (from == dtype) {
    shard.read(name, begin, n, dst);
    return;
  }
  if (!convertible(from, dtype))
    throw Error(fmt::format("{}: tensor '{}' is {}, which cannot be read as {}", shard.path(),
                            name, dtype_name(from), dtype_name(dtype)));
  const int64_t tile = std::max<int64_t>(1, kStreamTileBytes / int64_t(c10::elementSize(from)));
  auto buffer = torch::empty({std::min(tile, n)}, torch::TensorOptions().dtype(from));
  auto out = torch::from_blob(dst, {n}, torch::TensorOptions().dtype(dtype));
  for (int64_t done = 0; done < n; done += tile) {
    const int64_t m = std::min(tile, n - done);
    shard.read(name, begin + done, m, buffer.data_ptr());
    out.narrow(0, done, m).copy_(buffer.narrow(0, 0, m));
  }
}

std::vector<std::vector<TensorSpec>> hf_shard_plan(const std::vector<TensorSpec>& specs,
                                                   int64_t max_shard_bytes) {
  if (max_shard_bytes <= 0)
    throw Error(fmt::format("a shard size of {} bytes; give a positive size", max_shard_bytes));
  std::vector<std::vector<TensorSpec>> plan;
  int64_t in_shard = 0;
  for (const auto& s : specs) {
    const auto bytes = int64_t(tensor_bytes(s.shape, s.dtype, s.name));
    if (plan.empty() || (in_shard > 0 && in_shard + bytes > max_shard_bytes)) {
      plan.emplace_back();
      in_shard = 0;
    }
    plan.back().push_back(s);
    in_shard += bytes;
  }
  for (auto& shard : plan) shard = safetensors_order(std::move(shard));
  return plan;
}

HfFolderWriter::HfFolderWriter(const std::string& dir, const std::vector<TensorSpec>& specs,
                               int64_t max_shard_bytes)
    : dir_(dir), plan_(hf_shard_plan(specs, max_shard_bytes)) {
  if (plan_.empty()) throw Error(fmt::format("{}: no tensor to write", dir));
  for (const auto& shard : plan_)
    for (const auto& s : shard) total_bytes_ += tensor_bytes(s.shape, s.dtype, dir);
  for (size_t k = 0; k < plan_.size(); ++k)
    file_names_.push_back(plan_.size() == 1 ? std::string(kHfWeightsFile)
                                            : fmt::format("model-{:05}-of-{:05}.safetensors",
                                                          k + 1, plan_.size()));
  make_directories(dir);
  for (const auto& shard : plan_) order_.insert(order_.end(), shard.begin(), shard.end());
  open_next();
}

void HfFolderWriter::open_next() {
  current_ = std::make_unique<SafetensorsWriter>(dir_ + "/" + file_names_[shard_], plan_[shard_],
                                                 Metadata{{"format", "pt"}});
  written_in_shard_ = 0;
}

void HfFolderWriter::write(const torch::Tensor& tensor) {
  if (!current_) throw Error(fmt::format("{}: a tensor written after the last shard", dir_));
  current_->write(tensor);
  if (++written_in_shard_ < plan_[shard_].size()) return;
  current_->commit();
  current_.reset();
  if (++shard_ < plan_.size()) open_next();
}

void HfFolderWriter::commit() {
  if (current_ || shard_ != plan_.size())
    throw Error(fmt::format("{}: committed before every tensor was written", dir_));
  const std::string index = dir_ + "/" + kHfIndexFile;
  if (plan_.size() == 1) {
    // One file: no index, as save_pretrained writes it (a stale one would name other shards).
    if (exists(index)) ::unlink(index.c_str());
    return;
  }
  json weight_map = json::object();
  for (size_t k = 0; k < plan_.size(); ++k)
    for (const auto& s : plan_[k]) weight_map[s.name] = file_names_[k];
  const json j = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", weight_map}};
  write_file_atomic(index, j.dump(2) + "\n");
}

void write_hf_folder(const std::string& dir, const std::vector<TensorSpec>& specs,
                     const std::function<torch::Tensor(const std::string&)>& value_of,
                     int64_t max_shard_bytes) {
  HfFolderWriter writer(dir, specs, max_shard_bytes);
  for (const auto& spec : writer.order()) writer.write(value_of(spec.name));
  writer.commit();
}

int64_t parse_shard_size(const std::string& text, const std::string& what) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  static const std::map<std::string, int64_t> units = {
      {"", 1},          {"B", 1},           {"KB", 1000},          {"MB", 1000'000},
      {"GB", 1000'000'000}, {"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", int64_t(1) << 30}};
  const auto it = units.find(unit);
  if (digits == 0 || digits > 12 || it == units.end())
    throw Error(fmt::format("{} {}: expected a size such as 5GB, 500MB, 2GiB or a byte count",
                            what, text));
  const int64_t value = std::stoll(text.substr(0, digits)) * it->second;
  if (value <= 0) throw Error(fmt::format("{} {}: the size must be positive", what, text));
  return value;
}

}  // namespace strata::checkpoint
