// What resolves each "auto" key (autos.cpp); resolve_auto() itself is declared in schema.h.
#pragma once

#include <string>

namespace strata::schema {

// The AutoValues member (or rule) that resolves `path`, for messages; "" when none.
std::string auto_source(const std::string& path);
// The AutoValues member name(s) `path` reads ("lr", "beta1, beta2"); "" for constants and
// derivations. Config::filled names these, so a program can say which of its settings it was.
std::string auto_member(const std::string& path);
// strata-config's flags that would resolve `path` ("--auto lr=VALUE"); "" when none would.
std::string auto_needs(const std::string& path);

}  // namespace strata::schema
