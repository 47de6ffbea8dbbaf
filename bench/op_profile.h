// strata-bench --profile: where a step's GPU time goes, op by op, without a profiler library:
// a RecordFunction callback records a CUDA event pair around every dispatched op and autograd
// node (forward ops, scope FUNCTION; backward nodes, BACKWARD_FUNCTION) on the op's stream, and
// print() sums the elapsed times by name. Times are inclusive (aten::linear holds its
// aten::addmm) and ops on other streams (NCCL) are not seen. GPU builds only; elsewhere it does
// nothing.
#pragma once

#include <memory>

namespace strata::bench {

class OpProfile {
 public:
  OpProfile();  // starts recording
  ~OpProfile();
  // Registers the callback again, so that it runs after every op callback registered since (the
  // global callbacks run in registration order): an op that an offloaded step's weight arrival
  // (zero/weight_arrival.h) holds on the host is then timed from when it is released, and the
  // wait counts as idle. Call it after each engine step.
  void reattach();
  // Stops recording, waits for the device, prints the `top` names by total time (ms) per step.
  // Given the wall time the profiled steps took (ms, device synchronized at both ends), also
  // prints and returns the share of it the GPU ran none of the recorded ops: the union of the
  // ops' intervals is the time it was busy (ops on other streams, NCCL's and the offloaded
  // step's copies, are not counted as work). Returns -1 where there is no GPU.
  double print(int top, int steps, double wall_ms = 0);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace strata::bench
