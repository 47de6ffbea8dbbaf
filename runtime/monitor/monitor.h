// Training monitors, as DeepSpeed's deepspeed/monitor/ (monitor.py, tensorboard.py,
// csv_monitor.py): the engine hands a batch of scalar events — ("Train/Samples/train_loss",
// value, step) — to one MonitorMaster, which writes them to every monitor the config enables.
//
//   auto monitors = strata::monitor::make_monitors(config, rank);
//   if (monitors->enabled()) monitors->write_events({{"Train/Samples/train_loss", loss, samples}});
//
// DeepSpeed's semantics, kept here:
// - each monitor writes into os.path.join(output_path, job_name) (output_path "" = the working
//   directory), created when the monitor is made;
// - only rank 0 writes; on other ranks make_monitors returns a master with no monitors and
//   creates nothing;
// - TensorBoard: one event file per run, flushed after every write_events call;
// - CSV: one file per tag, <tag with '/' and ' ' replaced by '_'>.csv, opened for appending; the
//   first write of a tag by this monitor adds the header row "step,<last '/' part of the tag>";
//   rows are "step,value" with Python's repr of the value and "\r\n" line ends (Python's csv).
// Wandb (and comet) are not implemented: the config layer warns that they are ignored.
// I/O errors throw strata::Error naming the file or folder.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/config/config.h"

namespace strata::monitor {

class EventFileWriter;

struct Event {
  std::string tag;  // "Train/Samples/train_loss"
  double value = 0;
  int64_t step = 0;
};

class Monitor {
 public:
  virtual ~Monitor() = default;
  virtual void write_events(const std::vector<Event>& events) = 0;
  virtual void flush() {}
};

// os.path.join(output_path, job_name), as DeepSpeed's monitors compute their folder.
std::filesystem::path log_dir(const MonitorConfig& config);
// Creates log_dir(config) (os.makedirs(exist_ok=True)) and returns it; an error names the folder
// and the keys of `block` ("tensorboard", "csv_monitor") that chose it.
std::filesystem::path make_log_dir(const MonitorConfig& config, const char* block);

// The `tensorboard` block: TensorBoard event files written by Strata itself (event_file.h).
class TensorBoardMonitor final : public Monitor {
 public:
  explicit TensorBoardMonitor(const MonitorConfig& config);  // creates the folder and the file
  ~TensorBoardMonitor() override;                             // flushes
  void write_events(const std::vector<Event>& events) override;  // then flushes, as DeepSpeed
  void flush() override;
  const std::filesystem::path& event_file() const;

 private:
  std::unique_ptr<EventFileWriter> writer_;
};

// The `csv_monitor` block.
class CsvMonitor final : public Monitor {
 public:
  explicit CsvMonitor(const MonitorConfig& config);  // creates the folder
  void write_events(const std::vector<Event>& events) override;
  const std::filesystem::path& dir() const { return dir_; }

  // The file a tag goes to, and the CSV text of a value (Python's repr of a float).
  static std::string file_name(const std::string& tag);
  static std::string format_value(double value);

 private:
  std::filesystem::path dir_;
  std::set<std::string> headed_;  // files this monitor has written a header to
};

// DeepSpeed's MonitorMaster: writes every event to each enabled monitor.
class MonitorMaster final : public Monitor {
 public:
  explicit MonitorMaster(std::vector<std::unique_ptr<Monitor>> monitors);
  void write_events(const std::vector<Event>& events) override;
  void flush() override;
  // True when something is written (rank 0 with a monitor enabled): the caller may skip
  // building events otherwise.
  bool enabled() const { return !monitors_.empty(); }

 private:
  std::vector<std::unique_ptr<Monitor>> monitors_;
};

// The monitors `config` enables (tensorboard, then csv_monitor), for this rank.
std::unique_ptr<MonitorMaster> make_monitors(const Config& config, int rank);

}  // namespace strata::monitor
