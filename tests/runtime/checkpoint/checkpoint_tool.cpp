// checkpoint_tool: the other process of the checkpoint tests.
//
//   checkpoint_tool atomic-loop PATH START   rewrite PATH atomically with versions START, START+1...
//   checkpoint_tool save-loop DIR START [no-exchange]
//                                            save checkpoint steps START, START+1, ... into DIR
//   checkpoint_tool save-killed DIR STEP K [no-exchange]
//                                            save step STEP (small tensors), SIGKILLing itself
//                                            just before its K-th rename(2) into DIR; exits 0 if
//                                            it finished first
//   checkpoint_tool st-write PATH            write a safetensors file of every dtype, print it
//   checkpoint_tool st-read PATH             read a safetensors file, print it
//   checkpoint_tool full-disk-sweep DIR      engine saves into a full DIR (full_disk_workload.h)
//
// The loops print "started" once and run until killed. no-exchange commits as on file systems
// without renameat2 RENAME_EXCHANGE (WriteOptions). The st-* modes print one line per
// tensor, "tensor<TAB>name<TAB>dtype<TAB>shape JSON<TAB>hex of its bytes", and one per metadata
// entry, "meta<TAB>key<TAB>value", for read_safetensors.py to compare with the Python package.
#include <cstdio>
#include <iostream>
#include <string>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include "runtime/checkpoint/safetensors.h"
#include "tests/runtime/checkpoint/crash_workload.h"
#include "tests/runtime/checkpoint/full_disk_workload.h"

namespace ckpt = strata::checkpoint;

namespace {
std::string kill_dir;         // save-killed's DIR
long renames_until_kill = 0;  // and K; 0: never
}  // namespace

// Every commit point of a save is a rename(2) into DIR (AtomicFile and the folder renames call
// ::rename), so this program's own rename, which the linker picks over libc's, lets save-killed
// crash at each. Renames inside the staging folder, which no reader looks at, do not count.
extern "C" int rename(const char* from, const char* to) noexcept {
  if (renames_until_kill > 0) {
    const std::string target = to;
    const bool into_dir = target.rfind(kill_dir + "/", 0) == 0 &&
                          target.find('/', kill_dir.size() + 1) == std::string::npos;
    if (into_dir && --renames_until_kill == 0) ::kill(::getpid(), SIGKILL);
  }
  return ::renameat(AT_FDCWD, from, AT_FDCWD, to);
}

namespace {

void print(const ckpt::NamedTensors& tensors, const ckpt::Metadata& metadata) {
  static const char* kHex = "0123456789abcdef";
  for (const auto& [name, t] : tensors) {
    const auto c = t.contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    std::string hex;
    for (int64_t i = 0; i < c.numel() * int64_t(c.element_size()); ++i) {
      hex.push_back(kHex[p[i] >> 4]);
      hex.push_back(kHex[p[i] & 15]);
    }
    std::cout << "tensor\t" << name << "\t" << ckpt::dtype_name(t.scalar_type()) << "\t"
              << ckpt::json(t.sizes().vec()).dump() << "\t" << hex << "\n";
  }
  for (const auto& [k, v] : metadata) std::cout << "meta\t" << k << "\t" << v << "\n";
}

// Every safetensors dtype Strata writes, odd shapes, a 0-dim and an empty tensor, a view.
ckpt::NamedTensors sample_tensors() {
  torch::manual_seed(7);
  ckpt::NamedTensors t;
  t.emplace_back("f32", torch::randn({3, 5}));
  t.emplace_back("f64", torch::randn({7}, torch::kDouble));
  t.emplace_back("f16", torch::randn({2, 3, 2}).to(torch::kHalf));
  t.emplace_back("bf16", torch::randn({9}).to(torch::kBFloat16));
  t.emplace_back("i64", torch::randint(-1000000, 1000000, {4}, torch::kLong));
  t.emplace_back("i32", torch::randint(-100000, 100000, {2, 2}, torch::kInt));
  t.emplace_back("i16", torch::randint(-30000, 30000, {3}, torch::kShort));
  t.emplace_back("i8", torch::randint(-128, 128, {5}, torch::kChar));
  t.emplace_back("u8", torch::randint(0, 256, {6}, torch::kByte));
  t.emplace_back("bool", torch::rand({2, 4}) > 0.5);
  t.emplace_back("c64", torch::randn({3}, torch::kComplexFloat));
  t.emplace_back("scalar", torch::tensor(3.5));
  t.emplace_back("empty", torch::zeros({0, 4}));
  t.emplace_back("layers.0.attn.weight^T", torch::randn({4, 6}).t());
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: checkpoint_tool atomic-loop|save-loop|save-killed|st-write|st-read PATH "
                 "[START] [K] [no-exchange]\n";
    return 2;
  }
  const std::string mode = argv[1], path = argv[2];
  ckpt::WriteOptions options;
  options.allow_exchange = std::string(argv[argc - 1]) != "no-exchange";
  try {
    if (mode == "atomic-loop" || mode == "save-loop") {
      int64_t step = argc > 3 ? std::stoll(argv[3]) : 0;
      std::cout << "started" << std::endl;
      for (;; ++step) {
        if (mode == "atomic-loop")
          strata::test::write_atomic_version(path, uint64_t(step));
        else
          strata::test::save_crash_step(path, step, options);
      }
    }
    if (mode == "save-killed" && argc > 4) {
      kill_dir = path;
      renames_until_kill = std::stol(argv[4]);
      strata::test::save_crash_step(path, std::stoll(argv[3]), options,
                                    strata::test::kSmallCrashFloats);
      return 0;
    }
    if (mode == "st-write") {
      const auto tensors = sample_tensors();
      const ckpt::Metadata metadata{{"format", "pt"}, {"producer", "strata checkpoint_tool"}};
      ckpt::save_safetensors(path, tensors, metadata);
      print(tensors, metadata);
      return 0;
    }
    if (mode == "full-disk-sweep") return strata::test::full_disk_sweep(path);
    if (mode == "st-read") {
      const auto file = ckpt::load_safetensors(path);
      print(file.tensors, file.metadata);
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "checkpoint_tool: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "checkpoint_tool: unknown mode " << mode << "\n";
  return 2;
}
