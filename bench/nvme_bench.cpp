// strata-bench nvme --dir PATH [--size-gib 4] [--block-size 1M] [--queue-depth 32] [--pairs 7]
//                   [--intra-op 1] [--fio PATH] [--store-only] [--no-checksums]
// The NVMe tier's io_uring store (offload/nvme_store.h) against fio on the same file system, in
// one run: each pair writes, then reads, SIZE bytes with the store (one file, requests of 256 MiB
// from two alternating 4096-aligned buffers, two requests queued so the rings never run dry) and
// with `fio --ioengine=io_uring --direct=1` at the same block size, queue depth and size; which of
// the two goes first alternates from pair to pair, and the page cache is dropped before every run
// (`3` into /proc/sys/vm/drop_caches, where permitted: said so when not). Prints each pair, the
// medians, the ratios of medians and what the per-page CRC32C costs; the last line is one JSON
// object with write_ratio_vs_fio and read_ratio_vs_fio. fio is not a dependency of Strata: without
// it the benchmark says so and exits 2, or times the store alone with --store-only.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "offload/aligned_buffer.h"
#include "offload/nvme_store.h"
#include "runtime/error.h"
#include "runtime/util/crc32c.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
using offload::AlignedBuffer;
using offload::NvmeStore;

struct NvmeArgs {
  std::string dir, fio;
  double size_gib = 4;
  int64_t block_size = 1 << 20;
  int queue_depth = 32, pairs = 7, intra_op = 1;
  bool store_only = false, checksums = true;
};

// "1M", "512K", "4096", "1MiB", "2G".
int64_t parse_bytes(const std::string& s) {
  size_t end = 0;
  const double v = std::stod(s, &end);
  std::string unit = s.substr(end);
  if (unit.size() > 1 && unit.back() == 'B') unit.pop_back();
  if (unit.size() > 1 && unit.back() == 'i') unit.pop_back();
  const int64_t mult = unit.empty() ? 1 : unit == "K" || unit == "k" ? 1 << 10
                       : unit == "M" || unit == "m" ? 1 << 20
                       : unit == "G" || unit == "g" ? 1 << 30 : 0;
  if (mult == 0 || v <= 0) throw Error("strata-bench nvme: cannot read the size '" + s + "'");
  return int64_t(v * double(mult));
}

NvmeArgs parse_nvme_args(int argc, char** argv) {
  NvmeArgs a;
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error("strata-bench nvme: " + f + " needs a value");
      return argv[++i];
    };
    if (f == "--dir") a.dir = value();
    else if (f == "--size-gib") a.size_gib = std::stod(value());
    else if (f == "--block-size") a.block_size = parse_bytes(value());
    else if (f == "--queue-depth") a.queue_depth = std::stoi(value());
    else if (f == "--pairs") a.pairs = std::stoi(value());
    else if (f == "--intra-op") a.intra_op = std::stoi(value());
    else if (f == "--fio") a.fio = value();
    else if (f == "--store-only") a.store_only = true;
    else if (f == "--no-checksums") a.checksums = false;
    else
      throw Error("strata-bench nvme: unknown option " + f + " (known: --dir PATH --size-gib G "
                  "--block-size B --queue-depth Q --pairs N --intra-op T --fio PATH "
                  "--store-only --no-checksums)");
  }
  if (a.dir.empty()) throw Error("strata-bench nvme: --dir PATH is required (a folder on the drive)");
  if (a.size_gib <= 0 || a.pairs < 1 || a.queue_depth < 1)
    throw Error("strata-bench nvme: --size-gib, --pairs and --queue-depth must be positive");
  return a;
}

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string rest = path ? path : "";
  for (size_t at = 0; at <= rest.size();) {
    const size_t colon = std::min(rest.find(':', at), rest.size());
    const std::string candidate = rest.substr(at, colon - at) + "/" + name;
    if (colon > at && access(candidate.c_str(), X_OK) == 0) return candidate;
    at = colon + 1;
  }
  return "";
}

bool drop_caches() {
  sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  f.flush();
  return bool(f);
}

double nvme_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One fio job; returns bytes per second as fio measured them.
double run_fio(const NvmeArgs& a, const std::string& file, uint64_t size, bool write) {
  const std::string cmd =
      "'" + a.fio + "' --name=strata-bench --filename='" + file + "' --rw=" +
      (write ? "write" : "read") + " --bs=" + std::to_string(a.block_size) +
      " --iodepth=" + std::to_string(a.queue_depth) + " --size=" + std::to_string(size) +
      " --ioengine=io_uring --direct=1 --numjobs=1 --output-format=json 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw Error("strata-bench nvme: cannot start fio: " + cmd);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  const size_t brace = out.find('{');
  if (status != 0 || brace == std::string::npos)
    throw Error("strata-bench nvme: fio failed (" + cmd + "):\n" + out.substr(0, 2000));
  const auto j = nlohmann::json::parse(out.substr(brace));
  return j.at("jobs").at(0).at(write ? "write" : "read").at("bw_bytes").get<double>();
}

}  // namespace

int run_nvme(int argc, char** argv) {
  const NvmeArgs a = parse_nvme_args(argc, argv);
  NvmeArgs fa = a;
  if (!a.store_only) {
    if (fa.fio.empty()) fa.fio = find_on_path("fio");
    if (fa.fio.empty() || access(fa.fio.c_str(), X_OK) != 0) {
      std::printf("strata-bench nvme: fio is not installed (%s): the baseline cannot be measured. "
                  "Install fio, name one with --fio PATH, or time the store alone with "
                  "--store-only.\n", fa.fio.empty() ? "not on PATH" : fa.fio.c_str());
      return 2;
    }
  }
  const uint64_t size = offload::round_up_io(uint64_t(a.size_gib * double(1ull << 30)));
  offload::NvmeOptions o;
  o.block_size = a.block_size;
  o.queue_depth = a.queue_depth;
  o.intra_op_parallelism = a.intra_op;
  o.checksums = a.checksums;
  // The fio file lives in the store's folder: same file system, removed with it. Room for both.
  NvmeStore store(a.dir, "bench-" + std::to_string(getpid()), 0, o, a.store_only ? size : 2 * size);
  const auto file = store.create("bench", size);
  const std::string fio_file = store.folder() + "/fio-bench";

  const uint64_t chunk = std::min<uint64_t>(size, 256ull << 20);
  AlignedBuffer bufs[2] = {AlignedBuffer(chunk), AlignedBuffer(chunk)};
  std::mt19937_64 gen(1);
  for (auto& b : bufs)
    for (uint64_t i = 0; i < chunk / 8; ++i) {
      const uint64_t v = gen();
      std::memcpy(b.data() + 8 * i, &v, 8);
    }
  auto store_pass = [&](bool write) {
    const auto t0 = Clock::now();
    offload::NvmeTicket t[2];
    for (uint64_t at = 0, i = 0; at < size; at += chunk, ++i) {
      const uint64_t n = std::min(chunk, size - at);
      store.wait(t[i % 2]);  // its buffer is free again
      t[i % 2] = write ? store.write(file, at, bufs[i % 2].data(), n)
                       : store.read(file, at, bufs[i % 2].data(), n);
    }
    store.wait_all();
    return double(size) / std::chrono::duration<double>(Clock::now() - t0).count();
  };

  std::printf("strata-bench nvme: %s, %.2f GiB, block %lld, queue depth %d, %d pair(s), store "
              "intra_op_parallelism %d, checksums %s, O_DIRECT %s\n",
              store.folder().c_str(), double(size) / (1ull << 30), (long long)a.block_size,
              a.queue_depth, a.pairs, a.intra_op, a.checksums ? "on" : "off",
              store.direct() ? "yes" : "no (buffered fallback)");
  const bool dropped = drop_caches();
  std::printf("page cache: %s\n", dropped ? "dropped before every run (/proc/sys/vm/drop_caches)"
                                          : "NOT dropped: writing /proc/sys/vm/drop_caches is not "
                                            "permitted here (reads may come from the cache)");
  std::vector<double> sw, sr, fw, fr;
  auto timed = [&](auto&& fn) {
    if (dropped) drop_caches();
    return fn();
  };
  for (int p = 0; p < a.pairs; ++p) {
    const bool store_first = p % 2 == 0;
    for (bool write : {true, false}) {
      auto& s = write ? sw : sr;
      auto& f = write ? fw : fr;
      for (int k = 0; k < 2; ++k) {
        if ((k == 0) == store_first) s.push_back(timed([&] { return store_pass(write); }));
        else if (!a.store_only) f.push_back(timed([&] { return run_fio(fa, fio_file, size, write); }));
      }
    }
    if (a.store_only)
      std::printf("pair %d: store write %.3f GB/s, read %.3f GB/s\n", p, sw.back() / 1e9,
                  sr.back() / 1e9);
    else
      std::printf("pair %d (%s first): write store %.3f fio %.3f GB/s, read store %.3f fio %.3f "
                  "GB/s\n", p, store_first ? "store" : "fio", sw.back() / 1e9, fw.back() / 1e9,
                  sr.back() / 1e9, fr.back() / 1e9);
    std::fflush(stdout);
  }

  // What the per-page CRC32C costs: one core's rate over the same bytes.
  const auto t0 = Clock::now();
  uint32_t crc = 0;
  for (uint64_t at = 0; at < chunk; at += offload::kIoAlign)
    crc ^= crc32c(bufs[0].data() + at, offload::kIoAlign);
  const double crc_rate = double(chunk) / std::chrono::duration<double>(Clock::now() - t0).count();
  const double msw = nvme_median(sw), msr = nvme_median(sr);
  std::printf("crc32c per 4 KiB page: %.2f GB/s on one core (checksum %08x): at the store's read "
              "median it keeps %.0f%% of one worker core busy\n",
              crc_rate / 1e9, crc, 100.0 * msr / crc_rate);
  nlohmann::json j = {{"size_bytes", size}, {"block_size", a.block_size},
                      {"queue_depth", a.queue_depth}, {"pairs", a.pairs},
                      {"intra_op_parallelism", a.intra_op}, {"checksums", a.checksums},
                      {"drop_caches", dropped}, {"store_write_GBps", msw / 1e9},
                      {"store_read_GBps", msr / 1e9}, {"crc32c_GBps", crc_rate / 1e9}};
  if (a.store_only) {
    j["write_ratio_vs_fio"] = nullptr;
    j["read_ratio_vs_fio"] = nullptr;
  } else {
    const double mfw = nvme_median(fw), mfr = nvme_median(fr);
    std::printf("median: write store %.3f fio %.3f GB/s (ratio %.3f), read store %.3f fio %.3f "
                "GB/s (ratio %.3f)\n", msw / 1e9, mfw / 1e9, msw / mfw, msr / 1e9, mfr / 1e9,
                msr / mfr);
    j["fio_write_GBps"] = mfw / 1e9;
    j["fio_read_GBps"] = mfr / 1e9;
    j["write_ratio_vs_fio"] = msw / mfw;
    j["read_ratio_vs_fio"] = msr / mfr;
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace strata::bench
