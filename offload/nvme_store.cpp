// The NVMe store (offload/nvme_store.h): folder and file handling, request splitting, and the
// worker rings that keep pieces in flight.
#include "offload/nvme_store.h"

#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include <fmt/format.h>

#include "offload/aligned_buffer.h"
#include "runtime/error.h"
#include "runtime/util/file_tree.h"
#include "runtime/util/crc32c.h"

namespace strata::offload {
namespace {

constexpr uint64_t kPage = kIoAlign;
constexpr unsigned kFixedFiles = 1024;  // registered-file slots per ring; files past it use fds
constexpr uint64_t kWakeTag = 0;        // user_data of the eventfd poll that wakes a worker
std::atomic<bool> g_pretend_no_direct{false};

std::string errno_text(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

uint32_t zero_page_crc() {
  static const uint32_t crc = [] {
    AlignedBuffer z(kPage);
    std::memset(z.data(), 0, kPage);
    return crc32c(z.data(), kPage);
  }();
  return crc;
}

// A size for people beside the exact byte count: GiB, or MiB / KiB where GiB would print 0.00.
std::string human_size(uint64_t bytes) {
  if (bytes >= (1ull << 30) / 100) return fmt::format("{:.2f} GiB", double(bytes) / (1ull << 30));
  if (bytes >= (1ull << 20) / 100) return fmt::format("{:.2f} MiB", double(bytes) / (1ull << 20));
  return fmt::format("{:.2f} KiB", double(bytes) / 1024);
}

}  // namespace

struct NvmeTicket::State {
  std::atomic<int64_t> pieces{0};
  bool is_write = false;
  bool done = false;      // the fields below are guarded by the store's mutex
  std::string error;      // the first error of any piece
  bool reported = false;  // thrown by wait() already
};

bool NvmeTicket::done() const { return !state_ || state_->pieces.load() == 0; }

struct NvmeStore::File {
  std::string name, path;
  int fd = -1;
  int slot = -1;  // registered-file index in every ring, or -1
  uint64_t size = 0;
  std::vector<uint32_t> crc;  // one per 4 KiB page; written by the workers, disjoint pages
};

struct NvmeStore::Piece {
  std::shared_ptr<NvmeTicket::State> state;
  File* file = nullptr;
  bool is_write = false;
  uint64_t offset = 0;     // in the file
  std::byte* io = nullptr;  // what the kernel reads or fills: the caller's buffer or `bounce`
  uint32_t len = 0;        // a multiple of 4096
  uint32_t done = 0;       // transferred so far (short transfers resume here)
  std::byte* tail = nullptr;  // read of a partial last page: copy tail_len bytes of bounce here
  uint32_t tail_len = 0;
  AlignedBuffer bounce;
};

struct NvmeStore::Worker {
  NvmeStore* store = nullptr;
  io_uring ring{};
  int efd = -1;
  bool fixed = false;  // registered files available
  std::thread thread;
  std::mutex mu;
  std::deque<Piece*> queue;
  bool stop = false;

  io_uring_sqe* sqe() {
    io_uring_sqe* s = io_uring_get_sqe(&ring);
    while (!s) {  // the submission ring is full: hand what is there to the kernel first
      io_uring_submit(&ring);
      s = io_uring_get_sqe(&ring);
    }
    return s;
  }
  void arm_wake() {
    io_uring_sqe* s = sqe();
    io_uring_prep_poll_add(s, efd, POLLIN);
    io_uring_sqe_set_data64(s, kWakeTag);
  }
  void prep(Piece* p) {
    const NvmeOptions& o = store->options_;
    io_uring_sqe* s = sqe();
    const bool use_slot = fixed && p->file->slot >= 0;
    const int fd = use_slot ? p->file->slot : p->file->fd;
    if (p->is_write)
      io_uring_prep_write(s, fd, p->io + p->done, p->len - p->done, p->offset + p->done);
    else
      io_uring_prep_read(s, fd, p->io + p->done, p->len - p->done, p->offset + p->done);
    if (use_slot) s->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(s, p);
    if (o.single_submit) io_uring_submit(&ring);
  }
  // A piece whose bytes have all arrived: check them (read) and hand the result to the store.
  void complete(Piece* p) {
    std::string error;
    if (!p->is_write && store->options_.checksums) {
      for (uint32_t at = 0; at < p->len && error.empty(); at += kPage) {
        const uint64_t page = (p->offset + at) / kPage;
        if (crc32c(p->io + at, kPage) != p->file->crc[page])
          error = fmt::format(
              "nvme store: checksum mismatch in file '{}' at offset {} (the 4096 bytes there are "
              "not what this store wrote: a torn or corrupted write, or another process changed "
              "the file)",
              p->file->path, p->offset + at);
      }
    }
    if (p->tail && error.empty()) std::memcpy(p->tail, p->bounce.data(), p->tail_len);
    store->finish_piece(p, error);
  }
  void fail(Piece* p, int err) {
    store->finish_piece(
        p, fmt::format("nvme store: {} of file '{}' at offset {} ({} bytes) failed: {}",
                       p->is_write ? "write" : "read", p->file->path, p->offset + p->done,
                       p->len - p->done, errno_text(err)));
  }
  void run();
};

// Checksums are computed while the device works: a write's after it is submitted (its buffer
// stays unchanged until the ticket is done), a read's after the refill that follows its
// completion. Both happen before the next reap, so no piece finishes with its CRC undone.
void NvmeStore::Worker::run() {
  const NvmeOptions& o = store->options_;
  arm_wake();
  int inflight = 0;
  std::vector<Piece*> batch, sent_writes, arrived_reads;
  std::vector<std::pair<uint64_t, int>> done;
  for (;;) {
    batch.clear();
    {
      std::lock_guard<std::mutex> lock(mu);
      // overlap_events false: a new batch only once the previous one has drained.
      const int room = (o.overlap_events || inflight == 0) ? o.queue_depth - inflight : 0;
      while (int(batch.size()) < room && !queue.empty()) {
        batch.push_back(queue.front());
        queue.pop_front();
      }
    }
    for (Piece* p : batch) {
      prep(p);
      ++inflight;
      if (p->is_write && o.checksums) sent_writes.push_back(p);
    }
    if (!batch.empty() && !o.single_submit) io_uring_submit(&ring);
    for (Piece* p : sent_writes)
      for (uint32_t at = 0; at < p->len; at += kPage)
        p->file->crc[(p->offset + at) / kPage] = crc32c(p->io + at, kPage);
    sent_writes.clear();
    for (Piece* p : arrived_reads) complete(p);
    arrived_reads.clear();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stop && queue.empty() && inflight == 0) break;
    }
    int r = io_uring_submit_and_wait(&ring, 1);
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
      // Only a broken ring gets here (EFAULT, EBADF): nothing to resubmit to.
      std::fprintf(stderr, "strata nvme store: io_uring_enter failed: %s\n",
                   errno_text(-r).c_str());
      std::abort();
    }
    done.clear();
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      done.emplace_back(io_uring_cqe_get_data64(cqe), cqe->res);
      ++seen;
    }
    io_uring_cq_advance(&ring, seen);
    for (auto [tag, res] : done) {
      if (tag == kWakeTag) {
        eventfd_t v;
        eventfd_read(efd, &v);  // non-blocking: clears the count
        arm_wake();
        continue;
      }
      Piece* p = reinterpret_cast<Piece*>(tag);
      --inflight;
      if (res == -EAGAIN || res == -EINTR) {
        prep(p);  // the same transfer again
        ++inflight;
      } else if (res < 0) {
        fail(p, -res);
      } else if (res == 0) {
        fail(p, p->is_write ? ENOSPC : ENODATA);  // no progress: would loop forever
      } else {
        p->done += uint32_t(res);
        if (p->done < p->len) {  // short transfer: the remainder
          prep(p);
          ++inflight;
        } else if (!p->is_write && o.checksums) {
          arrived_reads.push_back(p);  // checked once the queue is refilled
        } else {
          complete(p);
        }
      }
    }
  }
}

void NvmeStore::pretend_no_direct_for_tests(bool on) { g_pretend_no_direct = on; }

std::string NvmeStore::folder_for(const std::string& nvme_path, const std::string& job_id,
                                  int rank) {
  // Plain string work: no std::filesystem here (runtime/util/file_tree.h says why).
  const bool slash = !nvme_path.empty() && nvme_path.back() == '/';
  return fmt::format("{}{}strata-{}-rank{}", nvme_path, slash ? "" : "/", job_id, rank);
}

NvmeStore::NvmeStore(const std::string& nvme_path, const std::string& job_id, int rank,
                     const NvmeOptions& options, uint64_t expected_bytes)
    : options_(options) {
  const NvmeOptions& o = options_;
  if (o.block_size <= 0 || o.block_size % int64_t(kPage) != 0 || o.block_size > (1ll << 30))
    throw Error(fmt::format("nvme store: aio.block_size {} must be a positive multiple of 4096 "
                            "(O_DIRECT transfers whole pages), at most 1 GiB", o.block_size));
  if (o.queue_depth < 1 || o.queue_depth > 4096)
    throw Error(fmt::format("nvme store: aio.queue_depth {} must be in 1..4096", o.queue_depth));
  if (o.intra_op_parallelism < 1 || o.intra_op_parallelism > 256)
    throw Error(fmt::format("nvme store: aio.intra_op_parallelism {} must be in 1..256",
                            o.intra_op_parallelism));
  if (job_id.empty() ||
      job_id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") !=
          std::string::npos)
    throw Error("nvme store: job id '" + job_id +
                "' must be non-empty letters, digits, '.', '_' or '-' (it names a folder)");
  if (rank < 0) throw Error(fmt::format("nvme store: rank {} must be >= 0", rank));

  struct stat st {};
  if (stat(nvme_path.c_str(), &st) != 0)
    throw Error(fmt::format("nvme store: nvme_path '{}' cannot be used: {} (it is not created: "
                            "point nvme_path at an existing folder on the NVMe drive)",
                            nvme_path, errno_text(errno)));
  if (!S_ISDIR(st.st_mode))
    throw Error("nvme store: nvme_path '" + nvme_path + "' is not a folder");

  // A folder of an earlier run of this job and rank is stale: never read it, start afresh. A
  // live store holds its folder's lock: two processes of one job id and rank are refused.
  folder_ = folder_for(nvme_path, job_id, rank);
  if (folder_in_use(folder_))
    throw Error(fmt::format("nvme store: '{}' is in use by another live process of job '{}' and "
                            "rank {}; give each job its own STRATA_JOB_ID",
                            folder_, job_id, rank));
  try {
    util::remove_tree(folder_);
  } catch (const Error& e) {
    throw Error(fmt::format("nvme store: cannot remove the stale folder '{}': {} (is nvme_path "
                            "'{}' writable?)", folder_, e.what(), nvme_path));
  }
  remove_abandoned_folders(nvme_path);
  if (mkdir(folder_.c_str(), 0700) != 0)
    throw Error(fmt::format("nvme store: nvme_path '{}' is not writable: mkdir '{}': {}",
                            nvme_path, folder_, errno_text(errno)));
  try {
    take_folder_lock();
    if (expected_bytes > 0) check_space(expected_bytes, "the job's offloaded state");
    // O_DIRECT is refused at open (tmpfs: EINVAL) or at the first transfer (some FUSE): try both.
    const std::string probe = folder_ + "/.direct-probe";
    int fd = open(probe.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | O_DIRECT, 0600);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
      AlignedBuffer page(kPage);
      std::memset(page.data(), 0, kPage);
      if (pwrite(fd, page.data(), kPage, 0) != ssize_t(kPage)) err = errno;
      close(fd);
    }
    unlink(probe.c_str());
    if (g_pretend_no_direct) err = EINVAL;
    if (err == EINVAL && o.allow_buffered) {
      direct_ = false;
    } else if (err == EINVAL) {
      throw Error(fmt::format(
          "nvme store: the file system of nvme_path '{}' does not support O_DIRECT (EINVAL; "
          "tmpfs before Linux 6.6 does not): use a folder on the NVMe drive, or allow buffered I/O "
          "(NvmeOptions::allow_buffered) to go through the page cache instead",
          nvme_path));
    } else if (err != 0) {
      throw Error(fmt::format("nvme store: cannot write in '{}': {}", folder_, errno_text(err)));
    }

    for (int i = 0; i < o.intra_op_parallelism; ++i) {
      auto w = std::make_unique<Worker>();
      w->store = this;
      // One extra entry for the wake-up poll; the completion ring is twice as large.
      const int r = io_uring_queue_init(unsigned(o.queue_depth) + 1, &w->ring, 0);
      if (r < 0)
        throw Error(fmt::format("nvme store: io_uring is not available: {} (needs Linux >= 5.6; "
                                "containers may block it with seccomp)", errno_text(-r)));
      w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (w->efd < 0) {
        io_uring_queue_exit(&w->ring);
        throw Error("nvme store: eventfd: " + errno_text(errno));
      }
      w->fixed = io_uring_register_files_sparse(&w->ring, kFixedFiles) == 0;
      workers_.push_back(std::move(w));
    }
    for (auto& w : workers_) w->thread = std::thread([wp = w.get()] { wp->run(); });
  } catch (...) {
    for (auto& w : workers_) {
      if (w->thread.joinable()) {
        { std::lock_guard<std::mutex> lock(w->mu); w->stop = true; }
        eventfd_write(w->efd, 1);
        w->thread.join();
      }
      io_uring_queue_exit(&w->ring);
      close(w->efd);
    }
    remove_folder_quietly();
    if (lock_fd_ >= 0) close(lock_fd_);
    throw;
  }
}

NvmeStore::~NvmeStore() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return outstanding_ == 0; });
  }
  for (auto& w : workers_) {
    { std::lock_guard<std::mutex> lock(w->mu); w->stop = true; }
    eventfd_write(w->efd, 1);
    w->thread.join();
    io_uring_queue_exit(&w->ring);
    close(w->efd);
  }
  for (auto& f : files_) close(f->fd);
  remove_folder_quietly();
  if (lock_fd_ >= 0) close(lock_fd_);
}

// A store's folder holds `.lock`, locked (flock, exclusive) for the store's life; the kernel
// drops the lock when the process ends, however it ends. The lock file is locked before it gets
// its name, so a `.lock` that can be locked belongs to no live store.
void NvmeStore::take_folder_lock() {
  const std::string tmp = folder_ + "/.lock.tmp", lock = folder_ + "/.lock";
  lock_fd_ = open(tmp.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (lock_fd_ < 0 || flock(lock_fd_, LOCK_EX | LOCK_NB) != 0 || rename(tmp.c_str(), lock.c_str()) != 0)
    throw Error(fmt::format("nvme store: cannot lock the folder '{}': {}", folder_,
                            errno_text(errno)));
}

bool NvmeStore::folder_in_use(const std::string& folder) {
  const int fd = open((folder + "/.lock").c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;  // no folder, or one no store locked
  // A process killed a moment ago may still hold it: the kernel closes a dead process's files
  // only once its io_uring rings are torn down, which it does asynchronously. Give it 10 s.
  bool held = true;
  for (int i = 0; i < 100 && held; ++i) {
    held = flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    if (held) usleep(100 * 1000);
  }
  close(fd);
  return held;
}

void NvmeStore::remove_abandoned_folders(const std::string& nvme_path) {
  // Folders of other jobs whose process died (SIGKILL, OOM, power) before removing them: their
  // lock is free. Folders without a lock file are left alone (not clearly a store's).
  std::vector<std::string> names;
  try {
    names = util::list_folder(nvme_path);
  } catch (const Error&) {
    return;  // unreadable nvme_path: the mkdir below reports what is wrong
  }
  const bool slash = !nvme_path.empty() && nvme_path.back() == '/';
  for (const auto& name : names) {
    if (name.rfind("strata-", 0) != 0 || name.find("-rank") == std::string::npos) continue;
    const std::string folder = nvme_path + (slash ? "" : "/") + name;
    if (folder == folder_) continue;
    const int fd = open((folder + "/.lock").c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    const bool abandoned = flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (abandoned) {
      try {
        util::remove_tree(folder);  // while holding its lock: no new store can take it meanwhile
        removed_abandoned_.push_back(folder);
      } catch (const Error&) {  // not ours to fix (another user's folder): leave it
      }
    }
    close(fd);
  }
}

void NvmeStore::remove_folder_quietly() noexcept {
  try {
    util::remove_tree(folder_);
  } catch (...) {  // nothing to do about a failure while tearing down
  }
}

void NvmeStore::check_space(uint64_t bytes, const char* what) const {
  struct statvfs vfs {};
  if (statvfs(folder_.c_str(), &vfs) != 0)
    throw Error(fmt::format("nvme store: statvfs '{}': {}", folder_, errno_text(errno)));
  const uint64_t avail = uint64_t(vfs.f_bavail) * vfs.f_frsize;
  if (bytes > avail)
    throw Error(fmt::format("nvme store: {} needs {} bytes ({}) but the file system of '{}' has "
                            "{} bytes ({}) available: free space there or choose another nvme_path",
                            what, bytes, human_size(bytes), folder_, avail, human_size(avail)));
}

NvmeStore::FileId NvmeStore::create(const std::string& name, uint64_t bytes) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name[0] == '.')
    throw Error("nvme store: file name '" + name + "' must be a plain name (no '/', no leading '.')");
  for (auto& f : files_)
    if (f->name == name) throw Error("nvme store: file '" + name + "' exists already in " + folder_);
  const uint64_t alloc = round_up_io(bytes);
  check_space(alloc, ("file '" + name + "'").c_str());
  auto f = std::make_unique<File>();
  f->name = name;
  f->path = folder_ + "/" + name;
  f->size = bytes;
  f->fd = open(f->path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | (direct_ ? O_DIRECT : 0),
               0600);
  if (f->fd < 0) throw Error(fmt::format("nvme store: create '{}': {}", f->path, errno_text(errno)));
  fchmod(f->fd, 0600);  // exactly 0600 whatever the umask
  // Preallocate, so that a full disk shows now and not halfway through a swap.
  if (alloc > 0 && fallocate(f->fd, 0, 0, off_t(alloc)) != 0) {
    const int err = errno;
    if ((err != EOPNOTSUPP && err != ENOSYS) || ftruncate(f->fd, off_t(alloc)) != 0) {
      close(f->fd);
      unlink(f->path.c_str());
      throw Error(fmt::format("nvme store: allocating {} bytes for '{}': {}", alloc, f->path,
                              errno_text(err)));
    }
  }
  if (options_.checksums) f->crc.assign(alloc / kPage, zero_page_crc());
  const int id = int(files_.size());
  if (id < int(kFixedFiles)) {
    bool all = true;
    for (auto& w : workers_)
      if (!w->fixed || io_uring_register_files_update(&w->ring, unsigned(id), &f->fd, 1) != 1)
        all = false;
    if (all) f->slot = id;
  }
  files_.push_back(std::move(f));
  return id;
}

NvmeStore::File& NvmeStore::file_at(FileId f, const char* what) const {
  if (f < 0 || size_t(f) >= files_.size())
    throw Error(fmt::format("nvme store: {} of unknown file id {} in {}", what, f, folder_));
  return *files_[size_t(f)];
}

NvmeStore::FileId NvmeStore::file(const std::string& name) const {
  for (size_t i = 0; i < files_.size(); ++i)
    if (files_[i]->name == name) return FileId(i);
  throw Error("nvme store: no file '" + name + "' in " + folder_);
}
const std::string& NvmeStore::path(FileId f) const { return file_at(f, "path").path; }
uint64_t NvmeStore::size(FileId f) const { return file_at(f, "size").size; }

NvmeTicket NvmeStore::write(FileId f, uint64_t offset, const void* buffer, uint64_t bytes) {
  return submit(true, f, offset, const_cast<void*>(buffer), bytes);
}
NvmeTicket NvmeStore::read(FileId f, uint64_t offset, void* buffer, uint64_t bytes) {
  return submit(false, f, offset, buffer, bytes);
}

NvmeTicket NvmeStore::submit(bool is_write, FileId id, uint64_t offset, void* buffer,
                             uint64_t bytes) {
  const char* what = is_write ? "write" : "read";
  File& f = file_at(id, what);
  if (offset % kPage != 0)
    throw Error(fmt::format("nvme store: {} of '{}' at offset {}: offsets must be multiples of "
                            "4096", what, f.path, offset));
  if (offset > f.size || bytes > f.size - offset)
    throw Error(fmt::format("nvme store: {} of '{}' at offset {} ({} bytes) runs past its size {}",
                            what, f.path, offset, bytes, f.size));
  if (direct_ && reinterpret_cast<uintptr_t>(buffer) % kIoAlign != 0)
    throw Error(fmt::format("nvme store: {} of '{}' at offset {}: the buffer {} is not "
                            "4096-aligned (O_DIRECT; use AlignedBuffer)", what, f.path, offset,
                            buffer));
  auto state = std::make_shared<NvmeTicket::State>();
  state->is_write = is_write;
  {
    std::lock_guard<std::mutex> lock(mu_);
    (is_write ? traffic_.written_bytes : traffic_.read_bytes) += bytes;
  }
  if (bytes == 0) {
    state->done = true;
    return NvmeTicket(state);
  }

  // Pieces on the file's block_size grid; a partial last page goes through a bounce page.
  std::vector<Piece*> pieces;
  const uint64_t bs = uint64_t(options_.block_size), end = offset + bytes;
  const uint64_t full_end = end / kPage * kPage;
  auto* base = static_cast<std::byte*>(buffer);
  for (uint64_t pos = offset; pos < full_end;) {
    const uint64_t next = std::min(full_end, (pos / bs + 1) * bs);
    auto* p = new Piece;
    p->offset = pos;
    p->io = base + (pos - offset);
    p->len = uint32_t(next - pos);
    pieces.push_back(p);
    pos = next;
  }
  if (full_end < end) {
    auto* p = new Piece;
    p->offset = full_end;
    p->len = uint32_t(kPage);
    p->bounce = AlignedBuffer(kPage);
    p->io = p->bounce.data();
    std::byte* user = base + (full_end - offset);
    const auto n = uint32_t(end - full_end);
    if (is_write) {  // the rest of the page is written as zeros
      std::memcpy(p->io, user, n);
      std::memset(p->io + n, 0, kPage - n);
    } else {
      p->tail = user;
      p->tail_len = n;
    }
    pieces.push_back(p);
  }
  state->pieces = int64_t(pieces.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++outstanding_;
  }
  // Round-robin over the workers, each handed its share under one lock and one wake-up.
  std::vector<std::vector<Piece*>> share(workers_.size());
  for (Piece* p : pieces) {
    p->state = state;
    p->file = &f;
    p->is_write = is_write;
    share[next_worker_++ % workers_.size()].push_back(p);
  }
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (share[w].empty()) continue;
    {
      std::lock_guard<std::mutex> lock(workers_[w]->mu);
      workers_[w]->queue.insert(workers_[w]->queue.end(), share[w].begin(), share[w].end());
    }
    eventfd_write(workers_[w]->efd, 1);
  }
  return NvmeTicket(state);
}

void NvmeStore::finish_piece(Piece* p, const std::string& error) {
  std::shared_ptr<NvmeTicket::State> st = std::move(p->state);
  delete p;
  if (!error.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (st->error.empty()) st->error = error;
  }
  if (st->pieces.fetch_sub(1) != 1) return;
  std::lock_guard<std::mutex> lock(mu_);
  st->done = true;
  --outstanding_;
  if (!st->error.empty()) failed_.push_back(st);
  cv_.notify_all();
}

void NvmeStore::wait(const NvmeTicket& t) {
  if (!t.state_) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (!t.state_->done) {
    const auto start = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return t.state_->done; });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    (t.state_->is_write ? traffic_.write_wait_s : traffic_.read_wait_s) += s;
  }
  if (!t.state_->error.empty()) {
    t.state_->reported = true;
    throw Error(t.state_->error);
  }
}

NvmeStore::Traffic NvmeStore::traffic() const {
  std::lock_guard<std::mutex> lock(mu_);
  return traffic_;
}

void NvmeStore::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  if (outstanding_ != 0) {
    const auto start = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return outstanding_ == 0; });
    traffic_.wait_all_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::vector<std::shared_ptr<NvmeTicket::State>> failed;
  failed.swap(failed_);
  for (auto& st : failed)
    if (!st->reported) {
      st->reported = true;
      throw Error(st->error);
    }
}

}  // namespace strata::offload
