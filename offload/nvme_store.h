// The NVMe tier's file store: named files under one folder, read and written asynchronously
// through io_uring with O_DIRECT, every 4 KiB page checked on the way back. It is what the
// swapper (optimizer states, parameters) stands on; it knows nothing of tensors.
//
// Layout. Each store owns `<nvme_path>/strata-<job_id>-rank<rank>/` (mode 0700): several ranks
// of a node share one nvme_path, and a job id keeps jobs apart. A folder left there by a dead run
// of the same job and rank is removed before use, so stale data is never read; the folder is
// removed again when the store is destroyed. A live store holds an flock on its folder's `.lock`
// (the kernel drops it when the process dies, SIGKILL included): a new store removes the folders
// of other jobs whose lock is free, and refuses a folder whose lock is held. Files are created 0600 and preallocated
// (fallocate) to their size rounded up to 4096.
//
// I/O. A read or write is split into pieces of at most `block_size` bytes (aio.block_size), cut
// on the block grid of the file; pieces go round-robin to `intra_op_parallelism` worker threads,
// each owning one ring that keeps up to `queue_depth` pieces in flight and refills as each
// completes. A caller gets a Ticket at once and waits on it (or on wait_all) later; errors
// surface there as strata::Error naming the file, the offset and the errno text. Short transfers
// are resubmitted for the remainder, -EAGAIN / -EINTR resubmitted as they are. Offsets must be
// multiples of 4096 and buffers 4096-aligned (O_DIRECT's rules); lengths are free: a tail short of
// a page goes through a page of the store's own.
//
// Checksums. The store is the only reader of its files within a run, so it keeps one CRC32C per
// 4 KiB page in memory (4 bytes per 4096: 0.1% of the file), computed by the worker for a write
// and checked after a read completes, both while the device works on the rest of the queue (the
// caller keeps a write's buffer unchanged until its ticket is done); a mismatch (a torn write, a
// flipped bit, another process writing the file) is an error naming file and offset, never silent
// garbage. 4 KiB rather than block_size so that any aligned read can be checked. Pages never
// written read back as zeros and check as such.
//
// Errors before anything is written: nvme_path missing (not created: a mistyped mount point would
// otherwise fill the root file system), not a folder, not writable, too little free space
// (statvfs) for what the caller says it will store, or a file system without O_DIRECT (tmpfs before
// Linux 6.6 answers EINVAL). For the last, `allow_buffered` is the stated fallback: ordinary page-cache I/O
// through the same rings, and direct() says false so the caller can say so.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace strata::offload {

// DeepSpeed's `aio` block (runtime/config: AioConfig), as this store reads it.
struct NvmeOptions {
  // Largest single read or write sent to the kernel; a request is cut into pieces of this size
  // (on the file's block_size grid). Must be a multiple of 4096.
  int64_t block_size = 1 << 20;
  // Pieces kept in flight per worker ring.
  int queue_depth = 8;
  // Worker threads, each with its own ring: up to queue_depth * intra_op_parallelism pieces in
  // flight, and checksums computed on that many cores.
  int intra_op_parallelism = 1;
  // true: one io_uring_enter per piece; false: all pieces ready at once go in one call.
  bool single_submit = false;
  // true: refill the queue as each piece completes; false: submit up to queue_depth pieces, wait
  // for all of them, then submit the next batch.
  bool overlap_events = true;
  // On a file system without O_DIRECT, use buffered I/O instead of refusing (see direct()).
  bool allow_buffered = false;
  // Keep and check the per-page CRC32C (off only to measure what it costs).
  bool checksums = true;
};

// A read or write in flight. Copyable; wait on it with NvmeStore::wait.
class NvmeTicket {
 public:
  NvmeTicket() = default;
  bool done() const;

 private:
  friend class NvmeStore;
  struct State;
  explicit NvmeTicket(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};

class NvmeStore {
 public:
  using FileId = int;

  // Makes the fresh folder and checks O_DIRECT there. `expected_bytes`: what the caller will
  // store in all (0: unknown); checked against the free space now, and each create() checks its
  // own size again. `job_id`: letters, digits, '.', '_', '-'.
  NvmeStore(const std::string& nvme_path, const std::string& job_id, int rank,
            const NvmeOptions& options = {}, uint64_t expected_bytes = 0);
  // Waits for every request, closes the files and removes the folder. Errors not yet reported
  // by wait/wait_all are lost here (a destructor does not throw): wait_all first to see them.
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  // A new file of `bytes` (readable and writable in [0, bytes)); the name must be new to this
  // store and a plain file name (no '/').
  FileId create(const std::string& name, uint64_t bytes);
  FileId file(const std::string& name) const;  // throws for an unknown name
  const std::string& path(FileId f) const;
  uint64_t size(FileId f) const;

  // `buffer` must stay valid, and (for write) unchanged, until the ticket is done.
  NvmeTicket write(FileId f, uint64_t offset, const void* buffer, uint64_t bytes);
  NvmeTicket read(FileId f, uint64_t offset, void* buffer, uint64_t bytes);
  // Blocks until the request is done; throws its error, if any.
  void wait(const NvmeTicket& t);
  // Blocks until every request is done; throws the first error not yet thrown by wait().
  void wait_all();

  // What went through the store since it was made: bytes submitted for reading and writing, and
  // the time callers spent blocked in wait() on a read, on a write, and in wait_all() (time a
  // read ahead did not hide shows here).
  struct Traffic {
    uint64_t read_bytes = 0, written_bytes = 0;
    double read_wait_s = 0, write_wait_s = 0, wait_all_s = 0;
  };
  Traffic traffic() const;

  const std::string& folder() const { return folder_; }
  // Folders under nvme_path that stores of dead processes left behind (their lock was free),
  // removed when this store started.
  const std::vector<std::string>& removed_abandoned() const { return removed_abandoned_; }
  bool direct() const { return direct_; }  // false: buffered fallback in use
  const NvmeOptions& options() const { return options_; }

  // Tests only: later stores behave as if the file system refused O_DIRECT (tmpfs does before
  // Linux 6.6 only, and a test machine may have no such file system).
  static void pretend_no_direct_for_tests(bool on);

  // The folder a store of this job and rank uses under nvme_path.
  static std::string folder_for(const std::string& nvme_path, const std::string& job_id, int rank);

 private:
  struct File;
  struct Piece;
  struct Worker;
  NvmeTicket submit(bool is_write, FileId f, uint64_t offset, void* buffer, uint64_t bytes);
  void finish_piece(Piece* p, const std::string& error);
  void check_space(uint64_t bytes, const char* what) const;
  void remove_folder_quietly() noexcept;  // the store's folder, for the destructor and failures
  void take_folder_lock();
  static bool folder_in_use(const std::string& folder);
  void remove_abandoned_folders(const std::string& nvme_path);
  File& file_at(FileId f, const char* what) const;

  NvmeOptions options_;
  std::string folder_;
  int lock_fd_ = -1;  // the folder's .lock, held while the store lives
  std::vector<std::string> removed_abandoned_;
  bool direct_ = true;
  std::vector<std::unique_ptr<File>> files_;
  std::vector<std::unique_ptr<Worker>> workers_;
  size_t next_worker_ = 0;

  mutable std::mutex mu_;  // guards the fields below and every State's done/error
  std::condition_variable cv_;
  int64_t outstanding_ = 0;
  std::vector<std::shared_ptr<NvmeTicket::State>> failed_;  // errors wait_all has to report
  Traffic traffic_;  // guarded by mu_
};

}  // namespace strata::offload
