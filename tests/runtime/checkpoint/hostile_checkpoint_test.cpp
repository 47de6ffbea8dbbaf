// Hostile checkpoint folders: the manifest and `latest` (every truncation, every flipped bit,
// crafted manifests with valid checksums), files that are FIFOs or folders, and the scalars the
// re-partitioning readers trust (shard pieces, the MoE experts' layout and pieces, what
// strata-ckpt consolidates by). Each case returns or throws strata::Error naming the file,
// within its memory and time bound (tests/fuzz_tally.h); the counts are printed.
#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/saved_experts.h"
#include "runtime/checkpoint/shard_pieces.h"
#include "runtime/util/crc32c.h"
#include "tests/fuzz_tally.h"
#include "tests/runtime/checkpoint/hostile_util.h"
#include "tests/runtime/checkpoint/scratch_dir.h"

namespace ckpt = strata::checkpoint;
using strata::test::for_each_cut_and_flip;
using strata::test::nested;
using strata::test::FuzzTally;
using strata::test::read_small_checkpoint;
using strata::test::save_small_checkpoint;
using strata::test::ScratchDir;
using strata::test::write_bytes;
using json = nlohmann::json;

namespace {

// The manifest's own checksum over `j` without it, as Manifest::to_json() computes it.
std::string resealed(json j) {
  j.erase("manifest_crc32c");
  j["manifest_crc32c"] = strata::crc32c(j.dump());
  return j.dump(1) + "\n";
}

}  // namespace

TEST(HostileCheckpoint, ManifestTruncationsAndFlippedBitsAreRefused) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save_small_checkpoint(dir, "s1");
  ASSERT_NO_THROW(read_small_checkpoint(dir));
  const std::string path = dir + "/s1/manifest.json";
  const std::string good = ckpt::read_file(path);
  FuzzTally tally("manifest");
  auto run = [&](const std::string& label, const std::string& bytes) {
    write_bytes(path, bytes);
    tally.run(label, path, bytes.size(), false, [&] { read_small_checkpoint(dir); });
  };
  for_each_cut_and_flip(good, [&](const std::string& label, const std::string& bytes, int64_t) {
    run(label, bytes);
  });
  run("one more space", good.substr(0, 1) + " " + good.substr(1));
  run("no final newline", good.substr(0, good.size() - 1));
  run("nested 10^6 deep", "{\"a\":" + nested(1000000) + "}");
  write_bytes(path, good);
  EXPECT_NO_THROW(read_small_checkpoint(dir));
}

// Manifests that say something else, with a checksum that matches what they say.
TEST(HostileCheckpoint, CraftedManifestsWithValidChecksumsAreRefused) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save_small_checkpoint(dir, "s1");
  const std::string path = dir + "/s1/manifest.json";
  const json good = json::parse(ckpt::read_file(path));
  FuzzTally tally("manifest, crafted");
  // The error names the manifest, or the file the manifest misdescribes: both are in DIR/s1.
  auto run = [&](const std::string& label, const json& j) {
    if (j == good) return;  // the change changed nothing
    const std::string bytes = resealed(j);
    write_bytes(path, bytes);
    tally.run(label, dir + "/s1", bytes.size(), false, [&] { read_small_checkpoint(dir); });
  };
  for (const json& world : {json(0), json(-1), json(1), json(3), json(INT32_MAX),
                            json(int64_t(1) << 40), json(2.0), json("2"), json(nullptr)}) {
    json j = good;
    j["world_size"] = world;
    run("world_size " + world.dump(), j);
  }
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"zero_stage", -1}, {"zero_stage", int64_t(1) << 40}, {"compute_dtype", "F8"},
           {"master_dtype", 32}, {"tag", "s2"}, {"tag", "../s1"}, {"format", "other"},
           {"version", 2}, {"files", json::object()}, {"files", nullptr}, {"files", "x"}}) {
    json j = good;
    j[key] = value;
    run(key + " = " + value.dump(), j);
  }
  const json file_changes = json::array({
      {"bytes", ~uint64_t(0)}, {"bytes", -1}, {"bytes", 1.5}, {"crc32c", int64_t(1) << 33},
      {"rank", 2}, {"rank", -2}, {"rank", int64_t(1) << 31}, {"rank", nullptr}, {"rank", 0},
      {"kind", "../x"}, {"kind", "Optim"}, {"kind", ""}, {"file", "../../etc/passwd"},
      {"file", "s1/../zero_pp_rank_1_optim_states.ckpt"}, {"tensors", json::array()},
      {"tensors", {{{"name", "master"}, {"dtype", "F32"}, {"shape", {int64_t(1) << 62, 4}}}}},
      {"tensors", {{{"name", "master"}, {"dtype", "F64"}, {"shape", {4}}}}},
      {"tensors", {{{"name", "other"}, {"dtype", "F32"}, {"shape", {4}}}}}});
  for (size_t f = 0; f < good["files"].size(); ++f)
    for (const auto& change : file_changes) {
      json j = good;
      j["files"][f][change[0].get<std::string>()] = change[1];
      run("file " + std::to_string(f) + " " + change.dump(), j);
    }
  {
    json j = good;  // a file listed twice, one missing, a hundred thousand
    j["files"].push_back(good["files"][1]);
    run("a file twice", j);
    j = good;
    j["files"].erase(1);
    run("a partition missing", j);
    j = good;
    for (int k = 0; k < 10000; ++k) j["files"].push_back(good["files"][0]);
    run("10001 copies of a file", j);
  }
  // Its own checksum: negative, past 32 bits, fractional, a string, absent.
  for (const json& crc : {json(-1), json(int64_t(1) << 32), json(1.5), json("0"), json()}) {
    json j = good;
    if (crc.is_null()) j.erase("manifest_crc32c");
    else j["manifest_crc32c"] = crc;
    const std::string bytes = j.dump(1) + "\n";
    write_bytes(path, bytes);
    tally.run("checksum " + crc.dump(), path, bytes.size(), false,
              [&] { read_small_checkpoint(dir); });
  }
  write_bytes(path, good.dump(1) + "\n");
  EXPECT_NO_THROW(read_small_checkpoint(dir));
}

TEST(HostileCheckpoint, LatestTruncationsFlipsAndCraftedNamesAreRefused) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save_small_checkpoint(dir, "global_step7");
  const std::string path = dir + "/latest";
  const std::string good = ckpt::read_file(path);
  FuzzTally tally("latest");
  auto run = [&](const std::string& label, const std::string& bytes) {
    write_bytes(path, bytes);
    tally.run(label, dir, bytes.size(), false, [&] { read_small_checkpoint(dir); });
  };
  for_each_cut_and_flip(good, [&](const std::string& label, const std::string& bytes, int64_t) {
    run(label, bytes);
  });
  // `latest` naming a folder outside the checkpoint folder is refused (a regression test).
  for (const std::string& name : std::vector<std::string>{
           "../global_step7", "/tmp", "global_step7/../global_step7", "..", ".", "latest",
        ".global_step7.next-00000000000000ab", ".global_step7.partial", std::string("g\0x", 3),
        std::string(5000, 'a'), std::string(1 << 20, ' ') + "global_step7"})
    run("'" + name.substr(0, 40) + "'", name);
  write_bytes(path, good);
  EXPECT_NO_THROW(read_small_checkpoint(dir));
}

// A FIFO, a folder or a device where a file should be: refused at once, never waited on.
TEST(HostileCheckpoint, SpecialFilesAreRefusedWithoutBlocking) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  save_small_checkpoint(dir, "s1");
  FuzzTally tally("special files");
  for (const std::string name : {"latest", "s1/manifest.json", "s1/model_states.ckpt",
                                 "s1/zero_pp_rank_1_optim_states.ckpt"}) {
    const std::string path = dir + "/" + name;
    const std::string saved = ckpt::read_file(path);
    for (int kind = 0; kind < 3; ++kind) {
      ::unlink(path.c_str());
      const int made = kind == 0   ? ::mkfifo(path.c_str(), 0600)
                       : kind == 1 ? ::mkdir(path.c_str(), 0700)
                                   : ::symlink("/dev/zero", path.c_str());
      ASSERT_EQ(made, 0) << path;
      tally.run(name + " as special file " + std::to_string(kind), path, 0, false,
                [&] { read_small_checkpoint(dir); });
      ::rmdir(path.c_str());
      ::unlink(path.c_str());
    }
    write_bytes(path, saved);
  }
  EXPECT_NO_THROW(read_small_checkpoint(dir));
}

namespace {

// Optimizer partitions in memory, as files would give them: rank r's master holds r*1000+1...
std::vector<ckpt::TensorFile> partitions(const std::vector<int64_t>& numels, const json& flat_numel,
                                         const std::vector<json>& pieces) {
  std::vector<ckpt::TensorFile> files;
  for (size_t r = 0; r < numels.size(); ++r) {
    ckpt::TensorFile f;
    f.path = "zero_pp_rank_" + std::to_string(r) + "_optim_states.ckpt";
    f.tensors = {{"master", torch::arange(numels[r]).to(torch::kFloat) + 1000.0 * r + 1}};
    if (!flat_numel.is_null()) f.scalars["flat_numel"] = flat_numel;
    if (!pieces[r].is_null()) f.scalars["shard_pieces"] = pieces[r];
    files.push_back(std::move(f));
  }
  return files;
}

// A map the reader accepted puts every flat element where its pieces say, exactly once.
void expect_exact(const std::vector<ckpt::TensorFile>& files, const strata::zero::ShardMap& map,
                  int64_t flat_numel, const std::string& label) {
  std::vector<torch::Tensor> masters;
  for (const auto& f : files) masters.push_back(f.at("master"));
  const auto flat = map.assemble(masters, flat_numel);
  ASSERT_EQ(flat.numel(), flat_numel) << label;
  EXPECT_TRUE((flat != 0).all().item<bool>()) << label << ": a flat element nobody covered";
  for (int64_t r = 0; r < map.parts(); ++r)
    for (const auto& p : map.pieces(r)) {
      const int64_t n = std::min(p.length, std::max<int64_t>(flat_numel - p.flat_begin, 0));
      if (n > 0) {
        EXPECT_TRUE(
            torch::equal(flat.narrow(0, p.flat_begin, n), masters[r].narrow(0, p.offset, n)))
            << label;
      }
    }
}

}  // namespace

TEST(HostileCheckpoint, ShardPiecesThatDoNotCoverTheLayoutAreRefused) {
  std::mt19937_64 rng(11);
  const int64_t big = int64_t(1) << 62, max = INT64_MAX;
  const std::vector<int64_t> interesting = {0, 1, 2, 3, 4, 5, 7, 8, 9, -1, big, max, max - 3, -max};
  auto pick = [&] {
    return rng() % 3 ? int64_t(rng() % 10) : interesting[rng() % interesting.size()];
  };
  FuzzTally tally("shard pieces");
  int exact = 0;
  for (int c = 0; c < 20000; ++c) {
    const int world = 1 + rng() % 3;
    std::vector<int64_t> numels(world, rng() % 4 ? 4 : pick() & 7);
    if (rng() % 8 == 0) numels[rng() % world] = rng() % 6;
    const json flat_numel = rng() % 10 == 0 ? json(pick()) : json(4 * world - rng() % 3);
    std::vector<json> pieces;
    for (int r = 0; r < world; ++r) {
      if (rng() % 10 == 0) {
        pieces.push_back(rng() % 2 ? json(nullptr) : json::parse(R"([[0, 1, "a"]])"));
        continue;
      }
      json list = json::array();
      if (rng() % 2) {
        list.push_back({4 * r, 4, 0});  // the contiguous partition, then perhaps a change
        if (rng() % 2) list[0][rng() % 3] = pick();
      } else {
        for (int k = rng() % 4; k > 0; --k) list.push_back({pick(), pick(), pick()});
      }
      pieces.push_back(list);
    }
    const auto files = partitions(numels, flat_numel, pieces);
    const std::string label = "case " + std::to_string(c) + " pieces " + json(pieces).dump() +
                              " numels " + json(numels).dump() + " flat " + flat_numel.dump();
    uint64_t bytes = 64;
    for (auto n : numels) bytes += 4 * n + 64;
    tally.run(label, "optim_states.ckpt", bytes, true, [&] {
      const auto map = ckpt::saved_shard_map(files);
      expect_exact(files, map, flat_numel.is_null() ? 0 : flat_numel.get<int64_t>(), label);
      ++exact;
    });
  }
  EXPECT_GT(exact, 1000);  // the contiguous layouts, and some others
  EXPECT_GT(tally.refused(), 5000);
}
