#include "launcher/config_block.h"

#include <fmt/format.h>

#include <filesystem>

#include "runtime/config/config.h"

namespace strata::launcher {

LauncherOptions options_from_config(const std::string& path) {
  LoadOptions load;
  load.allow_unresolved_auto = true;   // the program resolves its "auto"s
  load.check_batch_triangle = false;   // the world is not planned yet
  const Config config = load_config_file(path, load);
  const LauncherConfig& block = config.launcher;
  LauncherOptions options;
  if (!block.hostfile.empty()) {  // relative to the config's folder, as a config's paths are
    const std::filesystem::path hostfile(block.hostfile);
    options.hostfile = hostfile.is_absolute()
                           ? block.hostfile
                           : (std::filesystem::path(path).parent_path() / hostfile).string();
    options.hostfile_named_by =
        fmt::format("launcher.hostfile '{}' of {}{}", block.hostfile, path,
                    hostfile.is_absolute() ? "" : ", read relative to the config's folder");
  }
  if (!block.include.empty()) options.include = block.include;
  if (!block.exclude.empty()) options.exclude = block.exclude;
  if (block.num_nodes > 0) options.num_nodes = static_cast<int>(block.num_nodes);
  if (block.num_gpus > 0) options.num_gpus = static_cast<int>(block.num_gpus);
  if (!block.master_addr.empty()) options.master_addr = block.master_addr;
  if (block.master_port > 0) options.master_port = static_cast<int>(block.master_port);
  options.exports = block.export_env;
  return options;
}

void check_config_for_world(const std::string& path, int world_size) {
  LoadOptions load;
  load.allow_unresolved_auto = true;
  load.world_size = world_size;
  load_config_file(path, load);
}

}  // namespace strata::launcher
