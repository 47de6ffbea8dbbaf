// strata-run [options] [--] PROGRAM ARGS...: parse, resolve into a plan (every check happens
// there, before anything starts), then print it (--dry-run) or start and supervise it.
#include <cstdio>
#include <string>
#include <vector>

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
  try {
    std::optional<LauncherOptions> options =
        parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
    if (!options) return 0;  // --help
    if (options->config) {
      // The lead wires this: read the config's `launcher` block into a LauncherOptions through
      // the config schema, then `*options = merge(*options, from_config);`.
      throw strata::Error(
          "--config: reading the launcher block of a config is not wired yet; "
          "give the launcher options on the command line");
    }
    const LaunchPlan plan = make_plan(*options);
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
