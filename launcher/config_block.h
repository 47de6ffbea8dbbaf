// strata-run --config FILE: the training config's `launcher` block, read and validated through
// the config schema like every other block, and the whole config checked for the planned world
// before any rank starts.
#pragma once

#include <string>

#include "launcher/options.h"

namespace strata::launcher {

// The `launcher` block of FILE as options (fields the block leaves unset stay unset). A relative
// launcher.hostfile is read from FILE's folder.
LauncherOptions options_from_config(const std::string& path);

// The whole config validated for `world_size` ranks (the batch triangle included): a
// strata::Error naming the problems, before anything starts.
void check_config_for_world(const std::string& path, int world_size);

}  // namespace strata::launcher
