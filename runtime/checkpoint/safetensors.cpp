#include "runtime/checkpoint/safetensors.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "runtime/checkpoint/tensor_stream.h"
#include "runtime/error.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian data; this host is big-endian");

namespace strata::checkpoint {
namespace {

constexpr const char* kMetadataKey = "__metadata__";
constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference reader's limit

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw Error(fmt::format("safetensors file '{}': {}", path, what));
}

}  // namespace

const torch::Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  bad(path, fmt::format("no tensor '{}'", name));
}

std::vector<TensorSpec> safetensors_order(std::vector<TensorSpec> specs) {
  std::stable_sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    const auto ea = c10::elementSize(a.dtype), eb = c10::elementSize(b.dtype);
    return ea != eb ? ea > eb : a.name < b.name;
  });
  return specs;
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<TensorSpec>& specs,
                                     const Metadata& metadata)
    : file_(path) {
  std::set<std::string> names;
  for (const auto& s : specs) {
    if (s.name == kMetadataKey) bad(path, "a tensor may not be named \"__metadata__\"");
    if (!names.insert(s.name).second) bad(path, fmt::format("two tensors are named '{}'", s.name));
    if (s.dtype == torch::kComplexDouble)
      bad(path, fmt::format("tensor '{}' is complex128, which safetensors has no dtype for", s.name));
    dtype_name(s.dtype);  // throws outside the supported set
  }
  order_ = safetensors_order(specs);
  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const auto& s : order_) {
    const uint64_t bytes = tensor_bytes(s.shape, s.dtype, path);
    header[s.name] = {{"dtype", dtype_name(s.dtype)},
                      {"shape", s.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    bad(path, fmt::format("names or metadata are not valid UTF-8 ({})", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string length;
  for (int i = 0; i < 8; ++i) length.push_back(char((uint64_t(text.size()) >> (8 * i)) & 0xff));
  file_.write(length);
  file_.write(text);
}

void SafetensorsWriter::write(const torch::Tensor& tensor) {
  if (next_ >= order_.size())
    bad(path(), fmt::format("a tensor written past the {} the header lists", order_.size()));
  const auto& spec = order_[next_];
  if (!tensor.defined() || tensor.layout() != torch::kStrided || tensor.sizes().vec() != spec.shape ||
      (tensor.scalar_type() != spec.dtype &&
       !(tensor.is_floating_point() && c10::isFloatingType(spec.dtype))))
    bad(path(), fmt::format("tensor '{}' is {} {}, its header entry {} {}", spec.name,
                            tensor.defined() ? c10::toString(tensor.scalar_type()) : "undefined",
                            tensor.defined() ? c10::str(tensor.sizes()) : "", dtype_name(spec.dtype),
                            shape_text(spec.shape)));
  const auto flat = tensor.detach().reshape({-1});
  const int64_t tile = std::max<int64_t>(1, kStreamTileBytes / std::max<int64_t>(1, flat.element_size()));
  for (int64_t begin = 0; begin < flat.numel(); begin += tile) {
    const auto piece = flat.narrow(0, begin, std::min(tile, flat.numel() - begin))
                           .to(torch::kCPU, spec.dtype)
                           .contiguous();
    file_.write(piece.data_ptr(), size_t(piece.numel()) * piece.element_size());
  }
  ++next_;
}

void SafetensorsWriter::commit() {
  if (next_ != order_.size())
    bad(path(), fmt::format("{} of the {} tensors its header lists were written", next_,
                            order_.size()));
  file_.commit();
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata) {
  std::vector<TensorSpec> specs;
  std::map<std::string, const torch::Tensor*> by_name;
  for (const auto& [name, t] : tensors) {
    if (!t.defined() || t.layout() != torch::kStrided)
      bad(path, fmt::format("tensor '{}' is not a defined dense tensor", name));
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
    by_name.emplace(name, &t);
  }
  SafetensorsWriter writer(path, specs, metadata);
  for (const auto& spec : writer.order()) writer.write(*by_name.at(spec.name));
  writer.commit();
}

SafetensorsReader::SafetensorsReader(const std::string& path)
    : file_(std::make_unique<FileReader>(path)) {
  const auto& file = *file_;
  if (file.size() < 8) bad(path, fmt::format("{} bytes: too short for the header length", file.size()));
  unsigned char prefix[8];
  file.read_at(0, prefix, 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(prefix[i]) << (8 * i);
  if (n > kMaxHeaderBytes || n > file.size() - 8)
    bad(path, fmt::format("header length {} does not fit in its {} bytes", n, file.size()));
  std::string text(size_t(n), '\0');
  file.read_at(8, text.data(), text.size());
  json header;
  try {
    header = parse_json_bounded(text, fmt::format("safetensors file '{}': its header", path));
  } catch (const json::exception& e) {
    bad(path, fmt::format("header JSON does not parse ({})", e.what()));
  }
  if (!header.is_object()) bad(path, "header is not a JSON object");

  const uint64_t data_bytes = file.size() - 8 - n;
  for (const auto& [name, value] : header.items()) {
    try {
      if (name == kMetadataKey) {
        for (const auto& [k, v] : value.items()) metadata_[k] = v.get<std::string>();
        continue;
      }
      const std::string where = fmt::format("safetensors file '{}', tensor '{}'", path, name);
      SafetensorsEntry e{{name, dtype_from_name(value.at("dtype").get<std::string>(), where),
                          json_ints(value.at("shape"), where + ": shape")},
                         0, 0};
      const json& range = value.at("data_offsets");
      if (!range.is_array() || range.size() != 2)
        bad(path, fmt::format("tensor '{}': data_offsets {} is not [begin, end]", name,
                              range.dump()));
      const uint64_t offsets[2] = {json_uint(range[0], where + ": data_offsets"),
                                   json_uint(range[1], where + ": data_offsets")};
      if (offsets[0] > offsets[1] || offsets[1] > data_bytes)
        bad(path, fmt::format("tensor '{}': data_offsets {} outside the {} data bytes (the file "
                              "is truncated, or its header is wrong)",
                              name, range.dump(), data_bytes));
      e.offset = offsets[0];
      e.bytes = offsets[1] - offsets[0];
      const uint64_t want = tensor_bytes(e.spec.shape, e.spec.dtype, where);
      if (e.bytes != want)
        bad(path, fmt::format("tensor '{}': {} {} needs {} bytes but data_offsets give {}", name,
                              dtype_name(e.spec.dtype), shape_text(e.spec.shape), want, e.bytes));
      entries_.push_back(std::move(e));
    } catch (const json::exception& ex) {
      bad(path, fmt::format("malformed header entry '{}' ({})", name, ex.what()));
    }
  }
  std::sort(entries_.begin(), entries_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.offset < b.offset; });
  uint64_t expect = 0;
  for (auto& e : entries_) {
    if (e.offset != expect)
      bad(path, fmt::format("tensor '{}' starts at data byte {}, expected {} (a gap or an "
                            "overlap)",
                            e.spec.name, e.offset, expect));
    expect = e.offset + e.bytes;
    e.offset += 8 + n;
  }
  if (expect != data_bytes)
    bad(path, fmt::format("the tensors cover {} data bytes but the file holds {} (truncated or "
                          "padded)",
                          expect, data_bytes));
  for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].spec.name, i);
}

const SafetensorsEntry* SafetensorsReader::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void SafetensorsReader::read(const std::string& name, int64_t begin, int64_t n, void* dst) const {
  const auto* e = find(name);
  if (!e) bad(path(), fmt::format("no tensor '{}'", name));
  const int64_t numel = int64_t(e->bytes / std::max<size_t>(1, c10::elementSize(e->spec.dtype)));
  if (begin < 0 || n < 0 || begin > numel || n > numel - begin)
    bad(path(), fmt::format("tensor '{}': elements [{}, {}) outside its {}", name, begin,
                            begin + n, numel));
  const auto size = c10::elementSize(e->spec.dtype);
  file_->read_at(e->offset + uint64_t(begin) * size, dst, size_t(n) * size);
}

torch::Tensor SafetensorsReader::at(const std::string& name) const {
  const auto* e = find(name);
  if (!e) bad(path(), fmt::format("no tensor '{}'", name));
  auto t = torch::empty(e->spec.shape, torch::TensorOptions().dtype(e->spec.dtype));
  file_->read_at(e->offset, t.data_ptr(), size_t(e->bytes));
  return t;
}

SafetensorsFile load_safetensors(const std::string& path) {
  const SafetensorsReader reader(path);
  SafetensorsFile out;
  out.path = path;
  out.metadata = reader.metadata();
  for (const auto& e : reader.entries()) out.tensors.emplace_back(e.spec.name, reader.at(e.spec.name));
  return out;
}

}  // namespace strata::checkpoint
