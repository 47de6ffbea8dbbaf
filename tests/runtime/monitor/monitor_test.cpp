// DeepSpeed's monitor semantics: folder layout, CSV files byte for byte (the expected texts were
// produced by DeepSpeed's csvMonitor.write_events code under Python 3.11), the fan-out, rank 0
// only, disabled monitors, and errors that name the folder or file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <string>

#include <fmt/format.h>
#include <unistd.h>

#include "runtime/config/config.h"
#include "runtime/monitor/monitor.h"
#include "tests/runtime/monitor/event_reader.h"
#include "tests/runtime/monitor/temp_dir.h"

namespace strata::monitor {
namespace {

namespace fs = std::filesystem;

// A config with the given monitor blocks, through the real parser.
Config config_with(const std::string& blocks) {
  return parse_config_text(R"({"train_batch_size": 8, )" + blocks + "}", "test.json");
}

std::string block(const char* name, bool enabled, const std::string& output_path, const std::string& job) {
  return fmt::format(R"("{}": {{"enabled": {}, "output_path": "{}", "job_name": "{}"}})", name,
                     enabled ? "true" : "false", output_path, job);
}

std::set<std::string> names_in(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename().string());
  return names;
}

std::vector<fs::path> event_files_in(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(entry.path());
  }
  return files;
}

MonitorConfig monitor_config(const std::string& output_path, const std::string& job) {
  MonitorConfig c;
  c.enabled = true;
  c.output_path = output_path;
  c.job_name = job;
  return c;
}

TEST(MonitorLayout, LogDirJoinsAsOsPathJoin) {
  EXPECT_EQ(log_dir(monitor_config("", "job")), fs::path("job"));
  EXPECT_EQ(log_dir(monitor_config("runs/", "job")), fs::path("runs/job"));
  EXPECT_EQ(log_dir(monitor_config("runs", "job")), fs::path("runs/job"));
  EXPECT_EQ(log_dir(monitor_config("runs", "/abs/job")), fs::path("/abs/job"));
  EXPECT_EQ(log_dir(MonitorConfig{}), fs::path("DeepSpeedJobName"));  // DeepSpeed's defaults
}

TEST(MonitorLayout, DefaultOutputPathIsTheWorkingDirectory) {
  test::TempDir dir;
  fs::path old = fs::current_path();
  fs::current_path(dir.path());
  {
    auto monitors = make_monitors(config_with(R"("csv_monitor": {"enabled": true})"), 0);
    monitors->write_events({{"loss", 1.5, 3}});
  }
  fs::current_path(old);
  EXPECT_EQ(test::slurp_file((dir.path() / "DeepSpeedJobName" / "loss.csv").string()), "step,loss\r\n3,1.5\r\n");
}

TEST(TensorBoardMonitor, WritesEventsIntoOutputPathSlashJobName) {
  test::TempDir dir;
  auto monitors = make_monitors(config_with(block("tensorboard", true, dir.str() + "/tb", "run1")), 0);
  ASSERT_TRUE(monitors->enabled());
  fs::path job_dir = dir.path() / "tb" / "run1";
  ASSERT_TRUE(fs::is_directory(job_dir));
  std::vector<fs::path> files = event_files_in(job_dir);
  ASSERT_EQ(files.size(), 1u);  // created with the monitor, as SummaryWriter does

  monitors->write_events({{"Train/Samples/train_loss", 3.25, 8}, {"Train/Samples/lr", 0.001, 8}});
  monitors->write_events({{"Train/Samples/train_loss", 3.0, 16}});
  // Readable without flush() or destruction: DeepSpeed flushes after every write_events.
  std::vector<test::DecodedEvent> events = test::read_event_file(files[0].string());
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, std::optional<std::string>("brain.Event:2"));
  struct Want { const char* tag; float value; int64_t step; };
  const Want want[] = {{"Train/Samples/train_loss", 3.25f, 8}, {"Train/Samples/lr", 0.001f, 8},
                       {"Train/Samples/train_loss", 3.0f, 16}};
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_EQ(events[i + 1].values.size(), 1u);
    EXPECT_EQ(events[i + 1].values[0].tag, want[i].tag);
    EXPECT_EQ(events[i + 1].values[0].simple_value, want[i].value);
    EXPECT_EQ(events[i + 1].step, want[i].step);
    EXPECT_GE(events[i + 1].wall_time, events[0].wall_time);
  }
}

TEST(CsvMonitor, OneFilePerTagAsDeepSpeedWritesIt) {
  test::TempDir dir;
  auto monitors = make_monitors(config_with(block("csv_monitor", true, dir.str(), "csvjob")), 0);
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  monitors->write_events({{"Train/Samples/train_loss", 2.5, 0}, {"Train/Samples/lr", 1e-05, 0}, {"my tag", 65536.0, 0}});
  monitors->write_events({{"Train/Samples/train_loss", 0.1 + 0.2, 8}, {"Train/Samples/lr", 2.5e-05, 8}, {"my tag", -0.0, 8}});
  monitors->write_events({{"Train/Samples/train_loss", inf, 16}, {"Train/Samples/lr", nan, 16},
                          {"a/b,c", 1e16, int64_t(1) << 40}, {"q/say \"hi\"", 123456789.125, -3}});

  fs::path job_dir = dir.path() / "csvjob";
  EXPECT_EQ(names_in(job_dir), (std::set<std::string>{"Train_Samples_lr.csv", "Train_Samples_train_loss.csv",
                                                       "a_b,c.csv", "my_tag.csv", "q_say_\"hi\".csv"}));
  auto text = [&](const char* name) { return test::slurp_file((job_dir / name).string()); };
  EXPECT_EQ(text("Train_Samples_lr.csv"), "step,lr\r\n0,1e-05\r\n8,2.5e-05\r\n16,nan\r\n");
  EXPECT_EQ(text("Train_Samples_train_loss.csv"), "step,train_loss\r\n0,2.5\r\n8,0.30000000000000004\r\n16,inf\r\n");
  EXPECT_EQ(text("a_b,c.csv"), "step,\"b,c\"\r\n1099511627776,1e+16\r\n");
  EXPECT_EQ(text("my_tag.csv"), "step,my tag\r\n0,65536.0\r\n8,-0.0\r\n");
  EXPECT_EQ(text("q_say_\"hi\".csv"), "step,\"say \"\"hi\"\"\"\r\n-3,123456789.125\r\n");
}

TEST(CsvMonitor, ValuesFormatAsPythonRepr) {
  // repr() of each value, from Python 3.11.
  const std::pair<double, const char*> cases[] = {
      {1.0, "1.0"},     {0.5, "0.5"},       {1e-4, "0.0001"},   {1e15, "1000000000000000.0"},
      {1e16, "1e+16"},  {1e300, "1e+300"},  {-2.0, "-2.0"},     {123456789012345678.0, "1.2345678901234568e+17"},
      {5e-324, "5e-324"}, {0.0, "0.0"},
  };
  for (const auto& [value, repr] : cases) EXPECT_EQ(CsvMonitor::format_value(value), repr) << repr;
}

TEST(CsvMonitor, ANewMonitorAppendsWithAFreshHeader) {
  // DeepSpeed opens with 'a+' and remembers headers per monitor object: a restarted run appends
  // to the old file and writes the header row again.
  test::TempDir dir;
  MonitorConfig c = monitor_config(dir.str(), "job");
  CsvMonitor(c).write_events({{"Train/loss", 1.0, 1}, {"Train/loss", 0.5, 2}});
  CsvMonitor(c).write_events({{"Train/loss", 0.25, 3}});
  EXPECT_EQ(test::slurp_file((dir.path() / "job" / "Train_loss.csv").string()),
            "step,loss\r\n1,1.0\r\n2,0.5\r\nstep,loss\r\n3,0.25\r\n");
}

TEST(MonitorMaster, FansOutToEveryEnabledMonitor) {
  test::TempDir dir;
  Config config = config_with(block("tensorboard", true, dir.str(), "job") + ", " +
                              block("csv_monitor", true, dir.str(), "job"));
  {
    auto monitors = make_monitors(config, 0);
    monitors->write_events({{"Train/Samples/train_loss", 1.75, 4}});
    monitors->flush();
  }
  fs::path job_dir = dir.path() / "job";
  std::vector<fs::path> files = event_files_in(job_dir);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(names_in(job_dir), (std::set<std::string>{files[0].filename().string(), "Train_Samples_train_loss.csv"}));
  std::vector<test::DecodedEvent> events = test::read_event_file(files[0].string());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].values.at(0).simple_value, 1.75f);
  EXPECT_EQ(test::slurp_file((job_dir / "Train_Samples_train_loss.csv").string()), "step,train_loss\r\n4,1.75\r\n");
}

TEST(MonitorMaster, OnlyRankZeroWrites) {
  test::TempDir dir;
  Config config = config_with(block("tensorboard", true, dir.str(), "tb") + ", " +
                              block("csv_monitor", true, dir.str(), "csv"));
  for (int rank : {1, 3}) {
    auto monitors = make_monitors(config, rank);
    EXPECT_FALSE(monitors->enabled());
    monitors->write_events({{"Train/Samples/train_loss", 1.0, 1}});
    monitors->flush();
  }
  EXPECT_TRUE(names_in(dir.path()).empty());
}

TEST(MonitorMaster, DisabledMonitorsWriteNothing) {
  test::TempDir dir;
  Config config = config_with(block("tensorboard", false, dir.str(), "tb") + ", " +
                              block("csv_monitor", false, dir.str(), "csv") + R"(, "wandb": {"enabled": true})");
  auto monitors = make_monitors(config, 0);
  EXPECT_FALSE(monitors->enabled());  // wandb is accepted with a warning, not written
  monitors->write_events({{"Train/Samples/train_loss", 1.0, 1}});
  EXPECT_TRUE(names_in(dir.path()).empty());
  EXPECT_FALSE(make_monitors(Config{}, 0)->enabled());
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no strata::Error";
  return "";
}

TEST(MonitorErrors, UnwritableOutputPathNamesFolderAndKey) {
  test::TempDir dir;
  fs::path blocker = dir.path() / "not_a_folder";
  std::ofstream(blocker) << "a file where the output folder should go";
  for (const char* name : {"tensorboard", "csv_monitor"}) {
    Config config = config_with(block(name, true, blocker.string(), "job"));
    std::string msg = error_of([&] { make_monitors(config, 0); });
    EXPECT_NE(msg.find("'" + (blocker / "job").string() + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string(name) + ".output_path"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Not a directory"), std::string::npos) << msg;
  }
  // The folder itself is a file.
  std::string msg = error_of([&] { make_monitors(config_with(block("csv_monitor", true, dir.str(), "not_a_folder")), 0); });
  EXPECT_NE(msg.find("'" + blocker.string() + "'"), std::string::npos) << msg;
}

TEST(MonitorErrors, ReadOnlyFolder) {
  if (geteuid() == 0) GTEST_SKIP() << "root writes into read-only folders";
  test::TempDir dir;
  fs::permissions(dir.path(), fs::perms::owner_read | fs::perms::owner_exec);
  std::string msg = error_of([&] { make_monitors(config_with(block("tensorboard", true, dir.str(), "job")), 0); });
  fs::permissions(dir.path(), fs::perms::owner_all);
  EXPECT_NE(msg.find("Permission denied"), std::string::npos) << msg;
}

TEST(MonitorErrors, CsvWriteFailureNamesTheFile) {
  test::TempDir dir;
  CsvMonitor csv(monitor_config(dir.str(), "job"));
  fs::remove_all(dir.path() / "job");  // the folder vanishes under the running job
  std::string msg = error_of([&] { csv.write_events({{"Train/loss", 1.0, 1}}); });
  EXPECT_NE(msg.find("'" + (dir.path() / "job" / "Train_loss.csv").string() + "'"), std::string::npos) << msg;
  // Once the folder is back, the header is still written first.
  fs::create_directories(dir.path() / "job");
  csv.write_events({{"Train/loss", 2.0, 2}});
  EXPECT_EQ(test::slurp_file((dir.path() / "job" / "Train_loss.csv").string()), "step,loss\r\n2,2.0\r\n");
}

}  // namespace
}  // namespace strata::monitor
