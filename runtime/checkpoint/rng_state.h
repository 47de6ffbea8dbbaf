// Each rank's random generators in its checkpoint (Hugging Face's Trainer saves rng_state_N.pth
// the same way): LibTorch's default CPU generator and each CUDA device's, so that a model that
// draws random numbers (dropout) resumes bit for bit at the same world size.
#pragma once

#include <string>

#include "runtime/checkpoint/tensor_file.h"

namespace strata::checkpoint {

// The checkpoint kind of the generator states: one partition file per rank.
constexpr const char* kRngStatesKind = "rng_states";

// This process's generator states: "cpu", and "cuda.<i>" for each CUDA device of this build.
NamedTensors capture_rng_states();

// Sets this process's generators from `saved` (what capture_rng_states returned). A state this
// process has no generator for (a CUDA device it lacks), or a generator the file has no state
// for, is left as it is and named in the returned text (empty when everything was restored).
std::string restore_rng_states(const TensorFile& saved);

}  // namespace strata::checkpoint
