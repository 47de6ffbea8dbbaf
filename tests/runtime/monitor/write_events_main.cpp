// monitor_write_events OUTPUT_PATH JOB_NAME: writes a few scalars through the TensorBoard
// monitor and prints each as "tag<TAB>value<TAB>step" for read_events.py to compare.
#include <cstdio>
#include <exception>

#include "runtime/monitor/monitor.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s OUTPUT_PATH JOB_NAME\n", argv[0]);
    return 2;
  }
  try {
    strata::MonitorConfig config;
    config.enabled = true;
    config.output_path = argv[1];
    config.job_name = argv[2];
    strata::monitor::TensorBoardMonitor tb(config);
    std::vector<strata::monitor::Event> written;
    for (int64_t i = 0; i < 5; ++i) {
      int64_t step = i * 8;
      std::vector<strata::monitor::Event> events = {{"Train/Samples/train_loss", 4.0 / (1 + i), step},
                                                    {"Train/Samples/lr", 1e-4 * i, step}};
      tb.write_events(events);
      written.insert(written.end(), events.begin(), events.end());
    }
    tb.write_events({{"Train/Samples/loss_scale", 65536.0, int64_t(1) << 40}});
    written.push_back({"Train/Samples/loss_scale", 65536.0, int64_t(1) << 40});
    for (const auto& e : written) std::printf("%s\t%.17g\t%lld\n", e.tag.c_str(), e.value, static_cast<long long>(e.step));
    std::printf("file\t%s\n", tb.event_file().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
