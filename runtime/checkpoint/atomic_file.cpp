#include "runtime/checkpoint/atomic_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>

#include "runtime/util/crc32c.h"
#include "runtime/error.h"

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)  // linux/fs.h
#endif

namespace strata::checkpoint {
namespace {

constexpr const char* kTempMarker = ".tmp-";

std::string parent_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string name_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

[[noreturn]] void throw_errno(const std::string& what, const std::string& path, int err) {
  throw Error(fmt::format("checkpoint: cannot {} '{}': {}", what, path, errno_text(err)));
}

std::string temp_name_for(const std::string& path) {
  static thread_local std::mt19937_64 rng{std::random_device{}() ^ uint64_t(getpid()) << 32};
  return fmt::format("{}/.{}{}{}-{:016x}", parent_of(path), name_of(path), kTempMarker, getpid(),
                     rng());
}

void fsync_fd(int fd, const std::string& path, const char* what) {
  while (::fsync(fd) != 0) {
    if (errno == EINTR) continue;
    // Some file systems cannot fsync a folder; their entries are as durable as they get.
    if (errno == EINVAL || errno == EROFS) return;
    throw_errno(what, path, errno);
  }
}

}  // namespace

std::string errno_text(int err) { return fmt::format("{} (errno {})", std::strerror(err), err); }

// --- AtomicFile --------------------------------------------------------------------------------

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  if (path_.empty() || path_.back() == '/')
    throw Error(fmt::format("checkpoint: '{}' is not a file name", path_));
  for (int attempt = 0;; ++attempt) {
    temp_ = temp_name_for(path_);
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ >= 0) break;
    if (errno == EINTR || (errno == EEXIST && attempt < 8)) continue;
    const int err = errno;
    throw Error(fmt::format("checkpoint: cannot write '{}': creating its temporary '{}' failed: {}",
                            path_, temp_, errno_text(err)));
  }
}

AtomicFile::~AtomicFile() { discard(); }

void AtomicFile::discard() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(temp_.c_str());
  }
}

void AtomicFile::fail(const std::string& what, int err) {
  discard();
  throw Error(fmt::format("checkpoint: cannot write '{}': {} failed: {}", path_, what,
                          errno_text(err)));
}

void AtomicFile::write(const void* data, size_t size) {
  if (fd_ < 0) throw Error(fmt::format("checkpoint: '{}' is already committed or failed", path_));
  crc_ = crc32c_extend(crc_, data, size);
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(size, size_t(1) << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write", errno);
    }
    if (n == 0) fail("write", ENOSPC);
    p += n;
    size -= size_t(n);
    size_ += uint64_t(n);
  }
}

void AtomicFile::commit() {
  if (fd_ < 0) throw Error(fmt::format("checkpoint: '{}' is already committed or failed", path_));
  while (::fsync(fd_) != 0) {
    if (errno != EINTR) fail("fsync", errno);
  }
  if (::close(fd_) != 0 && errno != EINTR) {
    const int err = errno;
    fd_ = -1;
    ::unlink(temp_.c_str());
    throw Error(fmt::format("checkpoint: cannot write '{}': close failed: {}", path_,
                            errno_text(err)));
  }
  fd_ = -1;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp_.c_str());
    throw Error(fmt::format("checkpoint: cannot write '{}': renaming its temporary over it failed: {}",
                            path_, errno_text(err)));
  }
  fsync_directory(parent_of(path_));
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
}

// --- reading -----------------------------------------------------------------------------------

FileReader::FileReader(std::string path) : path_(std::move(path)) {
  // O_NONBLOCK: a FIFO planted under a checkpoint's file name must not block the open (it is
  // refused below); for regular files the flag changes nothing.
  do {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) throw_errno("read", path_, errno);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw_errno("read", path_, err);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd_);
    throw_errno("read", path_, EISDIR);
  }
  if (!S_ISREG(st.st_mode)) {  // a device or a FIFO: no size to check, maybe endless
    ::close(fd_);
    throw Error(fmt::format("checkpoint: cannot read '{}': not a regular file", path_));
  }
  size_ = uint64_t(st.st_size);
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

void FileReader::read_at(uint64_t offset, void* buf, size_t n) const {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd_, p, std::min<size_t>(n, size_t(1) << 30), off_t(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw_errno("read", path_, errno);
    }
    if (got == 0)
      throw Error(fmt::format("checkpoint: '{}' ends early at byte {} (truncated while reading?)",
                              path_, offset));
    p += got;
    n -= size_t(got);
    offset += uint64_t(got);
  }
}

uint32_t FileReader::crc32c(uint64_t offset, uint64_t n) const {
  // 1 MiB: the checksum pass of a streamed load must not cost more host memory than its tiles.
  std::vector<char> chunk(std::min<uint64_t>(n, uint64_t(1) << 20));
  uint32_t crc = 0;
  while (n > 0) {
    const size_t take = size_t(std::min<uint64_t>(n, chunk.size()));
    read_at(offset, chunk.data(), take);
    crc = crc32c_extend(crc, chunk.data(), take);
    offset += take;
    n -= take;
  }
  return crc;
}

std::string read_file(const std::string& path) {
  FileReader file(path);
  std::string bytes(size_t(file.size()), '\0');
  file.read_at(0, bytes.data(), bytes.size());
  return bytes;
}

// --- folders -----------------------------------------------------------------------------------

void fsync_directory(const std::string& dir) {
  int fd;
  do {
    fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw_errno("sync folder", dir, errno);
  try {
    fsync_fd(fd, dir, "sync folder");
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

void make_directories(const std::string& dir) {
  if (dir.empty()) throw Error("checkpoint: empty folder name");
  size_t pos = dir[0] == '/' ? 1 : 0;
  while (pos <= dir.size()) {
    size_t next = dir.find('/', pos);
    if (next == std::string::npos) next = dir.size();
    const std::string prefix = dir.substr(0, next);
    if (next > pos) {  // skip empty components ("a//b", trailing '/')
      if (::mkdir(prefix.c_str(), 0755) == 0) {
        fsync_directory(parent_of(prefix));
      } else if (errno == EEXIST) {
        struct stat st {};
        if (::stat(prefix.c_str(), &st) != 0) throw_errno("create folder", prefix, errno);
        if (!S_ISDIR(st.st_mode))
          throw Error(fmt::format("checkpoint: cannot create folder '{}': '{}' exists and is not a "
                                  "folder",
                                  dir, prefix));
      } else {
        throw_errno("create folder", prefix, errno);
      }
    }
    pos = next + 1;
  }
}

void rename_durable(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int err = errno;
    throw Error(fmt::format("checkpoint: cannot rename '{}' to '{}': {}", from, to,
                            errno_text(err)));
  }
  fsync_directory(parent_of(to));
  if (parent_of(from) != parent_of(to)) fsync_directory(parent_of(from));
}

bool exchange_paths(const std::string& a, const std::string& b) {
#ifdef SYS_renameat2
  if (::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_directory(parent_of(b));
    if (parent_of(a) != parent_of(b)) fsync_directory(parent_of(a));
    return true;
  }
  const int err = errno;
  if (err == EINVAL || err == ENOSYS || err == ENOTSUP || err == EOPNOTSUPP) return false;
  throw Error(fmt::format("checkpoint: cannot exchange '{}' and '{}': {}", a, b, errno_text(err)));
#else
  return false;
#endif
}

void link_folder(const std::string& from, const std::string& to, bool allow_link) {
  if (::mkdir(to.c_str(), 0755) != 0) throw_errno("create folder", to, errno);
  for (const auto& name : list_folder(from)) {
    const std::string src = from + "/" + name, dst = to + "/" + name;
    if (allow_link && ::link(src.c_str(), dst.c_str()) == 0) continue;
    const int err = allow_link ? errno : EPERM;
    // EPERM is Linux's "this file system has no hard links".
    if (err != EPERM && err != ENOTSUP && err != EOPNOTSUPP && err != EMLINK && err != ENOSYS)
      throw Error(fmt::format("checkpoint: cannot link '{}' to '{}': {}", src, dst,
                              errno_text(err)));
    FileReader in(src);
    AtomicFile out(dst);
    std::vector<char> chunk(size_t(std::min<uint64_t>(in.size(), uint64_t(8) << 20)));
    for (uint64_t offset = 0; offset < in.size(); offset += chunk.size()) {
      const size_t n = size_t(std::min<uint64_t>(chunk.size(), in.size() - offset));
      in.read_at(offset, chunk.data(), n);
      out.write(chunk.data(), n);
    }
    out.commit();
  }
  fsync_directory(to);
  fsync_directory(parent_of(to));
}

bool is_temporary_name(const std::string& file_name) {
  return file_name.size() > 1 && file_name[0] == '.' && file_name.find(kTempMarker) != std::string::npos;
}

void remove_stale_temporaries(const std::string& dir, const std::string& name) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 && errno == ENOENT) return;
  const std::string prefix = "." + name + kTempMarker;
  for (const auto& entry : list_folder(dir)) {
    if (!(name.empty() ? is_temporary_name(entry) : entry.rfind(prefix, 0) == 0)) continue;
    const std::string path = dir + "/" + entry;
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw_errno("remove", path, errno);
  }
}

}  // namespace strata::checkpoint
