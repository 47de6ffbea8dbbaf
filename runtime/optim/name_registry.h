// A case-insensitive table of named factories, shared by the optimizer and scheduler registries.
// Each registry keeps one in a function-local static, filled with its built-ins on first use, so
// static-library linking cannot drop them (no self-registering globals).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/error.h"

namespace strata::detail {

inline std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

template <class Factory>
class NameRegistry {
 public:
  NameRegistry(std::string kind, std::vector<std::pair<std::string, Factory>> builtins)
      : kind_(std::move(kind)) {
    for (auto& [name, factory] : builtins) add(name, std::move(factory));
  }

  void add(const std::string& name, Factory factory) {
    if (name.empty()) throw Error(fmt::format("register_{}: the name is empty", kind_));
    if (!factory)
      throw Error(fmt::format("register_{}(\"{}\"): the factory is empty", kind_, name));
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, inserted] = entries_.try_emplace(lower(name), name, std::move(factory));
    if (!inserted)
      throw Error(
          fmt::format("register_{}(\"{}\"): the name is taken by \"{}\" (names compare "
                      "case-insensitively); pick another",
                      kind_, name, it->second.first));
  }

  // A copy, so the caller runs it outside the lock.
  Factory get(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(lower(name));
    if (it == entries_.end())
      throw Error(
          fmt::format("{}.type \"{}\" is not a registered {}; registered: {}. Fix the "
                      "type, or register it with strata::register_{}() before building "
                      "the engine (and list it in LoadOptions::extra_{}s)",
                      kind_, name, kind_, fmt::join(names_locked(), ", "), kind_, kind_));
    return it->second.second;
  }

  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return names_locked();
  }

 private:
  std::vector<std::string> names_locked() const {
    std::vector<std::string> out;
    for (const auto& entry : entries_) out.push_back(entry.second.first);  // keyed lower-case
    return out;
  }

  std::string kind_;
  mutable std::mutex mutex_;
  std::map<std::string, std::pair<std::string, Factory>> entries_;  // lower-case name → entry
};

}  // namespace strata::detail
