// Where this process sits in the job, read from the environment the way launchers set it:
// torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), then
// OpenMPI's (OMPI_COMM_WORLD_*), then SLURM's (SLURM_PROCID, SLURM_NTASKS, ...), in that order of
// precedence. No torch here: this is pure parsing, unit-tested with a fake environment.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

namespace strata::comm {

struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string convention = "none";  // "torchrun", "OpenMPI", "SLURM" or "none" (one process)
};

// Returns the value of an environment variable, or nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

EnvLookup process_env();  // getenv

// Reads the first convention that is present. Missing or contradictory values throw
// strata::Error naming the variable. With no convention present: one process, rank 0 of 1.
RankEnv read_rank_env(const EnvLookup& env = process_env());

// The first host of a SLURM node list when it is simple ("a,b", "node[03-05,9]" -> node03);
// nullopt otherwise.
std::optional<std::string> first_slurm_host(const std::string& nodelist);

// The timeout for every wait: `seconds` when given, else STRATA_TIMEOUT (seconds, decimals
// allowed), else 600 s as in DeepSpeed. A bad STRATA_TIMEOUT throws strata::Error.
std::chrono::milliseconds resolve_timeout(std::optional<double> seconds,
                                          const EnvLookup& env = process_env());

// Which collectives the members compare before running them (comm/check.h): `mode` when given,
// else STRATA_COMM_CHECK (cpu, all or 1, off or 0), else Cpu. A bad value throws strata::Error.
enum class CommCheck { Off, Cpu, All };
const char* to_string(CommCheck mode);
CommCheck resolve_comm_check(std::optional<CommCheck> mode, const EnvLookup& env = process_env());

}  // namespace strata::comm
