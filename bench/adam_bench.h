// strata-bench adam: the optimizer step of the partitioned optimizer over a flat parameter
// buffer, fused (Adam::step_flat) against the unfused path it replaces and LibTorch's own AdamW
// (its fused multi-tensor kernel where this LibTorch has one), in one run on one device.
#pragma once

namespace strata::bench {

int run_adam(int argc, char** argv);
// strata-bench cpu-adam: the host tier's CPU Adam against LibTorch's AdamW and a STREAM triad
// (bench/cpu_adam_bench.cpp).
int run_cpu_adam(int argc, char** argv);

}  // namespace strata::bench
