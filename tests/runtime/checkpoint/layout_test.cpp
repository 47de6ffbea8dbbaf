// The checkpoint folder: layout and manifest, `latest` moved only by commit(), re-saving over
// the latest tag, and the reader's errors (each naming the file, the rank or the tensor).
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/error.h"
#include "runtime/util/crc32c.h"
#include "tests/runtime/checkpoint/child_process.h"
#include "tests/runtime/checkpoint/crash_workload.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/runtime/checkpoint/test_util.h"

namespace ckpt = strata::checkpoint;
namespace fs = std::filesystem;
using strata::test::ScratchDir;
using strata::test::error_of;
using strata::test::entries;
using strata::test::same_bits;
using strata::test::slurp;

namespace {

ckpt::NamedTensors model_state(float value, int64_t hidden = 8) {
  return {{"embed.weight", torch::full({16, hidden}, value)},
          {"head.bias", torch::full({4}, value, torch::kBFloat16)}};
}

ckpt::NamedTensors optim_state(float value, int rank) {
  return {{"exp_avg", torch::full({10}, value + rank)},
          {"exp_avg_sq", torch::full({10}, value * 2 + rank)},
          {"step", torch::tensor(int64_t(rank))}};
}

// Every rank's writer, in one process; returns the writers (rank 0 first) uncommitted.
std::vector<ckpt::CheckpointWriter> write_all(const std::string& dir, const std::string& tag,
                                              int world, float value) {
  std::vector<ckpt::CheckpointWriter> writers;
  for (int r = 0; r < world; ++r) writers.emplace_back(dir, tag, r, world);
  writers[0].write_shared("model_states", model_state(value), {{"global_steps", int(value)}});
  for (int r = 0; r < world; ++r)
    writers[r].write_partition("optim_states", optim_state(value, r), {{"rank", r}});
  return writers;
}

ckpt::Manifest save(const std::string& dir, const std::string& tag, int world, float value,
                    ckpt::WriteOptions options = {}) {
  ckpt::RunInfo info;
  info.zero_stage = 2;
  info.compute_dtype = "BF16";
  info.extra = {{"global_steps", int(value)}};
  std::vector<ckpt::CheckpointWriter> writers;
  for (int r = 0; r < world; ++r) writers.emplace_back(dir, tag, r, world, options);
  writers[0].write_shared("model_states", model_state(value), {{"global_steps", int(value)}});
  for (int r = 0; r < world; ++r)
    writers[r].write_partition("optim_states", optim_state(value, r), {{"rank", r}});
  return writers[0].commit(info);
}

float model_value(const ckpt::CheckpointReader& reader) {
  return reader.load_shared("model_states").at("embed.weight")[0][0].item<float>();
}

}  // namespace

TEST(CheckpointLayout, WritesDeepSpeedStyleFoldersAndAManifest) {
  ScratchDir tmp;
  const std::string dir = (tmp.path() / "ckpts").string();  // created by the writer
  const auto manifest = save(dir, "global_step10", 3, 10.0f);

  EXPECT_EQ(entries(dir), (std::vector<std::string>{"global_step10", "latest"}));
  EXPECT_EQ(slurp(fs::path(dir) / "latest"), "global_step10");
  EXPECT_EQ(entries(fs::path(dir) / "global_step10"),
            (std::vector<std::string>{"manifest.json", "model_states.ckpt",
                                      "zero_pp_rank_0_optim_states.ckpt",
                                      "zero_pp_rank_1_optim_states.ckpt",
                                      "zero_pp_rank_2_optim_states.ckpt"}));

  const auto j = ckpt::json::parse(slurp(fs::path(dir) / "global_step10" / "manifest.json"));
  EXPECT_EQ(j.at("format"), "strata-checkpoint");
  EXPECT_EQ(j.at("tag"), "global_step10");
  EXPECT_EQ(j.at("world_size"), 3);
  EXPECT_EQ(j.at("zero_stage"), 2);
  EXPECT_EQ(j.at("compute_dtype"), "BF16");
  EXPECT_EQ(j.at("master_dtype"), "F32");
  EXPECT_EQ(j.at("dtypes"), (ckpt::json{"BF16", "F32", "I64"}));
  EXPECT_EQ(j.at("extra").at("global_steps"), 10);
  ASSERT_EQ(j.at("files").size(), 4u);
  for (const auto& f : j.at("files")) {
    const auto path = fs::path(dir) / "global_step10" / f.at("file").get<std::string>();
    const std::string bytes = slurp(path);
    EXPECT_EQ(f.at("bytes"), bytes.size());
    // The manifest's checksum, recomputed by the byte-at-a-time CRC32C of the monitor layer.
    EXPECT_EQ(f.at("crc32c"), strata::crc32c(bytes.data(), bytes.size() - 16));
  }
  const auto& rank2 = j.at("files")[3];
  EXPECT_EQ(rank2.at("file"), "zero_pp_rank_2_optim_states.ckpt");
  EXPECT_EQ(rank2.at("kind"), "optim_states");
  EXPECT_EQ(rank2.at("rank"), 2);
  EXPECT_EQ(rank2.at("tensors")[0],
            (ckpt::json{{"name", "exp_avg"}, {"dtype", "F32"}, {"shape", {10}}}));
  EXPECT_EQ(rank2.at("tensors")[2],
            (ckpt::json{{"name", "step"}, {"dtype", "I64"}, {"shape", ckpt::json::array()}}));
  EXPECT_TRUE(j.at("files")[0].at("rank").is_null());
  EXPECT_EQ(j.at("files")[0].at("tensors")[1].at("dtype"), "BF16");

  // The reader sees the same manifest and every file.
  const ckpt::CheckpointReader reader(dir);
  EXPECT_EQ(reader.tag(), "global_step10");
  EXPECT_EQ(reader.world_size(), 3);
  EXPECT_EQ(reader.zero_stage(), 2);
  EXPECT_EQ(reader.manifest().to_json(), manifest.to_json());
  EXPECT_TRUE(reader.has_shared("model_states"));
  EXPECT_TRUE(reader.has_partition("optim_states"));
  EXPECT_FALSE(reader.has_partition("model_states"));
  for (int r = 0; r < 3; ++r) {
    const auto part = reader.load_partition("optim_states", r);
    EXPECT_EQ(part.at("exp_avg")[0].item<float>(), 10.0f + r);
    EXPECT_EQ(part.scalars.at("rank"), r);
  }
  EXPECT_EQ(reader.load_shared("model_states").scalars.at("global_steps"), 10);
}

TEST(CheckpointLayout, LatestMovesOnlyAtCommit) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save(dir, "a", 2, 1.0f);
  auto writers = write_all(dir, "b", 2, 2.0f);
  // Everything written, nothing committed: `latest` and the reader still see "a".
  EXPECT_EQ(*ckpt::find_latest(dir), "a");
  EXPECT_FALSE(fs::exists(fs::path(dir) / "b"));
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 1.0f);
  const auto msg = error_of([&] { ckpt::CheckpointReader(dir, "b"); });
  EXPECT_NE(msg.find("started but was never committed"), std::string::npos) << msg;

  ckpt::RunInfo info;
  writers[0].commit(info);
  EXPECT_EQ(*ckpt::find_latest(dir), "b");
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 2.0f);
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir, "a")), 1.0f);  // older tags stay readable
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"a", "b", "latest"}));
}

TEST(CheckpointLayout, ResavingTheLatestTagKeepsItReadableUntilCommit) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save(dir, "last", 2, 1.0f);
  auto writers = write_all(dir, "last", 2, 2.0f);
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 1.0f);  // old files untouched
  writers[0].commit({});
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 2.0f);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"last", "latest"}));
}

// Without RENAME_EXCHANGE (NFS, Lustre) a re-save goes through DIR/.TAG.next-HEX and leaves the
// same folders as with it.
TEST(CheckpointLayout, ResavingTheLatestTagWithoutExchange) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  const ckpt::WriteOptions no_exchange{false};
  save(dir, "last", 2, 1.0f, no_exchange);
  save(dir, "other", 2, 2.0f, no_exchange);
  save(dir, "last", 2, 3.0f, no_exchange);
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 3.0f);
  save(dir, "last", 2, 4.0f, no_exchange);
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 4.0f);
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir, "last")), 4.0f);
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir, "other")), 2.0f);
  EXPECT_EQ(slurp(fs::path(dir) / "latest"), "last");
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"last", "latest", "other"}));
}

// A crash in the middle of that: `latest` names the .next folder, which both `latest` and the
// tag load from (DIR/TAG may be gone or old); the next commit, of any tag, finishes the job and
// removes the leftovers; a load leaves them alone.
TEST(CheckpointLayout, LatestNamingANextFolderLoadsAndTheNextCommitFinishesIt) {
  ScratchDir tmp;
  const std::string dir = (tmp.path() / "ckpts").string();
  const fs::path d = dir;
  const std::string next = ".t.next-00000000000000ab";
  save(dir, "t", 2, 3.0f);
  fs::rename(d / "t", tmp.path() / "held");
  save(dir, "u", 2, 2.0f);
  save(dir, "t", 2, 1.0f);                  // an older DIR/t
  fs::rename(tmp.path() / "held", d / next);  // a re-save renamed to .next, `latest` names it
  ckpt::write_file_atomic(dir + "/latest", next);
  fs::create_directories(d / ".t.next-00000000000000ac");  // from a crash before `latest` moved
  fs::create_directories(d / (next + ".link"));            // a half-made hard-linked copy
  for (const bool t_exists : {true, false}) {
    if (!t_exists) fs::rename(d / "t", d / ".t.old");
    const ckpt::CheckpointReader latest(dir);
    EXPECT_EQ(latest.tag(), "t");
    EXPECT_EQ(latest.folder(), dir + "/" + next);
    EXPECT_EQ(model_value(latest), 3.0f);
    EXPECT_EQ(model_value(ckpt::CheckpointReader(dir, "t")), 3.0f);
    EXPECT_EQ(model_value(ckpt::CheckpointReader(dir, "u")), 2.0f);
    EXPECT_EQ(*ckpt::find_latest(dir), "t");
  }
  save(dir, "u", 2, 4.0f, {false});
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 4.0f);
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir, "t")), 3.0f);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{".t.next-00000000000000ac", "latest", "t",
                                                    "u"}));
  save(dir, "t", 2, 5.0f, {false});  // clears t's leftovers
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "t", "u"}));
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir, "t")), 5.0f);
}

TEST(CheckpointLayout, CommitPrunesWhatACrashedSaveLeftInTheStagingFolder) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  const auto staging = fs::path(dir) / ".t.partial";
  fs::create_directories(staging / "junk_folder");
  std::ofstream(staging / "zero_pp_rank_7_optim_states.ckpt") << "from an 8-rank run";
  std::ofstream(staging / ".model_states.ckpt.tmp-1-2") << "a torn temporary";
  save(dir, "t", 2, 1.0f);
  EXPECT_EQ(entries(fs::path(dir) / "t"),
            (std::vector<std::string>{"manifest.json", "model_states.ckpt",
                                      "zero_pp_rank_0_optim_states.ckpt",
                                      "zero_pp_rank_1_optim_states.ckpt"}));
  EXPECT_FALSE(fs::exists(staging));
}

TEST(CheckpointLayout, CommitRefusesMissingRanksAndMisuse) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save(dir, "good", 3, 1.0f);
  ckpt::CheckpointWriter w0(dir, "bad", 0, 3), w1(dir, "bad", 1, 3);
  w0.write_shared("model_states", model_state(2.0f));
  w0.write_partition("optim_states", optim_state(2.0f, 0));
  w1.write_partition("optim_states", optim_state(2.0f, 1));
  auto msg = error_of([&] { w0.commit({}); });  // rank 2 never wrote
  EXPECT_NE(msg.find("rank 2's file"), std::string::npos) << msg;
  EXPECT_NE(msg.find("zero_pp_rank_2_optim_states.ckpt"), std::string::npos) << msg;
  EXPECT_EQ(*ckpt::find_latest(dir), "good");
  EXPECT_FALSE(fs::exists(fs::path(dir) / "bad"));

  msg = error_of([&] { w1.write_shared("model_states", model_state(2.0f)); });
  EXPECT_NE(msg.find("only rank 0 writes shared files"), std::string::npos) << msg;
  msg = error_of([&] { w1.commit({}); });
  EXPECT_NE(msg.find("only rank 0 commits"), std::string::npos) << msg;
  msg = error_of([&] { w0.write_partition("optim_states", optim_state(2.0f, 0)); });
  EXPECT_NE(msg.find("already written"), std::string::npos) << msg;
  msg = error_of([&] { w0.write_partition("Optim-States", {}); });
  EXPECT_NE(msg.find("[a-z0-9_]+"), std::string::npos) << msg;
  for (const std::string tag : {"", "latest", ".hidden", "a/b", " padded"}) {
    msg = error_of([&] { ckpt::CheckpointWriter(dir, tag, 0, 1); });
    EXPECT_NE(msg.find("not a plain folder name"), std::string::npos) << "'" << tag << "': " << msg;
  }
  msg = error_of([&] { ckpt::CheckpointWriter(dir, "x", 3, 3); });
  EXPECT_NE(msg.find("rank 3 is outside a world of 3"), std::string::npos) << msg;
  std::ofstream(fs::path(dir) / "a_file") << "x";
  msg = error_of([&] { ckpt::CheckpointWriter((fs::path(dir) / "a_file").string(), "t", 0, 1); });
  EXPECT_NE(msg.find("exists and is not a folder"), std::string::npos) << msg;
}

TEST(CheckpointReader, ErrorsForMissingPieces) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  auto msg = error_of([&] { ckpt::CheckpointReader((tmp.path() / "nowhere").string()); });
  EXPECT_NE(msg.find("nowhere' does not exist"), std::string::npos) << msg;
  msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find(dir + "/latest' is missing"), std::string::npos) << msg;
  EXPECT_FALSE(ckpt::find_latest(dir).has_value());

  save(dir, "s1", 2, 1.0f);
  msg = error_of([&] { ckpt::CheckpointReader r(dir, "s2"); });
  EXPECT_NE(msg.find("tag folder '" + dir + "/s2' does not exist"), std::string::npos) << msg;
  ckpt::write_file_atomic(dir + "/latest", "s2");  // `latest` naming a folder that is gone
  msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find(dir + "/s2"), std::string::npos) << msg;
  // `latest` naming a folder outside the checkpoint folder (a path, a parent, an absolute path)
  // is refused before anything is opened there.
  for (const std::string outside : {"../s1", "/tmp", "s1/../../x", ".."}) {
    ckpt::write_file_atomic(dir + "/latest", outside);
    msg = error_of([&] { ckpt::CheckpointReader r(dir); });
    EXPECT_NE(msg.find("holds '" + outside + "', which is not a tag"), std::string::npos) << msg;
  }
  ckpt::write_file_atomic(dir + "/latest", "s1\n");  // a hand-written newline is fine

  const auto shard = fs::path(dir) / "s1" / "zero_pp_rank_1_optim_states.ckpt";
  fs::rename(shard, tmp.path() / "moved");
  msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find(shard.string() + "' (optim_states, rank 1)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("is missing"), std::string::npos) << msg;
  fs::rename(tmp.path() / "moved", shard);

  fs::rename(fs::path(dir) / "s1" / "manifest.json", tmp.path() / "manifest");
  msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find("manifest.json' is missing"), std::string::npos) << msg;
  fs::rename(tmp.path() / "manifest", fs::path(dir) / "s1" / "manifest.json");
  EXPECT_NO_THROW(ckpt::CheckpointReader r(dir));
}

// The manifest vouches for every file's size and checksum, so it is checksummed itself, and its
// bytes must be exactly as commit() wrote them: a flipped bit anywhere in it is refused, also
// one that would only change its layout.
TEST(CheckpointReader, EveryFlippedBitOfTheManifestIsRefused) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  const auto saved = save(dir, "s1", 2, 1.0f);
  const auto path = fs::path(dir) / "s1" / "manifest.json";
  const std::string original = slurp(path);
  int refused = 0, harmless = 0;
  for (size_t i = 0; i < original.size(); ++i)
    for (int bit : {0, 5}) {
      std::string damaged = original;
      damaged[i] = char(damaged[i] ^ (1 << bit));
      ckpt::write_file_atomic(path.string(), damaged);
      try {
        ckpt::CheckpointReader reader(dir);
        EXPECT_EQ(reader.manifest().to_json(), saved.to_json()) << "byte " << i << " bit " << bit;
        ++harmless;
      } catch (const strata::Error& e) {
        ++refused;
        EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos) << e.what();
      }
    }
  ckpt::write_file_atomic(path.string(), original);
  EXPECT_NO_THROW(ckpt::CheckpointReader r(dir));
  EXPECT_EQ(harmless, 0);
  std::printf("manifest of %zu bytes: %d flips refused, %d changed only its layout\n",
              original.size(), refused, harmless);
}

// An older Strata, where renameat2 could not swap folders, renamed DIR/TAG to DIR/.TAG.old
// first; a crash right then left `latest` naming a missing folder: the error says where it is.
TEST(CheckpointReader, InterruptedFolderSwapNamesTheOldFolder) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save(dir, "t", 1, 1.0f);
  fs::rename(fs::path(dir) / "t", fs::path(dir) / ".t.old");
  const auto msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find("the previous checkpoint is '" + dir + "/.t.old', rename it to '" + dir + "/t'"),
            std::string::npos)
      << msg;
  fs::rename(fs::path(dir) / ".t.old", fs::path(dir) / "t");
  EXPECT_EQ(model_value(ckpt::CheckpointReader(dir)), 1.0f);
}

TEST(CheckpointReader, CorruptTruncatedOrForeignShardsAreErrorsNamingTheFile) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save(dir, "old", 2, 1.0f);
  save(dir, "new", 2, 2.0f);
  const auto shard = fs::path(dir) / "new" / "zero_pp_rank_1_optim_states.ckpt";
  const std::string good = slurp(shard);

  std::string bad = good;
  bad[bad.size() / 3] ^= 0x10;
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bad;
  auto msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find("'" + shard.string() + "' is corrupt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("CRC32C mismatch"), std::string::npos) << msg;
  // Without the up-front check, the load of that shard finds it (and the others still load).
  const ckpt::CheckpointReader lazy(dir, "latest", ckpt::ReadOptions{false});
  EXPECT_NO_THROW(lazy.load_partition("optim_states", 0));
  msg = error_of([&] { lazy.load_partition("optim_states", 1); });
  EXPECT_NE(msg.find(shard.string()), std::string::npos) << msg;

  std::ofstream(shard, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() - 100);
  msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find(shard.string() + "' is " + std::to_string(good.size() - 100) + " bytes"),
            std::string::npos)
      << msg;

  // A valid file of the same size from another save: only the manifest's checksum tells.
  fs::copy_file(fs::path(dir) / "old" / "zero_pp_rank_1_optim_states.ckpt", shard,
                fs::copy_options::overwrite_existing);
  ASSERT_EQ(fs::file_size(shard), good.size());
  msg = error_of([&] { ckpt::CheckpointReader r(dir); });
  EXPECT_NE(msg.find(shard.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("from another save"), std::string::npos) << msg;
  msg = error_of([&] { lazy.load_partition("optim_states", 1); });
  EXPECT_NE(msg.find("from another save"), std::string::npos) << msg;
}

TEST(CheckpointReader, WorldSizeAndModelShapeMismatches) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save(dir, "w4", 4, 1.0f);
  const ckpt::CheckpointReader reader(dir);
  EXPECT_NO_THROW(reader.check_world_size(4));
  EXPECT_NO_THROW(reader.check_world_size(2, /*can_repartition=*/true));
  auto msg = error_of([&] { reader.check_world_size(2, false, "optimizer state"); });
  EXPECT_NE(msg.find("saved by 4 ranks (ZeRO stage 2) but this run has 2"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("optimizer state cannot be re-partitioned"), std::string::npos) << msg;
  msg = error_of([&] { reader.load_partition("optim_states", 4); });
  EXPECT_NE(msg.find("no 'optim_states' partition for rank 4 (saved by 4 ranks)"),
            std::string::npos)
      << msg;
  msg = error_of([&] { reader.load_shared("lr_scheduler"); });
  EXPECT_NE(msg.find("no shared 'lr_scheduler' file"), std::string::npos) << msg;

  // The model the run builds, as specs: same names, one wider tensor.
  EXPECT_NO_THROW(reader.load_shared("model_states", ckpt::specs_of(model_state(0.0f))));
  msg = error_of([&] { reader.load_shared("model_states", ckpt::specs_of(model_state(0.0f, 12))); });
  EXPECT_NE(msg.find("model_states.ckpt': tensor 'embed.weight' has shape [16, 8] in the file but "
                     "[16, 12] is expected"),
            std::string::npos)
      << msg;
}

namespace {

// kill -9 a process that saves 40 MiB checkpoints (5 files) in a loop over two tags: after
// every kill, `latest` loads, every checksum holds, and all files are of one and the same step.
void kill_nine_at_random_moments(bool allow_exchange) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  const ckpt::WriteOptions options{allow_exchange};
  const auto t0 = std::chrono::steady_clock::now();
  strata::test::save_crash_step(dir, 0, options);
  const auto save_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  ASSERT_EQ(strata::test::verify_crash_latest(dir), 0);

  std::mt19937 rng(std::random_device{}());
  int64_t last = 0, mid_save = 0;
  constexpr int kKills = 12;
  for (int kill = 0; kill < kKills; ++kill) {
    std::vector<std::string> args{"save-loop", dir, std::to_string(last + 1)};
    if (!allow_exchange) args.push_back("no-exchange");
    strata::test::KilledChild child(args);
    ASSERT_TRUE(child.started());
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % (3 * save_ms + 50)));
    EXPECT_TRUE(child.kill_now());
    mid_save += fs::exists(fs::path(dir) / ".t0.partial") || fs::exists(fs::path(dir) / ".t1.partial");
    int64_t step = -1;
    try {
      step = strata::test::verify_crash_latest(dir);
    } catch (const std::exception& e) {
      FAIL() << "after kill " << kill << ": " << e.what();
    }
    EXPECT_GE(step, last);
    last = step;
  }
  std::cout << "[          ] one save " << save_ms << " ms; " << kKills << " kills, " << mid_save
            << " of them mid-save; last committed step " << last << "\n";
  EXPECT_GT(mid_save, 0);
  // After the kills a clean save still works.
  strata::test::save_crash_step(dir, last + 1, options);
  EXPECT_EQ(strata::test::verify_crash_latest(dir), last + 1);
}

// A process that saves step `step` and SIGKILLs itself before its k-th rename(2) into DIR, after
// a clean save of step - 1: then `latest` names a folder that exists, holding step - 1 or step,
// each tag loads and verifies, and the next clean save finishes or clears what the kill left.
// k = 1, 2, ... reaches every commit point of the save; the first save that runs to its end
// stops.
void kill_before_every_rename(bool allow_exchange, int64_t step) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  const ckpt::WriteOptions options{allow_exchange};
  for (int64_t s = 0; s < step; ++s)
    strata::test::save_crash_step(dir, s, options, strata::test::kSmallCrashFloats);
  for (int k = 1;; ++k) {
    SCOPED_TRACE("killed before rename " + std::to_string(k));
    strata::test::save_crash_step(dir, step - 1, options, strata::test::kSmallCrashFloats);
    std::vector<std::string> args{"save-killed", dir, std::to_string(step), std::to_string(k)};
    if (!allow_exchange) args.push_back("no-exchange");
    const int rc = strata::test::run_checkpoint_tool(args);
    ASSERT_TRUE(rc == 0 || rc == 128 + SIGKILL) << "checkpoint_tool exit code " << rc;
    const std::string named = ckpt::read_file(dir + "/latest");
    EXPECT_TRUE(fs::is_directory(fs::path(dir) / named)) << "`latest` names '" << named << "'";
    try {
      const int64_t now = strata::test::verify_crash_latest(dir);
      EXPECT_TRUE(now == step - 1 || now == step) << "latest holds step " << now;
      for (const std::string tag : {"t0", "t1"}) strata::test::verify_crash_latest(dir, tag);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
      return;
    }
    if (rc == 0) break;
  }
}

}  // namespace

TEST(CheckpointCrash, KillNineAtRandomMomentsLeavesALoadableLatest) {
  kill_nine_at_random_moments(/*allow_exchange=*/true);
}

TEST(CheckpointCrash, KillNineAtRandomMomentsLeavesALoadableLatestWithoutExchange) {
  kill_nine_at_random_moments(/*allow_exchange=*/false);
}

// Step 5 re-saves t0, which `latest` names (step 4); step 6 re-saves t1 while `latest` names t0.
TEST(CheckpointCrash, KillBeforeEveryRenameOfAResaveWithoutExchange) {
  kill_before_every_rename(/*allow_exchange=*/false, /*step=*/5);
  kill_before_every_rename(/*allow_exchange=*/false, /*step=*/6);
}

TEST(CheckpointCrash, KillBeforeEveryRenameOfAResave) {
  kill_before_every_rename(/*allow_exchange=*/true, /*step=*/5);
  kill_before_every_rename(/*allow_exchange=*/true, /*step=*/6);
}
