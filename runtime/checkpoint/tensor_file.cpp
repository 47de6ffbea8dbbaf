#include "runtime/checkpoint/tensor_file.h"

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/tensor_stream.h"
#include "runtime/error.h"
#include "runtime/util/crc32c.h"

namespace strata::checkpoint {
namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', '\x01', 'T'};
constexpr size_t kTailBytes = 24;  // u64 meta length | u32 crc | u32 0 | magic
constexpr uint64_t kMaxMetaBytes = uint64_t(1) << 30;
constexpr const char* kFormat = "strata-tensors";
constexpr int kArchiveVersion = 1;  // LibTorch's zip archive as the payload
constexpr int kRawVersion = 2;      // raw tensor bytes at recorded offsets (tensor_stream.h)

struct DtypeName {
  torch::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {torch::kBool, "BOOL"},   {torch::kByte, "U8"},          {torch::kChar, "I8"},
    {torch::kShort, "I16"},   {torch::kInt, "I32"},          {torch::kLong, "I64"},
    {torch::kHalf, "F16"},    {torch::kBFloat16, "BF16"},    {torch::kFloat, "F32"},
    {torch::kDouble, "F64"},  {torch::kComplexFloat, "C64"}, {torch::kComplexDouble, "C128"},
};

std::string key_of(size_t index) { return "t" + std::to_string(index); }

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw Error(fmt::format("checkpoint file '{}' is corrupt or truncated: {}", path, what));
}

// A dense CPU tensor that owns exactly its bytes (a view into a flat buffer would otherwise be
// saved with the whole buffer).
torch::Tensor prepare(const std::string& path, const std::string& name, const torch::Tensor& in) {
  if (!in.defined())
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' is undefined", path, name));
  if (in.layout() != torch::kStrided)
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' is not a dense tensor", path, name));
  dtype_name(in.scalar_type());  // throws for a dtype outside the table
  torch::Tensor t = in.detach();
  if (t.device() != torch::Device(torch::kCPU)) t = t.to(torch::kCPU);
  const bool owns_bytes = t.is_contiguous() && t.storage_offset() == 0 &&
                          t.storage().nbytes() == size_t(t.numel()) * t.element_size();
  return owns_bytes ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Reads and checks the tail; returns the meta length.
uint64_t read_tail(const FileReader& file, uint32_t* stored_crc) {
  const auto& path = file.path();
  if (file.size() < kTailBytes)
    corrupt(path, fmt::format("{} bytes, shorter than the {}-byte tail every tensor file ends with",
                              file.size(), kTailBytes));
  char tail[kTailBytes];
  file.read_at(file.size() - kTailBytes, tail, kTailBytes);
  if (std::memcmp(tail + 16, kMagic, sizeof kMagic) != 0)
    corrupt(path, "its last bytes are not the Strata tensor-file tail (truncated, or not a "
                  "Strata tensor file)");
  if (get_le(tail + 12, 4) != 0) corrupt(path, "the tail's reserved field is not zero");
  *stored_crc = uint32_t(get_le(tail + 8, 4));
  const uint64_t meta_bytes = get_le(tail, 8);
  if (meta_bytes > file.size() - kTailBytes || meta_bytes > kMaxMetaBytes)
    corrupt(path, fmt::format("its meta length {} does not fit in its {} bytes", meta_bytes,
                              file.size()));
  return meta_bytes;
}

void check_crc(const FileReader& file, uint32_t stored) {
  const uint32_t computed = file.crc32c(0, file.size() - 16);
  if (computed != stored)
    corrupt(file.path(), fmt::format("CRC32C mismatch (stored 0x{:08x}, computed 0x{:08x})", stored,
                                     computed));
}

TensorFileInfo parse_footer(const FileReader& file, uint64_t meta_bytes, uint32_t crc) {
  const auto& path = file.path();
  std::string text(size_t(meta_bytes), '\0');
  file.read_at(file.size() - kTailBytes - meta_bytes, text.data(), text.size());
  json meta;
  try {
    meta = parse_json_bounded(text, fmt::format("checkpoint file '{}': its meta JSON", path));
  } catch (const json::exception& e) {
    corrupt(path, fmt::format("its meta JSON does not parse ({})", e.what()));
  }
  TensorFileInfo info;
  info.path = path;
  info.bytes = file.size();
  info.crc32c = crc;
  const std::string where = "checkpoint file '" + path + "'";
  try {
    if (meta.at("format") != kFormat ||
        (meta.at("version") != kArchiveVersion && meta.at("version") != kRawVersion))
      corrupt(path, fmt::format("format {} version {}, expected {} version {} or {} (a newer "
                                "Strata's file, or not a Strata tensor file)",
                                meta.at("format").dump(), meta.at("version").dump(), kFormat,
                                kArchiveVersion, kRawVersion));
    info.version = meta.at("version").get<int>();
    const auto payload = json_uint(meta.at("payload_bytes"), where + ": payload_bytes");
    // read_tail() bounds meta_bytes, so this subtraction cannot wrap (a sum could).
    if (payload != file.size() - kTailBytes - meta_bytes)
      corrupt(path, fmt::format("payload {} + meta {} + tail {} bytes != file size {}", payload,
                                meta_bytes, kTailBytes, file.size()));
    // Every tensor's bytes lie in the payload (LibTorch's archive stores them uncompressed), so
    // no tensor can need more than it: a footer claiming more is damaged, caught before LibTorch
    // runs. Not their sum: tensors may share a storage (tied weights under two names are saved
    // once), and LibTorch allocates per stored storage, which the file's size bounds.
    std::set<std::string> names;
    if (!meta.at("tensors").is_array()) corrupt(path, "its meta JSON's tensors are not a list");
    for (const auto& t : meta.at("tensors")) {
      info.tensors.push_back(spec_from_json(t, where));
      const auto& spec = info.tensors.back();
      if (!names.insert(spec.name).second)
        corrupt(path, fmt::format("its footer names tensor '{}' twice", spec.name));
      const uint64_t bytes = tensor_bytes(spec.shape, spec.dtype, where);
      if (bytes > payload)
        corrupt(path, fmt::format("its footer's tensor '{}' needs more than the {} payload bytes",
                                  spec.name, payload));
      if (info.version != kRawVersion) continue;
      StoredBytes stored;
      stored.offset = json_uint(t.at("offset"), where + ": offset of " + spec.name);
      stored.bytes = bytes;
      const uint64_t crc = json_uint(t.at("crc32c"), where + ": crc32c of " + spec.name);
      if (crc > UINT32_MAX || stored.offset > payload - bytes)
        corrupt(path, fmt::format("its footer's tensor '{}' ({} bytes at offset {}, CRC32C {}) "
                                  "does not lie in the {} payload bytes",
                                  spec.name, bytes, stored.offset, crc, payload));
      stored.crc32c = uint32_t(crc);
      info.stored.push_back(stored);
    }
    // Version 2: no two tensors share a byte (each is written once, one after another).
    std::vector<StoredBytes> by_offset = info.stored;
    std::sort(by_offset.begin(), by_offset.end(),
              [](const StoredBytes& a, const StoredBytes& b) { return a.offset < b.offset; });
    for (size_t i = 1; i < by_offset.size(); ++i)
      if (by_offset[i].offset < by_offset[i - 1].offset + by_offset[i - 1].bytes)
        corrupt(path, fmt::format("its footer places two tensors on payload byte {}",
                                  by_offset[i].offset));
    info.scalars = meta.at("scalars");
    if (!info.scalars.is_object()) corrupt(path, "its meta JSON's scalars are not an object");
  } catch (const json::exception& e) {
    corrupt(path, fmt::format("its meta JSON lacks a field ({})", e.what()));
  }
  return info;
}

TensorFile load(const std::string& path, const std::vector<TensorSpec>* expected) {
  FileReader file(path);
  uint32_t crc = 0;
  const uint64_t meta_bytes = read_tail(file, &crc);
  check_crc(file, crc);
  TensorFileInfo info = parse_footer(file, meta_bytes, crc);
  if (expected) check_specs(path, info.tensors, *expected);

  const uint64_t payload = file.size() - kTailBytes - meta_bytes;
  TensorFile out;
  out.path = path;
  out.crc32c = crc;
  out.scalars = std::move(info.scalars);
  if (info.version == kRawVersion) {
    for (size_t i = 0; i < info.tensors.size(); ++i)
      out.tensors.emplace_back(info.tensors[i].name,
                               read_stored_tensor(file, info.tensors[i], info.stored[i]));
    return out;
  }
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(
        [&](uint64_t pos, void* buf, size_t n) -> size_t {
          if (pos >= payload) return 0;
          n = size_t(std::min<uint64_t>(n, payload - pos));
          file.read_at(pos, buf, n);
          return n;
        },
        [&]() -> size_t { return size_t(payload); }, torch::Device(torch::kCPU));
    for (size_t i = 0; i < info.tensors.size(); ++i) {
      const auto& spec = info.tensors[i];
      torch::Tensor t;
      archive.read(key_of(i), t, /*is_buffer=*/true);
      if (t.scalar_type() != spec.dtype || t.sizes().vec() != spec.shape)
        corrupt(path, fmt::format("tensor '{}' is {} {} in the archive but {} {} in the footer",
                                  spec.name, dtype_name(t.scalar_type()), shape_text(t.sizes().vec()),
                                  dtype_name(spec.dtype), shape_text(spec.shape)));
      out.tensors.emplace_back(spec.name, std::move(t));
    }
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    corrupt(path, fmt::format("LibTorch cannot read its archive: {}", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    corrupt(path, fmt::format("LibTorch cannot read its archive: {}", e.what()));
  }
  return out;
}

}  // namespace

// --- dtypes and specs --------------------------------------------------------------------------

std::string dtype_name(torch::ScalarType dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d.name;
  throw Error(fmt::format("checkpoint: dtype {} is not supported in checkpoints",
                          c10::toString(dtype)));
}

torch::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.dtype;
  std::string known;
  for (const auto& d : kDtypes) known += std::string(known.empty() ? "" : ", ") + d.name;
  throw Error(fmt::format("{}: unknown dtype \"{}\" (known: {})", where, name, known));
}

std::vector<TensorSpec> specs_of(const NamedTensors& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  return specs;
}

json spec_to_json(const TensorSpec& spec) {
  return {{"name", spec.name}, {"dtype", dtype_name(spec.dtype)}, {"shape", spec.shape}};
}

TensorSpec spec_from_json(const json& j, const std::string& where) {
  TensorSpec spec;
  try {
    spec.name = j.at("name").get<std::string>();
    spec.dtype = dtype_from_name(j.at("dtype").get<std::string>(), where);
    spec.shape = json_ints(j.at("shape"), fmt::format("{}: shape of tensor '{}'", where,
                                                       spec.name));
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed tensor entry {} ({})", where, j.dump(), e.what()));
  }
  tensor_bytes(spec.shape, spec.dtype, fmt::format("{}: tensor '{}'", where, spec.name));
  return spec;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

uint64_t tensor_bytes(const std::vector<int64_t>& shape, torch::ScalarType dtype,
                      const std::string& where) {
  // The non-zero dimensions are bounded even when another is zero: the strides of an empty
  // tensor are products of them too.
  constexpr uint64_t kLimit = uint64_t(1) << 62;
  uint64_t product = c10::elementSize(dtype);
  bool empty = false;
  for (auto d : shape) {
    if (d < 0)
      throw Error(fmt::format("{}: negative dimension in shape {}", where, shape_text(shape)));
    if (d == 0) {
      empty = true;
    } else if (product > kLimit / uint64_t(d)) {
      throw Error(fmt::format("{}: shape {} is too large (past 2^62 bytes)", where,
                              shape_text(shape)));
    } else {
      product *= uint64_t(d);
    }
  }
  return empty ? 0 : product;
}

int64_t json_int(const json& value, const std::string& where) {
  if (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t(INT64_MAX))
    throw Error(fmt::format("{}: {} is too large", where, value.dump()));
  if (!value.is_number_integer())
    throw Error(fmt::format("{}: {} is not an integer", where, value.dump()));
  return value.get<int64_t>();
}

uint64_t json_uint(const json& value, const std::string& where) {
  if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<int64_t>() < 0))
    throw Error(fmt::format("{}: {} is not a non-negative integer", where, value.dump()));
  return value.get<uint64_t>();
}

std::vector<int64_t> json_ints(const json& value, const std::string& where) {
  if (!value.is_array()) throw Error(fmt::format("{}: {} is not a list", where, value.dump()));
  std::vector<int64_t> out;
  for (const auto& v : value) out.push_back(json_int(v, where));
  return out;
}

void check_specs(const std::string& path, const std::vector<TensorSpec>& actual,
                 const std::vector<TensorSpec>& expected) {
  std::map<std::string, const TensorSpec*> by_name;
  for (const auto& s : actual) by_name.emplace(s.name, &s);
  std::set<std::string> wanted;
  for (const auto& want : expected) {
    wanted.insert(want.name);
    const auto it = by_name.find(want.name);
    if (it == by_name.end())
      throw Error(fmt::format("checkpoint file '{}': tensor '{}' is missing (the file holds {} "
                              "tensors)",
                              path, want.name, actual.size()));
    const TensorSpec& have = *it->second;
    if (have.shape != want.shape)
      throw Error(fmt::format("checkpoint file '{}': tensor '{}' has shape {} in the file but {} "
                              "is expected",
                              path, want.name, shape_text(have.shape), shape_text(want.shape)));
    if (have.dtype != want.dtype)
      throw Error(fmt::format("checkpoint file '{}': tensor '{}' is {} in the file but {} is "
                              "expected",
                              path, want.name, dtype_name(have.dtype), dtype_name(want.dtype)));
  }
  for (const auto& s : actual)
    if (!wanted.count(s.name))
      throw Error(fmt::format("checkpoint file '{}': holds tensor '{}', which is not expected",
                              path, s.name));
}

// --- TensorFile --------------------------------------------------------------------------------

const torch::Tensor& TensorFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  throw Error(fmt::format("checkpoint file '{}': tensor '{}' is missing", path, name));
}

void TensorFile::copy_to(const NamedTensors& targets) const {
  check_specs(path, specs_of(tensors), specs_of(targets));
  std::map<std::string, const torch::Tensor*> by_name;
  for (const auto& [n, t] : tensors) by_name.emplace(n, &t);
  torch::NoGradGuard no_grad;
  for (const auto& [name, target] : targets) {
    auto dst = target;  // shares the TensorImpl: copy_ writes the caller's tensor
    dst.copy_(*by_name.at(name));
  }
}

// --- save / load -------------------------------------------------------------------------------

TensorFileInfo save_tensor_file(const std::string& path, const NamedTensors& tensors,
                                const json& scalars) {
  if (!scalars.is_object())
    throw Error(fmt::format("checkpoint file '{}': scalars must be a JSON object", path));
  TensorFileInfo info;
  info.path = path;
  info.scalars = scalars;
  torch::serialize::OutputArchive archive;
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    if (!names.insert(name).second)
      throw Error(fmt::format("checkpoint file '{}': two tensors are named '{}'", path, name));
    archive.write(key_of(i), prepare(path, name, tensor), /*is_buffer=*/true);
    info.tensors.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }

  AtomicFile file(path);
  // LibTorch's zip writer must never see a failed write: it would throw again from its
  // destructor while unwinding. The first error is kept and rethrown after save_to() returns.
  std::exception_ptr error;
  archive.save_to([&](const void* data, size_t n) -> size_t {
    if (!error) {
      try {
        file.write(data, n);
      } catch (...) {
        error = std::current_exception();
      }
    }
    return n;
  });
  if (error) std::rethrow_exception(error);
  const uint64_t payload = file.size();

  json meta = {{"format", kFormat},        {"version", kArchiveVersion}, {"payload_bytes", payload},
               {"tensors", json::array()}, {"scalars", scalars}};
  for (const auto& spec : info.tensors) meta["tensors"].push_back(spec_to_json(spec));
  info.version = kArchiveVersion;
  info.crc32c = seal_tensor_file(file, meta);
  info.bytes = file.size();
  file.commit();
  return info;
}

uint32_t seal_tensor_file(AtomicFile& file, const json& meta) {
  std::string text;
  try {
    text = meta.dump();
  } catch (const json::exception& e) {
    throw Error(fmt::format("checkpoint file '{}': names or scalars are not valid UTF-8 ({})",
                            file.path(), e.what()));
  }
  // Readable back.
  check_json_depth(text, fmt::format("checkpoint file '{}': its scalars", file.path()));
  file.write(text);
  std::string tail;
  put_le(tail, text.size(), 8);
  file.write(tail);
  const uint32_t crc = file.crc32c();
  tail.clear();
  put_le(tail, crc, 4);
  put_le(tail, 0, 4);
  tail.append(kMagic, sizeof kMagic);
  file.write(tail);
  return crc;
}

TensorFileInfo read_footer(const FileReader& file, bool verify) {
  uint32_t crc = 0;
  const uint64_t meta_bytes = read_tail(file, &crc);
  if (verify) check_crc(file, crc);
  return parse_footer(file, meta_bytes, crc);
}

torch::Tensor read_stored_tensor(const FileReader& file, const TensorSpec& spec,
                                 const StoredBytes& stored) {
  auto t = torch::empty(spec.shape, torch::TensorOptions().dtype(spec.dtype));
  file.read_at(stored.offset, t.data_ptr(), size_t(stored.bytes));
  const uint32_t crc = crc32c(t.data_ptr(), size_t(stored.bytes));
  if (crc != stored.crc32c)
    corrupt(file.path(), fmt::format("tensor '{}' has CRC32C 0x{:08x}, its footer says 0x{:08x}",
                                     spec.name, crc, stored.crc32c));
  return t;
}

TensorFile load_tensor_file(const std::string& path) { return load(path, nullptr); }

TensorFile load_tensor_file(const std::string& path, const std::vector<TensorSpec>& expected) {
  return load(path, &expected);
}

TensorFileInfo read_tensor_file_info(const std::string& path) {
  return read_footer(FileReader(path), /*verify=*/false);
}

TensorFileInfo verify_tensor_file(const std::string& path) {
  return read_footer(FileReader(path), /*verify=*/true);
}

}  // namespace strata::checkpoint
