// The declarative schema: one table (Block) per config block, one Field per JSON key, each bound
// to a struct member by pointer-to-member. Parsing, validation, "did you mean", defaults, "auto"
// resolution, pending-feature listing and the printout all walk these tables (schema.cpp); the
// tables themselves live in schema_<block>.cpp, one file per block.
#pragma once

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/config/json_reader.h"

namespace strata::schema {

// FloatOrList: one number, or one per optimizer param group (DeepSpeed's "float or list").
enum class Kind { Bool, Int, Float, String, FloatList, FloatOrList, StringList, Object, Any, Block, Legacy };

// What Strata does with a key once it is set to an "active" value (by default: not its default).
enum class Support {
  Implemented,     // Strata does what the key says
  Pending,         // valid, not yet run by this build's engine: pending_features() lists it
  Ignored,         // accepted, no effect in Strata (observers, DeepSpeed tooling): a warning
  NotImplemented,  // would change the math and Strata lacks it: an error
};

struct Block;
struct Ctx;

struct Field {
  std::string key;                      // canonical (DeepSpeed's documented spelling)
  std::vector<std::string> aliases;     // also accepted silently (pydantic field names)
  std::vector<std::string> deprecated;  // legacy spellings: accepted with a warning
  Kind kind = Kind::Any;
  bool nullable = false;
  bool allow_auto = false;
  bool required = false;
  bool is_setting = false;  // stored in ShallowConfig::settings; printed only when given
  std::optional<double> lo, hi;
  bool lo_open = false, hi_open = false;
  std::vector<std::string> choices;
  bool choices_ci = false;
  std::vector<std::pair<std::string, std::string>> value_aliases;  // legacy value -> canonical
  size_t length = 0;  // exact list length, 0 = any
  Support support = Support::Implemented;
  std::string note;                         // the why, shown when `support` bites
  // What the key means in DeepSpeed (its documentation's sense, in one line), for the reference
  // (`strata-config schema`). Declared here, beside the key, rather than in a table keyed by JSON
  // path: a path table would be a second copy of every key, and a key's meaning stays next to its
  // type and range when either changes. `support`/`note` say where Strata differs.
  std::string description;
  std::function<bool(const json&)> active;  // default: value != default_value
  json default_value;
  const Block* block = nullptr;  // Kind::Block

  // Type-erased access to the bound member of the block's struct.
  std::function<void(void*, const json&)> set;  // value already converted to canonical JSON
  std::function<json(const void*)> get;
  std::function<void(void*)> mark_auto;  // Autoable members only
  std::function<void*(void*)> child;     // Kind::Block
  std::function<const void*(const void*)> child_c;
  std::function<bool(const void*)> printed;  // Kind::Block: print it? (default: yes)
  // Kind::Legacy: rewrites a legacy key into canonical members; runs after the block's fields.
  std::function<void(Ctx&, void*, const json&, const std::string& path)> legacy;

  Field& range(double low, double high) { lo = low; hi = high; return *this; }
  Field& min(double low) { lo = low; return *this; }
  Field& positive() { lo = 0; lo_open = true; return *this; }
  Field& below(double high) { hi = high; hi_open = true; return *this; }
  Field& one_of(std::vector<std::string> c, bool case_insensitive = false) {
    choices = std::move(c);
    choices_ci = case_insensitive;
    return *this;
  }
  Field& value_alias(std::string from, std::string to) {
    value_aliases.emplace_back(std::move(from), std::move(to));
    return *this;
  }
  Field& alias(std::string a) { aliases.push_back(std::move(a)); return *this; }
  Field& deprecated_alias(std::string a) { deprecated.push_back(std::move(a)); return *this; }
  Field& autoable() { allow_auto = true; return *this; }
  Field& can_be_null() { nullable = true; return *this; }
  Field& not_null() { nullable = false; return *this; }
  Field& must_be_given() { required = true; return *this; }
  Field& len(size_t n) { length = n; return *this; }
  Field& as(Kind k) { kind = k; return *this; }
  Field& pending(std::string why) { return level(Support::Pending, std::move(why)); }
  Field& ignored(std::string why) { return level(Support::Ignored, std::move(why)); }
  Field& not_implemented(std::string why) { return level(Support::NotImplemented, std::move(why)); }
  Field& when(std::function<bool(const json&)> is_active) { active = std::move(is_active); return *this; }
  Field& describe(std::string what) { description = std::move(what); return *this; }

  Field& level(Support s, std::string why) {
    support = s;
    note = std::move(why);
    return *this;
  }
  bool is_active(const json& value) const { return active ? active(value) : value != default_value; }
};

struct Block {
  std::string name;
  std::vector<Field> fields;
  // Turns a non-object value into the block's object form (legacy shorthands), or returns
  // nothing to reject it as a type error.
  std::function<std::optional<json>(const json&, Ctx&, const std::string& path)> coerce;
  // DeepSpeed's pydantic blocks drop "auto" values, i.e. read them as the default; such a block
  // does the same for keys Hugging Face does not fill (with a warning).
  bool auto_is_default = false;
  // Runs after the block was read from the file (not when it is absent).
  std::function<void(void*, Ctx&, const std::string& path)> finish;

  const Field* find(const std::string& key) const;  // canonical, alias or deprecated spelling
};

struct Issue {
  bool error = true;
  std::string path;
  std::string text;
};

// One walk over one file: the options, every problem found, which keys were given.
struct Ctx {
  const LoadOptions& options;
  std::string source;
  const PositionMap* positions = nullptr;
  std::vector<Issue> issues;
  std::set<std::string> present;          // canonical paths of the keys the file gave
  std::vector<std::string> unresolved;    // paths left "auto"
  std::vector<Config::Filled> filled;     // values taken from the program (Config::filled)
  std::unordered_map<std::string, std::string> spelled;  // canonical path -> path as written

  Ctx(const LoadOptions& o, std::string src, const PositionMap* pos)
      : options(o), source(std::move(src)), positions(pos) {}
  // A garbage file can yield a million problems; the first few hundred say enough.
  static constexpr size_t kMaxIssues = 300;
  size_t dropped = 0;
  bool full() const { return issues.size() >= kMaxIssues; }
  void error(const std::string& path, std::string text) { add({true, path, std::move(text)}); }
  void warn(const std::string& path, std::string text) { add({false, path, std::move(text)}); }
  void add(Issue issue) {
    if (full()) {
      ++dropped;
      if (issue.error) dropped_error = true;
      return;
    }
    issues.push_back(std::move(issue));
  }
  bool dropped_error = false;
  bool has_errors() const;
  bool has_error_at(const std::string& path) const;
  std::string format(const Issue& issue) const;  // "source:line:col: text"
};

// ---- the walks (schema.cpp) ----------------------------------------------------------------
std::string join(const std::string& path, const std::string& key);
std::string show(const json& value);  // a value as written, shortened for messages
void read_block(const Block& block, void* obj, const json& value, const std::string& path, Ctx& ctx);
json print_block(const Block& block, const void* obj, const std::string& path,
                 const std::vector<std::string>& unresolved);
// Every scalar field of the tree with its path and current value.
void visit(const Block& block, const void* obj, const std::string& path,
           const std::function<void(const Field&, const json& value, const std::string& path)>& fn);
// Converts `value` to the field's canonical JSON (an error and nothing when it does not fit).
std::optional<json> convert(const Field& field, const json& value, const std::string& path, Ctx& ctx);
// Sets a field by its key from a computed value (auto resolution, derived defaults), checked.
bool assign(const Block& block, void* obj, const std::string& key, const json& value,
            const std::string& path, Ctx& ctx);

// "auto" resolution as Hugging Face's integration does it (autos.cpp): the value for a path, or
// nothing when neither the program's AutoValues nor the config resolve it.
std::optional<json> resolve_auto(const std::string& path, const Ctx& ctx);

// ---- binding members (the only place that knows member types) ------------------------------
template <class M>
struct Bind;
template <>
struct Bind<bool> {
  static constexpr Kind kind = Kind::Bool;
  static void set(bool& m, const json& v) { m = v.get<bool>(); }
  static json get(const bool& m) { return m; }
};
template <>
struct Bind<int64_t> {
  static constexpr Kind kind = Kind::Int;
  static void set(int64_t& m, const json& v) { m = v.get<int64_t>(); }
  static json get(const int64_t& m) { return m; }
};
template <>
struct Bind<double> {
  static constexpr Kind kind = Kind::Float;
  static void set(double& m, const json& v) { m = v.get<double>(); }
  static json get(const double& m) { return m; }
};
template <>
struct Bind<std::string> {
  static constexpr Kind kind = Kind::String;
  // An empty string is DeepSpeed's None: null in, null out (such fields are nullable).
  static void set(std::string& m, const json& v) { m = v.is_null() ? std::string() : v.get<std::string>(); }
  static json get(const std::string& m) { return m.empty() ? json() : json(m); }
};
template <>
struct Bind<std::vector<double>> {
  static constexpr Kind kind = Kind::FloatList;
  static void set(std::vector<double>& m, const json& v) { m = v.get<std::vector<double>>(); }
  static json get(const std::vector<double>& m) { return m; }
};
template <>
struct Bind<std::vector<std::string>> {
  static constexpr Kind kind = Kind::StringList;
  static void set(std::vector<std::string>& m, const json& v) { m = v.get<std::vector<std::string>>(); }
  static json get(const std::vector<std::string>& m) { return m; }
};
template <>
struct Bind<json> {
  static constexpr Kind kind = Kind::Any;
  static void set(json& m, const json& v) { m = v; }
  static json get(const json& m) { return m; }
};
template <class T>
struct Bind<std::optional<T>> {
  static constexpr Kind kind = Bind<T>::kind;
  static void set(std::optional<T>& m, const json& v) {
    if (v.is_null()) {
      m.reset();
    } else {
      T t{};
      Bind<T>::set(t, v);
      m = std::move(t);
    }
  }
  static json get(const std::optional<T>& m) { return m ? Bind<T>::get(*m) : json(); }
};
template <class T>
struct Bind<Autoable<T>> {
  static constexpr Kind kind = Bind<T>::kind;
  static void set(Autoable<T>& m, const json& v) {
    Bind<T>::set(m.value, v);
    m.is_auto = false;
  }
  static json get(const Autoable<T>& m) { return m.is_auto ? json("auto") : Bind<T>::get(m.value); }
};

template <class M>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};
template <class M>
struct IsAutoable : std::false_type {};
template <class T>
struct IsAutoable<Autoable<T>> : std::true_type {};

// Builds the table of one struct T. Defaults come from a value-initialised T.
template <class T>
class BlockBuilder {
 public:
  explicit BlockBuilder(std::string name) { block_.name = std::move(name); }

  template <class M>
  Field& add(M T::*member, std::string key) {
    Field f;
    f.key = std::move(key);
    f.kind = Bind<M>::kind;
    f.nullable = IsOptional<M>::value;
    f.set = [member](void* o, const json& v) { Bind<M>::set(static_cast<T*>(o)->*member, v); };
    f.get = [member](const void* o) { return Bind<M>::get(static_cast<const T*>(o)->*member); };
    if constexpr (IsAutoable<M>::value) {
      f.allow_auto = true;
      f.mark_auto = [member](void* o) { (static_cast<T*>(o)->*member).is_auto = true; };
    }
    f.default_value = f.get(&defaults());
    if (f.default_value.is_null()) f.nullable = true;
    return push(std::move(f));
  }

  template <class S>
  Field& block(S T::*member, std::string key, const Block& sub) {
    Field f;
    f.key = std::move(key);
    f.kind = Kind::Block;
    f.nullable = true;  // `"offload_param": null` means the defaults, as in DeepSpeed
    f.block = &sub;
    f.child = [member](void* o) -> void* { return &(static_cast<T*>(o)->*member); };
    f.child_c = [member](const void* o) -> const void* { return &(static_cast<const T*>(o)->*member); };
    return push(std::move(f));
  }

  // A key stored in the json object `member` (ShallowConfig::settings); printed only when given.
  Field& setting(json T::*member, std::string key, Kind kind) {
    Field f;
    f.key = key;
    f.kind = kind;
    f.is_setting = true;
    f.nullable = true;
    f.set = [member, key](void* o, const json& v) { (static_cast<T*>(o)->*member)[key] = v; };
    f.get = [member, key](const void* o) {
      const json& s = static_cast<const T*>(o)->*member;
      return s.is_object() && s.contains(key) ? s.at(key) : json();
    };
    f.active = [](const json& v) { return !v.is_null(); };
    return push(std::move(f));
  }

  // A legacy key rewritten into canonical members (after the block's other keys were read);
  // `rewrite` checks the value's type itself.
  Field& legacy(std::string key, std::function<void(Ctx&, T&, const json&, const std::string& path)> rewrite) {
    Field f;
    f.key = std::move(key);
    f.kind = Kind::Legacy;
    f.legacy = [rewrite](Ctx& ctx, void* o, const json& v, const std::string& path) {
      rewrite(ctx, *static_cast<T*>(o), v, path);
    };
    return push(std::move(f));
  }

  Block build() { return std::move(block_); }

 private:
  static const T& defaults() {
    static const T d{};
    return d;
  }
  Field& push(Field f) {
    block_.fields.push_back(std::move(f));
    return block_.fields.back();
  }
  Block block_;
};

// `value[key] == true`, for any value (false when it is not an object or not a boolean).
inline bool json_flag(const json& value, const std::string& key) {
  if (!value.is_object()) return false;
  auto it = value.find(key);
  return it != value.end() && it->is_boolean() && it->get<bool>();
}

// Case-insensitive helpers shared by the tables.
std::string lower(std::string s);
bool iequals(const std::string& a, const std::string& b);
// The closest candidate within a small edit distance (case-insensitive, '-' == '_'), or "".
std::string closest(const std::string& key, const std::vector<std::string>& candidates);

}  // namespace strata::schema
