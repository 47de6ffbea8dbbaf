#include "comm/env.h"
#include "comm/store.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <regex>
#include <vector>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::comm {
namespace {

constexpr int kDefaultPort = 29500;

class Reader {
 public:
  Reader(const EnvLookup& env, std::string convention) : env_(env), convention_(std::move(convention)) {}

  std::optional<std::string> get(const std::string& name) const {
    auto v = env_(name);
    if (v && v->empty()) return std::nullopt;  // an empty variable counts as unset
    return v;
  }
  bool has(const std::string& name) const { return get(name).has_value(); }

  std::optional<long> integer(const std::string& name, long lo, long hi) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    errno = 0;
    char* end = nullptr;
    long x = std::strtol(v->c_str(), &end, 10);
    if (errno != 0 || end == v->c_str() || *end != '\0')
      throw Error(fmt::format("{}={} is not an integer ({} convention)", name, *v, convention_));
    if (x < lo || x > hi)
      throw Error(fmt::format("{}={} is out of range [{}, {}] ({} convention)", name, *v, lo, hi,
                              convention_));
    return x;
  }

  long required(const std::string& name, long lo, long hi, const std::string& why) const {
    auto x = integer(name, lo, hi);
    if (!x) throw Error(fmt::format("{} is not set, but {}; set it or unset the others", name, why));
    return *x;
  }

 private:
  const EnvLookup& env_;
  std::string convention_;
};

void check_position(RankEnv& e, const char* rank_var, const char* size_var, const char* lrank_var,
                    const char* lsize_var) {
  if (e.rank >= e.world_size)
    throw Error(fmt::format("{}={} is not below {}={} ({} convention)", rank_var, e.rank,
                            size_var, e.world_size, e.convention));
  if (e.local_world_size > e.world_size)
    throw Error(fmt::format("{}={} is larger than {}={} ({} convention)", lsize_var,
                            e.local_world_size, size_var, e.world_size, e.convention));
  if (e.local_rank >= e.local_world_size)
    throw Error(fmt::format("{}={} is not below {}={} ({} convention)", lrank_var, e.local_rank,
                            lsize_var, e.local_world_size, e.convention));
  if (e.local_rank > e.rank)
    throw Error(fmt::format("{}={} is larger than {}={} ({} convention)", lrank_var,
                            e.local_rank, rank_var, e.rank, e.convention));
}

void read_master(const Reader& r, RankEnv& e, bool port_required) {
  if (auto a = r.get("MASTER_ADDR")) e.master_addr = *a;
  auto port = r.integer("MASTER_PORT", 1, 65535);
  if (!port && port_required && e.world_size > 1)
    throw Error(fmt::format("MASTER_PORT is not set ({} convention with WORLD_SIZE={}); set it "
                            "to a free TCP port on MASTER_ADDR",
                            e.convention, e.world_size));
  e.master_port = port ? int(*port) : kDefaultPort;
}

RankEnv torchrun(const Reader& r) {
  RankEnv e;
  e.convention = "torchrun";
  const std::string why = "RANK or WORLD_SIZE is (torchrun sets both)";
  e.world_size = int(r.required("WORLD_SIZE", 1, 1 << 24, why));
  e.rank = int(r.required("RANK", 0, 1 << 24, why));
  auto lrank = r.integer("LOCAL_RANK", 0, 1 << 24);
  auto lsize = r.integer("LOCAL_WORLD_SIZE", 1, 1 << 24);
  if (lrank.has_value() != lsize.has_value() && lsize)
    throw Error("LOCAL_RANK is not set, but LOCAL_WORLD_SIZE is (torchrun sets both)");
  // LOCAL_RANK alone is common (older launchers); the local world size is then unknown, so
  // assume one node unless told otherwise.
  e.local_rank = lrank ? int(*lrank) : e.rank;
  e.local_world_size = lsize ? int(*lsize) : e.world_size;
  if (e.world_size > 1 && !r.has("MASTER_ADDR"))
    throw Error(fmt::format("MASTER_ADDR is not set (torchrun convention, WORLD_SIZE={}); set it "
                            "to the host of rank 0",
                            e.world_size));
  read_master(r, e, /*port_required=*/true);
  check_position(e, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  return e;
}

RankEnv openmpi(const Reader& r) {
  RankEnv e;
  e.convention = "OpenMPI";
  const std::string why = "OMPI_COMM_WORLD_RANK is (mpirun sets all four)";
  e.rank = int(r.required("OMPI_COMM_WORLD_RANK", 0, 1 << 24, why));
  e.world_size = int(r.required("OMPI_COMM_WORLD_SIZE", 1, 1 << 24, why));
  e.local_rank = int(r.required("OMPI_COMM_WORLD_LOCAL_RANK", 0, 1 << 24, why));
  e.local_world_size = int(r.required("OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1 << 24, why));
  if (e.world_size > 1 && !r.has("MASTER_ADDR"))
    throw Error(fmt::format("MASTER_ADDR is not set (OpenMPI convention, "
                            "OMPI_COMM_WORLD_SIZE={}); export it to every rank with mpirun -x "
                            "MASTER_ADDR=<host of rank 0>",
                            e.world_size));
  read_master(r, e, /*port_required=*/false);
  check_position(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE");
  return e;
}

// SLURM_TASKS_PER_NODE looks like "4(x2),3": tasks on each node in node order.
std::optional<int> tasks_on_node(const std::string& spec, int node) {
  static const std::regex item(R"((\d+)(?:\(x(\d+)\))?)");
  int seen = 0;
  size_t start = 0;
  while (start <= spec.size()) {
    size_t comma = spec.find(',', start);
    std::string part = spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    std::smatch m;
    if (!std::regex_match(part, m, item)) return std::nullopt;
    int count = std::stoi(m[1]);
    int repeat = m[2].matched ? std::stoi(m[2]) : 1;
    if (node < seen + repeat) return count;
    seen += repeat;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return std::nullopt;
}

RankEnv slurm(const Reader& r) {
  RankEnv e;
  e.convention = "SLURM";
  const std::string why = "SLURM_PROCID is (srun sets both)";
  e.rank = int(r.required("SLURM_PROCID", 0, 1 << 24, why));
  e.world_size = int(r.required("SLURM_NTASKS", 1, 1 << 24, why));
  e.local_rank = int(r.required("SLURM_LOCALID", 0, 1 << 24, "SLURM_PROCID is (srun sets both)"));
  // Tasks on this node: SLURM_NTASKS_PER_NODE when plain, else this node's entry of
  // SLURM_TASKS_PER_NODE, else NTASKS / NNODES when that divides.
  std::optional<long> local;
  if (auto v = r.get("SLURM_NTASKS_PER_NODE"); v && std::regex_match(*v, std::regex(R"(\d+)")))
    local = r.integer("SLURM_NTASKS_PER_NODE", 1, 1 << 24);
  if (!local) {
    if (auto spec = r.get("SLURM_TASKS_PER_NODE")) {
      auto node = r.integer("SLURM_NODEID", 0, 1 << 24);
      if (auto n = tasks_on_node(*spec, node ? int(*node) : 0)) local = *n;
    }
  }
  if (!local) {
    auto nodes = r.integer("SLURM_NNODES", 1, 1 << 24);
    if (!nodes) nodes = r.integer("SLURM_JOB_NUM_NODES", 1, 1 << 24);
    if (nodes && e.world_size % *nodes == 0) local = e.world_size / *nodes;
  }
  if (!local)
    throw Error("SLURM_NTASKS_PER_NODE is not set (nor a usable SLURM_TASKS_PER_NODE, nor "
                "SLURM_NNODES dividing SLURM_NTASKS); run with srun --ntasks-per-node=N");
  e.local_world_size = int(*local);
  if (!r.has("MASTER_ADDR")) {
    const char* list_var = r.has("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    auto list = r.get(list_var);
    std::optional<std::string> host = list ? first_slurm_host(*list) : std::nullopt;
    if (!host && e.world_size > 1)
      throw Error(fmt::format("MASTER_ADDR is not set and {} {}; export MASTER_ADDR=<host of "
                              "rank 0> (e.g. $(scontrol show hostnames | head -n1))",
                              list_var,
                              list ? fmt::format("('{}') is not a simple list", *list)
                                   : std::string("is not set either")));
    if (host) e.master_addr = *host;
  }
  read_master(r, e, /*port_required=*/false);
  check_position(e, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
  return e;
}

}  // namespace

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

std::optional<std::string> first_slurm_host(const std::string& nodelist) {
  // "a,b" -> a ; "pre[03-05,9]suf,..." -> pre03suf ; anything fancier -> nullopt.
  static const std::regex plain(R"(([A-Za-z0-9_.\-]+)(,.*)?)");
  static const std::regex ranged(R"(([A-Za-z0-9_.\-]*)\[(\d+)(?:-\d+)?(?:,[\d\-]+)*\]([A-Za-z0-9_.\-]*)(,.*)?)");
  std::smatch m;
  if (std::regex_match(nodelist, m, plain)) return m[1].str();
  if (std::regex_match(nodelist, m, ranged)) return m[1].str() + m[2].str() + m[3].str();
  return std::nullopt;
}

RankEnv read_rank_env(const EnvLookup& env) {
  const Reader tr(env, "torchrun"), mpi(env, "OpenMPI"), sl(env, "SLURM");
  if (tr.has("RANK") || tr.has("WORLD_SIZE")) return torchrun(tr);
  if (mpi.has("OMPI_COMM_WORLD_RANK") || mpi.has("OMPI_COMM_WORLD_SIZE")) return openmpi(mpi);
  if (sl.has("SLURM_PROCID")) return slurm(sl);
  RankEnv e;  // one process
  Reader r(env, "none");
  if (auto a = r.get("MASTER_ADDR")) e.master_addr = *a;
  if (auto p = r.integer("MASTER_PORT", 0, 65535)) e.master_port = int(*p);
  else e.master_port = 0;  // any free port
  return e;
}

std::chrono::milliseconds resolve_timeout(std::optional<double> seconds, const EnvLookup& env) {
  auto from = [](double s, const std::string& what) {
    if (!(s > 0) || !std::isfinite(s) || s > 1e7)
      throw Error(fmt::format("{} must be a positive number of seconds, got {}", what, s));
    return std::chrono::milliseconds(std::max<long long>(1, std::llround(s * 1000)));
  };
  if (seconds) return from(*seconds, "the timeout argument");
  if (auto v = env("STRATA_TIMEOUT"); v && !v->empty()) {
    char* end = nullptr;
    errno = 0;
    double s = std::strtod(v->c_str(), &end);
    if (errno != 0 || end == v->c_str() || *end != '\0')
      throw Error(fmt::format("STRATA_TIMEOUT={} is not a number of seconds", *v));
    return from(s, "STRATA_TIMEOUT=" + *v + ":");
  }
  return std::chrono::seconds(600);
}

StoreAccess read_store_access(const EnvLookup& env) {
  StoreAccess access;
  if (auto v = env("STRATA_JOB_SECRET"); v && !v->empty()) {
    if (v->size() < 16)
      throw Error(fmt::format("STRATA_JOB_SECRET has {} characters; use at least 16 random ones "
                              "(e.g. export STRATA_JOB_SECRET=$(od -An -N32 -tx1 /dev/urandom | "
                              "tr -d ' \\n')), the same on every rank",
                              v->size()));
    access.secret = *v;
  }
  if (auto v = env("STRATA_STORE_LISTEN_ALL"); v && !v->empty()) {
    if (*v != "0" && *v != "1")
      throw Error(fmt::format("STRATA_STORE_LISTEN_ALL={} must be 1 (listen on every interface) "
                              "or 0 (on MASTER_ADDR's only)",
                              *v));
    access.listen_all = *v == "1";
  }
  if (auto v = env("STRATA_STORE_AUTH_TIMEOUT"); v && !v->empty()) {
    char* end = nullptr;
    errno = 0;
    const double s = std::strtod(v->c_str(), &end);
    if (errno != 0 || end == v->c_str() || *end != '\0' || !(s > 0) || s > 3600)
      throw Error(fmt::format("STRATA_STORE_AUTH_TIMEOUT={} must be a number of seconds in "
                              "(0, 3600]",
                              *v));
    access.auth_timeout = std::chrono::milliseconds(std::max<long long>(1, std::llround(s * 1000)));
  }
  return access;
}

const char* to_string(CommCheck mode) {
  switch (mode) {
    case CommCheck::Off: return "off";
    case CommCheck::Cpu: return "cpu";
    case CommCheck::All: return "all";
  }
  return "?";
}

CommCheck resolve_comm_check(std::optional<CommCheck> mode, const EnvLookup& env) {
  if (mode) return *mode;
  const auto v = env("STRATA_COMM_CHECK");
  if (!v || v->empty() || *v == "cpu") return CommCheck::Cpu;
  if (*v == "all" || *v == "1") return CommCheck::All;
  if (*v == "off" || *v == "0") return CommCheck::Off;
  throw Error(fmt::format("STRATA_COMM_CHECK={} is not one of cpu (the default: check collectives "
                          "on CPU tensors), all or 1 (CUDA ones too), off or 0",
                          *v));
}

}  // namespace strata::comm
