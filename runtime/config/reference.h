// The config reference, generated from the schema tables (`strata-config schema`): every key
// with its JSON path, DeepSpeed's meaning, type, default, allowed values, other spellings and what
// Strata does with it. docs/config.md is its Markdown form; a test fails when that file is stale.
#pragma once

#include <string>

#include "runtime/config/config.h"

namespace strata {

// {"keys": [{"path", "block", "type", "description" (DeepSpeed's meaning), "default", "nullable",
// "auto", "required", "min", "max", "min_open", "max_open", "choices", "length", "aliases",
// "deprecated", "value_aliases", "support", "note", "for_type"}, ...]}: one entry per key, blocks
// included, in schema order.
json config_reference_json();
// The same as Markdown: one table per block.
std::string config_reference_markdown();

}  // namespace strata
