// The public entry points of config.h: read strictly, walk the schema, apply the cross-block
// rules, and either return the resolved Config or throw one ConfigError with every problem.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include <fmt/format.h>

#include "runtime/config/config.h"
#include "runtime/config/json_reader.h"
#include "runtime/config/rules.h"
#include "runtime/config/schema_blocks.h"

namespace strata {
namespace {

std::string joined(const std::vector<std::string>& problems) {
  std::string s;
  for (const std::string& p : problems) {
    if (!s.empty()) s += '\n';
    s += p;
  }
  return s;
}

const char* type_of(const json& v) {
  if (v.is_array()) return "a list";
  if (v.is_string()) return "a string";
  if (v.is_number()) return "a number";
  if (v.is_boolean()) return "a boolean";
  return "null";
}

}  // namespace

ConfigError::ConfigError(std::string source, std::vector<std::string> problems)
    : Error(joined(problems)), source_(std::move(source)), problems_(std::move(problems)) {}

Config parse_config_text(const std::string& text, const std::string& source, const LoadOptions& options) {
  if (options.world_size < 1)
    throw ConfigError(source, {fmt::format("{}: world size {} must be at least 1", source, options.world_size)});
  ReadJson read = read_json_strict(text, source);
  if (!read.value.is_object())
    throw ConfigError(source, {fmt::format("{}: a config is a JSON object {{ ... }}; found {}", source,
                                           type_of(read.value))});
  schema::Ctx ctx(options, source, &read.positions);
  Config cfg;
  cfg.source = source;
  cfg.world_size = options.world_size;
  schema::read_block(schema::root_block(), &cfg, read.value, "", ctx);
  schema::apply_rules(cfg, ctx);

  std::vector<std::string> errors;
  for (const schema::Issue& issue : ctx.issues) {
    if (issue.text.empty()) continue;  // counted past the cap
    (issue.error ? errors : cfg.warnings).push_back(ctx.format(issue));
  }
  if (ctx.has_errors()) {
    if (ctx.dropped)
      errors.push_back(fmt::format("{}: ... and {} more problems not shown", source, ctx.dropped));
    throw ConfigError(source, std::move(errors));
  }
  cfg.unresolved_autos = ctx.unresolved;
  cfg.filled = std::move(ctx.filled);
  return cfg;
}

Config load_config_file(const std::string& path, const LoadOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) throw ConfigError(path, {fmt::format("{}: no such file", path)});
  if (fs::is_directory(st)) throw ConfigError(path, {fmt::format("{}: is a directory, not a config file", path)});
  if (!fs::is_regular_file(st)) throw ConfigError(path, {fmt::format("{}: not a regular file", path)});
  constexpr uintmax_t kMaxBytes = 64u << 20;  // configs are kilobytes; refuse to slurp a disk image
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) throw ConfigError(path, {fmt::format("{}: cannot read: {}", path, ec.message())});
  if (size > kMaxBytes)
    throw ConfigError(path, {fmt::format("{}: {} bytes is too large for a config (limit {})", path, size, kMaxBytes)});
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path, {fmt::format("{}: cannot open for reading", path)});
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ConfigError(path, {fmt::format("{}: read error", path)});
  return parse_config_text(text.str(), path, options);
}

json to_json(const Config& config) {
  return schema::print_block(schema::root_block(), &config, "", config.unresolved_autos);
}

std::vector<std::string> pending_features(const Config& config) {
  std::vector<std::string> out;
  schema::visit(schema::root_block(), &config, "",
                [&](const schema::Field& f, const json& value, const std::string& path) {
                  if (f.support == schema::Support::Pending && f.is_active(value))
                    out.push_back(fmt::format("{} = {}: {} is valid config, but this build's engine does "
                                              "not run it yet",
                                              path, schema::show(value), f.note));
                });
  return out;
}

}  // namespace strata
