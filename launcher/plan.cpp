#include "launcher/plan.h"

#include <dirent.h>
#include <fmt/format.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <regex>

#include "launcher/net.h"
#include "launcher/program.h"
#include "runtime/error.h"

extern char** environ;

namespace strata::launcher {
namespace {

constexpr int kDefaultPort = 29500;  // torchrun's and DeepSpeed's

// The launcher's own CUDA_VISIBLE_DEVICES as a list; nullopt when unset. Slots index into it,
// so `CUDA_VISIBLE_DEVICES=4,5 strata-run --nproc-per-node 2` gives the ranks GPU 4 and GPU 5.
std::optional<std::vector<std::string>> visible_devices() {
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  if (!env) return std::nullopt;
  std::vector<std::string> list;
  std::string all = env;
  for (size_t start = 0; !all.empty() && start <= all.size();) {
    size_t end = std::min(all.find(',', start), all.size());
    list.push_back(all.substr(start, end - start));
    start = end + 1;
  }
  return list;
}

// Default ranks per node, as DeepSpeed's: the GPUs this process may use, or 1 (a CPU run).
int detect_gpus() {
  if (auto visible = visible_devices()) return std::max<int>(1, static_cast<int>(visible->size()));
  int count = 0;
  if (DIR* dev = ::opendir("/dev")) {
    static const std::regex gpu("nvidia[0-9]+");
    while (dirent* e = ::readdir(dev)) count += std::regex_match(e->d_name, gpu);
    ::closedir(dev);
  }
  return std::max(count, 1);
}

std::string device_for(int slot, const std::optional<std::vector<std::string>>& visible) {
  if (!visible) return std::to_string(slot);
  if (visible->empty()) return "";  // the user hid every GPU: keep it that way
  if (slot >= static_cast<int>(visible->size()))
    throw Error(
        fmt::format("slot {} needs device {} of CUDA_VISIBLE_DEVICES, which lists only {} "
                    "({}); use fewer slots or widen CUDA_VISIBLE_DEVICES",
                    slot, slot, visible->size(), std::getenv("CUDA_VISIBLE_DEVICES")));
  return (*visible)[static_cast<size_t>(slot)];
}

void set(EnvList& env, const std::string& name, const std::string& value) {
  for (auto& entry : env)
    if (entry.first == name) return void(entry.second = value);
  env.emplace_back(name, value);
}

// --export entries into NAME=VALUE pairs. Names are checked because they go into a remote shell.
EnvList resolve_exports(const std::vector<std::string>& entries) {
  static const std::regex identifier("[A-Za-z_][A-Za-z0-9_]*\\*?");
  EnvList out;
  for (const std::string& entry : entries) {
    size_t eq = entry.find('=');
    std::string name = entry.substr(0, eq);
    if (!std::regex_match(name, identifier) || (eq != std::string::npos && name.back() == '*'))
      throw Error(fmt::format("--export '{}': expected NAME, NAME_* or NAME=VALUE", entry));
    if (eq != std::string::npos) {
      set(out, name, entry.substr(eq + 1));
    } else if (name.back() == '*') {
      std::string prefix = name.substr(0, name.size() - 1);
      for (char** e = environ; *e; ++e) {
        std::string var = *e;
        size_t at = var.find('=');
        if (at != std::string::npos && var.compare(0, prefix.size(), prefix) == 0)
          set(out, var.substr(0, at), var.substr(at + 1));
      }
    } else if (const char* value = std::getenv(name.c_str())) {
      set(out, name, value);
    } else {
      throw Error(
          fmt::format("--export {}: {} is not set here; give --export {}=VALUE", name, name, name));
    }
  }
  return out;
}

void reject(bool given, const char* option, const char* because) {
  if (given) throw Error(fmt::format("{} cannot be combined with {}", option, because));
}

std::string self_path() {
  char buf[PATH_MAX] = {};
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "strata-run";
}

std::string current_directory() {
  char buf[PATH_MAX] = {};
  if (!::getcwd(buf, sizeof buf)) throw Error("cannot read the current directory");
  return buf;
}

// The nodes of a DeepSpeed-style launch: the hostfile, filtered, cut by --num_nodes/--num_gpus.
Resources hostfile_world(const LauncherOptions& o) {
  reject(o.node_rank.has_value(), "--node-rank", "--hostfile (the launcher numbers the nodes)");
  bool filtered = o.include || o.exclude;
  reject(filtered && o.num_nodes, "--num_nodes", "--include/--exclude");
  reject(filtered && o.num_gpus, "--num_gpus/--nproc-per-node", "--include/--exclude");
  Resources world =
      filter_resources(read_hostfile(*o.hostfile), o.include.value_or(""), o.exclude.value_or(""));
  if (o.num_nodes) {
    if (*o.num_nodes > static_cast<int>(world.size()))
      throw Error(fmt::format("--num_nodes {} but hostfile '{}' lists {} hosts", *o.num_nodes,
                              *o.hostfile, world.size()));
    world.resize(static_cast<size_t>(*o.num_nodes));
  }
  if (o.num_gpus)
    for (HostSlots& h : world) {
      if (*o.num_gpus > static_cast<int>(h.slots.size()))
        throw Error(fmt::format("--num_gpus {} but host '{}' has {} slots in '{}'", *o.num_gpus,
                                h.host, h.slots.size(), *o.hostfile));
      h.slots.resize(static_cast<size_t>(*o.num_gpus));
    }
  return world;
}

// The nodes of a torchrun-style launch: num_nodes alike machines, this one at --node-rank.
Resources torchrun_world(const LauncherOptions& o) {
  const int nodes = o.num_nodes.value_or(1);
  if (o.node_rank.value_or(0) >= nodes)
    throw Error(fmt::format("--node-rank {} must be below --nnodes {}", *o.node_rank, nodes));
  bool filtered = o.include || o.exclude;
  reject(filtered && nodes > 1, "--include/--exclude", "--nnodes > 1 without a hostfile");
  reject(filtered && o.num_gpus, "--num_gpus/--nproc-per-node", "--include/--exclude");
  HostSlots node{"localhost", {}};
  for (int s = 0, n = o.num_gpus.value_or(detect_gpus()); s < n; ++s) node.slots.push_back(s);
  node = filter_resources({node}, o.include.value_or(""), o.exclude.value_or("")).at(0);
  Resources world;
  for (int n = 0; n < nodes; ++n) {
    world.push_back(node);
    if (nodes > 1) world.back().host = fmt::format("node{}", n);
  }
  return world;
}

}  // namespace

LaunchPlan make_plan(const LauncherOptions& o) {
  LaunchPlan plan;
  plan.program = o.program;
  plan.grace_seconds = o.grace_seconds.value_or(5);
  plan.watch_stdin = o.watch_stdin;
  std::vector<int> here;     // node ranks whose ranks this launcher starts itself
  bool choose_port = false;  // true when every node learns the port from this launcher
  if (o.world_info) {
    const char* why = "--world-info (set by the head launcher)";
    reject(o.hostfile.has_value(), "--hostfile", why);
    reject(o.include || o.exclude, "--include/--exclude", why);
    reject(o.num_nodes || o.num_gpus, "--num_nodes/--num_gpus", why);
    if (!o.node_rank || !o.master_addr || !o.master_port)
      throw Error("--world-info needs --node-rank, --master-addr and --master-port");
    plan.world = parse_world_info(*o.world_info);
    if (*o.node_rank >= static_cast<int>(plan.world.size()))
      throw Error(fmt::format("--node-rank {} but --world-info lists {} nodes", *o.node_rank,
                              plan.world.size()));
    here = {*o.node_rank};
    plan.master_addr = *o.master_addr;
  } else if (o.hostfile) {
    plan.world = hostfile_world(o);
    for (size_t n = 0; n < plan.world.size(); ++n)
      if (is_local_host(plan.world[n].host)) here.push_back(static_cast<int>(n));
    choose_port = !here.empty() && here.front() == 0;
    // The master is node 0. Remote nodes cannot reach "localhost", so name this machine then.
    if (o.master_addr) {
      plan.master_addr = *o.master_addr;
    } else if (!is_local_host(plan.world[0].host)) {
      plan.master_addr = plan.world[0].host;
    } else {
      plan.master_addr = here.size() == plan.world.size() ? "127.0.0.1" : this_hostname();
    }
  } else {
    plan.world = torchrun_world(o);
    here = {o.node_rank.value_or(0)};
    choose_port = plan.world.size() == 1;
    if (plan.world.size() > 1 && !o.master_addr)
      throw Error(
          "--nnodes > 1 needs --master-addr: the address of node 0 that every node reaches");
    plan.master_addr = o.master_addr.value_or("127.0.0.1");
  }

  // The port is checked where the master runs (node 0 is here), before any rank starts.
  const bool master_here = !here.empty() && here.front() == 0;
  plan.master_port = o.master_port ? *o.master_port : choose_port ? 0 : kDefaultPort;
  if (plan.master_port == 0) {
    plan.master_port = pick_free_port();
  } else if (master_here) {
    check_port_free(plan.master_port);
  }

  const EnvList exports = resolve_exports(o.exports);
  const auto visible = visible_devices();
  int world_size = 0;
  std::vector<int> first_rank;
  for (const HostSlots& h : plan.world) {
    first_rank.push_back(world_size);
    world_size += static_cast<int>(h.slots.size());
  }
  for (int node : here) {
    const std::vector<int>& slots = plan.world[static_cast<size_t>(node)].slots;
    for (size_t local = 0; local < slots.size(); ++local) {
      LocalRank r;
      r.rank = first_rank[static_cast<size_t>(node)] + static_cast<int>(local);
      r.env = {{"RANK", std::to_string(r.rank)},
               {"WORLD_SIZE", std::to_string(world_size)},
               {"LOCAL_RANK", std::to_string(local)},
               {"LOCAL_WORLD_SIZE", std::to_string(slots.size())},
               {"GROUP_RANK", std::to_string(node)},
               {"NODE_RANK", std::to_string(node)},
               {"GROUP_WORLD_SIZE", std::to_string(plan.world.size())},
               {"MASTER_ADDR", plan.master_addr},
               {"MASTER_PORT", std::to_string(plan.master_port)},
               {"CUDA_VISIBLE_DEVICES", device_for(slots[local], visible)}};
      for (const auto& [name, value] : exports) set(r.env, name, value);
      plan.local.push_back(std::move(r));
    }
  }
  if (!plan.local.empty()) plan.program_path = find_program(plan.program.at(0));

  if (o.hostfile) {  // the other hosts: one ssh each, running a node launcher there
    const std::string directory = current_directory();
    const std::string world_info = format_world_info(plan.world);
    for (size_t n = 0; n < plan.world.size(); ++n) {
      if (is_local_host(plan.world[n].host)) continue;
      std::vector<std::string> args = {self_path(),     "--watch-stdin",
                                       "--node-rank",   std::to_string(n),
                                       "--world-info",  world_info,
                                       "--master-addr", plan.master_addr,
                                       "--master-port", std::to_string(plan.master_port)};
      if (o.grace_seconds)
        args.insert(args.end(), {"--grace", fmt::format("{}", *o.grace_seconds)});
      args.push_back("--");
      args.insert(args.end(), plan.program.begin(), plan.program.end());
      const std::string& host = plan.world[n].host;
      plan.remote.push_back(
          {host, static_cast<int>(n), ssh_argv(host, remote_command(exports, directory, args))});
    }
  }
  return plan;
}

std::vector<std::string> command_lines(const LaunchPlan& plan) {
  std::vector<std::string> lines;
  for (const LocalRank& r : plan.local) {
    std::string line;
    for (const auto& [name, value] : r.env) line += name + "=" + shell_quote(value) + " ";
    lines.push_back(line + shell_join(plan.program));
  }
  for (const RemoteNode& node : plan.remote) lines.push_back(shell_join(node.argv));
  return lines;
}

}  // namespace strata::launcher
