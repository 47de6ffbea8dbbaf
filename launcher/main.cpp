// strata-run [options] [--] PROGRAM ARGS...: parse, resolve into a plan (every check happens
// there, before anything starts), then print it (--dry-run) or start and supervise it.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "launcher/config_block.h"
#include "launcher/hostfile.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "launcher/program.h"
#include "launcher/supervisor.h"
#include "runtime/error.h"

using namespace strata::launcher;

namespace {

std::vector<ChildSpec> children_of(const LaunchPlan& plan) {
  std::vector<ChildSpec> children;
  for (const LocalRank& r : plan.local) {
    ChildSpec child;
    child.name = "rank " + std::to_string(r.rank);
    child.prefix = "[rank " + std::to_string(r.rank) + "] ";
    child.path = plan.program_path;
    child.argv = plan.program;
    child.env = r.env;
    if (!plan.secret.empty()) child.env.emplace_back("STRATA_JOB_SECRET", plan.secret);
    children.push_back(std::move(child));
  }
  if (!plan.remote.empty()) {
    const std::string ssh = find_program("ssh");
    for (const RemoteNode& node : plan.remote) {
      ChildSpec child;
      child.name = "node " + std::to_string(node.node_rank) + " (" + node.host + ")";
      child.path = ssh;
      child.argv = node.argv;
      child.remote = true;
      EnvList env = node.env;
      if (!plan.secret.empty()) env.emplace_back("STRATA_JOB_SECRET", plan.secret);
      child.stdin_text = env_block(env);
      child.host = node.host;
      child.remote_launcher = plan.remote_launcher;
      child.connect_timeout = plan.ssh.connect_timeout;
      children.push_back(std::move(child));
    }
  }
  return children;
}

// A node launcher's "node K, HOST" (from --node-rank and --world-info), for its error messages.
std::string node_label(const LauncherOptions& o) {
  if (!o.world_info || !o.node_rank) return "";
  try {
    const Resources world = parse_world_info(*o.world_info);
    if (*o.node_rank < static_cast<int>(world.size()))
      return "node " + std::to_string(*o.node_rank) + ", " +
             world[static_cast<size_t>(*o.node_rank)].host;
  } catch (const std::exception&) {
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--version") {
    std::puts(STRATA_VERSION_LINE);  // cmake/package.cmake, as strata/version.h's line
    return 0;
  }
  std::string who = "strata-run";
  try {
    std::optional<LauncherOptions> options =
        parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
    if (!options) return 0;  // --help
    options->argv0 = argv[0];
    if (const std::string label = node_label(*options); !label.empty())
      who = "strata-run (" + label + ")";
    if (options->env_stdin)  // the head writes them at once; allow for a slow ssh login
      for (const auto& [name, value] : read_env_block(STDIN_FILENO, 120))
        ::setenv(name.c_str(), value.c_str(), 1);
    if (options->chdir && ::chdir(options->chdir->c_str()) != 0)
      throw strata::Error(fmt::format(
          "cannot enter the working folder '{}' here: {} (it is the head's folder as typed "
          "there; every host needs that path, e.g. on a shared file system)",
          *options->chdir, std::strerror(errno)));
    if (options->config) {
      const std::string path = std::filesystem::absolute(*options->config).string();
      *options = merge(*options, options_from_config(path));
      // The program gets the same config, unless its arguments already name one.
      auto& program = options->program;
      if (!program.empty() && std::find(program.begin(), program.end(), "--config") == program.end()) {
        program.push_back("--config");
        program.push_back(path);
      }
    }
    const LaunchPlan plan = make_plan(*options);
    if (options->config) {
      int world_size = 0;
      for (const auto& host : plan.world) world_size += static_cast<int>(host.slots.size());
      check_config_for_world(std::filesystem::absolute(*options->config).string(), world_size);
    }
    if (options->dry_run) {
      for (const std::string& line : command_lines(plan)) std::printf("%s\n", line.c_str());
      return 0;
    }
    if (const std::string warning = check_master_address(plan); !warning.empty())
      std::fprintf(stderr, "%s: warning: %s\n", who.c_str(), warning.c_str());
    return supervise(children_of(plan), {plan.grace_seconds, plan.watch_stdin, plan.label});
  } catch (const UsageError& e) {
    std::fprintf(stderr,
                 "strata-run: %s\nusage: strata-run [options] [--] PROGRAM ARGS... "
                 "(strata-run --help lists the options)\n",
                 e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return 1;
  }
}
