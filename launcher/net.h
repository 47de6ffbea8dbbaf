// This machine's name and the rendezvous port: which hosts are "here", and whether a port is free.
#pragma once

#include <string>

namespace strata::launcher {

std::string this_hostname();

// localhost, 127.0.0.1 (any 127.x), ::1, or this machine's name (full or short): run without ssh.
// A name with a user ("alice@localhost") always goes through ssh.
bool is_local_host(const std::string& host);

// localhost, any 127.x, ::1 (also ::ffff:127.x).
bool is_loopback(const std::string& address);

// The address of this machine that packets to `host` leave from (the route's source: a UDP
// socket connected there, nothing sent), so the right one of several interfaces. "" when `host`
// does not resolve here or has no route.
std::string address_towards(const std::string& host);

// "" if `host` resolves here, else why not (getaddrinfo's message).
std::string resolve_error(const std::string& host);

// Whether `host` resolves to an address of this machine (one that a socket can bind).
bool names_this_machine(const std::string& host);

// The loopback address `host` resolves to when it is a name (not an address literal) whose every
// address is a loopback one, as Debian's /etc/hosts maps the machine's own name to 127.0.1.1;
// "" otherwise. Other hosts cannot reach a master of that name.
std::string loopback_alias(const std::string& host);

// 32 random bytes as 64 hex digits, for STRATA_JOB_SECRET. Throws strata::Error when the kernel
// has no random bytes to give.
std::string make_job_secret();

// Throws strata::Error naming the port if something on this machine already listens on it.
void check_port_free(int port);

// A port free a moment ago, outside the ephemeral range (runtime/util/free_port.h); throws
// strata::Error when none can be bound.
int pick_free_port();

}  // namespace strata::launcher
