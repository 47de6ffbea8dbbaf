// strata-bench adam: the optimizer step of the partitioned optimizer over a flat parameter
// buffer, fused (Adam::step_flat) against the unfused path it replaces and LibTorch's own AdamW
// (its fused multi-tensor kernel where this LibTorch has one), in one run on one device.
#pragma once

namespace strata::bench {

int run_adam(int argc, char** argv);

}  // namespace strata::bench
