// strata-rendezvous-bench: how long init_process_group takes on this rank (the rendezvous: store
// start or connection, authentication, every rank's arrival). Run it under strata-run; each rank
// prints "rendezvous_ms RANK MS" and a driver takes the slowest rank of each run
// (bench/rendezvous.sh compares two builds back to back).
#include <chrono>
#include <cstdio>

#include "comm/process_group.h"

int main() {
  const auto start = std::chrono::steady_clock::now();
  auto world = strata::comm::init_process_group();
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start).count();
  std::printf("rendezvous_ms %d %.3f\n", world->rank(), ms);
  return 0;
}
