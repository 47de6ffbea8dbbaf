#include "launcher/line_prefixer.h"

namespace strata::launcher {

const std::string& LinePrefixer::prefix_for(std::string_view line) const {
  static const std::string none;
  for (const std::string& start : unmarked_)
    if (line.substr(0, start.size()) == start) return none;
  return prefix_;
}

std::string LinePrefixer::feed(std::string_view data) {
  std::string out;
  pending_.append(data);
  size_t start = 0;
  while (true) {
    size_t end = pending_.find('\n', start);
    const std::string& prefix = prefix_for(std::string_view(pending_).substr(start));
    if (end == std::string::npos) {
      if (pending_.size() - start < kMaxLine) break;
      end = start + kMaxLine - 1;
      out.append(prefix).append(pending_, start, end - start + 1).push_back('\n');
    } else {
      out.append(prefix).append(pending_, start, end - start + 1);
    }
    start = end + 1;
  }
  pending_.erase(0, start);
  return out;
}

std::string LinePrefixer::flush() {
  if (pending_.empty()) return "";
  std::string out = prefix_for(pending_) + pending_ + "\n";
  pending_.clear();
  return out;
}

}  // namespace strata::launcher
