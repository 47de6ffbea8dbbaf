#!/usr/bin/env bash
# Sourced by bench/device/*.sh: unpacks the carried .debs into /tmp/deps, installs carried wheels,
# builds $TARGETS into /tmp/sb (scripts/build_cuda.sh).
set -uo pipefail
export DEPS_PREFIX=/tmp/deps BUILD_DIR=/tmp/sb
if [[ ! -d /tmp/deps/usr ]]; then for d in .debs/*.deb; do dpkg -x "$d" /tmp/deps; done; fi
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c 'import deepspeed' 2>/dev/null; then
  python3 -m pip install --no-deps --no-index .whl/*.whl > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
fi
t0=$(date +%s)
STRATA_TARGETS="$TARGETS" STRATA_JOBS=15 scripts/build_cuda.sh > "$OUT/build.log" 2>&1 || { echo BUILD FAILED; grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
