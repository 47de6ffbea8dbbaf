#include "launcher/plan.h"

#include <dirent.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>

#include "launcher/net.h"
#include "launcher/program.h"
#include "runtime/error.h"

extern char** environ;

namespace strata::launcher {
namespace {

constexpr int kDefaultPort = 29500;  // torchrun's and DeepSpeed's
constexpr const char* kSecretVariable = "STRATA_JOB_SECRET";

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

// A shell variable name: [A-Za-z_][A-Za-z0-9_]*, checked by hand (std::regex recurses once per
// character and overflowed the stack on a 100 kB name), at most 1024 characters.
bool is_variable_name(const std::string& name) {
  if (name.empty() || name.size() > 1024) return false;
  auto letter = [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; };
  if (!letter(name[0])) return false;
  for (char c : name)
    if (!letter(c) && !(c >= '0' && c <= '9')) return false;
  return true;
}

// --export entries into NAME=VALUE pairs. Names are checked because they go into a remote shell.
EnvList resolve_exports(const std::vector<std::string>& entries) {
  EnvList out;
  for (const std::string& entry : entries) {
    size_t eq = entry.find('=');
    std::string name = entry.substr(0, eq);
    const bool prefix = !name.empty() && name.back() == '*';
    if (!is_variable_name(prefix ? name.substr(0, name.size() - 1) : name) ||
        (eq != std::string::npos && prefix))
      throw Error(fmt::format("--export '{}{}': expected NAME, NAME_* or NAME=VALUE (a shell "
                              "variable name of at most 1024 characters)",
                              entry.substr(0, 200), entry.size() > 200 ? "..." : ""));
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

// The working folder as the user reached it: $PWD when it names the current folder (as `pwd`
// prints it, symlinks kept), else the resolved path. On a cluster the path as typed (a shared
// /work/me/run reached through a link) is the one that exists on the other hosts.
std::string logical_directory() {
  const char* pwd = std::getenv("PWD");
  struct stat typed {}, here {};
  if (pwd && pwd[0] == '/' && ::stat(pwd, &typed) == 0 && ::stat(".", &here) == 0 &&
      typed.st_dev == here.st_dev && typed.st_ino == here.st_ino)
    return pwd;
  return current_directory();
}

// What the remote hosts run: $STRATA_REMOTE_LAUNCHER, else this strata-run as it was started
// (argv[0], through PATH if it has no '/'), made absolute against the folder as typed, links kept.
std::string remote_launcher(const std::string& argv0, const std::string& directory) {
  if (const char* env = std::getenv("STRATA_REMOTE_LAUNCHER"); env && *env) return env;
  std::string path = argv0;
  if (path.empty()) return self_path();
  if (path.find('/') == std::string::npos) {
    try {
      path = find_program(path);
    } catch (const Error&) {
      return self_path();
    }
  }
  if (path[0] != '/') path = directory + "/" + path;
  return std::filesystem::path(path).lexically_normal().string();
}

// DeepSpeed's .deepspeed_env: NAME=VALUE lines ('#' comments, blank lines), set on every rank.
void read_env_file(const std::string& path, EnvList& into) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;  // no such file: nothing to export
  if (!S_ISREG(st.st_mode))  // a FIFO would block the launch
    throw Error(fmt::format("{} is not a regular file: remove it or make it a file of NAME=VALUE "
                            "lines", path));
  std::ifstream file(path);
  if (!file) return;
  std::string line;
  for (int line_no = 1; std::getline(file, line); ++line_no) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    if (line.back() == '\r') line.pop_back();
    const size_t eq = line.find('=');
    const std::string name = eq == std::string::npos ? "" : line.substr(first, eq - first);
    if (!is_variable_name(name))
      throw Error(fmt::format("{} line {}: expected NAME=VALUE with NAME a variable name, got '{}'",
                              path, line_no, line.size() > 200 ? line.substr(0, 200) + "..." : line));
    set(into, name, line.substr(eq + 1));
  }
}

// The head's NCCL_* and STRATA_* (STRATA_TIMEOUT, ...), which its local ranks inherit: remote
// ranks get them too, so every rank of a job runs with the same settings.
EnvList forwarded_environment() {
  EnvList out;
  for (char** e = environ; *e; ++e) {
    const std::string var = *e;
    const size_t eq = var.find('=');
    if (eq == std::string::npos) continue;
    const std::string name = var.substr(0, eq);
    if ((name.rfind("NCCL_", 0) == 0 || name.rfind("STRATA_", 0) == 0) &&
        name != "STRATA_REMOTE_LAUNCHER" && name != kSecretVariable)
      set(out, name, var.substr(eq + 1));
  }
  return out;
}

// The nodes of a DeepSpeed-style launch: the hostfile, filtered, cut by --num_nodes/--num_gpus.
Resources hostfile_world(const LauncherOptions& o) {
  reject(o.node_rank.has_value(), "--node-rank", "--hostfile (the launcher numbers the nodes)");
  bool filtered = o.include || o.exclude;
  reject(filtered && o.num_nodes, "--num_nodes", "--include/--exclude");
  reject(filtered && o.num_gpus, "--num_gpus/--nproc-per-node", "--include/--exclude");
  Resources world = filter_resources(read_hostfile(*o.hostfile, o.hostfile_named_by),
                                     o.include.value_or(""), o.exclude.value_or(""));
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

// ssh, if this machine has it ("" otherwise: then names stay as written).
std::string ssh_program() {
  try {
    return find_program("ssh");
  } catch (const Error&) {
    return "";
  }
}

// The master of a hostfile launch without --master-addr: node 0 as the other nodes reach it.
// Node 0 remote: the host ssh connects to for it (`ssh -G`: an alias's HostName), not the alias,
// which only ssh knows. Node 0 here: this machine's address on the route to the first remote
// node (the right one of several interfaces), else its name. All nodes here: the loopback.
std::string default_master(const Resources& world, const SshOptions& ssh_options) {
  const std::string ssh = ssh_program();
  auto target = [&](const std::string& host) {
    std::optional<SshTarget> t;
    if (!ssh.empty()) t = ssh_resolve(ssh, host, ssh_options);
    return t ? t->hostname : machine_of(host);
  };
  const auto remote = std::find_if(world.begin(), world.end(),
                                   [](const HostSlots& h) { return !is_local_host(h.host); });
  if (remote == world.end()) return "127.0.0.1";
  if (remote != world.begin()) {
    const std::string address = address_towards(target(remote->host));
    return address.empty() ? this_hostname() : address;
  }
  const std::string master = target(world[0].host);
  if (is_loopback(master))  // node 0 is this machine: every node must be
    for (size_t n = 1; n < world.size(); ++n) {
      if (is_local_host(world[n].host)) continue;
      const std::string there = target(world[n].host);
      if (!is_loopback(there))
        throw Error(fmt::format(
            "node 0 ('{}') is {} through ssh, a loopback address that node {} ('{}', {}) cannot "
            "reach as the master; give --master-addr with an address of node 0 that every host "
            "reaches",
            world[0].host, master, n, world[n].host, there));
    }
  return master;
}

}  // namespace

LaunchPlan make_plan(const LauncherOptions& o) {
  LaunchPlan plan;
  plan.program = o.program;
  plan.ssh.config = o.ssh_config.value_or("");
  plan.ssh.port = o.ssh_port.value_or(0);
  plan.ssh.connect_timeout = o.ssh_connect_timeout.value_or(kDefaultConnectTimeout);
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
    plan.label = fmt::format("node {}, {}", *o.node_rank,
                             plan.world[static_cast<size_t>(*o.node_rank)].host);
  } else if (o.hostfile) {
    plan.world = hostfile_world(o);
    for (size_t n = 0; n < plan.world.size(); ++n)
      if (is_local_host(plan.world[n].host)) here.push_back(static_cast<int>(n));
    choose_port = !here.empty() && here.front() == 0;
    plan.master_addr = o.master_addr ? *o.master_addr : default_master(plan.world, plan.ssh);
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

  // The job's secret: a node launcher has the head's (from its stdin); a head that starts every
  // node makes one unless the user gave it. One node of a torchrun-style job started by hand
  // cannot make one that the others share.
  if (const char* given = std::getenv(kSecretVariable); given && *given) {
    plan.secret = given;
  } else if (!(o.world_info || (!o.hostfile && plan.world.size() > 1))) {
    plan.secret = make_job_secret();
  }

  // What every rank gets set: .strata_env (hostfile launches, as DeepSpeed's .deepspeed_env:
  // the home folder's, then the working folder's), then --export; remote ranks also get the
  // head's NCCL_* and STRATA_*, which the local ones inherit.
  EnvList exports;
  if (o.hostfile) {
    if (const char* home = std::getenv("HOME"))
      read_env_file(std::string(home) + "/.strata_env", exports);
    read_env_file(".strata_env", exports);
  }
  for (const auto& [name, value] : resolve_exports(o.exports)) set(exports, name, value);
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
    const std::string directory = logical_directory();
    plan.remote_launcher = remote_launcher(o.argv0, directory);
    const std::string world_info = format_world_info(plan.world);
    EnvList remote_exports = exports;
    for (const auto& [name, value] : forwarded_environment())
      if (std::none_of(exports.begin(), exports.end(),
                       [&, &name = name](const auto& e) { return e.first == name; }))
        remote_exports.emplace_back(name, value);
    for (size_t n = 0; n < plan.world.size(); ++n) {
      if (is_local_host(plan.world[n].host)) continue;
      std::vector<std::string> args = {
          plan.remote_launcher, "--env-stdin", "--chdir",       directory,
          "--watch-stdin",      "--node-rank",   std::to_string(n),
          "--world-info",       world_info,      "--master-addr",
          plan.master_addr,     "--master-port", std::to_string(plan.master_port)};
      if (o.grace_seconds)
        args.insert(args.end(), {"--grace", fmt::format("{}", *o.grace_seconds)});
      args.push_back("--");
      args.insert(args.end(), plan.program.begin(), plan.program.end());
      const std::string& host = plan.world[n].host;
      plan.remote.push_back(
          {host, static_cast<int>(n), ssh_argv(host, remote_command(args), plan.ssh),
           remote_exports});
    }
  }
  return plan;
}

std::string check_master_address(const LaunchPlan& plan) {
  // torchrun-style nodes are named node0, node1, ...: never this host's names.
  const bool other_hosts = std::any_of(plan.world.begin(), plan.world.end(),
                                       [](const HostSlots& h) { return !is_local_host(h.host); });
  if (other_hosts)
    if (const std::string loop = loopback_alias(plan.master_addr); !loop.empty())
      throw Error(fmt::format(
          "the master address '{}' resolves to {} here, a loopback address (as Debian's "
          "/etc/hosts maps the host's own name to 127.0.1.1), which the other hosts of the job "
          "cannot reach; give --master-addr this host's address on their network",
          plan.master_addr, loop));
  if (plan.local.empty()) return "";
  if (const std::string why = resolve_error(plan.master_addr); !why.empty())
    throw Error(fmt::format(
        "the master address '{}' does not resolve here ({}), so the ranks here could not reach "
        "the rendezvous; give --master-addr an address of node 0 that every host resolves",
        plan.master_addr, why));
  if (plan.local.front().rank == 0 && !names_this_machine(plan.master_addr))
    return fmt::format(
        "the master address '{}' is not an address of this host, which runs rank 0 and its "
        "rendezvous store; the ranks will look for the store there",
        plan.master_addr);
  return "";
}

std::vector<std::string> command_lines(const LaunchPlan& plan) {
  std::vector<std::string> lines;
  for (const LocalRank& r : plan.local) {
    std::string line;
    for (const auto& [name, value] : r.env) line += name + "=" + shell_quote(value) + " ";
    lines.push_back(line + shell_join(plan.program));
  }
  for (const RemoteNode& node : plan.remote) {
    std::string line = shell_join(node.argv);
    if (!node.env.empty()) {
      line += "  # stdin:";
      for (const auto& [name, value] : node.env) line += " " + name + "=" + shell_quote(value);
    }
    lines.push_back(line);
  }
  return lines;
}

}  // namespace strata::launcher
