// Rendezvous from the environment: torchrun's, OpenMPI's and SLURM's conventions, their
// precedence, and the errors that name the variable. A fake environment, no processes.
#include <gtest/gtest.h>

#include <map>

#include "comm/env.h"
#include "runtime/error.h"

namespace strata::comm {
namespace {

EnvLookup fake(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(std::map<std::string, std::string> vars) {
  try {
    read_rank_env(fake(std::move(vars)));
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CommEnv, NothingSetIsOneProcess) {
  RankEnv e = read_rank_env(fake({}));
  EXPECT_EQ(e.convention, "none");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.master_port, 0);  // any free port
}

TEST(CommEnv, Torchrun) {
  RankEnv e = read_rank_env(fake({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                  {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"},
                                  {"MASTER_PORT", "29501"}}));
  EXPECT_EQ(e.convention, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29501);
}

TEST(CommEnv, TorchrunWinsOverOpenMpiAndSlurm) {
  RankEnv e = read_rank_env(fake({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"},
                                  {"MASTER_PORT", "1234"}, {"OMPI_COMM_WORLD_RANK", "0"},
                                  {"OMPI_COMM_WORLD_SIZE", "4"}, {"SLURM_PROCID", "3"}}));
  EXPECT_EQ(e.convention, "torchrun");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.local_rank, 1);  // LOCAL_* unset: one node
  EXPECT_EQ(e.local_world_size, 2);
}

TEST(CommEnv, OpenMpi) {
  RankEnv e = read_rank_env(fake({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "h0"},
                                  {"SLURM_PROCID", "0"}}));
  EXPECT_EQ(e.convention, "OpenMPI");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_port, 29500);  // DeepSpeed's default when MASTER_PORT is unset
}

TEST(CommEnv, SlurmDerivesLocalSizeAndMaster) {
  RankEnv e = read_rank_env(fake({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"},
                                  {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"},
                                  {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                  {"SLURM_JOB_NODELIST", "gpu[07-08]"}}));
  EXPECT_EQ(e.convention, "SLURM");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "gpu07");
  RankEnv f = read_rank_env(fake({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "6"},
                                  {"SLURM_LOCALID", "0"}, {"SLURM_NNODES", "3"},
                                  {"SLURM_JOB_NODELIST", "a,b,c"}, {"MASTER_ADDR", "x"}}));
  EXPECT_EQ(f.local_world_size, 2);
  EXPECT_EQ(f.master_addr, "x");  // the environment wins over the node list
  RankEnv g = read_rank_env(fake({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},
                                  {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "2"},
                                  {"SLURM_JOB_NODELIST", "solo"}}));
  EXPECT_EQ(g.local_world_size, 2);
  EXPECT_EQ(g.master_addr, "solo");
}

TEST(CommEnv, SlurmNodeLists) {
  EXPECT_EQ(first_slurm_host("n1,n2").value_or("-"), "n1");
  EXPECT_EQ(first_slurm_host("node[003-010,20]").value_or("-"), "node003");
  EXPECT_EQ(first_slurm_host("rack[1-2]-gpu,x").value_or("-"), "rack1-gpu");
  EXPECT_FALSE(first_slurm_host("a[1-2]b[3-4]").has_value());
}

TEST(CommEnv, ErrorsNameTheVariable) {
  EXPECT_NE(error_of({{"RANK", "0"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK=x is not an integer"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"},
                      {"MASTER_PORT", "1"}})
                .find("RANK=2 is not below WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}})
                .find("MASTER_ADDR is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}})
                .find("MASTER_PORT is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"},
                      {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT=70000 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"},
                      {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})
                .find("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}})
                .find("OMPI_COMM_WORLD_LOCAL_RANK is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}})
                .find("SLURM_NTASKS_PER_NODE is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                      {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_JOB_NODELIST", "a[1-2]b[1-2]"}})
                .find("MASTER_ADDR is not set and SLURM_JOB_NODELIST"),
            std::string::npos);
}

TEST(CommEnv, Timeout) {
  EXPECT_EQ(resolve_timeout(2.5, fake({{"STRATA_TIMEOUT", "9"}})).count(), 2500);
  EXPECT_EQ(resolve_timeout(std::nullopt, fake({{"STRATA_TIMEOUT", "9"}})).count(), 9000);
  EXPECT_EQ(resolve_timeout(std::nullopt, fake({})).count(), 600000);
  EXPECT_THROW(resolve_timeout(std::nullopt, fake({{"STRATA_TIMEOUT", "soon"}})), Error);
  EXPECT_THROW(resolve_timeout(std::nullopt, fake({{"STRATA_TIMEOUT", "-1"}})), Error);
  EXPECT_THROW(resolve_timeout(0.0, fake({})), Error);
}

TEST(CommEnv, CommCheck) {
  EXPECT_EQ(resolve_comm_check(std::nullopt, fake({})), CommCheck::Cpu);
  EXPECT_EQ(resolve_comm_check(std::nullopt, fake({{"STRATA_COMM_CHECK", "1"}})), CommCheck::All);
  EXPECT_EQ(resolve_comm_check(std::nullopt, fake({{"STRATA_COMM_CHECK", "all"}})),
            CommCheck::All);
  EXPECT_EQ(resolve_comm_check(std::nullopt, fake({{"STRATA_COMM_CHECK", "0"}})), CommCheck::Off);
  EXPECT_EQ(resolve_comm_check(CommCheck::Off, fake({{"STRATA_COMM_CHECK", "1"}})),
            CommCheck::Off);
  EXPECT_THROW(resolve_comm_check(std::nullopt, fake({{"STRATA_COMM_CHECK", "yes"}})), Error);
}

}  // namespace
}  // namespace strata::comm
