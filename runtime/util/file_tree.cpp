#include "runtime/util/file_tree.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "runtime/error.h"

namespace strata::util {
namespace {

[[noreturn]] void fail(const char* what, const std::string& path, int err) {
  throw Error(std::string("cannot ") + what + " '" + path + "': " + std::strerror(err) +
              " (errno " + std::to_string(err) + ")");
}

}  // namespace

std::vector<std::string> list_folder(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) fail("list folder", dir, errno);
  std::vector<std::string> names;
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  const int err = errno;
  ::closedir(d);
  if (err != 0) fail("list folder", dir, err);
  return names;
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail("remove", path, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    for (const auto& name : list_folder(path)) remove_tree(path + "/" + name);
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) fail("remove", path, errno);
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    fail("remove", path, errno);
  }
}

}  // namespace strata::util
