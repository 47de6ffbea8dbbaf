// strata-run [options] [--] PROGRAM ARGS...: parse, resolve into a plan (every check happens
// there, before anything starts), then print it (--dry-run) or start and supervise it.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "launcher/config_block.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "launcher/program.h"
#include "launcher/supervisor.h"
#include "runtime/error.h"

using namespace strata::launcher;

namespace {

std::vector<ChildSpec> children_of(const LaunchPlan& plan) {
  std::vector<ChildSpec> children;
  for (const LocalRank& r : plan.local)
    children.push_back({"rank " + std::to_string(r.rank), "[rank " + std::to_string(r.rank) + "] ",
                        plan.program_path, plan.program, r.env, false});
  if (!plan.remote.empty()) {
    const std::string ssh = find_program("ssh");
    for (const RemoteNode& node : plan.remote)
      children.push_back({"node " + std::to_string(node.node_rank) + " (" + node.host + ")",
                          "",
                          ssh,
                          node.argv,
                          {},
                          true});
  }
  return children;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--version") {
    std::puts(STRATA_VERSION_LINE);  // cmake/package.cmake, as strata/version.h's line
    return 0;
  }
  try {
    std::optional<LauncherOptions> options =
        parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
    if (!options) return 0;  // --help
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
    return supervise(children_of(plan), {plan.grace_seconds, plan.watch_stdin});
  } catch (const UsageError& e) {
    std::fprintf(stderr,
                 "strata-run: %s\nusage: strata-run [options] [--] PROGRAM ARGS... "
                 "(strata-run --help lists the options)\n",
                 e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-run: error: %s\n", e.what());
    return 1;
  }
}
