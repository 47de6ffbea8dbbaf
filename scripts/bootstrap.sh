#!/usr/bin/env bash
# Installs Strata's dependencies on Debian 12 / Ubuntu 24.04 (apt) and builds into build/.
#   scripts/bootstrap.sh            # install what is missing, configure, build
# Environment: BUILD_DIR (default build), CMAKE_ARGS (extra configure arguments, e.g. a CUDA
# LibTorch: -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')),
# STRATA_SKIP_APT=1 to skip the package step, STRATA_APT_ONLY=1 to run only it, STRATA_JOBS (build
# parallelism, default nproc), STRATA_TARGETS (what to build: by default what the main job needs,
# the libraries, train_gpt, strata-run, strata-ckpt and strata-config; "all" for the whole tree
# with the tests and benchmarks, as scripts/test.sh's build stage asks).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage says how long it took (apt's download and install apart from the build).
t_stage=$(date +%s)
took() {
  local now
  now=$(date +%s)
  awk -v s=$((now - t_stage)) -v what="$1" 'BEGIN { printf "bootstrap: %s took %.1f min\n", what, s / 60 }'
  t_stage=$now
}

# libopenblas0-pthread: Debian's libtorch-dev links libblas.so.3 / liblapack.so.3, which without
# it are the netlib reference code (fp32 matrix products ~10x slower on CPU); installing it
# switches both alternatives to OpenBLAS.
packages=(g++ cmake ninja-build ccache lld pkg-config libtorch-dev nlohmann-json3-dev libfmt-dev
          libgtest-dev libgloo-dev liburing-dev libssl-dev libopenblas0-pthread)
if [[ "${STRATA_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "bootstrap: installing ${missing[*]}"
    sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing[@]}"
  fi
  took "apt (update, download, install)"
fi
[[ "${STRATA_APT_ONLY:-0}" == 1 ]] && exit 0

build_dir="${BUILD_DIR:-build}"
# shellcheck disable=SC2086
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}
# The tests are about half of the tree's compile time; the test command builds them.
read -r -a targets <<<"${STRATA_TARGETS:-train_gpt strata-run strata-ckpt strata-config}"
cmake --build "$build_dir" -j "${STRATA_JOBS:-$(nproc)}" --target "${targets[@]}"
took "configure and build (${targets[*]})"

# Which BLAS LibTorch's CPU library actually loads (the engine logs the same at start-up).
torch_lib=$(sed -n 's/^TORCH_LIBRARY:[A-Z]*=//p' "$build_dir/CMakeCache.txt" | head -n1)
torch_cpu="$(dirname "${torch_lib:-/usr/lib/x86_64-linux-gnu/libtorch.so}")/libtorch_cpu.so"
if [[ -e "$torch_cpu" ]]; then
  deps=$(ldd "$torch_cpu" || true)  # whole, then searched: awk's early exit would SIGPIPE ldd
  blas=$(awk '!found && $1 ~ /^libblas|openblas|mkl_rt/ {print $3; found = 1}' <<<"$deps")
  if [[ -n "$blas" ]]; then
    echo "bootstrap: LibTorch's BLAS is $(readlink -f "$blas")"
  else
    echo "bootstrap: LibTorch ($torch_cpu) links no shared BLAS (MKL or its own kernels inside)"
  fi
fi
