// Hosts and their slots: the hostfile, DeepSpeed's --include/--exclude filter over it, and the
// same NAME:SLOT,SLOT@NAME... text that the head hands each remote node as --world-info.
#pragma once

#include <string>
#include <vector>

namespace strata::launcher {

struct HostSlots {
  std::string host;        // as ssh gets it: NAME, USER@NAME, or an IPv6 literal without brackets
  std::vector<int> slots;  // GPU slots, in the order their ranks get them
};
using Resources = std::vector<HostSlots>;  // hosts in hostfile order: node rank = index

// The machine part of a hostfile name: "node1" for "alice@node1", "::1" for "[::1]".
std::string machine_of(const std::string& host);
// How --include/--exclude and --world-info write a host: its machine, in brackets when it holds
// ':' (an IPv6 literal), since '@' and ':' separate nodes and slots there.
std::string spec_name(const std::string& host);

// "HOST slots=N" per line; blank lines and '#' comments ignored. HOST is a name or address as
// ssh takes it, optionally USER@ in front; an IPv6 literal may be bracketed ("[fe80::1]").
// Errors name the line.
Resources parse_hostfile_text(const std::string& text, const std::string& origin);
// `named_by` says where the path came from, for the error (e.g. the config's launcher.hostfile).
Resources read_hostfile(const std::string& path, const std::string& named_by = "");

// DeepSpeed's parse_resource_filter: include keeps only the named hosts/slots, exclude removes
// them; a host without ":SLOTS" means all of its slots; hosts keep the pool's order and hosts
// left without slots are dropped. Unknown hosts or slots are errors. A spec names a host by its
// spec_name (so "node1" selects "alice@node1", and "[::1]:0" slot 0 of "::1"). (Differs from
// DeepSpeed in one corner: a host named twice in --include gets the union of its slots, not the
// last list.)
Resources filter_resources(const Resources& pool, const std::string& include,
                           const std::string& exclude);

// --world-info: every node with its explicit slots, e.g. "node-a:0,1@node-b:0,1"; hosts by their
// spec_name (a remote node launcher needs the slots; the names only label its messages).
Resources parse_world_info(const std::string& text);
std::string format_world_info(const Resources& world);

}  // namespace strata::launcher
