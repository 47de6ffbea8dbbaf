// Finds the program the ranks will run, as execvp would, so a typo fails before any rank starts.
#pragma once

#include <string>

namespace strata::launcher {

// The path to execute: `name` itself if it contains '/', else the first executable PATH entry.
// Throws strata::Error naming the program and what is wrong (missing, a directory, not
// executable, not in PATH).
std::string find_program(const std::string& name);

}  // namespace strata::launcher
