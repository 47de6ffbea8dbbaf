#!/usr/bin/env bash
# One call for issue 61: build (or take .device/bin.tgz when built from this tree), ZenFlow's GPU
# test (the exact step on the device, the overlapped mode training), then PART=speed of
# zenflow.sh (dense-1.3B: Strata without offload / ZeRO-Offload / ZenFlow under the op profile,
# then DeepSpeed's ZeRO-Offload and ZenFlow; PEERS=0 Strata's alone). PART=converge belongs to
# a call of its own: `... source bench/device/setup.sh; PART=converge bash bench/device/zenflow.sh`.
set -uo pipefail
START=$(date +%s); export START
nvidia-smi -L; free -g | head -2; nproc
export TARGETS="strata-bench train_gpt test_engine_zenflow"
source bench/device/setup.sh || exit 1
(( PREBUILT )) || pack_binaries
timeout 120 /tmp/sb/bin/test_engine_zenflow > "$OUT/zenflow_test.log" 2>&1; echo "test_engine_zenflow rc $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|actual" "$OUT/zenflow_test.log" | head -20
PART=speed timeout $(( ${LIMIT:-585} - ($(date +%s) - START) )) bash bench/device/zenflow.sh
echo "elapsed $(( $(date +%s) - START )) s"
