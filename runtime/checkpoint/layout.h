// The checkpoint folder: DeepSpeed's layout, with a manifest and a crash-safe commit.
//
//   DIR/
//     latest                              newest committed tag (text, no newline, as DeepSpeed)
//     TAG/                                one checkpoint
//       manifest.json                     world size, ZeRO stage, dtypes, and per file: name,
//                                         kind, rank, bytes, CRC32C, every tensor's name, dtype
//                                         and shape
//       KIND.ckpt                         state every rank shares, written by rank 0
//                                         (e.g. model_states.ckpt)
//       zero_pp_rank_R_KIND.ckpt          rank R's partition (e.g. zero_pp_rank_3_optim_states.ckpt)
//     .TAG.partial/                       a save in progress; becomes TAG at commit
//     .TAG.next-HEX/                      a re-save of TAG, committed, while it replaces TAG/
//                                         (only where folders cannot be swapped; see below)
//
// Each *.ckpt file is a tensor file (tensor_file.h; written as version 2, read as 1 or 2). Every rank writes into DIR/.TAG.partial/;
// rank 0's commit(), after every rank has written (the caller barriers), checks that each
// expected file is there, writes the manifest, publishes the folder as DIR/TAG and only then
// rewrites `latest`. A new tag is one rename. A re-saved tag is swapped in by one atomic
// renameat2 RENAME_EXCHANGE. Where the file system lacks it (NFS, Lustre), the folder is renamed
// to a fresh DIR/.TAG.next-HEX, `latest` is pointed at that name, a hard-linked copy of it
// replaces DIR/TAG (through DIR/.TAG.old), and `latest` names TAG again: no folder is moved or
// removed while `latest` names it. Meanwhile loading TAG reads the folder `latest` names, and
// the next commit finishes a promotion a crash cut short. So a crash at any moment leaves
// `latest`, and each tag, naming a complete checkpoint. The folder must be one file system that
// every rank sees (shared storage across nodes). The caller barriers twice: after every rank's
// writes (before commit) and after commit (before any rank starts another save, which would
// reuse DIR/.TAG.partial).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/checkpoint/tensor_file.h"
#include "runtime/checkpoint/tensor_stream.h"

namespace strata::checkpoint {

// What the manifest records about the run beside its files.
struct RunInfo {
  int zero_stage = 0;
  std::string compute_dtype = "F32";  // the model's parameters in training (dtype_name())
  std::string master_dtype = "F32";   // the optimizer's master weights
  json extra = json::object();        // the engine's own small facts (steps, config digest...)
};

struct FileEntry {
  std::string file;  // name inside TAG/
  std::string kind;  // "model_states", "optim_states", ...
  int rank = -1;     // the partition's rank; -1 for a shared file
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  std::vector<TensorSpec> tensors;
};

struct Manifest {
  std::string tag;
  int world_size = 1;
  RunInfo info;
  std::vector<FileEntry> files;

  json to_json() const;
  // `where` names the manifest file in errors.
  static Manifest from_json(const json& j, const std::string& where);
  // The file of `kind` for `rank` (-1: the shared one), or null.
  const FileEntry* find(const std::string& kind, int rank) const;
};

std::string shared_file_name(const std::string& kind);
std::string partition_file_name(const std::string& kind, int rank);
// A tag is one plain folder name: not empty, no '/', no leading '.', not "latest".
void check_tag(const std::string& tag);
// The tag in DIR/latest (also while it names TAG's .next folder), or nullopt when there is none
// (no checkpoint committed yet).
std::optional<std::string> find_latest(const std::string& dir);

struct WriteOptions {
  // false: commit as where the file system cannot swap folders (NFS, Lustre), for tests.
  bool allow_exchange = true;
};

class CheckpointWriter {
 public:
  // Every rank constructs one with the same dir and tag; creates DIR/.TAG.partial/.
  CheckpointWriter(std::string dir, std::string tag, int rank, int world_size,
                   WriteOptions options = {});

  // This rank's partition of `kind` (each rank writes one per partitioned kind; rank 0 writes
  // every kind that any rank writes). Kinds are [a-z0-9_]+.
  FileEntry write_partition(const std::string& kind, const NamedTensors& tensors,
                            const json& scalars = json::object());
  // State all ranks share; rank 0 only.
  FileEntry write_shared(const std::string& kind, const NamedTensors& tensors,
                         const json& scalars = json::object());
  // The same, for state that does not exist whole in memory: `tensors` writes it piece by piece
  // into the file (tensor_stream.h); the footer lists them in `order` (empty: as written).
  using WriteTensors = std::function<void(TensorFileWriter&)>;
  FileEntry stream_partition(const std::string& kind, const WriteTensors& tensors,
                             const json& scalars = json::object(),
                             const std::vector<std::string>& order = {});
  FileEntry stream_shared(const std::string& kind, const WriteTensors& tensors,
                          const json& scalars = json::object(),
                          const std::vector<std::string>& order = {});

  // Rank 0, after every rank's writes have returned: checks every expected file, writes the
  // manifest, publishes DIR/TAG and then `latest`. Returns the manifest.
  Manifest commit(const RunInfo& info);

  const std::string& staging_folder() const { return staging_; }

 private:
  FileEntry write(const std::string& kind, int file_rank, const WriteTensors& tensors,
                  const json& scalars, const std::vector<std::string>& order);

  std::string dir_, tag_, staging_;
  int rank_, world_size_;
  WriteOptions options_;
  std::vector<FileEntry> written_;
  bool committed_ = false;
};

struct ReadOptions {
  // Check every file's CRC32C when the reader is built (reads the whole checkpoint). Off, the
  // reader checks presence and sizes; each load still verifies its own file.
  bool verify_checksums = true;
};

class CheckpointReader {
 public:
  // tag "latest" follows DIR/latest. A tag that `latest` names by its .next folder (a commit
  // under way or cut short) is read from there. Reads the manifest and checks that every file
  // it lists is there with its size (and checksum, per `options`).
  CheckpointReader(std::string dir, std::string tag = "latest", ReadOptions options = {});

  const std::string& tag() const { return manifest_.tag; }
  const std::string& folder() const { return folder_; }  // DIR/TAG (or its .next folder)
  const Manifest& manifest() const { return manifest_; }
  int world_size() const { return manifest_.world_size; }
  int zero_stage() const { return manifest_.info.zero_stage; }

  // Throws when this run's world size differs from the checkpoint's and the caller cannot
  // re-partition (`kind` names what would need it, for the message).
  void check_world_size(int world_size, bool can_repartition = false,
                        const std::string& kind = "partitioned state") const;

  bool has_shared(const std::string& kind) const;
  bool has_partition(const std::string& kind) const;
  std::string path_of(const FileEntry& entry) const { return folder_ + "/" + entry.file; }

  // Loads (verifying the checksum against the file's tail and the manifest). With `expected`,
  // names, shapes and dtypes must match it exactly (the model's tensors: specs_of(...)).
  TensorFile load_shared(const std::string& kind) const;
  TensorFile load_shared(const std::string& kind, const std::vector<TensorSpec>& expected) const;
  TensorFile load_partition(const std::string& kind, int rank) const;
  TensorFile load_partition(const std::string& kind, int rank,
                            const std::vector<TensorSpec>& expected) const;

  // A file opened for reading by range (tensor_stream.h): its tail's checksum and its footer
  // checked against the manifest (and `expected`, when given), and with `verify` its bytes
  // against the checksum in one streaming pass, before any tensor is read (without: call the
  // reader's verify() before using it).
  std::unique_ptr<TensorFileReader> open_shared(const std::string& kind,
                                                const std::vector<TensorSpec>* expected = nullptr,
                                                bool verify = true) const;
  std::unique_ptr<TensorFileReader> open_partition(const std::string& kind, int rank,
                                                   bool verify = true) const;

  // Every file's checksum (what the constructor does with verify_checksums).
  void verify() const;

 private:
  const FileEntry& entry(const std::string& kind, int rank) const;
  TensorFile load(const FileEntry& entry, const std::vector<TensorSpec>* expected) const;
  std::unique_ptr<TensorFileReader> open(const FileEntry& entry,
                                         const std::vector<TensorSpec>* expected,
                                         bool verify) const;

  std::string dir_, folder_;
  Manifest manifest_;
};

}  // namespace strata::checkpoint
