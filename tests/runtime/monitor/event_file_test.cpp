// TensorBoard event files: the Event protos against bytes serialized by protobuf itself
// (tensorboard.compat.proto.event_pb2), and files read back by the independent reader in
// event_reader.h (framing, both CRCs, field-by-field decoding).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <unistd.h>

#include "runtime/error.h"
#include "runtime/monitor/event_file.h"
#include "tests/runtime/monitor/event_reader.h"
#include "tests/runtime/monitor/temp_dir.h"

namespace strata::monitor {
namespace {

std::string hex(const std::string& s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string this_host() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

TEST(EventProto, MatchesProtobufSerialization) {
  // Event(wall_time=..., step=..., summary=Summary(value=[Summary.Value(tag=..., simple_value=...)]))
  //   .SerializeToString().hex(), from Python's protobuf.
  EXPECT_EQ(hex(encode_scalar_event(1700000000.5, 300, "Train/Samples/train_loss", 2.5f)),
            "0900002040fc54d94110ac022a210a1f0a18547261696e2f53616d706c65732f747261696e5f6c6f7373"
            "1500002040");
  EXPECT_EQ(hex(encode_file_version_event(1700000000.25)),
            "0900001040fc54d9411a0d627261696e2e4576656e743a32");
  EXPECT_EQ(hex(encode_scalar_event(1.0, -1, "x", -0.125f)),
            "09000000000000f03f10ffffffffffffffffff012a0a0a080a017815000000be");
  EXPECT_EQ(hex(encode_scalar_event(1.0, 0, "x", 0.0f)), "09000000000000f03f2a0a0a080a01781500000000");
}

struct Scalar {
  std::string tag;
  float value;
  int64_t step;
};

TEST(EventFile, ReadsBackWhatWasWritten) {
  test::TempDir dir;
  const std::vector<Scalar> scalars = {
      {"Train/Samples/train_loss", 2.71875f, 0},
      {"Train/Samples/lr", 1e-5f, 8},
      {"Train/Samples/loss_scale", 65536.0f, (int64_t(1) << 40) + 3},
      {"negative step", -0.5f, -7},
      {std::string(300, 't'), 3.0f, 129},  // a tag longer than one varint byte
  };
  double before = std::floor(wall_time_now());
  std::string path;
  {
    EventFileWriter writer(dir.path());
    path = writer.path().string();
    for (size_t i = 0; i < scalars.size(); ++i) {
      writer.add_scalar(scalars[i].tag, scalars[i].value, scalars[i].step, 1000.0 + i);
    }
  }  // the destructor flushes
  double after = wall_time_now();

  std::vector<test::DecodedEvent> events = test::read_event_file(path);
  ASSERT_EQ(events.size(), scalars.size() + 1);
  EXPECT_EQ(events[0].file_version, std::optional<std::string>("brain.Event:2"));
  EXPECT_GE(events[0].wall_time, before);
  EXPECT_LE(events[0].wall_time, after);
  EXPECT_TRUE(events[0].values.empty());
  for (size_t i = 0; i < scalars.size(); ++i) {
    const test::DecodedEvent& e = events[i + 1];
    EXPECT_FALSE(e.file_version.has_value());
    EXPECT_EQ(e.wall_time, 1000.0 + i);
    EXPECT_EQ(e.step, scalars[i].step);
    ASSERT_EQ(e.values.size(), 1u);
    EXPECT_EQ(e.values[0].tag, scalars[i].tag);
    EXPECT_EQ(e.values[0].simple_value, scalars[i].value);
  }
}

TEST(EventFile, NamedAsTensorBoardExpects) {
  test::TempDir dir;
  int64_t before = static_cast<int64_t>(wall_time_now());
  EventFileWriter first(dir.path());
  EventFileWriter second(dir.path());  // same folder, same second: still two files
  int64_t after = static_cast<int64_t>(wall_time_now());

  EXPECT_EQ(first.path().parent_path(), dir.path());
  EXPECT_NE(first.path(), second.path());
  std::smatch m;
  std::string name = first.path().filename().string();
  ASSERT_TRUE(std::regex_match(name, m, std::regex(R"(events\.out\.tfevents\.(\d{10})\.(.+)\.(\d+)\.(\d+))")))
      << name;
  EXPECT_GE(std::stoll(m[1]), before);
  EXPECT_LE(std::stoll(m[1]), after);
  EXPECT_EQ(m[2].str(), this_host());
  EXPECT_EQ(std::stol(m[3]), static_cast<long>(getpid()));
}

TEST(EventFile, FlushMakesRecordsVisible) {
  test::TempDir dir;
  EventFileWriter writer(dir.path());
  // The file_version record is on disk as soon as the writer exists.
  EXPECT_EQ(test::read_event_file(writer.path().string()).size(), 1u);
  writer.add_scalar("a", 1.0f, 1, 1.0);
  writer.add_scalar("a", 2.0f, 2, 2.0);
  writer.flush();
  std::vector<test::DecodedEvent> events = test::read_event_file(writer.path().string());
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2].values.at(0).simple_value, 2.0f);
}

TEST(EventFile, MissingFolderNamesTheFile) {
  test::TempDir dir;
  std::filesystem::path missing = dir.path() / "no" / "such" / "folder";
  try {
    EventFileWriter writer(missing);
    FAIL() << "created an event file in a missing folder";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(missing.string() + "/events.out.tfevents."), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
  }
}

TEST(EventFile, FullDiskIsAnError) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  RecordWriter writer("/dev/full");
  writer.write("some event");  // buffered
  try {
    writer.flush();
    FAIL() << "flushing to /dev/full succeeded";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("'/dev/full'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("No space left on device"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace strata::monitor
