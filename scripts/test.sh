#!/usr/bin/env bash
# The test command (README; CI's .ci/run runs exactly it). It runs stages, each timed; the minutes
# each took are printed as it ends and again in a table at the end:
#   apt         install what is missing (scripts/bootstrap.sh's package step)
#   asan-build  build-asan/: the whole tree under AddressSanitizer + UndefinedBehaviorSanitizer
#               (RelWithDebInfo keeping NDEBUG, at -O0 -g1: a translation unit compiles in the time
#               of the Release build's, where -O1 took 1.4x as long; a unity build, see
#               configure_sanitized)
#   asan-suite  every CTest suite in build-asan/ (the GPU suites are not built there); the
#               exhaustive fuzz loops take every 7th case and the chaos test 2 seeds per stage
#               there (tests/sanitized.h)
# and, when asked for (STRATA_TEST_STAGES):
#   tsan-build  build-tsan/: ThreadSanitizer over the code of Strata's own threads: comm (Gloo's
#               worker, liveness, the store), the launcher (its pumps, strata-run) and the NVMe
#               store with the optimizer swapper (io_uring workers, pipelined tiles): their test
#               binaries and strata-run ("tsan" in STRATA_TEST_STAGES; about 3 minutes cold on
#               2 cores, which would leave the test command no margin under the 35 minutes it is
#               held to there, hence not a default stage)
#   tsan-suite  their CTest suites (label tsan; scripts/sanitizers/tsan.supp says what is
#               suppressed and why)
#   build       build/ in Release, as scripts/bootstrap.sh configures it, every target
#   suite       every CTest suite in build/
# The suite runs once, in the sanitized build: two full builds of the tree do not fit CI's budget
# (2 cores: a cold build is about 30 minutes), and the sanitized one runs the same tests with
# every heap access, leak and undefined behaviour checked.
#
#   scripts/test.sh [extra ctest arguments, e.g. -L unit]   # they apply to every suite
# Environment: STRATA_TEST_STAGES (default "apt asan"; "apt asan tsan" adds ThreadSanitizer;
# "build suite" for the Release suite in build/, every fuzz case and chaos seed included),
# BUILD_DIR (default build), ASAN_BUILD_DIR (build-asan), TSAN_BUILD_DIR (build-tsan),
# STRATA_JOBS (build and ctest parallelism, default nproc). A failed build skips its suite; a
# failed suite does not stop the next stages; the exit status is that of the first stage that
# failed.
set -uo pipefail
cd "$(dirname "$0")/.."

stages=" ${STRATA_TEST_STAGES:-apt asan} "
jobs=${STRATA_JOBS:-$(nproc)}
build_dir=${BUILD_DIR:-build}
asan_dir=${ASAN_BUILD_DIR:-build-asan}
tsan_dir=${TSAN_BUILD_DIR:-build-tsan}
ctest_args=("$@")

declare -a table=()
status=0
t_all=$(date +%s)

minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }
# stage NAME COMMAND...: runs it, prints and records its minutes and its exit status.
stage() {
  local name=$1
  shift
  echo "=== test.sh: $name"
  local t0 rc
  t0=$(date +%s)
  "$@"
  rc=$?
  local took=$(($(date +%s) - t0))
  echo "=== test.sh: $name took $(minutes "$took") min (exit $rc)"
  table+=("$(printf '%-11s %5s min  %s' "$name" "$(minutes "$took")" \
               "$([[ $rc == 0 ]] && echo ok || echo "FAILED (exit $rc)")")")
  ((rc != 0 && status == 0)) && status=$rc
  return "$rc"
}
want() { [[ "$stages" == *" $1 "* ]]; }

run_ctest() {  # run_ctest DIR [ctest arguments]
  local dir=$1
  shift
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" --timeout 600 "$@" "${ctest_args[@]}"
}

# ThreadSanitizer's scope (the suites labelled tsan): comm's tests (Gloo, the store, liveness, a
# rank's threads), the launcher's with strata-run, and the NVMe store's and optimizer swapper's
# (torch-free). Left out: test_launcher_ssh (it needs train_gpt, the whole engine) and the
# engine's threads (the CPU Adam's, weight arrival's), which run inside LibTorch: not instrumented.
tsan_targets=(test_comm_unit test_comm_multirank test_launcher_parts test_worker_pool
              test_launcher_run strata-run test_nvme_store test_optimizer_swapper)
plain_build() {
  STRATA_SKIP_APT=1 BUILD_DIR="$build_dir" STRATA_JOBS="$jobs" STRATA_TARGETS=all scripts/bootstrap.sh
}
# Unity builds (CMake's, every source of a target in one translation unit): each translation
# unit that includes LibTorch pays ~5 s to load the precompiled header and instantiates and emits
# the same templates and inline functions again; four of zero/'s files compile in 16 s of CPU
# together, 40 s apart, and strata_runtime's two batches of 8 in 37 s as one, 54 s as two. Only
# here: an edit rebuilds a whole target, so the Release build a developer iterates on has none.
configure_sanitized() {  # configure_sanitized DIR SANITIZERS
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 -g1 -DNDEBUG" -DSTRATA_SANITIZE="$2" \
    -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=0 >/dev/null
}
asan_build() {
  configure_sanitized "$asan_dir" address,undefined && cmake --build "$asan_dir" -j "$jobs"
}
tsan_build() {
  configure_sanitized "$tsan_dir" thread &&
    cmake --build "$tsan_dir" -j "$jobs" --target "${tsan_targets[@]}"
}
tsan_suite() (
  # shellcheck source=sanitizers/env.sh
  source scripts/sanitizers/env.sh
  # Label tsan marks the suites of tsan_targets (tests/comm, tests/launcher, tests/offload); the
  # tree's other suites are not built there.
  run_ctest "$tsan_dir" -L tsan
)
sanitized_suite() (  # sanitized_suite DIR [ctest arguments]: with the sanitizers' runtime options
  # shellcheck source=sanitizers/env.sh
  source scripts/sanitizers/env.sh
  # LeakSanitizer stops the process's threads with ptrace; where a container forbids that it
  # cannot run at all, and every test would fail for it: say so and check the rest.
  if ! "$1/bin/strata-config" --version >/dev/null 2>&1; then
    echo "test.sh: LeakSanitizer cannot run on this machine (no ptrace); leaks are not checked"
    export ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0"
  fi
  run_ctest "$@"
)

want apt && stage apt env STRATA_APT_ONLY=1 scripts/bootstrap.sh
if want build; then
  stage build plain_build && { want suite && stage suite run_ctest "$build_dir"; }
elif want suite; then
  stage suite run_ctest "$build_dir"
fi
if want asan; then
  stage asan-build asan_build && stage asan-suite sanitized_suite "$asan_dir"
fi
if want tsan; then
  stage tsan-build tsan_build && stage tsan-suite tsan_suite
fi

echo "=== test.sh: minutes per stage"
printf '  %s\n' "${table[@]}"
echo "  total       $(minutes $(($(date +%s) - t_all))) min"
exit "$status"
