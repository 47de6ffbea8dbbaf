// Small helpers the checkpoint suites share.
#pragma once

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/error.h"

namespace strata::test {

// The message of the strata::Error that f() throws, or "(no error)".
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const strata::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Equal bit for bit (NaN-safe, and the same for every dtype).
inline bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ca = a.contiguous(), cb = b.contiguous();
  const size_t bytes = ca.numel() * ca.element_size();  // empty: data_ptr() may be null
  return bytes == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), bytes) == 0;
}

// A file's bytes.
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// A folder's entries, sorted.
inline std::vector<std::string> entries(const std::filesystem::path& dir) {
  auto names = strata::checkpoint::list_folder(dir.string());
  std::sort(names.begin(), names.end());
  return names;
}

// A new file each time: ext4 flushes a file truncated and rewritten in place when it is
// closed (auto_da_alloc), which made thousands of cases wait on the disk.
inline void write_bytes(const std::string& path, const std::string& bytes) {
  ::unlink(path.c_str());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// JSON nested `depth` lists deep.
inline std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

}  // namespace strata::test
