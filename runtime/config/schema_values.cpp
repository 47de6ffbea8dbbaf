// Converting one JSON value to a field's canonical form: type, integral floats, ranges, choices,
// and the hints for the usual mistakes ("true" in quotes, numbers in strings, 1.5 for an int).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

#include "runtime/config/schema.h"

namespace strata::schema {
namespace {

std::string number(double d) {
  if (std::floor(d) == d && std::fabs(d) < 1e15) return fmt::format("{}", static_cast<int64_t>(d));
  return fmt::format("{}", d);
}

std::string expected(const Field& f) {
  switch (f.kind) {
    case Kind::Bool: return "true or false";
    case Kind::Int: return "an integer";
    case Kind::Float: return "a number";
    case Kind::String:
      return f.choices.empty() ? "a string" : fmt::format("one of {}", fmt::join(f.choices, "|"));
    case Kind::FloatList:
      return f.length ? fmt::format("a list of {} numbers", f.length) : "a list of numbers";
    case Kind::FloatOrList: return "a number or a list of numbers (one per param group)";
    case Kind::StringList: return "a list of strings";
    case Kind::Object: return "an object {...}";
    default: return "a value";
  }
}

std::string type_name(const json& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "a list";
  if (v.is_object()) return "an object";
  return "null";
}

bool numeric_string(const std::string& s) {
  if (s.empty() || s.size() > 40) return false;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

void type_error(const Field& f, const json& v, const std::string& p, Ctx& ctx) {
  std::string hint;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (f.kind == Kind::Bool && (iequals(s, "true") || iequals(s, "false")))
      hint = fmt::format("; write {} without quotes", lower(s));
    else if ((f.kind == Kind::Int || f.kind == Kind::Float) && numeric_string(s))
      hint = fmt::format("; write {} without quotes", s);
  } else if (f.kind == Kind::Bool && v.is_number()) {
    hint = "; write true or false";
  }
  ctx.error(p, fmt::format("{} = {}: expected {}, found {}{}", p, show(v), expected(f), type_name(v), hint));
}

std::string allowed(const Field& f) {
  std::string s;
  if (f.lo) s += fmt::format("{} {}", f.lo_open ? ">" : ">=", number(*f.lo));
  if (f.lo && f.hi) s += " and ";
  if (f.hi) s += fmt::format("{} {}", f.hi_open ? "<" : "<=", number(*f.hi));
  return s;
}

bool in_range(const Field& f, double d, const json& shown, const std::string& p, Ctx& ctx) {
  const bool low = f.lo && (f.lo_open ? d <= *f.lo : d < *f.lo);
  const bool high = f.hi && (f.hi_open ? d >= *f.hi : d > *f.hi);
  if (!low && !high) return true;
  ctx.error(p, fmt::format("{} = {} is out of range; allowed: {}", p, show(shown), allowed(f)));
  return false;
}

std::optional<json> to_int(const Field& f, const json& v, const std::string& p, Ctx& ctx) {
  int64_t i = 0;
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      ctx.error(p, fmt::format("{} = {} is out of range for an integer; allowed: {}", p, show(v),
                               f.lo || f.hi ? allowed(f) : "a 64-bit integer"));
      return std::nullopt;
    }
    i = static_cast<int64_t>(v.get<uint64_t>());
  } else if (v.is_number_integer()) {
    i = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::floor(d) != d) {
      ctx.error(p, fmt::format("{} = {}: expected an integer, found a fraction", p, show(v)));
      return std::nullopt;
    }
    // 2^63 is exactly representable; anything at or beyond it does not fit.
    if (d >= 9223372036854775808.0 || d < -9223372036854775808.0) {
      ctx.error(p, fmt::format("{} = {} is out of range for an integer; allowed: {}", p, show(v),
                               f.lo || f.hi ? allowed(f) : "a 64-bit integer"));
      return std::nullopt;
    }
    i = static_cast<int64_t>(d);
  } else {
    type_error(f, v, p, ctx);
    return std::nullopt;
  }
  if (!in_range(f, static_cast<double>(i), v, p, ctx)) return std::nullopt;
  return json(i);
}

std::optional<json> to_float(const Field& f, const json& v, const std::string& p, Ctx& ctx) {
  if (!v.is_number()) {
    type_error(f, v, p, ctx);
    return std::nullopt;
  }
  const double d = v.get<double>();
  if (!std::isfinite(d)) {
    ctx.error(p, fmt::format("{} = {}: expected a finite number", p, show(v)));
    return std::nullopt;
  }
  if (!in_range(f, d, v, p, ctx)) return std::nullopt;
  return json(d);
}

std::optional<json> to_string(const Field& f, const json& v, const std::string& p, Ctx& ctx) {
  if (!v.is_string()) {
    type_error(f, v, p, ctx);
    return std::nullopt;
  }
  const std::string& s = v.get_ref<const std::string&>();
  if (f.choices.empty()) return v;
  for (const std::string& c : f.choices)
    if (s == c || (f.choices_ci && iequals(s, c))) return json(c);
  for (const auto& [from, to] : f.value_aliases) {
    if (iequals(s, from)) {
      ctx.warn(p, fmt::format("{} = \"{}\" is a legacy spelling; read as \"{}\"", p, s, to));
      return json(to);
    }
  }
  const std::string best = closest(s, f.choices);
  ctx.error(p, fmt::format("{} = {}: expected one of {}{}", p, show(v), fmt::join(f.choices, "|"),
                           best.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", best)));
  return std::nullopt;
}

}  // namespace

std::optional<json> convert(const Field& f, const json& v, const std::string& p, Ctx& ctx) {
  if (v.is_null()) {
    if (f.nullable || f.kind == Kind::Any) return json();
    ctx.error(p, fmt::format("{} = null: expected {}", p, expected(f)));
    return std::nullopt;
  }
  switch (f.kind) {
    case Kind::Bool:
      if (v.is_boolean()) return v;
      type_error(f, v, p, ctx);
      return std::nullopt;
    case Kind::Int: return to_int(f, v, p, ctx);
    case Kind::Float: return to_float(f, v, p, ctx);
    case Kind::String: return to_string(f, v, p, ctx);
    case Kind::FloatOrList:
      if (v.is_number() || v.is_array()) {
        Field one = f;
        one.kind = v.is_number() ? Kind::Float : Kind::FloatList;
        if (v.is_array() && v.empty()) {
          type_error(f, v, p, ctx);
          return std::nullopt;
        }
        return convert(one, v, p, ctx);
      }
      type_error(f, v, p, ctx);
      return std::nullopt;
    case Kind::FloatList: {
      if (!v.is_array() || (f.length && v.size() != f.length)) {
        type_error(f, v, p, ctx);
        return std::nullopt;
      }
      json out = json::array();
      Field element = f;
      element.kind = Kind::Float;
      for (size_t i = 0; i < v.size(); ++i) {
        auto e = to_float(element, v[i], fmt::format("{}[{}]", p, i), ctx);
        if (!e) return std::nullopt;
        out.push_back(*e);
      }
      return out;
    }
    case Kind::StringList:
      if (v.is_array() && std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); }))
        return v;
      type_error(f, v, p, ctx);
      return std::nullopt;
    case Kind::Object:
      if (v.is_object()) return v;
      type_error(f, v, p, ctx);
      return std::nullopt;
    default:
      return v;
  }
}

}  // namespace strata::schema
