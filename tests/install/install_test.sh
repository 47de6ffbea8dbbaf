#!/usr/bin/env bash
# Strata as an installed library (CTest, label slow):
#   1. cmake --install BUILD into a fresh prefix, and list what it holds: the four tools and no
#      test binaries; headers: <strata/strata.h>, strata/version.h and only the Strata headers
#      they reach;
#   2. configure and build tests/install/consumer (a plain LibTorch model, a config, the README's
#      ten lines) with find_package(Strata) and nothing else of Strata, then run it for 20 steps
#      and see the loss fall;
#   3. configure (only: no second build of Strata) the same project through add_subdirectory.
# usage: install_test.sh SOURCE_DIR BUILD_DIR WORK_DIR CMAKE GENERATOR CXX_COMPILER [LAUNCHER]
# Exit 77 (CTest: skipped) only when a prerequisite is missing.
set -euo pipefail
src=$1 build=$2 work=$3 cmake=$4 generator=$5 cxx=$6 launcher=${7:-}

skip() { echo "SKIP: $*"; exit 77; }
[[ -x "$cmake" ]] || skip "no cmake at $cmake"
command -v "$cxx" >/dev/null 2>&1 || skip "no C++ compiler $cxx"
[[ -x "$build/bin/train_gpt" ]] || skip "$build is not built (no bin/train_gpt)"

# A fixed work folder under the build: the consumer's compile commands are the same each run, so
# ccache serves them after the first.
prefix=$work/prefix
rm -rf "$prefix"
mkdir -p "$work"
t0=$SECONDS
"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log"
echo "installed into $prefix in $((SECONDS - t0)) s:"
(cd "$prefix" && find . -type f | sort | sed 's|^\./|  |')

fail() { echo "FAIL: $*"; exit 1; }
# The tools, and nothing else, in bin/.
tools=$(cd "$prefix/bin" && ls | sort | tr '\n' ' ')
[[ "$tools" == "strata-ckpt strata-config strata-run train_gpt " ]] || fail "bin/ holds: $tools"
# No test binaries or test sources anywhere.
if found=$(cd "$prefix" && find . -type f \( -name '*test*' -o -name '*gtest*' \) | grep .); then
  fail "the installed tree holds test files: $found"
fi
# Every installed header is reached from <strata/strata.h> or <strata/models.h> through quoted
# includes.
inc=$prefix/include
declare -A reached=()
todo=("strata/strata.h" "strata/models.h")
while ((${#todo[@]})); do
  h=${todo[0]}; todo=("${todo[@]:1}")
  [[ -n "${reached[$h]:-}" ]] && continue
  reached[$h]=1
  file=$inc/$h
  [[ -f "$file" ]] || file=$inc/strata/$h
  [[ -f "$file" ]] || fail "$h is included but not installed"
  while read -r dep; do
    if [[ -f "$inc/$dep" ]]; then todo+=("$dep"); else todo+=("strata/$dep"); fi
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$file")
done
while read -r h; do
  [[ -n "${reached[$h]:-}" ]] || fail "include/$h is installed but neither <strata/strata.h> nor <strata/models.h> needs it"
done < <(cd "$inc" && find . -type f | sed 's|^\./||')
echo "installed tree: ${#reached[@]} headers, all reached from <strata/strata.h> and <strata/models.h>; tools: $tools"
[[ -f "$prefix/lib/cmake/Strata/StrataConfig.cmake" || -f "$prefix/lib64/cmake/Strata/StrataConfig.cmake" ]] ||
  fail "no StrataConfig.cmake"

# The consumer, with find_package(Strata) only (its CMAKE_PREFIX_PATH is the prefix alone).
args=(-G "$generator" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx")
[[ -n "$launcher" ]] && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher")
t0=$SECONDS
rm -rf "$work/consumer"
"$cmake" -S "$src/tests/install/consumer" -B "$work/consumer" "${args[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix" >"$work/consumer-configure.log" 2>&1 ||
  { cat "$work/consumer-configure.log"; fail "configuring the consumer failed"; }
"$cmake" --build "$work/consumer" -j 2 ||
  fail "building the consumer against the installed Strata failed"
echo "consumer configured and built against the install in $((SECONDS - t0)) s"
"$work/consumer/consumer" "$src/tests/install/consumer/config.json" ||
  fail "the consumer did not train (exit $?)"

# The add_subdirectory route: configure and generate only (a build would compile Strata again),
# with the prefixes Strata's own build was given (where Torch is, for a pip LibTorch).
t0=$SECONDS
rm -rf "$work/consumer-subdir"
prefix_path=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$build/CMakeCache.txt" | head -n1)
"$cmake" -S "$src/tests/install/consumer" -B "$work/consumer-subdir" "${args[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix_path" -DSTRATA_SOURCE_DIR="$src" >"$work/consumer-subdir.log" 2>&1 ||
  { cat "$work/consumer-subdir.log"; fail "configuring the consumer with add_subdirectory failed"; }
echo "add_subdirectory route configured and generated in $((SECONDS - t0)) s"
echo "PASS"
