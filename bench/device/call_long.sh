#!/usr/bin/env bash
# One call for issue 58: bench/run_long.sh at LENGTHS (default 32K 64K 128K 256K), Strata and
# DeepSpeed's ALST each length (SIDES=strata: Strata alone), with the binaries carried in
# .device/bin.tgz (or built, then sent back). GPU_TEST=1 first runs test_fused_layers_gpu (the
# grouped attention's test among them).
set -uo pipefail
START=$(date +%s); export START
nvidia-smi -L; free -g | head -2
export TARGETS="strata-bench test_fused_layers_gpu train_gpt"
source bench/device/setup.sh || exit 1
(( PREBUILT )) || pack_binaries
if [[ -n "${GPU_TEST:-}" ]]; then
  timeout 120 /tmp/sb/bin/test_fused_layers_gpu > "$OUT/fused_gpu.log" 2>&1; echo "fused_gpu rc $?"
  grep -E "^\[  (PASSED|FAILED) |FAILED \]|Failure|Expected|Which is|actual|^attention|^rms_norm" "$OUT/fused_gpu.log" | head -30
fi
export BIN=/tmp/sb/bin TORCH_CUDA_ARCH_LIST=9.0 LLAMA_DIR=/tmp/llama-long STRATA_PEER_DIR=$PWD/.device/peers
mkdir -p "$OUT/long"
left=$(( ${LIMIT:-585} - ($(date +%s) - START) ))
echo "left for the long runs: $left s"
timeout $left bash bench/run_long.sh "$OUT/long" ${LENGTHS:-32768 65536 131072 262144} 2>&1
tar czf "$OUT/long.tgz" -C "$OUT" long && rm -rf "$OUT/long"
echo "elapsed $(( $(date +%s) - START )) s"
