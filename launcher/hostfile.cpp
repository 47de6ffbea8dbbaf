#include "launcher/hostfile.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <regex>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/error.h"

namespace strata::launcher {
namespace {

// Bounds on what a hostfile may ask for (a hostile one must not make the launcher allocate or
// loop without end): a host's name as ssh takes it, a node's slots, and the file itself.
constexpr size_t kMaxHostChars = 1024;
constexpr int kMaxSlots = 4096;
constexpr long kMaxHostfileBytes = 16l << 20;

const char* kSpecSyntax =
    "expected NAME[:SLOT[,SLOT...]][@NAME[:SLOT...]...], e.g. 'worker-0@worker-1:0,2'";

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// At most 200 characters of `s`, for a message (a hostile line may be megabytes long).
std::string shortened(const std::string& s) {
  return s.size() <= 200 ? s : s.substr(0, 200) + "...";
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t at; (at = s.find(sep, start)) != std::string::npos; start = at + 1)
    parts.push_back(s.substr(start, at - start));
  parts.push_back(s.substr(start));
  return parts;
}

// Splits a spec node "NAME[:SLOTS]" or "[V6]:SLOTS" into its name and its ":SLOTS" remainder.
bool split_node(const std::string& part, std::string& name, std::string& rest) {
  if (!part.empty() && part[0] == '[') {
    size_t close = part.find(']');
    if (close == std::string::npos) return false;
    name = part.substr(1, close - 1);
    rest = part.substr(close + 1);
    return rest.empty() || rest[0] == ':';
  }
  size_t colon = part.find(':');
  name = part.substr(0, colon);
  rest = colon == std::string::npos ? "" : part.substr(colon);
  return true;
}

bool parse_uint(const std::string& s, int& out) {
  if (s.empty() || s.size() > 9 ||
      !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  out = std::stoi(s);
  return true;
}

// One NAME[:SLOT,...] of a spec. has_slots=false means "the whole host".
struct NodeSpec {
  std::string host;
  bool has_slots = false;
  std::vector<int> slots;
};

std::vector<NodeSpec> parse_spec(const std::string& what, const std::string& text) {
  std::vector<NodeSpec> nodes;
  for (const std::string& part : split(text, '@')) {
    NodeSpec node;
    std::string rest;
    const bool ok = split_node(part, node.host, rest);
    if (!ok || node.host.empty() || (!rest.empty() && rest.find(':', 1) != std::string::npos))
      throw Error(fmt::format("{} '{}': bad node '{}'; {} (an IPv6 address goes in brackets: "
                              "'[fe80::1]:0')",
                              what, text, part, kSpecSyntax));
    if (!rest.empty()) {
      node.has_slots = true;
      for (const std::string& slot : split(rest.substr(1), ',')) {
        int n = 0;
        if (!parse_uint(slot, n))
          throw Error(fmt::format("{} '{}': slot '{}' of host '{}' is not a number; {}", what, text,
                                  slot, node.host, kSpecSyntax));
        node.slots.push_back(n);
      }
    }
    nodes.push_back(std::move(node));
  }
  return nodes;
}

void add_unique(std::vector<int>& to, const std::vector<int>& slots) {
  for (int s : slots)
    if (std::find(to.begin(), to.end(), s) == to.end()) to.push_back(s);
}

// A host as ssh takes it: [USER@]NAME or [USER@]IPV6 (the caller strips brackets). Anything else
// (a '/', a shell character, a second '@') would fail only on the remote side, so it fails here.
bool valid_host(const std::string& host) {
  // libstdc++'s regex recurses per character: a hostile 100 kB name would overflow the stack.
  if (host.size() > kMaxHostChars) return false;
  static const std::regex name(
      "([A-Za-z0-9_][A-Za-z0-9_.-]*@)?"
      "([A-Za-z0-9_][A-Za-z0-9_.-]*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9_.-]+)?)");
  return std::regex_match(host, name);
}

}  // namespace

std::string machine_of(const std::string& host) {
  std::string machine = host.substr(host.find('@') + 1);  // npos + 1 == 0
  if (machine.size() > 1 && machine.front() == '[' && machine.back() == ']')
    machine = machine.substr(1, machine.size() - 2);
  return machine;
}

std::string spec_name(const std::string& host) {
  const std::string machine = machine_of(host);
  return machine.find(':') == std::string::npos ? machine : "[" + machine + "]";
}

Resources parse_hostfile_text(const std::string& text, const std::string& origin) {
  Resources pool;
  std::map<std::string, std::string> seen;  // spec_name -> the host as written
  std::istringstream in(text);
  std::string raw;
  for (int line_no = 1; std::getline(in, raw); ++line_no) {
    std::string line = trim(raw.substr(0, raw.find('#')));
    if (line.empty()) continue;
    auto bad = [&](const std::string& why) {
      return Error(
          fmt::format("{} line {}: {} in '{}'; expected 'HOST slots=N', e.g. "
                      "'worker-0 slots=8'",
                      origin, line_no, why, shortened(trim(raw))));
    };
    std::istringstream words(line);
    std::string host, slots_word, extra;
    words >> host >> slots_word >> extra;
    if (host[0] == '-') throw bad("a host name cannot start with '-'");  // ssh would read an option
    const size_t at = host.find('@') + 1;  // 0 without a user
    if (host.size() > at + 1 && host[at] == '[' && host.back() == ']')
      host = host.substr(0, at) + host.substr(at + 1, host.size() - at - 2);
    if (!valid_host(host))
      throw bad(fmt::format("'{}' is not a host as ssh takes it ([USER@]NAME or an IPv6 address)",
                            shortened(host)));
    if (slots_word.empty()) throw bad("no slots=N");
    if (!extra.empty()) throw bad(fmt::format("unexpected '{}'", extra));
    int slots = 0;
    if (slots_word.rfind("slots=", 0) != 0 || !parse_uint(slots_word.substr(6), slots))
      throw bad(fmt::format("'{}' is not slots=N", slots_word));
    if (slots == 0) throw bad("slots must be at least 1");
    if (slots > kMaxSlots) throw bad(fmt::format("slots must be at most {}", kMaxSlots));
    const auto [it, fresh] = seen.emplace(spec_name(host), host);
    if (!fresh)
      throw bad(it->second == host ? fmt::format("host '{}' is listed twice", host)
                                   : fmt::format("host '{}' is listed twice (also as '{}')",
                                                 spec_name(host), it->second));
    HostSlots entry{host, {}};
    for (int s = 0; s < slots; ++s) entry.slots.push_back(s);
    pool.push_back(std::move(entry));
  }
  if (pool.empty())
    throw Error(fmt::format("{} names no hosts; expected lines 'HOST slots=N'", origin));
  return pool;
}

Resources read_hostfile(const std::string& path, const std::string& named_by) {
  const std::string where = named_by.empty() ? "" : " (" + named_by + ")";
  auto fail = [&](const std::string& why) {
    return Error(fmt::format("cannot read hostfile '{}'{}: {}", path, where, why));
  };
  // A regular file of bounded size: a FIFO or a device named as the hostfile would block or
  // never end.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw fail(std::strerror(errno));
  struct stat st {};
  std::string text, problem;
  if (::fstat(fd, &st) != 0) problem = std::strerror(errno);
  else if (S_ISDIR(st.st_mode)) problem = "it is a folder";
  else if (!S_ISREG(st.st_mode)) problem = "not a regular file";
  else if (st.st_size > kMaxHostfileBytes) problem = "larger than 16 MiB; a hostfile lists hosts";
  if (problem.empty()) {
    text.resize(size_t(st.st_size));
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) problem = std::strerror(errno);
      if (n <= 0) break;
      got += size_t(n);
    }
    if (problem.empty() && got < text.size()) problem = "it shrank while being read";
  }
  ::close(fd);
  if (!problem.empty()) throw fail(problem);
  return parse_hostfile_text(text, fmt::format("hostfile '{}'", path));
}

Resources filter_resources(const Resources& pool, const std::string& include,
                           const std::string& exclude) {
  if (!include.empty() && !exclude.empty())
    throw Error("--include and --exclude are mutually exclusive; give one of them");
  if (include.empty() && exclude.empty()) return pool;
  const bool including = !include.empty();
  const std::string what = including ? "--include" : "--exclude";
  const std::string& text = including ? include : exclude;

  Resources kept = pool;
  if (including)
    for (HostSlots& h : kept) h.slots.clear();
  for (const NodeSpec& node : parse_spec(what, text)) {
    auto known = std::find_if(pool.begin(), pool.end(), [&](const HostSlots& h) {
      return machine_of(h.host) == node.host || h.host == node.host;
    });
    if (known == pool.end()) {
      std::vector<std::string> names;
      for (const HostSlots& h : pool) names.push_back(spec_name(h.host));
      throw Error(fmt::format("{} names host '{}', which is not in the hostfile (hosts: {})", what,
                              node.host, fmt::join(names, ", ")));
    }
    for (int s : node.slots)
      if (std::find(known->slots.begin(), known->slots.end(), s) == known->slots.end())
        throw Error(fmt::format("{} names slot {} on host '{}', which has slots {}", what, s,
                                node.host, fmt::join(known->slots, ",")));
    std::vector<int>& slots = kept[static_cast<size_t>(known - pool.begin())].slots;
    const std::vector<int>& named = node.has_slots ? node.slots : known->slots;
    if (including) {
      add_unique(slots, named);
    } else {
      for (int s : named) slots.erase(std::remove(slots.begin(), slots.end(), s), slots.end());
    }
  }
  kept.erase(
      std::remove_if(kept.begin(), kept.end(), [](const HostSlots& h) { return h.slots.empty(); }),
      kept.end());
  if (kept.empty()) throw Error(fmt::format("{} '{}' leaves no slots to run on", what, text));
  return kept;
}

Resources parse_world_info(const std::string& text) {
  Resources world;
  for (const NodeSpec& node : parse_spec("--world-info", text)) {
    if (!node.has_slots)
      throw Error(fmt::format("--world-info '{}': host '{}' has no slot list", text, node.host));
    world.push_back(HostSlots{node.host, {}});
    add_unique(world.back().slots, node.slots);
  }
  return world;
}

std::string format_world_info(const Resources& world) {
  std::vector<std::string> nodes;
  for (const HostSlots& h : world)
    nodes.push_back(fmt::format("{}:{}", spec_name(h.host), fmt::join(h.slots, ",")));
  return fmt::format("{}", fmt::join(nodes, "@"));
}

}  // namespace strata::launcher
