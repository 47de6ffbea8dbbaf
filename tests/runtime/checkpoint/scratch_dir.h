// A fresh folder under $TMPDIR (or /tmp), removed with everything in it at scope exit. Removal
// goes through checkpoint::remove_tree, not std::filesystem::remove_all, which crashes in
// programs linked with pip LibTorch 2.x (its libtorch.so exports a broken copy).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "runtime/checkpoint/atomic_file.h"

namespace strata::test {

class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/strata_checkpoint_test.XXXXXX";
    if (!::mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed for " + templ);
    path_ = templ;
  }
  ~ScratchDir() {
    try {
      checkpoint::remove_tree(path_);
    } catch (...) {
    }
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::filesystem::path path() const { return path_; }
  const std::string& str() const { return path_; }

 private:
  std::string path_;
};

}  // namespace strata::test
