#include "runtime/checkpoint/tensor_stream.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "runtime/error.h"
#include "runtime/util/crc32c.h"

namespace strata::checkpoint {

// --- writer ------------------------------------------------------------------------------------

TensorFileWriter::TensorFileWriter(const std::string& path) : file_(path) {}

void TensorFileWriter::begin(const TensorSpec& spec) {
  if (open_)
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' begun before '{}' ended", path(),
                            spec.name, specs_.back().name));
  dtype_name(spec.dtype);  // throws for a dtype outside the table
  if (!names_.insert(spec.name).second)
    throw Error(fmt::format("checkpoint file '{}': two tensors are named '{}'", path(), spec.name));
  StoredBytes stored;
  stored.offset = file_.size();
  stored.bytes = tensor_bytes(spec.shape, spec.dtype, "checkpoint file '" + path() + "'");
  specs_.push_back(spec);
  stored_.push_back(stored);
  open_ = true;
  written_ = 0;
}

void TensorFileWriter::write(const void* data, size_t bytes) {
  if (!open_) throw Error(fmt::format("checkpoint file '{}': bytes written outside a tensor", path()));
  auto& stored = stored_.back();
  if (bytes > stored.bytes - written_)
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' given more than its {} bytes",
                            path(), specs_.back().name, stored.bytes));
  stored.crc32c = crc32c_extend(stored.crc32c, data, bytes);
  file_.write(data, bytes);
  written_ += bytes;
}

void TensorFileWriter::end() {
  if (!open_) throw Error(fmt::format("checkpoint file '{}': end() without begin()", path()));
  if (written_ != stored_.back().bytes)
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' got {} of its {} bytes", path(),
                            specs_.back().name, written_, stored_.back().bytes));
  open_ = false;
}

void TensorFileWriter::add(const std::string& name, const torch::Tensor& tensor) {
  if (!tensor.defined())
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' is undefined", path(), name));
  if (tensor.layout() != torch::kStrided)
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' is not a dense tensor", path(), name));
  begin({name, tensor.scalar_type(), tensor.sizes().vec()});
  auto t = tensor.detach();
  if (!t.is_contiguous()) t = t.contiguous();  // rare (a transposed view): one copy of it
  const auto flat = t.view({-1});
  const bool on_host = t.device() == torch::Device(torch::kCPU);
  if (on_host) {
    write(t.data_ptr(), size_t(t.numel()) * t.element_size());
  } else {
    const int64_t tile = std::max<int64_t>(1, kStreamTileBytes / t.element_size());
    for (int64_t at = 0; at < flat.numel(); at += tile) {
      const auto piece = flat.narrow(0, at, std::min(tile, flat.numel() - at)).to(torch::kCPU);
      write(piece.data_ptr(), size_t(piece.numel()) * piece.element_size());
    }
  }
  end();
}

TensorFileInfo TensorFileWriter::commit(const json& scalars, const std::vector<std::string>& order) {
  if (open_)
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' not ended", path(),
                            specs_.back().name));
  if (!scalars.is_object())
    throw Error(fmt::format("checkpoint file '{}': scalars must be a JSON object", path()));
  std::vector<size_t> listed;
  if (order.empty()) {
    for (size_t i = 0; i < specs_.size(); ++i) listed.push_back(i);
  } else {
    std::map<std::string, size_t> by_name;
    for (size_t i = 0; i < specs_.size(); ++i) by_name.emplace(specs_[i].name, i);
    for (const auto& name : order) {
      const auto it = by_name.find(name);
      if (it == by_name.end())
        throw Error(fmt::format("checkpoint file '{}': tensor '{}' was listed but not written",
                                path(), name));
      listed.push_back(it->second);
      by_name.erase(it);
    }
    if (!by_name.empty())
      throw Error(fmt::format("checkpoint file '{}': tensor '{}' was written but not listed",
                              path(), by_name.begin()->first));
  }
  TensorFileInfo info;
  info.path = path();
  info.version = 2;
  info.scalars = scalars;
  json meta = {{"format", "strata-tensors"}, {"version", 2}, {"payload_bytes", file_.size()},
               {"tensors", json::array()},   {"scalars", scalars}};
  for (size_t i : listed) {
    json entry = spec_to_json(specs_[i]);
    entry["offset"] = stored_[i].offset;
    entry["crc32c"] = stored_[i].crc32c;
    meta["tensors"].push_back(std::move(entry));
    info.tensors.push_back(specs_[i]);
    info.stored.push_back(stored_[i]);
  }
  info.crc32c = seal_tensor_file(file_, meta);
  info.bytes = file_.size();
  file_.commit();
  return info;
}

TensorFileInfo save_tensor_file_v2(const std::string& path, const NamedTensors& tensors,
                                   const json& scalars) {
  TensorFileWriter out(path);
  for (const auto& [name, t] : tensors) out.add(name, t);
  return out.commit(scalars);
}

// --- reader ------------------------------------------------------------------------------------

TensorFileReader::TensorFileReader(const std::string& path, bool verify)
    : file_(std::make_unique<FileReader>(path)), info_(read_footer(*file_, verify)) {
  for (size_t i = 0; i < info_.tensors.size(); ++i) index_.emplace(info_.tensors[i].name, i);
  verified_ = verify;
  if (info_.version != 2) {
    whole_ = load_tensor_file(path);  // checks the CRC (again, when verified): old files only
    verified_ = true;
  }
}

void TensorFileReader::verify() const {
  if (verified_) return;
  read_footer(*file_, /*verify=*/true);
  verified_ = true;
}

size_t TensorFileReader::index_of(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end())
    throw Error(fmt::format("checkpoint file '{}': tensor '{}' is missing", path(), name));
  return it->second;
}

const TensorSpec& TensorFileReader::spec(const std::string& name) const {
  return info_.tensors[index_of(name)];
}

int64_t TensorFileReader::numel(const std::string& name) const {
  int64_t n = 1;
  for (auto d : spec(name).shape) n *= d;  // bounded by tensor_bytes() when parsed
  return n;
}

void TensorFileReader::read(const std::string& name, int64_t begin, int64_t n, void* dst) const {
  const size_t i = index_of(name);
  const int64_t total = numel(name);
  if (begin < 0 || n < 0 || begin > total || n > total - begin)
    throw Error(fmt::format("checkpoint file '{}': elements [{}, {}) of tensor '{}' lie outside "
                            "its {}",
                            path(), begin, begin + n, name, total));
  if (n == 0) return;
  const size_t element = c10::elementSize(info_.tensors[i].dtype);
  if (whole_) {
    const auto& t = whole_->at(name);
    std::memcpy(dst, static_cast<const char*>(t.data_ptr()) + size_t(begin) * element,
                size_t(n) * element);
    return;
  }
  file_->read_at(info_.stored[i].offset + uint64_t(begin) * element, dst, size_t(n) * element);
}

torch::Tensor TensorFileReader::at(const std::string& name) const {
  const size_t i = index_of(name);
  if (whole_) return whole_->at(name);
  return read_stored_tensor(*file_, info_.tensors[i], info_.stored[i]);
}

}  // namespace strata::checkpoint
