// strata-config: checks a training config the way the engine will read it, and prints the
// config reference generated from the schema tables.
//   strata-config check FILE [--world-size N] [--auto NAME=VALUE ...] [--allow-optimizer NAME]
//                            [--allow-scheduler NAME]
//   strata-config schema [--markdown | --json]
//   strata-config --version
// stdout: the resolved config (every key, defaults included); stderr: warnings and errors.
// Exit codes: 0 valid (warnings allowed), 1 invalid, 2 bad command line. Nothing else, ever.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/config/reference.h"
#include "strata/version.h"

namespace {

constexpr int kValid = 0, kInvalid = 1, kUsage = 2;

const char* const kUsageText =
    "usage: strata-config check FILE [--world-size N] [--auto NAME=VALUE ...]\n"
    "                           [--allow-optimizer NAME] [--allow-scheduler NAME]\n"
    "       strata-config schema [--markdown | --json]\n"
    "       strata-config --help | --version\n";

const char* const kHelpText =
    "strata-config check FILE: validate a DeepSpeed-style training config as Strata reads it.\n"
    "\n"
    "Prints the resolved config (every key, defaults filled in, legacy spellings mapped to\n"
    "DeepSpeed's current ones) on stdout, and warnings and errors on stderr, each naming the\n"
    "JSON path. Unknown keys, wrong types, out-of-range values, features that would change\n"
    "the math but that Strata does not implement, and batch sizes that do not satisfy\n"
    "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world\n"
    "size are errors. \"auto\" values that only the training program can fill (learning rate,\n"
    "steps, hidden size) are left as \"auto\" with a warning naming the --auto value that would\n"
    "fill each; given those values, the check resolves the config as the engine does with the\n"
    "same InitOptions::autos (a missing batch size included).\n"
    "\n"
    "options:\n"
    "  --world-size N          data-parallel world size for the batch triangle (default 1)\n"
    "  --auto NAME=VALUE       a value the program passes for \"auto\" (AutoValues::NAME): lr, beta1,\n"
    "                          beta2, eps, weight_decay, max_grad_norm, micro_batch_per_gpu,\n"
    "                          gradient_accumulation_steps, warmup_steps, total_steps, fp16, bf16,\n"
    "                          hidden_size; repeat for each\n"
    "  --allow-optimizer NAME  accept optimizer type NAME, as a program that registers it would\n"
    "  --allow-scheduler NAME  accept scheduler type NAME likewise\n"
    "\n"
    "exit status: 0 valid (warnings allowed), 1 invalid, 2 bad command line\n"
    "\n"
    "strata-config schema [--markdown | --json]: print the config reference (every key: JSON\n"
    "path, DeepSpeed's meaning, type, default, allowed values, other spellings, whether Strata\n"
    "implements it, warns or refuses it), generated from the schema tables; Markdown by default\n"
    "(docs/config.md).\n"
    "\n"
    "strata-config --version: the version and what this build was made with.\n";

bool parse_world_size(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  out = std::stoll(s);
  return out >= 1;
}

int usage(const std::string& why) {
  std::fprintf(stderr, "strata-config: %s\n%s", why.c_str(), kUsageText);
  return kUsage;
}

int check(const std::string& file, const strata::LoadOptions& options) {
  try {
    const strata::Config cfg = strata::load_config_file(file, options);
    for (const std::string& w : cfg.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
    for (const std::string& p : strata::pending_features(cfg))
      std::fprintf(stderr, "warning: %s: %s\n", file.c_str(), p.c_str());
    const std::string out = strata::to_json(cfg).dump(2, ' ', false, strata::json::error_handler_t::replace);
    std::fprintf(stdout, "%s\n", out.c_str());
    std::fprintf(stderr, "%s: valid\n", file.c_str());
    return kValid;
  } catch (const strata::ConfigError& e) {
    for (const std::string& p : e.problems()) std::fprintf(stderr, "error: %s\n", p.c_str());
    std::fprintf(stderr, "%s: invalid (%zu problem%s)\n", file.c_str(), e.problems().size(),
                 e.problems().size() == 1 ? "" : "s");
    return kInvalid;
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return kInvalid;
  }
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return usage("missing command");
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kHelpText, stdout);
    return kValid;
  }
  if (args[0] == "--version") {
    std::puts(strata::version_line());
    return kValid;
  }
  if (args[0] == "schema") {
    if (args.size() > 2) return usage("schema takes one option, --markdown or --json");
    const std::string format = args.size() == 2 ? args[1] : "--markdown";
    if (format == "--json") {
      std::printf("%s\n", strata::config_reference_json().dump(2).c_str());
    } else if (format == "--markdown") {
      std::fputs(strata::config_reference_markdown().c_str(), stdout);
    } else {
      return usage("schema: unknown option '" + format + "' (--markdown or --json)");
    }
    return kValid;
  }
  if (args[0] != "check") return usage("unknown command '" + args[0] + "'");
  strata::LoadOptions options;
  options.allow_unresolved_auto = true;  // no program here to supply AutoValues
  std::string file;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string* { return i + 1 < args.size() ? &args[++i] : nullptr; };
    if (a == "--help" || a == "-h") {
      std::fputs(kHelpText, stdout);
      return kValid;
    } else if (a == "--world-size") {
      const std::string* v = value();
      if (!v || !parse_world_size(*v, options.world_size))
        return usage("--world-size needs a whole number >= 1");
    } else if (a == "--auto") {
      const std::string* v = value();
      if (!v) return usage("--auto needs NAME=VALUE");
      const std::string problem = strata::set_auto_value(options.autos, *v);
      if (!problem.empty()) return usage(problem);
    } else if (a == "--allow-optimizer" || a == "--allow-scheduler") {
      const std::string* v = value();
      if (!v || v->empty()) return usage(a + " needs a type name");
      (a == "--allow-optimizer" ? options.extra_optimizers : options.extra_schedulers).push_back(*v);
    } else if (!a.empty() && a[0] == '-') {
      return usage("unknown option '" + a + "'");
    } else if (file.empty()) {
      file = a;
    } else {
      return usage("more than one FILE given");
    }
  }
  if (file.empty()) return usage("check needs a FILE");
  return check(file, options);
}

}  // namespace

int main(int argc, char** argv) {
  // Whatever happens, the exit status is 0, 1 or 2: a crash-free answer is part of the contract.
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: internal: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "error: internal: unknown exception\n");
  }
  return kInvalid;
}
