#include "runtime/monitor/monitor.h"

#include <system_error>

#include <fmt/format.h>

namespace strata::monitor {

std::filesystem::path log_dir(const MonitorConfig& config) {
  // std::filesystem's operator/ joins as os.path.join does: "" + job = job, and an absolute
  // job_name replaces output_path.
  return std::filesystem::path(config.output_path) / config.job_name;
}

std::filesystem::path make_log_dir(const MonitorConfig& config, const char* block) {
  std::filesystem::path dir = log_dir(config);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!ec && !std::filesystem::is_directory(dir, ec)) ec = std::make_error_code(std::errc::not_a_directory);
  if (ec) {
    throw Error(fmt::format(
        "{0}: cannot create the monitor folder '{1}' ({0}.output_path \"{2}\" + {0}.job_name "
        "\"{3}\"): {4}. Set {0}.output_path to a folder this process can write to.",
        block, dir.string(), config.output_path, config.job_name, ec.message()));
  }
  return dir;
}

MonitorMaster::MonitorMaster(std::vector<std::unique_ptr<Monitor>> monitors)
    : monitors_(std::move(monitors)) {}

void MonitorMaster::write_events(const std::vector<Event>& events) {
  for (auto& m : monitors_) m->write_events(events);
}

void MonitorMaster::flush() {
  for (auto& m : monitors_) m->flush();
}

std::unique_ptr<MonitorMaster> make_monitors(const Config& config, int rank) {
  std::vector<std::unique_ptr<Monitor>> monitors;
  if (rank == 0) {
    if (config.tensorboard.enabled) monitors.push_back(std::make_unique<TensorBoardMonitor>(config.tensorboard));
    if (config.csv_monitor.enabled) monitors.push_back(std::make_unique<CsvMonitor>(config.csv_monitor));
  }
  return std::make_unique<MonitorMaster>(std::move(monitors));
}

}  // namespace strata::monitor
