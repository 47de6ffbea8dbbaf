#include "runtime/data/token_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::data {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A bijection of [0, 2^(2h)) keyed by (seed, epoch): a 4-round Feistel network on two h-bit halves.
uint64_t feistel(uint64_t x, int h, uint64_t key) {
  const uint64_t mask = (uint64_t{1} << h) - 1;
  uint64_t left = x >> h, right = x & mask;
  for (uint64_t round = 0; round < 4; ++round) {
    const uint64_t f = mix(key ^ mix(round ^ (right << 8))) & mask;
    const uint64_t next = left ^ f;
    left = right;
    right = next;
  }
  return (left << h) | right;
}

// Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py): PREFIX.bin holds the
// tokens, PREFIX.idx = "MMIDIDX\0\0", u64 version 1, u8 dtype code, u64 sequences, u64 documents,
// i32 lengths[sequences], i64 byte pointers[sequences], i64 document indices[documents]. Checked
// against its .bin: the width its dtype names, pointers that follow the lengths, lengths that
// cover the .bin exactly. The tokens are then read as any flat file (documents concatenated, as
// Megatron's GPT dataset samples across them).
void check_megatron_index(const std::string& idx, const std::string& bin, int64_t bin_bytes,
                          int64_t token_bytes) {
  std::ifstream in(idx, std::ios::binary);
  if (!in) throw Error(fmt::format("token dataset: {}: cannot open the index", idx));
  auto fail = [&](const std::string& what) {
    throw Error(fmt::format("token dataset: {} does not match {}: {}", idx, bin, what));
  };
  char magic[9];
  uint64_t version = 0, sequences = 0, documents = 0;
  uint8_t code = 0;
  in.read(magic, 9);
  if (!in || std::string(magic, 9) != std::string("MMIDIDX\0\0", 9))
    fail("no Megatron index header (MMIDIDX) at byte offset 0");
  in.read(reinterpret_cast<char*>(&version), 8);
  in.read(reinterpret_cast<char*>(&code), 1);
  in.read(reinterpret_cast<char*>(&sequences), 8);
  in.read(reinterpret_cast<char*>(&documents), 8);
  if (!in) fail("the header is truncated (before byte offset 34)");
  if (version != 1) fail(fmt::format("index version {} (byte offset 9); version 1 is read", version));
  // Megatron's DType codes: 8 uint16, 4 int32 (token ids); others are not token widths here.
  const int64_t width = code == 8 ? 2 : code == 4 ? 4 : 0;
  if (width == 0) fail(fmt::format("dtype code {} (byte offset 17): token files are uint16 (8) or int32 (4)", code));
  if (width != token_bytes)
    fail(fmt::format("its dtype is {}-byte tokens, the dataset reads {}-byte ones", width, token_bytes));
  struct stat st {};
  const int64_t need = 34 + int64_t(sequences) * 12 + int64_t(documents) * 8;
  if (::stat(idx.c_str(), &st) != 0 || int64_t(st.st_size) < need || sequences > (uint64_t{1} << 40))
    fail(fmt::format("{} sequences and {} documents need {} bytes of index; it has {}", sequences,
                     documents, need, int64_t(st.st_size)));
  std::vector<int32_t> lengths(sequences);
  std::vector<int64_t> pointers(sequences);
  in.read(reinterpret_cast<char*>(lengths.data()), std::streamsize(sequences * 4));
  in.read(reinterpret_cast<char*>(pointers.data()), std::streamsize(sequences * 8));
  if (!in) fail("the index is truncated in its arrays");
  int64_t at = 0;
  for (uint64_t i = 0; i < sequences; ++i) {
    if (lengths[i] < 0 || pointers[i] != at)
      fail(fmt::format("sequence {} (index byte offset {}) starts at byte {} of {} where the lengths "
                       "before it end at byte {}", i, 34 + sequences * 4 + i * 8, pointers[i], bin,
                       at));
    at += int64_t(lengths[i]) * width;
  }
  if (at != bin_bytes)
    fail(fmt::format("its sequences cover {} bytes, {} has {}", at, bin, bin_bytes));
}

}  // namespace

struct TokenDataset::File {
  std::string path;
  int fd = -1;
  const uint8_t* bytes = nullptr;
  int64_t size = 0;    // bytes
  int64_t tokens = 0;  // size / token width

  ~File() {
    if (bytes && size > 0) ::munmap(const_cast<uint8_t*>(bytes), size_t(size));
    if (fd >= 0) ::close(fd);
  }
};

TokenDataset::TokenDataset(TokenDatasetOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  if (o.files.empty()) throw Error("token dataset: no files given");
  if (o.token_bytes != 2 && o.token_bytes != 4)
    throw Error(fmt::format("token dataset: token width {} bytes; give 2 (uint16) or 4 (uint32)",
                            o.token_bytes));
  if (o.seq_len < 1) throw Error(fmt::format("token dataset: seq_len {} must be >= 1", o.seq_len));
  if (o.vocab_size < 0) throw Error("token dataset: vocab_size must be >= 0 (0: not checked)");
  for (const auto& path : o.files) {
    auto f = std::make_unique<File>();
    f->path = path;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      throw Error(fmt::format("token dataset: {}: {}", path, std::strerror(errno)));
    // A FIFO or a device would block or never end: only regular files.
    if (!S_ISREG(st.st_mode))
      throw Error(fmt::format("token dataset: {}: not a regular file", path));
    f->size = int64_t(st.st_size);
    if (f->size % o.token_bytes != 0)
      throw Error(fmt::format("token dataset: {}: {} bytes is not a multiple of the {}-byte token "
                              "width (a truncated file?): the last token would start at byte "
                              "offset {}", path, f->size, o.token_bytes,
                              f->size - f->size % o.token_bytes));
    f->tokens = f->size / o.token_bytes;
    // A Megatron index beside a .bin (PREFIX.idx): checked against it.
    if (path.size() > 4 && path.compare(path.size() - 4, 4, ".bin") == 0) {
      const auto idx = path.substr(0, path.size() - 4) + ".idx";
      struct stat is {};
      if (::stat(idx.c_str(), &is) == 0) check_megatron_index(idx, path, f->size, o.token_bytes);
    }
    if (f->size > 0) {
      f->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (f->fd < 0) throw Error(fmt::format("token dataset: {}: {}", path, std::strerror(errno)));
      void* m = ::mmap(nullptr, size_t(f->size), PROT_READ, MAP_SHARED, f->fd, 0);
      if (m == MAP_FAILED)
        throw Error(fmt::format("token dataset: {}: mmap: {}", path, std::strerror(errno)));
      f->bytes = static_cast<const uint8_t*>(m);
    }
    first_sample_.push_back(samples_);
    if (f->tokens > o.seq_len) samples_ += (f->tokens - 1) / o.seq_len;
    files_.push_back(std::move(f));
  }
  first_sample_.push_back(samples_);
  if (samples_ == 0)
    throw Error(fmt::format("token dataset: no file holds a sample of {} + 1 tokens ({} file(s), "
                            "the first {})", o.seq_len, o.files.size(), o.files.front()));
}

TokenDataset::~TokenDataset() = default;

int64_t TokenDataset::sample_at(int64_t position) const {
  if (position < 0) throw Error(fmt::format("token dataset: position {} < 0", position));
  const int64_t epoch = position / samples_, p = position % samples_;
  if (!options_.shuffle) return p;
  int h = 1;
  while ((uint64_t{1} << (2 * h)) < uint64_t(samples_)) ++h;
  const uint64_t key = mix(options_.seed ^ mix(uint64_t(epoch) + 0x66));
  uint64_t x = uint64_t(p);
  do x = feistel(x, h, key);
  while (x >= uint64_t(samples_));  // cycle-walking: the walk stays within [0, N)
  return int64_t(x);
}

void TokenDataset::read_sample(int64_t id, int64_t* out) const {
  const auto it = std::upper_bound(first_sample_.begin(), first_sample_.end(), id) - 1;
  const auto& f = *files_[size_t(it - first_sample_.begin())];
  const int64_t first_token = (id - *it) * options_.seq_len;
  const int64_t w = options_.token_bytes;
  for (int64_t i = 0; i <= options_.seq_len; ++i) {
    const uint8_t* b = f.bytes + (first_token + i) * w;
    const int64_t v = w == 2 ? int64_t(b[0]) | int64_t(b[1]) << 8
                             : int64_t(b[0]) | int64_t(b[1]) << 8 | int64_t(b[2]) << 16 |
                                   int64_t(b[3]) << 24;
    if (options_.vocab_size > 0 && v >= options_.vocab_size)
      throw Error(fmt::format("token dataset: {}: token id {} at byte offset {} is not below the "
                              "model's vocabulary of {}", f.path, v, (first_token + i) * w,
                              options_.vocab_size));
    out[i] = v;
  }
}

TokenDataset::Batch TokenDataset::batch(int64_t first, int64_t count) const {
  if (first < 0 || count < 0)
    throw Error(fmt::format("token dataset: batch at {} of {} samples", first, count));
  const int64_t t = options_.seq_len;
  auto window = torch::empty({count, t + 1}, torch::kLong);
  Batch b;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = sample_at(first + i);
    b.ids.push_back(id);
    read_sample(id, window.data_ptr<int64_t>() + i * (t + 1));
  }
  b.tokens = window.narrow(1, 0, t).contiguous();
  b.targets = window.narrow(1, 1, t).contiguous();
  return b;
}

int64_t TokenDataset::first_position(int64_t step, int64_t micro, int64_t rank, int64_t world,
                                     int64_t micro_batch, int64_t gas, int64_t start) {
  if (world < 1 || gas < 1 || micro_batch < 1 || rank < 0 || rank >= world || micro < 0 ||
      micro >= gas || step < 0)
    throw Error(fmt::format("token dataset: step {}, micro-step {} of {}, rank {} of {}, micro-batch "
                            "{}: out of range", step, micro, gas, rank, world, micro_batch));
  const int64_t global = micro_batch * world * gas;
  return start + step * global + (micro * world + rank) * micro_batch;
}

}  // namespace strata::data
