// A fresh folder per test on the build's file system (ext4 or the like, where O_DIRECT works;
// /tmp may be tmpfs), removed after the test: the offload tests' swap and store files go there.
// Removed with runtime/util/file_tree's POSIX calls: std::filesystem::remove_all binds to pip
// LibTorch 2.x's exported copy in torch-linked tests and jumps to address 0 on a folder in a
// folder (the CUDA build's test_checkpointing crashed in this TearDown).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "runtime/util/file_tree.h"

namespace strata::test_support {

class BuildFsDirTest : public ::testing::Test {
 protected:
  // `tag` keeps the test binaries' folders apart.
  explicit BuildFsDirTest(std::string tag) : tag_(std::move(tag)) {}
  void SetUp() override {
    namespace fs = std::filesystem;
    dir_ = fs::path(STRATA_BIN_DIR) / ".." /
           (tag_ + "-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    strata::util::remove_tree(dir_.string());
    fs::create_directories(dir_);
    dir_ = fs::canonical(dir_);
  }
  void TearDown() override { strata::util::remove_tree(dir_.string()); }
  std::filesystem::path dir_;

 private:
  std::string tag_;
};

}  // namespace strata::test_support
