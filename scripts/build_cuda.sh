#!/usr/bin/env bash
# Builds Strata against the CUDA LibTorch of a pip-installed PyTorch (and its NCCL), for a GPU
# machine without the distribution's -dev packages. Optional DEPS_PREFIX: a folder holding
# Debian packages (liburing, Gloo, libssl-dev and libssl3, and their libraries) unpacked with
# `dpkg -x PKG.deb DEPS_PREFIX`.
#   DEPS_PREFIX=/tmp/deps BUILD_DIR=build-cuda scripts/build_cuda.sh
# STRATA_TARGETS (default all) and STRATA_JOBS (default nproc) choose what and how wide.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
# pip's NCCL (nvidia-nccl-cu*) when present; otherwise CMake looks in the CUDA toolkit.
nccl_home=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
prefix="$torch_prefix"
if [[ -n "${DEPS_PREFIX:-}" ]]; then
  prefix="$prefix;$DEPS_PREFIX/usr"
  export PKG_CONFIG_SYSROOT_DIR="$DEPS_PREFIX"
  export PKG_CONFIG_PATH="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu/pkgconfig:${PKG_CONFIG_PATH:-}"
  export GLOO_HOME="$DEPS_PREFIX/usr"
  export LD_LIBRARY_PATH="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu:$DEPS_PREFIX/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
[[ -n "$nccl_home" ]] && export NCCL_HOME="$nccl_home"
# Strata's kernels need nvcc; CUDA images keep it in /usr/local/cuda/bin, not always on PATH.
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
build_dir="${BUILD_DIR:-build-cuda}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$prefix" \
  ${CMAKE_ARGS:-}
read -r -a targets <<<"${STRATA_TARGETS:-all}"
cmake --build "$build_dir" -j "${STRATA_JOBS:-$(nproc)}" --target "${targets[@]}"
