// The checks that span blocks (rules.cpp, batch.cpp), run after every block was read.
#pragma once

#include "runtime/config/schema.h"

namespace strata::schema {

void resolve_batch(Config& config, Ctx& ctx);  // batch.cpp
void apply_rules(Config& config, Ctx& ctx);    // rules.cpp: everything, in order

}  // namespace strata::schema
