// Hosts and their slots: the hostfile, DeepSpeed's --include/--exclude filter over it, and the
// same NAME:SLOT,SLOT@NAME... text that the head hands each remote node as --world-info.
#pragma once

#include <string>
#include <vector>

namespace strata::launcher {

struct HostSlots {
  std::string host;
  std::vector<int> slots;  // GPU slots, in the order their ranks get them
};
using Resources = std::vector<HostSlots>;  // hosts in hostfile order: node rank = index

// "HOST slots=N" per line; blank lines and '#' comments ignored. Errors name the line.
Resources parse_hostfile_text(const std::string& text, const std::string& origin);
Resources read_hostfile(const std::string& path);

// DeepSpeed's parse_resource_filter: include keeps only the named hosts/slots, exclude removes
// them; a host without ":SLOTS" means all of its slots; hosts keep the pool's order and hosts
// left without slots are dropped. Unknown hosts or slots are errors. (Differs from DeepSpeed in
// one corner: a host named twice in --include gets the union of its slots, not the last list.)
Resources filter_resources(const Resources& pool, const std::string& include,
                           const std::string& exclude);

// --world-info: every node with its explicit slots, e.g. "node-a:0,1@node-b:0,1".
Resources parse_world_info(const std::string& text);
std::string format_world_info(const Resources& world);

}  // namespace strata::launcher
