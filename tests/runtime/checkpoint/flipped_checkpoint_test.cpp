// A bit flipped at every byte of a small checkpoint the engine saved (latest, the manifest and
// every tensor file), one byte at a time: the checkpoint reader refuses it naming the damaged
// file, and so do the two ways the tools read a checkpoint, in process: consolidate() (what
// strata-ckpt runs) and Engine::load_checkpoint (what train_gpt --resume runs), which also
// leaves the model as it was. The tools themselves, as processes, are tools_test.cpp.
#include <chrono>
#include <cstdio>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/error.h"
#include "tests/runtime/checkpoint/engine_model.h"
#include "tests/runtime/checkpoint/hostile_util.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/runtime/checkpoint/test_util.h"

namespace ckpt = strata::checkpoint;
using strata::test::error_of;
using strata::test::ScratchDir;

TEST(FlippedCheckpoint, EveryByteOfEveryFileIsRefusedByTheReaderTheToolAndTheEngine) {
  ScratchDir tmp;
  const std::string dir = tmp.str();
  torch::manual_seed(1);
  strata::test::TinyNet saved;
  auto writer = strata::initialize(saved, strata::test::tiny_config(1));
  strata::test::train_tiny(writer, 2);
  writer->save_checkpoint(dir);  // tag global_step2

  torch::manual_seed(2);
  strata::test::TinyNet model;
  auto engine = strata::initialize(model, strata::test::tiny_config(1));
  const auto before = strata::test::snapshot(*model);

  const auto start = std::chrono::steady_clock::now();
  const std::string folder = dir + "/global_step2";
  std::vector<std::string> files = {dir + "/latest", folder + "/manifest.json"};
  for (const auto& name : ckpt::list_folder(folder))
    if (name != "manifest.json") files.push_back(folder + "/" + name);
  size_t bytes = 0, refused = 0;
  for (const auto& path : files) {
    const std::string good = ckpt::read_file(path);
    bytes += good.size();
    // `latest` damaged names another tag: the error names the checkpoint folder and that tag.
    const std::string named = path == files[0] ? dir : path;
    for (size_t i = 0; i < good.size(); ++i) {
      std::string bad = good;
      bad[i] = char(bad[i] ^ (1 << (i % 8)));
      strata::test::write_bytes(path, bad);
      const std::string where = path + " byte " + std::to_string(i);
      const auto reader = error_of([&] { ckpt::CheckpointReader r(dir); });
      ASSERT_NE(reader.find(named), std::string::npos) << where << ": " << reader;
      const auto tool = error_of([&] { ckpt::consolidate(dir, "latest", torch::kFloat); });
      ASSERT_NE(tool.find(named), std::string::npos) << where << ": " << tool;
      const auto resume = error_of([&] { engine->load_checkpoint(dir); });
      ASSERT_NE(resume.find(named), std::string::npos) << where << ": " << resume;
      ++refused;
    }
    strata::test::write_bytes(path, good);
  }
  EXPECT_TRUE(strata::test::unchanged(*model, before)) << "a refused load changed the model";
  EXPECT_EQ(engine->global_steps(), 0);
  EXPECT_NO_THROW(engine->load_checkpoint(dir));
  EXPECT_EQ(engine->global_steps(), 2);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[flips] %zu files, %zu bytes: %zu flipped bytes refused by the reader, "
              "consolidate and load_checkpoint (%.1f s)\n",
              files.size(), bytes, refused, seconds);
}
