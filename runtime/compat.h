// Differences between LibTorch 1.13 (Debian's libtorch-dev, CPU) and LibTorch 2.x live here and
// nowhere else.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#define STRATA_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
