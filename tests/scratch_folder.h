// A fresh folder under /tmp for one test (mkdtemp), emptied and removed at the end: the files,
// FIFOs and empty folders the test made in it (one level deep; a fuzz test's crafted entries).
#pragma once

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

namespace strata::test {

class ScratchFolder {
 public:
  explicit ScratchFolder(const std::string& tag) {
    std::string templ = "/tmp/strata_" + tag + ".XXXXXX";
    if (::mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~ScratchFolder() {
    if (path_.empty()) return;
    if (DIR* d = ::opendir(path_.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        const std::string p = path_ + "/" + name;
        if (::unlink(p.c_str()) != 0) ::rmdir(p.c_str());
      }
      ::closedir(d);
    }
    ::rmdir(path_.c_str());
  }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const char* name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace strata::test
