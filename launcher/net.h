// This machine's name and the rendezvous port: which hosts are "here", and whether a port is free.
#pragma once

#include <string>

namespace strata::launcher {

std::string this_hostname();

// localhost, 127.0.0.1 (any 127.x), ::1, or this machine's name (full or short): run without ssh.
bool is_local_host(const std::string& host);

// Throws strata::Error naming the port if something on this machine already listens on it.
void check_port_free(int port);

// A port free a moment ago, outside the ephemeral range (runtime/util/free_port.h); throws
// strata::Error when none can be bound.
int pick_free_port();

}  // namespace strata::launcher
