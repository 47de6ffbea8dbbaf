#include "launcher/program.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "runtime/error.h"

namespace strata::launcher {
namespace {

enum class Found { kMissing, kDirectory, kNotExecutable, kOk };

Found probe(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Found::kMissing;
  if (S_ISDIR(st.st_mode)) return Found::kDirectory;
  if (::access(path.c_str(), X_OK) != 0) return Found::kNotExecutable;
  return Found::kOk;
}

}  // namespace

std::string find_program(const std::string& name) {
  if (name.empty()) throw Error("the program name is empty");
  if (name.find('/') != std::string::npos) {
    switch (probe(name)) {
      case Found::kOk:
        return name;
      case Found::kMissing:
        throw Error(fmt::format("program '{}' does not exist", name));
      case Found::kDirectory:
        throw Error(fmt::format("program '{}' is a directory", name));
      case Found::kNotExecutable:
        throw Error(fmt::format("program '{}' is not executable (chmod +x?)", name));
    }
  }
  const char* env = std::getenv("PATH");
  const std::string path = env ? env : "/bin:/usr/bin";  // glibc execvp's default
  std::string not_executable;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    Found found = probe(candidate);
    if (found == Found::kOk) return candidate;
    if (found == Found::kNotExecutable && not_executable.empty()) not_executable = candidate;
    start = end + 1;
  }
  if (!not_executable.empty())
    throw Error(
        fmt::format("program '{}' found as '{}', which is not executable", name, not_executable));
  throw Error(fmt::format("program '{}' not found in PATH ({})", name, path));
}

}  // namespace strata::launcher
