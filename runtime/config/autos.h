// What resolves each "auto" key (autos.cpp); resolve_auto() itself is declared in schema.h.
#pragma once

#include <string>

namespace strata::schema {

// The AutoValues member (or rule) that resolves `path`, for messages; "" when none.
std::string auto_source(const std::string& path);

}  // namespace strata::schema
