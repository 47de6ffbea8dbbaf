#include "runtime/monitor/event_file.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>
#include <unistd.h>

#include "runtime/error.h"
#include "runtime/util/crc32c.h"

namespace strata::monitor {

const char* const kEventFileVersion = "brain.Event:2";

namespace {

// --- protobuf wire format (only what Event needs) ---

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (field << 3) | type); }

template <class UInt>
void put_little_endian(std::string& out, UInt v) {
  for (size_t i = 0; i < sizeof(UInt); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed64);
  put_little_endian(out, bits);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed32);
  put_little_endian(out, bits);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

// Field numbers of event.proto / summary.proto.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersionField = 3, kEventSummary = 5;
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1, kValueSimpleValue = 2;

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

}  // namespace

std::string encode_file_version_event(double wall_time) {
  std::string event;
  put_double(event, kEventWallTime, wall_time);
  put_bytes(event, kEventFileVersionField, kEventFileVersion);
  return event;
}

std::string encode_scalar_event(double wall_time, int64_t step, std::string_view tag, float value) {
  std::string summary_value;
  put_bytes(summary_value, kValueTag, tag);
  put_float(summary_value, kValueSimpleValue, value);
  std::string summary;
  put_bytes(summary, kSummaryValue, summary_value);

  std::string event;
  put_double(event, kEventWallTime, wall_time);
  if (step != 0) {  // proto3 leaves a default out
    put_key(event, kEventStep, kVarint);
    put_varint(event, static_cast<uint64_t>(step));  // int64: two's complement, 10 bytes if < 0
  }
  put_bytes(event, kEventSummary, summary);
  return event;
}

double wall_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// --- RecordWriter ---

RecordWriter::RecordWriter(std::filesystem::path path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) fail("cannot create", errno);
}

RecordWriter::~RecordWriter() {
  if (file_ == nullptr) return;
  bool ok = std::fflush(file_) == 0;
  int err = errno;
  ok = (std::fclose(file_) == 0) && ok;
  if (!ok && !failed_) {
    fmt::print(stderr, "strata: could not finish the TensorBoard event file '{}': {}\n",
               path_.string(), std::strerror(err));
  }
}

void RecordWriter::write(std::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  put_little_endian(record, static_cast<uint64_t>(data.size()));
  put_little_endian(record, mask_crc(crc32c(record.data(), 8)));
  record.append(data.data(), data.size());
  put_little_endian(record, mask_crc(crc32c(data)));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) fail("cannot write to", errno);
}

void RecordWriter::flush() {
  if (std::fflush(file_) != 0) fail("cannot write to", errno);
}

void RecordWriter::fail(const char* what, int err) {
  failed_ = true;
  throw Error(fmt::format("TensorBoard monitor: {} the event file '{}': {}. Check that the folder "
                          "is writable and the disk has room (tensorboard.output_path).",
                          what, path_.string(), std::strerror(err)));
}

// --- EventFileWriter ---

std::string event_file_name(int64_t unix_time) {
  static std::atomic<int> counter{0};
  return fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", unix_time, hostname(),
                     static_cast<long>(getpid()), counter++);
}

EventFileWriter::EventFileWriter(const std::filesystem::path& log_dir)
    : records_(log_dir / event_file_name(static_cast<int64_t>(wall_time_now()))) {
  records_.write(encode_file_version_event(wall_time_now()));
  records_.flush();
}

void EventFileWriter::add_scalar(std::string_view tag, float value, int64_t step, double wall_time) {
  records_.write(encode_scalar_event(wall_time, step, tag, value));
}

}  // namespace strata::monitor
