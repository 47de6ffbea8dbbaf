// DeepSpeed's TensorBoardMonitor (deepspeed/monitor/tensorboard.py) over Strata's own event file
// writer instead of torch.utils.tensorboard.SummaryWriter.
#include "runtime/monitor/event_file.h"
#include "runtime/monitor/monitor.h"

namespace strata::monitor {

TensorBoardMonitor::TensorBoardMonitor(const MonitorConfig& config)
    : writer_(std::make_unique<EventFileWriter>(make_log_dir(config, "tensorboard"))) {}

TensorBoardMonitor::~TensorBoardMonitor() = default;  // the writer flushes and closes

void TensorBoardMonitor::write_events(const std::vector<Event>& events) {
  for (const Event& e : events) {
    writer_->add_scalar(e.tag, static_cast<float>(e.value), e.step, wall_time_now());
  }
  writer_->flush();
}

void TensorBoardMonitor::flush() { writer_->flush(); }

const std::filesystem::path& TensorBoardMonitor::event_file() const { return writer_->path(); }

}  // namespace strata::monitor
