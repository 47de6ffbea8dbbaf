// TensorBoard event files, written without protobuf or TensorFlow.
//
// An event file is a sequence of TFRecords: uint64 length (little-endian), masked CRC32C of those
// 8 bytes, the data, masked CRC32C of the data. Each record holds one serialized `Event` proto
// (tensorboard/compat/proto/event.proto); the first one names the format:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// torch.utils.tensorboard.SummaryWriter.add_scalar writes one Event per scalar, as done here.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>

namespace strata::monitor {

// TFRecord's masked CRC32C (TensorBoard's record framing).
inline uint32_t mask_crc(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }


// "brain.Event:2": the version TensorBoard expects in the first record of a file.
extern const char* const kEventFileVersion;

// Serialized Event protos.
std::string encode_file_version_event(double wall_time);
std::string encode_scalar_event(double wall_time, int64_t step, std::string_view tag, float value);

// Seconds since the Unix epoch, as Python's time.time().
double wall_time_now();

// Appends TFRecords to one file. Errors throw strata::Error naming the file; the destructor
// flushes and closes, and reports a failure on stderr (it cannot throw).
class RecordWriter {
 public:
  explicit RecordWriter(std::filesystem::path path);  // creates or truncates the file
  ~RecordWriter();
  RecordWriter(const RecordWriter&) = delete;
  RecordWriter& operator=(const RecordWriter&) = delete;

  void write(std::string_view data);
  void flush();
  const std::filesystem::path& path() const { return path_; }

 private:
  [[noreturn]] void fail(const char* what, int err);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  bool failed_ = false;  // an error was thrown already: the destructor stays quiet
};

// One event file in `log_dir` (which must exist), named as torch's SummaryWriter names it:
// events.out.tfevents.<unix time, 10 digits>.<hostname>.<pid>.<n>; TensorBoard reads every file
// whose name holds "tfevents". The file_version record is written and flushed at once.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::filesystem::path& log_dir);

  void add_scalar(std::string_view tag, float value, int64_t step, double wall_time);
  void flush() { records_.flush(); }
  const std::filesystem::path& path() const { return records_.path(); }

 private:
  RecordWriter records_;
};

// The file name EventFileWriter uses for a file created at `unix_time`.
std::string event_file_name(int64_t unix_time);

}  // namespace strata::monitor
