// DeepSpeed's csvMonitor (deepspeed/monitor/csv_monitor.py), byte for byte: Python's csv.writer
// ends rows with "\r\n", quotes a field only when it must, and writes a float with repr().
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "runtime/monitor/monitor.h"

namespace strata::monitor {
namespace {

// csv.QUOTE_MINIMAL: quote a field holding the delimiter, the quote character or a line end.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string CsvMonitor::file_name(const std::string& tag) {
  std::string name = tag;
  for (char& c : name) {
    if (c == '/' || c == ' ') c = '_';
  }
  return name + ".csv";
}

std::string CsvMonitor::format_value(double value) {
  // fmt's shortest round-trip form matches Python's repr (exponent below 1e-4 and from 1e16 on),
  // except that repr keeps ".0" on a whole number.
  std::string s = fmt::format("{}", value);
  if (s.find_first_not_of("-0123456789") == std::string::npos) s += ".0";
  return s;
}

CsvMonitor::CsvMonitor(const MonitorConfig& config) : dir_(make_log_dir(config, "csv_monitor")) {}

void CsvMonitor::write_events(const std::vector<Event>& events) {
  for (const Event& e : events) {
    std::string name = file_name(e.tag);
    std::string text;
    bool first = headed_.insert(name).second;
    if (first) {
      size_t slash = e.tag.rfind('/');
      std::string header = slash == std::string::npos ? e.tag : e.tag.substr(slash + 1);
      text = "step," + csv_field(header) + "\r\n";
    }
    text += fmt::format("{},{}\r\n", e.step, format_value(e.value));

    std::filesystem::path path = dir_ / name;
    std::FILE* f = std::fopen(path.c_str(), "ab");
    bool ok = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size();
    int err = errno;
    if (f != nullptr && std::fclose(f) != 0 && ok) {
      ok = false;
      err = errno;
    }
    if (!ok) {
      if (first) headed_.erase(name);  // the header is still owed
      throw Error(fmt::format("CSV monitor: cannot append to '{}': {}. Check that the folder is "
                              "writable and the disk has room (csv_monitor.output_path).",
                              path.string(), std::strerror(err)));
    }
  }
}

}  // namespace strata::monitor
