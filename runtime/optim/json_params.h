// Reading an optimizer's or scheduler's `params` block inside a factory. For built-in types the
// config layer has already filled every key with DeepSpeed's default and resolved "auto", so a
// key missing here is a hand-built config or a bug upstream: say which key, where, and what to do.
// No defaults live here.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "runtime/error.h"

namespace strata::params {

using json = nlohmann::json;

// True when `key` is present and not null (DeepSpeed's "None": a value derived from elsewhere).
inline bool has(const json& p, const char* key) {
  return p.is_object() && p.contains(key) && !p.at(key).is_null();
}

inline const json& require(const json& p, const char* key, const std::string& where) {
  if (!p.is_object())
    throw Error(fmt::format("{}: params must be a JSON object, got {}", where, p.dump()));
  auto it = p.find(key);
  if (it == p.end() || it->is_null())
    throw Error(
        fmt::format("{}.{} is missing; write it in the config (built-in types get it "
                    "from the config layer's defaults)",
                    where, key));
  if (it->is_string() && it->get<std::string>() == "auto")
    throw Error(
        fmt::format("{}.{} is \"auto\" and was not resolved; pass its value to the config "
                    "loader (AutoValues) or write a number",
                    where, key));
  return *it;
}

inline double number(const json& v, const std::string& path) {
  if (!v.is_number()) throw Error(fmt::format("{} must be a number, got {}", path, v.dump()));
  return v.get<double>();
}

inline double get_double(const json& p, const char* key, const std::string& where) {
  return number(require(p, key, where), where + "." + key);
}

inline int64_t get_int(const json& p, const char* key, const std::string& where) {
  const double v = get_double(p, key, where);
  if (v != std::floor(v))
    throw Error(fmt::format("{}.{} must be a whole number, got {}", where, key, v));
  return static_cast<int64_t>(v);
}

inline bool get_bool(const json& p, const char* key, const std::string& where) {
  const json& v = require(p, key, where);
  if (!v.is_boolean())
    throw Error(fmt::format("{}.{} must be true or false, got {}", where, key, v.dump()));
  return v.get<bool>();
}

inline std::string get_string(const json& p, const char* key, const std::string& where) {
  const json& v = require(p, key, where);
  if (!v.is_string())
    throw Error(fmt::format("{}.{} must be a string, got {}", where, key, v.dump()));
  return v.get<std::string>();
}

inline std::pair<double, double> get_pair(const json& p, const char* key,
                                          const std::string& where) {
  const json& v = require(p, key, where);
  if (!v.is_array() || v.size() != 2)
    throw Error(fmt::format("{}.{} must be a list of two numbers, got {}", where, key, v.dump()));
  const std::string path = where + "." + key;
  return {number(v[0], path + "[0]"), number(v[1], path + "[1]")};
}

// DeepSpeed's "float or list": one value for every param group, or one per group.
inline std::vector<double> get_per_group(const json& p, const char* key, const std::string& where,
                                         size_t groups) {
  const json& v = require(p, key, where);
  const std::string path = where + "." + key;
  if (!v.is_array()) return std::vector<double>(groups, number(v, path));
  if (v.size() != groups)
    throw Error(
        fmt::format("{} has {} values but the optimizer has {} param groups; give one "
                    "number or one per group",
                    path, v.size(), groups));
  std::vector<double> out;
  for (size_t i = 0; i < v.size(); ++i) out.push_back(number(v[i], fmt::format("{}[{}]", path, i)));
  return out;
}

}  // namespace strata::params
