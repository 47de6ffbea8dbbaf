#include "runtime/checkpoint/safetensors.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "runtime/checkpoint/atomic_file.h"
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

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata) {
  struct Item {
    const std::string* name;
    const torch::Tensor* tensor;
    uint64_t bytes;
  };
  std::vector<Item> items;
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    if (name == kMetadataKey) bad(path, "a tensor may not be named \"__metadata__\"");
    if (!names.insert(name).second) bad(path, fmt::format("two tensors are named '{}'", name));
    if (!t.defined() || t.layout() != torch::kStrided)
      bad(path, fmt::format("tensor '{}' is not a defined dense tensor", name));
    if (t.scalar_type() == torch::kComplexDouble)
      bad(path, fmt::format("tensor '{}' is complex128, which safetensors has no dtype for", name));
    dtype_name(t.scalar_type());  // throws outside the supported set
    items.push_back({&name, &t, uint64_t(t.numel()) * t.element_size()});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.tensor->element_size() != b.tensor->element_size())
      return a.tensor->element_size() > b.tensor->element_size();
    return *a.name < *b.name;
  });

  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const auto& it : items) {
    header[*it.name] = {{"dtype", dtype_name(it.tensor->scalar_type())},
                        {"shape", it.tensor->sizes().vec()},
                        {"data_offsets", {offset, offset + it.bytes}}};
    offset += it.bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    bad(path, fmt::format("names or metadata are not valid UTF-8 ({})", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  AtomicFile file(path);
  std::string length;
  for (int i = 0; i < 8; ++i) length.push_back(char((uint64_t(text.size()) >> (8 * i)) & 0xff));
  file.write(length);
  file.write(text);
  for (const auto& it : items) {
    const torch::Tensor t = it.tensor->detach().to(torch::kCPU).contiguous();
    file.write(t.data_ptr(), it.bytes);
  }
  file.commit();
}

SafetensorsFile load_safetensors(const std::string& path) {
  FileReader file(path);
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

  SafetensorsFile out;
  out.path = path;
  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  const uint64_t data_bytes = file.size() - 8 - n;
  for (const auto& [name, value] : header.items()) {
    try {
      if (name == kMetadataKey) {
        for (const auto& [k, v] : value.items()) out.metadata[k] = v.get<std::string>();
        continue;
      }
      const std::string where = fmt::format("safetensors file '{}', tensor '{}'", path, name);
      Entry e{name, dtype_from_name(value.at("dtype").get<std::string>(), where),
              json_ints(value.at("shape"), where + ": shape"), 0, 0};
      const json& range = value.at("data_offsets");
      if (!range.is_array() || range.size() != 2)
        bad(path, fmt::format("tensor '{}': data_offsets {} is not [begin, end]", name,
                              range.dump()));
      const uint64_t offsets[2] = {json_uint(range[0], where + ": data_offsets"),
                                   json_uint(range[1], where + ": data_offsets")};
      if (offsets[0] > offsets[1] || offsets[1] > data_bytes)
        bad(path, fmt::format("tensor '{}': data_offsets {} outside the {} data bytes", name,
                              value.at("data_offsets").dump(), data_bytes));
      e.begin = offsets[0];
      e.end = offsets[1];
      const uint64_t want = tensor_bytes(e.shape, e.dtype, where);
      if (e.end - e.begin != want)
        bad(path, fmt::format("tensor '{}': {} {} needs {} bytes but data_offsets give {}", name,
                              dtype_name(e.dtype), shape_text(e.shape), want, e.end - e.begin));
      entries.push_back(std::move(e));
    } catch (const json::exception& ex) {
      bad(path, fmt::format("malformed header entry '{}' ({})", name, ex.what()));
    }
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  uint64_t expect = 0;
  for (const auto& e : entries) {
    if (e.begin != expect)
      bad(path, fmt::format("tensor '{}' starts at data byte {}, expected {} (a gap or an "
                            "overlap)",
                            e.name, e.begin, expect));
    expect = e.end;
  }
  if (expect != data_bytes)
    bad(path, fmt::format("the tensors cover {} data bytes but the file holds {} (truncated or "
                          "padded)",
                          expect, data_bytes));
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    file.read_at(8 + n + e.begin, t.data_ptr(), size_t(e.end - e.begin));
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace strata::checkpoint
