#!/usr/bin/env bash
# The test command (README, CI): installs and builds as bootstrap.sh does, then runs every
# CTest suite. GPU tests skip cleanly on machines without a GPU.
#   scripts/test.sh [extra ctest arguments, e.g. -L unit]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" --timeout 600 "$@"
