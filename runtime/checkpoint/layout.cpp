#include "runtime/checkpoint/layout.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <map>
#include <random>
#include <set>

#include <sys/stat.h>

#include <fmt/format.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/error.h"
#include "runtime/util/crc32c.h"

namespace strata::checkpoint {
namespace {

constexpr const char* kManifestFormat = "strata-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kManifestChecksum = "manifest_crc32c";

// CRC32C of the manifest's content without its own checksum, in nlohmann's canonical form (keys
// sorted, no spaces): how the file is laid out does not matter, what it says does.
uint32_t manifest_checksum(const json& body) { return crc32c(body.dump()); }
constexpr const char* kManifest = "manifest.json";
constexpr const char* kLatest = "latest";

std::string staging_name(const std::string& tag) { return "." + tag + ".partial"; }
std::string old_name(const std::string& tag) { return "." + tag + ".old"; }
constexpr const char* kNext = ".next-";  // ".TAG.next-HEX": a re-save `latest` names meanwhile
constexpr size_t kNextHex = 16;
constexpr const char* kLinked = ".link";  // ".TAG.next-HEX.link": its hard-linked copy

void check_kind(const std::string& kind) {
  const bool ok = !kind.empty() && std::all_of(kind.begin(), kind.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
  if (!ok)
    throw Error(fmt::format("checkpoint: state kind '{}' must be [a-z0-9_]+ (e.g. optim_states)",
                            kind));
}

enum class PathKind { kMissing, kFolder, kOther };
PathKind stat_kind(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return PathKind::kMissing;
    throw Error(fmt::format("checkpoint: cannot inspect '{}': {}", path, errno_text(errno)));
  }
  return S_ISDIR(st.st_mode) ? PathKind::kFolder : PathKind::kOther;
}

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r\n") - first + 1);
}

FileEntry entry_of(const TensorFileInfo& info, std::string kind, int rank) {
  FileEntry e;
  e.file = info.path.substr(info.path.find_last_of('/') + 1);
  e.kind = std::move(kind);
  e.rank = rank;
  e.bytes = info.bytes;
  e.crc32c = info.crc32c;
  e.tensors = info.tensors;
  return e;
}

std::string next_name(const std::string& tag) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format(".{}{}{:016x}", tag, kNext, rng());
}

// The tag whose .next folder `name` is (".TAG.next-HEX"), or "" when it is none.
std::string tag_of_next(const std::string& name) {
  const size_t tail = std::char_traits<char>::length(kNext) + kNextHex;
  if (name.size() < 2 + tail || name[0] != '.') return "";
  const std::string tag = name.substr(1, name.size() - 1 - tail);
  const bool hex = std::all_of(name.end() - kNextHex, name.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
  if (!hex || name.compare(1 + tag.size(), tail - kNextHex, kNext) != 0) return "";
  try {
    check_tag(tag);
  } catch (const Error&) {
    return "";
  }
  return tag;
}

// A leftover of `tag`'s: its .next folder or that one's hard-linked copy.
bool is_next_of(const std::string& name, const std::string& tag) {
  const size_t n = std::char_traits<char>::length(kLinked);
  const bool linked = name.size() > n && name.compare(name.size() - n, n, kLinked) == 0;
  return tag_of_next(linked ? name.substr(0, name.size() - n) : name) == tag;
}

// DIR/latest as written (a tag or a .next folder), or nullopt when there is none.
std::optional<std::string> read_latest(const std::string& dir) {
  const std::string path = dir + "/" + kLatest;
  if (stat_kind(path) == PathKind::kMissing) return std::nullopt;
  constexpr uint64_t kMaxBytes = 4096;  // a tag is at most 200 bytes; never slurp a huge file
  if (const uint64_t size = FileReader(path).size(); size > kMaxBytes)
    throw Error(fmt::format("checkpoint: '{}' is {} bytes; it should hold one tag name", path,
                            size));
  return trim(read_file(path));
}

// The tag that `latest`, holding `name`, names.
std::string tag_in_latest(const std::string& dir, const std::string& name) {
  if (std::string tag = tag_of_next(name); !tag.empty()) return tag;
  try {
    check_tag(name);
  } catch (const Error&) {
    throw Error(fmt::format("checkpoint: '{}/{}' holds '{}', which is not a tag", dir, kLatest,
                            name));
  }
  return name;
}

// `latest` names DIR/NEXT, a committed re-save of `tag`: gives it the name DIR/TAG, then points
// `latest` back at TAG. DIR/NEXT is neither moved nor removed before that, so every crash point
// leaves `latest` naming a whole folder; run again after a crash, it finishes the job.
void promote(const std::string& dir, const std::string& tag, const std::string& next) {
  const std::string target = dir + "/" + tag, linked = dir + "/" + next + kLinked,
                    old = dir + "/" + old_name(tag);
  remove_tree(linked);
  link_folder(dir + "/" + next, linked);
  if (stat_kind(target) != PathKind::kMissing) {
    remove_tree(old);
    rename_durable(target, old);
  }
  rename_durable(linked, target);
  remove_stale_temporaries(dir, kLatest);
  write_file_atomic(dir + "/" + kLatest, tag);
  remove_tree(old);
  remove_tree(dir + "/" + next);
}

}  // namespace

// --- names -------------------------------------------------------------------------------------

std::string shared_file_name(const std::string& kind) {
  check_kind(kind);
  return kind + ".ckpt";
}

std::string partition_file_name(const std::string& kind, int rank) {
  check_kind(kind);
  return fmt::format("zero_pp_rank_{}_{}.ckpt", rank, kind);
}

void check_tag(const std::string& tag) {
  const bool ok = !tag.empty() && tag.size() <= 200 && tag[0] != '.' && tag != kLatest &&
                  trim(tag) == tag &&
                  std::none_of(tag.begin(), tag.end(), [](char c) {
                    return c == '/' || c == '\0' || c == '\n' || c == '\r';
                  });
  if (!ok)
    throw Error(fmt::format("checkpoint: tag '{}' is not a plain folder name (not empty, no '/', "
                            "no leading '.', no surrounding spaces, not 'latest')",
                            tag));
}

std::optional<std::string> find_latest(const std::string& dir) {
  const auto name = read_latest(dir);
  if (!name) return std::nullopt;
  return tag_in_latest(dir, *name);
}

// --- manifest ----------------------------------------------------------------------------------

json Manifest::to_json() const {
  std::set<std::string> dtypes;
  json files_json = json::array();
  for (const auto& f : files) {
    json tensors = json::array();
    for (const auto& t : f.tensors) {
      tensors.push_back(spec_to_json(t));
      dtypes.insert(dtype_name(t.dtype));
    }
    files_json.push_back({{"file", f.file},
                          {"kind", f.kind},
                          {"rank", f.rank < 0 ? json(nullptr) : json(f.rank)},
                          {"bytes", f.bytes},
                          {"crc32c", f.crc32c},
                          {"tensors", std::move(tensors)}});
  }
  json j = {{"format", kManifestFormat},
            {"version", kVersion},
            {"tag", tag},
            {"world_size", world_size},
            {"zero_stage", info.zero_stage},
            {"compute_dtype", info.compute_dtype},
            {"master_dtype", info.master_dtype},
            {"dtypes", dtypes},
            {"extra", info.extra},
            {"files", std::move(files_json)}};
  j[kManifestChecksum] = manifest_checksum(j);
  return j;
}

Manifest Manifest::from_json(const json& j, const std::string& where) {
  Manifest m;
  // A count of the manifest in [lo, hi] (an int unless hi says otherwise).
  auto int_in = [&](const json& v, const char* what, int64_t lo, int64_t hi = INT32_MAX) {
    const int64_t n = json_int(v, fmt::format("{}: {}", where, what));
    if (n < lo || n > hi)
      throw Error(fmt::format("{}: {} {} is outside [{}, {}]", where, what, n, lo, hi));
    return n;
  };
  try {
    // The manifest vouches for every file's size and checksum, so it carries its own: a changed
    // byte in a name, a shape or a checksum is refused before anything is read by it.
    if (!j.is_object() || !j.contains(kManifestChecksum))
      throw Error(fmt::format("{}: no \"{}\": the manifest is damaged, or was written by an "
                              "earlier Strata, which did not checksum it",
                              where, kManifestChecksum));
    json body = j;
    body.erase(kManifestChecksum);
    const uint64_t saved = json_uint(j.at(kManifestChecksum), where + ": its checksum");
    if (saved != manifest_checksum(body))
      throw Error(fmt::format("{}: its checksum is 0x{:08x} but it says 0x{:08x}: the manifest is "
                              "damaged (a changed byte); the checkpoint cannot be trusted",
                              where, manifest_checksum(body), saved));
    if (j.at("format") != kManifestFormat)
      throw Error(fmt::format("{}: format {} is not \"{}\"", where, j.at("format").dump(), kManifestFormat));
    if (j.at("version") != kVersion)
      throw Error(fmt::format("{}: version {} is not supported (this build reads {})", where,
                              j.at("version").dump(), kVersion));
    m.tag = j.at("tag").get<std::string>();
    m.world_size = int_in(j.at("world_size"), "world_size", 1);
    m.info.zero_stage = int_in(j.at("zero_stage"), "zero_stage", 0);
    m.info.compute_dtype = j.at("compute_dtype").get<std::string>();
    m.info.master_dtype = j.at("master_dtype").get<std::string>();
    m.info.extra = j.at("extra");
    for (const auto& f : j.at("files")) {
      FileEntry e;
      e.file = f.at("file").get<std::string>();
      e.kind = f.at("kind").get<std::string>();
      e.rank = f.at("rank").is_null() ? -1 : int_in(f.at("rank"), "rank", 0);
      e.bytes = json_uint(f.at("bytes"), where + ": bytes of " + e.file);
      e.crc32c = uint32_t(int_in(f.at("crc32c"), "crc32c", 0, UINT32_MAX));
      for (const auto& t : f.at("tensors")) e.tensors.push_back(spec_from_json(t, where));
      std::string expected;
      try {
        expected = e.rank < 0 ? shared_file_name(e.kind) : partition_file_name(e.kind, e.rank);
      } catch (const Error& bad) {
        throw Error(fmt::format("{}: {}", where, bad.what()));
      }
      if (e.file != expected)
        throw Error(fmt::format("{}: file '{}' does not match its kind '{}' and rank {}", where,
                                e.file, e.kind, e.rank));
      m.files.push_back(std::move(e));
    }
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed manifest ({})", where, e.what()));
  }
  dtype_from_name(m.info.compute_dtype, where + ": compute_dtype");
  dtype_from_name(m.info.master_dtype, where + ": master_dtype");
  // Each file once, and each partitioned kind for every rank 0..world_size-1 (what commit()
  // checks): a reader may then load any rank's partition of any kind the manifest has.
  std::set<std::pair<std::string, int>> seen;
  std::map<std::string, int> partitions;
  for (const auto& f : m.files) {
    if (!seen.insert({f.kind, f.rank}).second)
      throw Error(fmt::format("{}: lists file '{}' twice", where, f.file));
    if (f.rank >= m.world_size)
      throw Error(fmt::format("{}: file '{}' is of rank {} in a world of {}", where, f.file,
                              f.rank, m.world_size));
    if (f.rank >= 0) ++partitions[f.kind];
  }
  for (const auto& [kind, count] : partitions)
    if (count != m.world_size)
      throw Error(fmt::format("{}: lists {} '{}' partitions for a world of {}", where, count,
                              kind, m.world_size));
  return m;
}

const FileEntry* Manifest::find(const std::string& kind, int rank) const {
  for (const auto& f : files)
    if (f.kind == kind && f.rank == rank) return &f;
  return nullptr;
}

// --- writer ------------------------------------------------------------------------------------

CheckpointWriter::CheckpointWriter(std::string dir, std::string tag, int rank, int world_size,
                                   WriteOptions options)
    : dir_(std::move(dir)),
      tag_(std::move(tag)),
      rank_(rank),
      world_size_(world_size),
      options_(options) {
  check_tag(tag_);
  if (world_size_ < 1 || rank_ < 0 || rank_ >= world_size_)
    throw Error(fmt::format("checkpoint: rank {} is outside a world of {}", rank_, world_size_));
  staging_ = dir_ + "/" + staging_name(tag_);
  make_directories(staging_);
}

FileEntry CheckpointWriter::write(const std::string& kind, int file_rank,
                                  const WriteTensors& tensors, const json& scalars,
                                  const std::vector<std::string>& order) {
  if (committed_) throw Error(fmt::format("checkpoint '{}': already committed", tag_));
  for (const auto& f : written_)
    if (f.kind == kind && f.rank == file_rank)
      throw Error(fmt::format("checkpoint '{}': '{}' was already written", tag_, f.file));
  const std::string name =
      file_rank < 0 ? shared_file_name(kind) : partition_file_name(kind, file_rank);
  remove_stale_temporaries(staging_, name);
  TensorFileWriter file(staging_ + "/" + name);
  tensors(file);
  written_.push_back(entry_of(file.commit(scalars, order), kind, file_rank));
  return written_.back();
}

namespace {
CheckpointWriter::WriteTensors each_of(const NamedTensors& tensors) {
  return [&tensors](TensorFileWriter& file) {
    for (const auto& [name, t] : tensors) file.add(name, t);
  };
}
}  // namespace

FileEntry CheckpointWriter::write_partition(const std::string& kind, const NamedTensors& tensors,
                                            const json& scalars) {
  return write(kind, rank_, each_of(tensors), scalars, {});
}

FileEntry CheckpointWriter::stream_partition(const std::string& kind, const WriteTensors& tensors,
                                             const json& scalars,
                                             const std::vector<std::string>& order) {
  return write(kind, rank_, tensors, scalars, order);
}

FileEntry CheckpointWriter::stream_shared(const std::string& kind, const WriteTensors& tensors,
                                          const json& scalars,
                                          const std::vector<std::string>& order) {
  if (rank_ != 0)
    throw Error(fmt::format("checkpoint '{}': rank {} wrote shared state '{}'; only rank 0 writes "
                            "shared files",
                            tag_, rank_, kind));
  return write(kind, -1, tensors, scalars, order);
}

FileEntry CheckpointWriter::write_shared(const std::string& kind, const NamedTensors& tensors,
                                         const json& scalars) {
  if (rank_ != 0)
    throw Error(fmt::format("checkpoint '{}': rank {} wrote shared state '{}'; only rank 0 writes "
                            "shared files",
                            tag_, rank_, kind));
  return write(kind, -1, each_of(tensors), scalars, {});
}

Manifest CheckpointWriter::commit(const RunInfo& info) {
  if (rank_ != 0)
    throw Error(fmt::format("checkpoint '{}': rank {} called commit(); only rank 0 commits", tag_,
                            rank_));
  if (committed_) throw Error(fmt::format("checkpoint '{}': already committed", tag_));
  dtype_from_name(info.compute_dtype, "checkpoint: RunInfo.compute_dtype");
  dtype_from_name(info.master_dtype, "checkpoint: RunInfo.master_dtype");

  // 1. Every expected file: rank 0's own, and each other rank's partition of each kind rank 0
  // wrote (footers only: the whole checkpoint is not read back here).
  Manifest manifest;
  manifest.tag = tag_;
  manifest.world_size = world_size_;
  manifest.info = info;
  for (const auto& mine : written_) {
    manifest.files.push_back(mine);
    if (mine.rank < 0) continue;
    for (int r = 1; r < world_size_; ++r) {
      const std::string path = staging_ + "/" + partition_file_name(mine.kind, r);
      if (stat_kind(path) == PathKind::kMissing)
        throw Error(fmt::format("checkpoint '{}': rank {}'s file '{}' is missing at commit; every "
                                "rank must write its partitions before rank 0 commits (barrier)",
                                tag_, r, path));
      manifest.files.push_back(entry_of(read_tensor_file_info(path), mine.kind, r));
    }
  }

  // 2. The manifest, and nothing else, in the staging folder (a crashed earlier save may have
  // left files of another world size there).
  write_file_atomic(staging_ + "/" + kManifest, manifest.to_json().dump(1) + "\n");
  std::set<std::string> keep{kManifest};
  for (const auto& f : manifest.files) keep.insert(f.file);
  for (const auto& name : list_folder(staging_))
    if (!keep.count(name)) remove_tree(staging_ + "/" + name);

  // 3. Finish a promotion a crash cut short, then clear this tag's .next leftovers (no longer
  // named by `latest`).
  const std::string named = read_latest(dir_).value_or("");
  if (const std::string tag = tag_of_next(named);
      !tag.empty() && stat_kind(dir_ + "/" + named) == PathKind::kFolder)
    promote(dir_, tag, named);
  for (const auto& name : list_folder(dir_))
    if (is_next_of(name, tag_)) remove_tree(dir_ + "/" + name);

  // 4. Publish the folder as DIR/TAG, then `latest`.
  const std::string target = dir_ + "/" + tag_;
  const PathKind existing = stat_kind(target);
  if (existing == PathKind::kOther)
    throw Error(fmt::format("checkpoint: '{}' exists and is not a folder", target));
  const bool swapped = existing == PathKind::kFolder && options_.allow_exchange &&
                       exchange_paths(staging_, target);
  if (existing == PathKind::kFolder && !swapped) {
    // No atomic swap: `latest` names the new folder under a fresh name while it replaces TAG.
    const std::string next = next_name(tag_);
    rename_durable(staging_, dir_ + "/" + next);
    remove_stale_temporaries(dir_, kLatest);
    write_file_atomic(dir_ + "/" + kLatest, next);
    promote(dir_, tag_, next);
  } else {
    if (existing == PathKind::kMissing) rename_durable(staging_, target);
    remove_stale_temporaries(dir_, kLatest);
    write_file_atomic(dir_ + "/" + kLatest, tag_);
    remove_tree(staging_);                     // after the swap: the old folder
    remove_tree(dir_ + "/" + old_name(tag_));  // superseded (a crash's leftover)
  }
  committed_ = true;
  return manifest;
}

// --- reader ------------------------------------------------------------------------------------

CheckpointReader::CheckpointReader(std::string dir, std::string tag, ReadOptions options)
    : dir_(std::move(dir)) {
  if (stat_kind(dir_) != PathKind::kFolder)
    throw Error(fmt::format("checkpoint: folder '{}' does not exist", dir_));
  const std::string latest = read_latest(dir_).value_or("");
  if (tag == kLatest) {
    if (stat_kind(dir_ + "/" + kLatest) == PathKind::kMissing)
      throw Error(fmt::format("checkpoint: '{}/{}' is missing: no checkpoint was committed in '{}' "
                              "(or name a tag)",
                              dir_, kLatest, dir_));
    tag = tag_in_latest(dir_, latest);
  }
  check_tag(tag);
  // While a re-save of TAG replaces DIR/TAG, `latest` names its .next folder: the newest TAG.
  folder_ = dir_ + "/" + (tag_of_next(latest) == tag ? latest : tag);
  if (stat_kind(folder_) != PathKind::kFolder) {
    std::string hint;
    if (stat_kind(dir_ + "/" + old_name(tag)) == PathKind::kFolder)
      hint = fmt::format("; a commit was interrupted while swapping folders: the previous "
                         "checkpoint is '{}/{}', rename it to '{}'",
                         dir_, old_name(tag), folder_);
    else if (stat_kind(dir_ + "/" + staging_name(tag)) == PathKind::kFolder)
      hint = "; a save to this tag started but was never committed";
    throw Error(fmt::format("checkpoint: tag folder '{}' does not exist{}", folder_, hint));
  }
  const std::string manifest_path = folder_ + "/" + kManifest;
  if (stat_kind(manifest_path) == PathKind::kMissing)
    throw Error(fmt::format("checkpoint: '{}' is missing: '{}' is not a committed Strata checkpoint",
                            manifest_path, folder_));
  const std::string text = read_file(manifest_path);
  json j;
  try {
    j = parse_json_bounded(text, manifest_path);
  } catch (const json::exception& e) {
    throw Error(fmt::format("checkpoint: '{}' does not parse: {}", manifest_path, e.what()));
  }
  manifest_ = Manifest::from_json(j, manifest_path);
  // The checksum covers what the manifest says; this covers every byte of it: commit() writes
  // exactly this text, so a changed space or line break is damage too.
  if (j.dump(1) + "\n" != text)
    throw Error(fmt::format("checkpoint: '{}' is not laid out as Strata writes its manifests (a "
                            "changed space or line break): the manifest is damaged",
                            manifest_path));
  if (manifest_.tag != tag)
    throw Error(fmt::format("checkpoint: '{}' names tag '{}', not '{}'", manifest_path,
                            manifest_.tag, tag));

  for (const auto& f : manifest_.files) {
    const std::string path = path_of(f);
    if (stat_kind(path) == PathKind::kMissing)
      throw Error(fmt::format("checkpoint: file '{}' ({}{}) listed in '{}' is missing", path,
                              f.kind, f.rank < 0 ? "" : fmt::format(", rank {}", f.rank),
                              manifest_path));
    const uint64_t size = FileReader(path).size();
    if (size != f.bytes)
      throw Error(fmt::format("checkpoint file '{}' is {} bytes but its manifest says {}: it is "
                              "truncated or from another save",
                              path, size, f.bytes));
  }
  if (options.verify_checksums) verify();
}

void CheckpointReader::verify() const {
  for (const auto& f : manifest_.files) {
    const auto info = verify_tensor_file(path_of(f));
    if (info.crc32c != f.crc32c)
      throw Error(fmt::format("checkpoint file '{}' has CRC32C 0x{:08x} but its manifest says "
                              "0x{:08x}: it is from another save",
                              info.path, info.crc32c, f.crc32c));
  }
}

void CheckpointReader::check_world_size(int world_size, bool can_repartition,
                                        const std::string& kind) const {
  if (world_size == manifest_.world_size || can_repartition) return;
  throw Error(fmt::format("checkpoint '{}' was saved by {} ranks (ZeRO stage {}) but this run has "
                          "{}; its {} cannot be re-partitioned: resume with {} ranks",
                          folder_, manifest_.world_size, manifest_.info.zero_stage, world_size,
                          kind, manifest_.world_size));
}

bool CheckpointReader::has_shared(const std::string& kind) const {
  return manifest_.find(kind, -1) != nullptr;
}

bool CheckpointReader::has_partition(const std::string& kind) const {
  return manifest_.find(kind, 0) != nullptr;
}

const FileEntry& CheckpointReader::entry(const std::string& kind, int rank) const {
  if (const FileEntry* e = manifest_.find(kind, rank)) return *e;
  if (rank < 0)
    throw Error(fmt::format("checkpoint '{}' holds no shared '{}' file", folder_, kind));
  throw Error(fmt::format("checkpoint '{}' holds no '{}' partition for rank {} (saved by {} ranks)",
                          folder_, kind, rank, manifest_.world_size));
}

TensorFile CheckpointReader::load(const FileEntry& e, const std::vector<TensorSpec>* expected) const {
  const std::string path = path_of(e);
  TensorFile file = expected ? load_tensor_file(path, *expected) : load_tensor_file(path);
  if (file.crc32c != e.crc32c)
    throw Error(fmt::format("checkpoint file '{}' has CRC32C 0x{:08x} but its manifest says "
                            "0x{:08x}: it is from another save",
                            path, file.crc32c, e.crc32c));
  check_specs(path, specs_of(file.tensors), e.tensors);  // the manifest lists what it holds
  return file;
}

std::unique_ptr<TensorFileReader> CheckpointReader::open(
    const FileEntry& e, const std::vector<TensorSpec>* expected, bool verify) const {
  const std::string path = path_of(e);
  auto file = std::make_unique<TensorFileReader>(path, verify);
  if (file->info().crc32c != e.crc32c)
    throw Error(fmt::format("checkpoint file '{}' has CRC32C 0x{:08x} but its manifest says "
                            "0x{:08x}: it is from another save",
                            path, file->info().crc32c, e.crc32c));
  check_specs(path, file->info().tensors, e.tensors);
  if (expected) check_specs(path, file->info().tensors, *expected);
  return file;
}

std::unique_ptr<TensorFileReader> CheckpointReader::open_shared(
    const std::string& kind, const std::vector<TensorSpec>* expected, bool verify) const {
  return open(entry(kind, -1), expected, verify);
}

std::unique_ptr<TensorFileReader> CheckpointReader::open_partition(const std::string& kind,
                                                                   int rank, bool verify) const {
  return open(entry(kind, rank), nullptr, verify);
}

TensorFile CheckpointReader::load_shared(const std::string& kind) const {
  return load(entry(kind, -1), nullptr);
}
TensorFile CheckpointReader::load_shared(const std::string& kind,
                                         const std::vector<TensorSpec>& expected) const {
  return load(entry(kind, -1), &expected);
}
TensorFile CheckpointReader::load_partition(const std::string& kind, int rank) const {
  return load(entry(kind, rank), nullptr);
}
TensorFile CheckpointReader::load_partition(const std::string& kind, int rank,
                                            const std::vector<TensorSpec>& expected) const {
  return load(entry(kind, rank), &expected);
}

}  // namespace strata::checkpoint
