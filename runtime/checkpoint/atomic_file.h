// Files that appear whole or not at all, and the small POSIX helpers around them. Every failure
// is a strata::Error naming the path and the errno text ("No space left on device").
//
// An AtomicFile writes under a temporary name in the target's own folder
// (".NAME.tmp-PID-RANDOM"); commit() fsyncs it, renames it over the target and fsyncs the
// folder. Until commit() returns the target is untouched, so a crash at any moment (kill -9,
// power loss on a file system that honours fsync) leaves the old file or the new one, never a
// torn one. What a crash can leave is a stale temporary: remove_stale_temporaries() clears them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>
#include "runtime/util/file_tree.h"

namespace strata::checkpoint {

class AtomicFile {
 public:
  // Creates the temporary (the target's folder must exist).
  explicit AtomicFile(std::string path);
  // Without commit(): removes the temporary; the target stays as it was.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  // Bytes written so far and their CRC32C (so a caller gets the file's checksum for free).
  uint64_t size() const { return size_; }
  uint32_t crc32c() const { return crc_; }
  // fsync, rename over the target, fsync the folder. After a failure the target is unchanged.
  void commit();

  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const std::string& what, int err);
  void discard() noexcept;

  std::string path_;
  std::string temp_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint32_t crc_ = 0;
};

// AtomicFile in one call.
void write_file_atomic(const std::string& path, std::string_view bytes);

// A regular file opened for reading at offsets; errors name the path.
class FileReader {
 public:
  explicit FileReader(std::string path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  uint64_t size() const { return size_; }
  // Reads exactly n bytes at `offset`; a short read (the file shrank) is an error.
  void read_at(uint64_t offset, void* buf, size_t n) const;
  // CRC32C of bytes [offset, offset + n), read in chunks.
  uint32_t crc32c(uint64_t offset, uint64_t n) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole file as bytes.
std::string read_file(const std::string& path);

// mkdir -p, then fsync of each folder whose entry was created, so the folders survive a crash.
// A component that exists as a file is an error naming it.
void make_directories(const std::string& dir);
void fsync_directory(const std::string& dir);
// Renames `from` to `to` (atomically replacing a file `to`) and fsyncs the folders involved.
void rename_durable(const std::string& from, const std::string& to);
// Swaps two directory entries in one atomic step (renameat2 RENAME_EXCHANGE). Returns false,
// changing nothing, where the kernel or the file system cannot (EINVAL, ENOSYS, ENOTSUP).
bool exchange_paths(const std::string& a, const std::string& b);
// Creates folder `to` with a second name for every file of folder `from` (a hard link; a copy
// where the file system has none, or with allow_link=false, for tests), then fsyncs it. `from`
// holds files only. So `to` can be renamed into place while `from` stays whole.
void link_folder(const std::string& from, const std::string& to, bool allow_link = true);
// rm -rf, and a folder's names: runtime/util/file_tree.h (POSIX calls, not std::filesystem, whose
// copy in pip LibTorch 2.x's libtorch.so crashes).
using util::list_folder;
using util::remove_tree;
// Removes the temporaries that crashed AtomicFile writers of `dir`/`name` left behind; with an
// empty name, those of every file in `dir`.
void remove_stale_temporaries(const std::string& dir, const std::string& name = "");
bool is_temporary_name(const std::string& file_name);

// "No space left on device (errno 28)".
std::string errno_text(int err);

}  // namespace strata::checkpoint
