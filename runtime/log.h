// Console output. Log lines go to stdout; a "status line" (the trainer's live progress) is
// redrawn in place on a terminal and printed as ordinary lines otherwise. A log line first clears
// an active status line so the two never interleave. Ranks other than 0 stay quiet.
#pragma once

#include <string>

#include <fmt/format.h>

namespace strata::log {

// Only rank 0 prints by default; STRATA_LOG_ALL_RANKS=1 lets every rank print.
void set_rank(int rank);

void line(const std::string& text);
void status(const std::string& text);
// Ends an active status line with a newline (call before the program's final output).
void end_status();

template <class... Args>
void info(fmt::format_string<Args...> format, Args&&... args) {
  line(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace strata::log
