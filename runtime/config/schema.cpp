// The walks over the schema tables: reading a block (unknown keys, aliases, "auto", support
// levels), printing it back, visiting its fields. Value conversion lives in schema_values.cpp.
#include "runtime/config/schema.h"

#include <algorithm>
#include <cctype>
#include <map>

#include <fmt/format.h>

#include "runtime/config/autos.h"

namespace strata::schema {

const Field* Block::find(const std::string& key) const {
  for (const Field& f : fields)
    if (f.key == key) return &f;
  for (const Field& f : fields) {
    if (std::find(f.aliases.begin(), f.aliases.end(), key) != f.aliases.end()) return &f;
    if (std::find(f.deprecated.begin(), f.deprecated.end(), key) != f.deprecated.end()) return &f;
  }
  return nullptr;
}

bool Ctx::has_errors() const {
  return dropped_error || std::any_of(issues.begin(), issues.end(), [](const Issue& i) { return i.error; });
}

bool Ctx::has_error_at(const std::string& path) const {
  return std::any_of(issues.begin(), issues.end(), [&](const Issue& i) { return i.error && i.path == path; });
}

std::string Ctx::format(const Issue& issue) const {
  // The closest position the reader recorded: the key itself, else its nearest parent.
  if (positions) {
    std::string p = issue.path;
    for (;;) {
      auto it = positions->find(p);
      if (it == positions->end()) {
        auto sp = spelled.find(p);
        if (sp != spelled.end()) it = positions->find(sp->second);
      }
      if (it != positions->end())
        return fmt::format("{}:{}:{}: {}", source, it->second.line, it->second.column, issue.text);
      const size_t cut = p.find_last_of(".[");
      if (cut == std::string::npos || p.empty()) break;
      p = p.substr(0, cut);
    }
  }
  return fmt::format("{}: {}", source, issue.text);
}

std::string join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

std::string show(const json& value) {
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool iequals(const std::string& a, const std::string& b) { return lower(a) == lower(b); }

namespace {

std::string normalised(const std::string& s) {
  std::string n = lower(s);
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

// Optimal string alignment distance (Levenshtein plus adjacent transpositions), or limit + 1
// once it must exceed limit: every unknown key is measured against every known spelling of its
// block, so the rows are flat and the candidates too far apart in length are not aligned at all.
size_t edit_distance_within(const std::string& a, const std::string& b, size_t limit) {
  const size_t n = a.size(), m = b.size();
  if ((n > m ? n - m : m - n) > limit) return limit + 1;
  std::vector<size_t> rows(3 * (m + 1));
  size_t* before = rows.data();  // row i - 2
  size_t* prev = before + (m + 1);  // row i - 1
  size_t* cur = prev + (m + 1);  // row i
  for (size_t j = 0; j <= m; ++j) prev[j] = j;
  for (size_t i = 1; i <= n; ++i) {
    cur[0] = i;
    size_t row_min = i;
    for (size_t j = 1; j <= m; ++j) {
      size_t d = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      if (prev[j] + 1 < d) d = prev[j] + 1;
      if (cur[j - 1] + 1 < d) d = cur[j - 1] + 1;
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && before[j - 2] + 1 < d)
        d = before[j - 2] + 1;
      cur[j] = d;
      if (d < row_min) row_min = d;
    }
    if (row_min > limit) return limit + 1;  // a row's minimum never falls again
    size_t* spare = before;
    before = prev;
    prev = cur;
    cur = spare;
  }
  return prev[m] <= limit ? prev[m] : limit + 1;
}

}  // namespace

std::string closest(const std::string& key, const std::vector<std::string>& candidates) {
  if (key.empty() || key.size() > 80) return "";
  const std::string k = normalised(key);
  const size_t limit = k.size() <= 4 ? 1 : k.size() <= 10 ? 2 : 3;
  std::string best;
  size_t best_d = limit + 1;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance_within(k, normalised(c), limit);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

namespace {

void unknown_key(const Block& b, const std::string& key, const std::string& path, Ctx& ctx) {
  if (ctx.full()) return ctx.error(path, "");  // counted, not shown
  std::vector<std::string> names;
  std::map<std::string, std::string> canonical;
  for (const Field& f : b.fields) {
    std::vector<std::string> spellings = f.aliases;
    spellings.insert(spellings.end(), f.deprecated.begin(), f.deprecated.end());
    spellings.push_back(f.key);
    for (const std::string& n : spellings) {
      names.push_back(n);
      canonical[n] = f.key;
    }
  }
  const std::string p = join(path, key);
  std::string text = fmt::format("unknown key '{}'", p);
  const std::string best = closest(key, names);
  if (!best.empty()) {
    text += fmt::format("; did you mean '{}'?", canonical[best]);
  } else if (b.fields.size() <= 12) {
    std::vector<std::string> keys;
    for (const Field& f : b.fields)
      if (f.kind != Kind::Legacy) keys.push_back(f.key);
    text += fmt::format("; remove it ({} accepts: {})", b.name.empty() ? "the top level" : b.name,
                        fmt::join(keys, ", "));
  } else {
    text += "; it is not a DeepSpeed or Strata setting: remove it";
  }
  if (!key.empty() && key[0] == '_') text += " (JSON has no comments: delete a disabled key)";
  ctx.error(p, text);
}

void check_support(const Field& f, const json& v, const std::string& p, Ctx& ctx) {
  if (f.support == Support::Implemented || f.support == Support::Pending) return;
  if (!f.is_active(v)) return;
  if (f.support == Support::Ignored) {
    ctx.warn(p, fmt::format("{} = {} is accepted but has no effect in Strata: {}", p, show(v), f.note));
    return;
  }
  const std::string fix = f.default_value.is_null() || f.is_setting
                              ? "remove it"
                              : fmt::format("remove it or set {}", show(f.default_value));
  ctx.error(p, fmt::format("{} = {}: not implemented in Strata ({}); {}", p, show(v), f.note, fix));
}

void read_block_as(const Block& b, void* obj, const json& in, const std::string& path,
                   const std::string& shown, Ctx& ctx);

// `p` is the canonical path (bookkeeping: present, autos, rules); `shown` the path as the file
// spells it (messages and positions).
void read_field(const Field& f, void* obj, const json& val, const std::string& p, const std::string& shown,
                bool auto_is_default, Ctx& ctx) {
  if (f.kind == Kind::Block) {
    if (!val.is_null()) read_block_as(*f.block, f.child(obj), val, p, shown, ctx);
    return;
  }
  json value = val;
  const bool is_auto = val.is_string() && val.get_ref<const std::string&>() == "auto";
  if (is_auto && f.allow_auto) {
    auto resolved = resolve_auto(p, ctx);
    if (!resolved) {
      if (f.mark_auto) f.mark_auto(obj);
      ctx.unresolved.push_back(p);
      return;
    }
    value = *resolved;
    ctx.filled.push_back({p, value, auto_member(p)});
  } else if (is_auto && auto_is_default) {
    ctx.warn(shown, fmt::format("{} = \"auto\" is read as the default, {}, as DeepSpeed reads it", shown,
                                show(f.default_value)));
    return;
  } else if (is_auto && f.kind != Kind::String && f.kind != Kind::Any) {
    ctx.error(shown, fmt::format("{} = \"auto\": \"auto\" is not resolvable for this key (only the keys "
                                 "Hugging Face's integration fills); write a value",
                                 shown));
    return;
  }
  auto converted = convert(f, value, shown, ctx);
  if (!converted) return;
  f.set(obj, *converted);
  check_support(f, *converted, shown, ctx);
}

void read_block_as(const Block& b, void* obj, const json& in, const std::string& path,
                   const std::string& shown, Ctx& ctx) {
  json coerced;
  const json* v = &in;
  if (!in.is_object()) {
    std::optional<json> c = b.coerce ? b.coerce(in, ctx, shown) : std::nullopt;
    if (!c) {
      if (!b.coerce)
        ctx.error(shown, fmt::format("{}: expected an object {{...}}, found {}", shown, show(in)));
      return;
    }
    coerced = std::move(*c);
    v = &coerced;
  }
  // Which field each given key names; two spellings of one field is an error.
  std::map<const Field*, std::string> used;
  for (auto it = v->begin(); it != v->end(); ++it) {
    const std::string& k = it.key();
    const Field* f = b.find(k);
    if (!f) {
      // The JSON comment convention ("_comment", a key disabled by a leading '_'): DeepSpeed
      // reads its top level as a plain dict and skips such keys; its blocks forbid extra keys,
      // so inside a block they stay errors.
      if (path.empty() && !k.empty() && k[0] == '_') {
        ctx.warn(k, fmt::format("'{}' is ignored: a top-level key that begins with '_' is a comment",
                                k));
        continue;
      }
      unknown_key(b, k, shown, ctx);
      continue;
    }
    if (auto prev = used.find(f); prev != used.end()) {
      ctx.error(join(shown, k),
                fmt::format("'{}' and '{}' both set '{}'; keep one", join(shown, prev->second),
                            join(shown, k), join(path, f->key)));
      continue;
    }
    used[f] = k;
    if (k != f->key &&
        std::find(f->deprecated.begin(), f->deprecated.end(), k) != f->deprecated.end())
      ctx.warn(join(shown, k),
               fmt::format("'{}' is a legacy spelling; read as '{}'", join(shown, k), join(path, f->key)));
  }
  for (const Field& f : b.fields) {
    const std::string p = join(path, f.key);
    auto hit = used.find(&f);
    if (hit == used.end()) {
      if (f.required)
        ctx.error(join(shown, f.key), fmt::format("{} is missing; {} needs it (there is no default)",
                                                  join(shown, f.key), shown.empty() ? "the config" : shown));
      continue;
    }
    const std::string written = join(shown, hit->second);
    if (written != p) ctx.spelled[p] = written;
    ctx.present.insert(p);
    if (f.kind == Kind::Legacy) continue;  // after the canonical keys, which it must not undo
    read_field(f, obj, v->at(hit->second), p, written, b.auto_is_default, ctx);
  }
  for (const Field& f : b.fields) {
    auto hit = used.find(&f);
    if (f.kind == Kind::Legacy && hit != used.end())
      f.legacy(ctx, obj, v->at(hit->second), join(shown, hit->second));
  }
  if (b.finish) b.finish(obj, ctx, path);
}

}  // namespace

void read_block(const Block& b, void* obj, const json& in, const std::string& path, Ctx& ctx) {
  read_block_as(b, obj, in, path, path, ctx);
}

json print_block(const Block& b, const void* obj, const std::string& path,
                 const std::vector<std::string>& unresolved) {
  json out = json::object();
  for (const Field& f : b.fields) {
    if (f.kind == Kind::Legacy) continue;
    const std::string p = join(path, f.key);
    if (f.kind == Kind::Block) {
      if (f.printed && !f.printed(obj)) continue;
      out[f.key] = print_block(*f.block, f.child_c(obj), p, unresolved);
      continue;
    }
    json value = f.get(obj);
    if (f.is_setting && value.is_null()) continue;
    if (std::find(unresolved.begin(), unresolved.end(), p) != unresolved.end()) value = "auto";
    out[f.key] = std::move(value);
  }
  return out;
}

void visit(const Block& b, const void* obj, const std::string& path,
           const std::function<void(const Field&, const json&, const std::string&)>& fn) {
  for (const Field& f : b.fields) {
    const std::string p = join(path, f.key);
    if (f.kind == Kind::Legacy) continue;
    if (f.kind == Kind::Block) {
      visit(*f.block, f.child_c(obj), p, fn);
    } else {
      fn(f, f.get(obj), p);
    }
  }
}

bool assign(const Block& b, void* obj, const std::string& key, const json& value,
            const std::string& path, Ctx& ctx) {
  const Field* f = b.find(key);
  if (!f || !f->set) return false;
  auto converted = convert(*f, value, join(path, key), ctx);
  if (!converted) return false;
  f->set(obj, *converted);
  return true;
}

}  // namespace strata::schema
