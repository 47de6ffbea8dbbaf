// Listing and removing folders with POSIX calls, not std::filesystem: pip LibTorch 2.x's
// libtorch.so exports its own std::filesystem symbols, and a program linked with it can resolve
// std::filesystem::remove_all to that copy, which jumps to a null address (seen on the GPU
// machine: train_gpt crashed removing its NVMe swap folder). Torch-free.
#pragma once

#include <string>
#include <vector>

namespace strata::util {

// The names in `dir` (without "." and ".."), unsorted. Throws strata::Error naming the folder.
std::vector<std::string> list_folder(const std::string& dir);
// rm -rf (symbolic links are removed, not followed); a missing path is fine. Throws
// strata::Error naming the path that could not be removed.
void remove_tree(const std::string& path);

}  // namespace strata::util
