// A TCP port for a rendezvous server that is free now and stays out of everyone's way until the
// server binds it.
#pragma once

namespace strata {

// A port that nothing on this machine binds now, chosen outside the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range). Why outside: a port from bind(0) sits in that
// range, so between the pick and the server's bind it can be handed to any socket that binds
// port 0 or connects (Gloo's pair listeners do); and clients still knocking on a port whose
// server never came (a rank 0 that died) then reach such a stranger, which accepts them (the
// Gloo Debian ships does not check who connected). Falls back to bind(0) when the range leaves
// no room. Returns -errno when no port can be bound at all.
int pick_free_port();

// bind() to `port` on every address (SO_REUSEADDR, so TIME_WAIT does not count) and close:
// the port, or -errno. `port` 0 asks the kernel for one.
int try_bind_port(int port);

}  // namespace strata
