#!/usr/bin/env bash
# Sourced by bench/device/*.sh: unpacks the carried .debs into /tmp/deps, installs carried wheels,
# builds $TARGETS into /tmp/sb (scripts/build_cuda.sh) -- or, when .device/bin.tgz (written by
# an earlier call's `pack_binaries`, carried back) was built from this very source tree (the
# stamp below), unpacks those binaries instead: a fresh machine then starts in seconds, not the
# build's two minutes. ANY_PREBUILT=1 takes them whatever they were built from (a run the source
# changes since do not touch; say which commit built them).
set -uo pipefail
export DEPS_PREFIX=/tmp/deps BUILD_DIR=/tmp/sb
if [[ ! -d /tmp/deps/usr ]]; then for d in .debs/*.deb; do dpkg -x "$d" /tmp/deps; done; fi
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c 'import deepspeed' 2>/dev/null; then
  python3 -m pip install --no-deps --no-index .whl/*.whl > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
fi
# What the binaries are built from: every source and build file of the tree.
source_stamp() {
  find . -path ./.git -prune -o -path ./.device -prune -o -path ./build -prune -o -type f \
    \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name CMakeLists.txt \
       -o -name '*.cmake' \) -print | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-16
}
pack_binaries() {  # the built binaries back to this machine, for the next call to carry
  mkdir -p /tmp/pack/bin && for t in $TARGETS; do strip -o /tmp/pack/bin/$t /tmp/sb/bin/$t; done
  source_stamp > /tmp/pack/stamp && tar czf "$OUT/bin.tgz" -C /tmp/pack bin stamp && ls -la "$OUT/bin.tgz"
}
have_prebuilt() { local t; for t in $TARGETS; do [[ -x /tmp/pre/bin/$t ]] || return 1; done; }
t0=$(date +%s)
if [[ -f .device/bin.tgz ]] && mkdir -p /tmp/pre && tar xzf .device/bin.tgz -C /tmp/pre \
   && { [[ "$(cat /tmp/pre/stamp)" == "$(source_stamp)" ]] || [[ -n "${ANY_PREBUILT:-}" ]]; } \
   && have_prebuilt; then
  mkdir -p /tmp/sb/bin && cp /tmp/pre/bin/* /tmp/sb/bin/ && echo "prebuilt binaries (stamp $(cat /tmp/pre/stamp))"
  PREBUILT=1
else
  STRATA_TARGETS="$TARGETS" STRATA_JOBS=15 scripts/build_cuda.sh > "$OUT/build.log" 2>&1 || { echo BUILD FAILED; grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  echo "build $(( $(date +%s) - t0 )) s"
  PREBUILT=0
fi
