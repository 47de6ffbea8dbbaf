#!/usr/bin/env bash
# A check of the long-sequence layout on a GPU, Strata alone: build, the GPU kernel tests (the
# grouped attention's among them), then bench/run_long.sh's Strata side at LENGTHS (default 128K
# and 256K) with what is left of LIMIT s. ALST's side is the full call's (call_long.sh).
set -uo pipefail
START=$(date +%s); export START
nvidia-smi -L; free -g | head -2
export TARGETS="strata-bench test_fused_layers_gpu train_gpt"
source bench/device/setup.sh || exit 1
(( PREBUILT )) || pack_binaries
timeout 120 /tmp/sb/bin/test_fused_layers_gpu > "$OUT/fused_gpu.log" 2>&1; echo "fused_gpu rc $?"
grep -E "^\[  (PASSED|FAILED) |FAILED \]|Failure|Expected|Which is|actual|^attention|^rms_norm" "$OUT/fused_gpu.log" | head -30
export BIN=/tmp/sb/bin TORCH_CUDA_ARCH_LIST=9.0 LLAMA_DIR=/tmp/llama-long
mkdir -p "$OUT/long"
left=$(( ${LIMIT:-585} - ($(date +%s) - START) ))
echo "left for the long runs: $left s"
SIDES=strata timeout $left bash bench/run_long.sh "$OUT/long" ${LENGTHS:-131072 262144} 2>&1
tar czf "$OUT/long.tgz" -C "$OUT" long && rm -rf "$OUT/long"
echo "elapsed $(( $(date +%s) - START )) s"
