// Strata's `launcher` block: what strata-run --config reads (hosts, slots, master, environment),
// DeepSpeed's launcher flags as keys. The engine ignores the block; the command line overrides it.
#include <fmt/format.h>

#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

Block make_launcher() {
  BlockBuilder<LauncherConfig> b("launcher");
  b.add(&LauncherConfig::hostfile, "hostfile")
      .describe("Hostfile listing the hosts and their GPU slots (lines of host slots=N)");
  b.add(&LauncherConfig::include, "include")
      .describe("Hosts and GPUs to use, e.g. node1:0,1@node2");
  b.add(&LauncherConfig::exclude, "exclude")
      .describe("Hosts and GPUs to leave out, e.g. node1:0@node2");
  b.add(&LauncherConfig::num_nodes, "num_nodes")
      .min(0)
      .describe("Number of nodes to run on");
  b.add(&LauncherConfig::num_gpus, "num_gpus")
      .alias("nproc_per_node").min(0)
      .describe("GPUs (processes) to run on each node");
  b.add(&LauncherConfig::master_addr, "master_addr")
      .describe("Address of the rank-0 host for rendezvous");
  b.add(&LauncherConfig::master_port, "master_port")
      .range(0, 65535)
      .describe("Port of the rendezvous on the rank-0 host");
  b.add(&LauncherConfig::export_env, "export")
      .describe("Environment variables set on every rank, also on remote hosts (DeepSpeed: .deepspeed_env)");
  Block block = b.build();
  block.finish = [](void* obj, Ctx& ctx, const std::string& path) {
    const auto& l = *static_cast<LauncherConfig*>(obj);
    if (!l.include.empty() && !l.exclude.empty())
      ctx.error(join(path, "exclude"),
                fmt::format("{}.include and {}.exclude are exclusive (DeepSpeed's rule); keep one",
                            path, path));
  };
  return block;
}

}  // namespace

const Block& launcher_block() {
  static const Block b = make_launcher();
  return b;
}

}  // namespace strata::schema
