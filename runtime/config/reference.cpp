// The config reference: a walk over the schema tables (schema_*.cpp), nothing written twice.
#include "runtime/config/reference.h"

#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "runtime/config/schema_blocks.h"

namespace strata {
namespace {

using schema::Block;
using schema::Field;
using schema::Kind;
using schema::Support;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "number";
    case Kind::String: return "string";
    case Kind::FloatList: return "list of numbers";
    case Kind::FloatOrList: return "number or list of numbers";
    case Kind::StringList: return "list of strings";
    case Kind::Object: return "object";
    case Kind::Any: return "any";
    case Kind::Block: return "block";
    case Kind::Legacy: return "legacy";
  }
  return "any";
}

const char* support_name(Support s) {
  switch (s) {
    case Support::Implemented: return "implemented";
    case Support::Pending: return "pending";
    case Support::Ignored: return "ignored";
    case Support::NotImplemented: return "not_implemented";
  }
  return "implemented";
}

struct Entry {
  std::string path, block, for_type;
  const Field* field;
};

// Every field of `block` under `path`, then (depth first) the fields of each sub-block, so that
// each block's keys stay together.
void walk(const Block& block, const std::string& path, const std::string& for_type,
          std::vector<Entry>& out) {
  for (const Field& f : block.fields) out.push_back({schema::join(path, f.key), path, for_type, &f});
  for (const Field& f : block.fields)
    if (f.kind == Kind::Block && f.block) walk(*f.block, schema::join(path, f.key), for_type, out);
}

std::vector<Entry> entries() {
  std::vector<Entry> out;
  walk(schema::root_block(), "", "", out);
  // The params tables of the built-in optimizer and scheduler types: "optimizer.params (Adam)".
  std::vector<const Block*> params = schema::optimizer_params_blocks();
  for (const Block* b : schema::scheduler_params_blocks()) params.push_back(b);
  for (const Block* b : params) {
    const size_t open = b->name.find(" (");
    const std::string path = b->name.substr(0, open);
    std::string type =
        open == std::string::npos ? "" : b->name.substr(open + 2, b->name.size() - open - 3);
    if (type == "Adam") type = "Adam or AdamW";  // one params table for both
    walk(*b, path, type, out);
  }
  return out;
}

json entry_json(const Entry& e) {
  const Field& f = *e.field;
  json j = {{"path", e.path}, {"block", e.block}, {"type", kind_name(f.kind)}, {"description", f.description}};
  if (!e.for_type.empty()) j["for_type"] = e.for_type;
  if (f.kind != Kind::Block && f.kind != Kind::Legacy) j["default"] = f.default_value;
  j["nullable"] = f.nullable;
  j["auto"] = f.allow_auto;
  j["required"] = f.required;
  if (f.lo) {
    j["min"] = *f.lo;
    j["min_open"] = f.lo_open;
  }
  if (f.hi) {
    j["max"] = *f.hi;
    j["max_open"] = f.hi_open;
  }
  if (!f.choices.empty()) {
    j["choices"] = f.choices;
    j["choices_case_insensitive"] = f.choices_ci;
  }
  if (f.length) j["length"] = f.length;
  if (!f.aliases.empty()) j["aliases"] = f.aliases;
  if (!f.deprecated.empty()) j["deprecated"] = f.deprecated;
  if (!f.value_aliases.empty()) {
    json va = json::object();
    for (const auto& [from, to] : f.value_aliases) va[from] = to;
    j["value_aliases"] = va;
  }
  j["support"] = support_name(f.support);
  if (!f.note.empty()) j["note"] = f.note;
  return j;
}

// Markdown table cells: no pipes or line breaks.
std::string cell(std::string s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += "\\|";
    else if (c == '\n') out += ' ';
    else out += c;
  }
  return out;
}

std::string code(const std::string& s) { return "`" + cell(s) + "`"; }

std::string number(double v) {
  if (std::abs(v) < 1e15 && v == std::floor(v)) return std::to_string(static_cast<long long>(v));
  return json(v).dump();
}

std::string type_md(const Field& f) {
  std::string t = kind_name(f.kind);
  if (f.kind == Kind::Block) t = "object";
  if (f.allow_auto) t += ", \"auto\"";
  if (f.nullable && f.kind != Kind::Block) t += ", null";
  return t;
}

std::string default_md(const Field& f) {
  if (f.kind == Kind::Block || f.kind == Kind::Legacy) return "";
  if (f.required) return "required";
  std::string d = f.default_value.dump();
  if (d.size() > 60) d = d.substr(0, 57) + "...";
  return code(d);
}

std::string allowed_md(const Field& f) {
  std::vector<std::string> parts;
  if (f.lo && f.hi) {
    parts.push_back(fmt::format("{}{}, {}{}", f.lo_open ? "(" : "[", number(*f.lo), number(*f.hi),
                                f.hi_open ? ")" : "]"));
  } else if (f.lo) {
    parts.push_back(fmt::format("{} {}", f.lo_open ? ">" : "≥", number(*f.lo)));
  } else if (f.hi) {
    parts.push_back(fmt::format("{} {}", f.hi_open ? "<" : "≤", number(*f.hi)));
  }
  if (!f.choices.empty()) {
    std::string c;
    for (const std::string& x : f.choices) c += (c.empty() ? "" : ", ") + code(x);
    parts.push_back(c + (f.choices_ci ? " (any case)" : ""));
  }
  if (f.length) parts.push_back(fmt::format("{} items", f.length));
  for (const auto& [from, to] : f.value_aliases)
    parts.push_back(fmt::format("{} reads as {}", code(from), code(to)));
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

std::string spellings_md(const Field& f) {
  std::string out;
  for (const std::string& a : f.aliases) out += (out.empty() ? "" : ", ") + code(a);
  for (const std::string& a : f.deprecated) out += (out.empty() ? "" : ", ") + code(a) + " (deprecated: warns)";
  return out;
}

std::string support_md(const Field& f) {
  if (f.kind == Kind::Legacy) return "legacy spelling: read and rewritten, or refused with the right key";
  std::string s;
  switch (f.support) {
    case Support::Implemented: s = "yes"; break;
    case Support::Pending: s = "not yet: refused by the engine when set"; break;
    case Support::Ignored: s = "ignored: a warning when set"; break;
    case Support::NotImplemented: s = "no: an error when set"; break;
  }
  if (!f.note.empty()) s += " (" + cell(f.note) + ")";
  return s;
}

}  // namespace

json config_reference_json() {
  json keys = json::array();
  for (const Entry& e : entries()) keys.push_back(entry_json(e));
  return json{{"keys", std::move(keys)}};
}

std::string config_reference_markdown() {
  std::string out =
      "# Strata config reference\n"
      "\n"
      "Generated by `strata-config schema --markdown` from the schema tables\n"
      "(`runtime/config/schema_*.cpp`); do not edit by hand. `strata-config schema --json` gives\n"
      "the same as JSON. Key names and meanings are DeepSpeed's (see DeepSpeed's configuration\n"
      "documentation); this page says what Strata accepts and what it does with each key.\n"
      "\n"
      "Columns: **DeepSpeed's meaning** (what the key does in DeepSpeed; where Strata differs or\n"
      "refuses it, the **Strata** column says so); **type** (`\"auto\"`: the key may be `\"auto\"`,\n"
      "resolved as Hugging Face's integration resolves it; `null`: may be null); **default**\n"
      "(`required`: must be given); **allowed** (ranges, choices, list lengths, legacy values);\n"
      "**also spelled** (aliases accepted silently; deprecated spellings warn); **Strata** (what\n"
      "happens when the key is set to a value that asks for something: `yes` implemented; `not yet`\n"
      "accepted by `strata-config` and refused by the engine; `ignored` a warning; `no` an error).\n"
      "An unknown key is an error naming the nearest known key.\n";
  std::string current = "\x01";
  for (const Entry& e : entries()) {
    const std::string section = e.block + (e.for_type.empty() ? "" : " (" + e.for_type + ")");
    if (section != current) {
      current = section;
      if (e.block.empty())
        out += "\n## Top level\n";
      else if (e.for_type.empty())
        out += fmt::format("\n## `{}`\n", e.block);
      else
        out += fmt::format("\n## `{}` when `type` is {}\n", e.block, e.for_type);
      out += "\n| key | DeepSpeed's meaning | type | default | allowed | also spelled | Strata |\n";
      out += "|---|---|---|---|---|---|---|\n";
    }
    const Field& f = *e.field;
    out += fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", code(e.path), cell(f.description),
                       type_md(f), default_md(f), allowed_md(f), spellings_md(f), support_md(f));
  }
  return out;
}

}  // namespace strata
