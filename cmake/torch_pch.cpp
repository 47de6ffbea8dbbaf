// Compiled once so that strata_torch_pch has its precompiled <torch/torch.h>.
