#!/usr/bin/env bash
# One call for issue 61: build (or take .device/bin.tgz when built from this tree), ZenFlow's GPU
# test (the exact step on the device, the overlapped mode training), then PART=speed of
# zenflow.sh (dense-1.3B: Strata without offload / ZeRO-Offload / ZenFlow under the op profile,
# then DeepSpeed's ZeRO-Offload and ZenFlow; PEERS=0 Strata's alone; RUNS picks Strata's).
# CONVERGE=1 then runs Strata's two convergence curves for the time the call has left; all three
# with DeepSpeed's take a call of their own: `... source bench/device/setup.sh; PART=converge
# bash bench/device/zenflow.sh`.
set -uo pipefail
START=$(date +%s); export START
nvidia-smi -L; free -g | head -2; nproc
export TARGETS="strata-bench train_gpt test_engine_zenflow test_host_copy"
source bench/device/setup.sh || exit 1
(( PREBUILT )) || pack_binaries
# The tests one by one, so that a crash names its test; a failure's lines in this output.
for t in test_host_copy test_engine_zenflow; do
  for c in $(/tmp/sb/bin/$t --gtest_list_tests | awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
    timeout 120 /tmp/sb/bin/$t --gtest_filter="$c" > /tmp/one.log 2>&1; rc=$?
    echo "$c rc $rc"; grep -E "^GPU|Skipped" /tmp/one.log | head -3
    (( rc == 0 )) || tail -25 /tmp/one.log
  done
done
PART=speed timeout $(( ${LIMIT:-585} - ($(date +%s) - START) )) bash bench/device/zenflow.sh
# CONVERGE=1: then Strata's exact and ZenFlow curves side by side for what the call has left.
if [[ -n "${CONVERGE:-}" ]]; then
  CONVERGE_S=$(( ${LIMIT:-585} - ($(date +%s) - START) - 10 )) PEERS=0 PART=converge bash bench/device/zenflow.sh
fi
echo "elapsed $(( $(date +%s) - START )) s"
