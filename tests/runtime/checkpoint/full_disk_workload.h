// checkpoint_tool full-disk-sweep DIR: DIR is a small file system of its own (a tmpfs the test
// mounted). For each amount of free space K (0, 4, 8, ... KiB) a fresh checkpoint folder gets a
// good save at step 2, the disk is filled to leave K KiB, and a save at step 3 runs into the
// full disk somewhere (a tensor file, the manifest, `latest`) or, with room enough, completes.
// One line per K: "free K: ok|error: TEXT | latest loads step N".
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <iostream>
#include <string>
#include <vector>

#include "runtime/checkpoint/atomic_file.h"
#include "tests/runtime/checkpoint/engine_model.h"

namespace strata::test {

// Fills the file system of `path` up, then frees `free_bytes` of it again.
inline void fill_leaving(const std::string& path, int64_t free_bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error("cannot create " + path);
  const std::vector<char> chunk(4096, 'f');
  int64_t written = 0;
  for (;;) {
    const ssize_t n = ::write(fd, chunk.data(), chunk.size());
    if (n <= 0) break;  // ENOSPC: full
    written += n;
  }
  if (::ftruncate(fd, std::max<int64_t>(written - free_bytes, 0)) != 0)
    throw std::runtime_error("cannot truncate " + path);
  ::close(fd);
}

inline int full_disk_sweep(const std::string& dir) {
  for (int64_t kib = 0; kib <= 48; kib += 4) {
    const std::string ck = dir + "/ck" + std::to_string(kib), filler = dir + "/filler";
    torch::manual_seed(1);
    TinyNet model;
    auto engine = strata::initialize(model, tiny_config(1));
    train_tiny(engine, 2);
    engine->save_checkpoint(ck);  // the previous checkpoint, saved with room to spare
    train_tiny(engine, 1);
    fill_leaving(filler, kib << 10);
    std::string outcome = "ok";
    try {
      engine->save_checkpoint(ck);
    } catch (const strata::Error& e) {
      outcome = std::string("error: ") + e.what();
    }
    ::unlink(filler.c_str());
    TinyNet fresh;
    auto resumed = strata::initialize(fresh, tiny_config(1));
    resumed->load_checkpoint(ck);
    std::cout << "free " << kib << ": " << outcome << " | latest loads step "
              << resumed->global_steps() << std::endl;
    checkpoint::remove_tree(ck);
  }
  return 0;
}

}  // namespace strata::test
