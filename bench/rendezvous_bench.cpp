// strata-rendezvous-bench: how long the rendezvous (init_process_group: store start or
// connection, authentication, every rank's arrival) takes. Run it under strata-run; each rank
// prints "rendezvous RANK ENTER_US LEAVE_US MS": the steady clock (one per machine) when it
// entered and left init_process_group, and the difference. bench/rendezvous.sh takes, per run,
// the last leave minus the last entry (the rendezvous once every rank has come, which process
// start-up skew does not blur) and the slowest rank's MS.
#include <chrono>
#include <cstdio>

#include "comm/process_group.h"

int main() {
  using Clock = std::chrono::steady_clock;
  auto us = [](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  };
  const auto enter = Clock::now();
  auto world = strata::comm::init_process_group();
  const auto leave = Clock::now();
  std::printf("rendezvous %d %lld %lld %.3f\n", world->rank(), static_cast<long long>(us(enter)),
              static_cast<long long>(us(leave)),
              std::chrono::duration<double, std::milli>(leave - enter).count());
  std::fflush(stdout);
  world->barrier();  // nobody leaves while another still connects (not measured)
  return 0;
}
