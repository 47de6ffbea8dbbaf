#!/usr/bin/env bash
# One call for issue 60: build (or unpack the carried binaries), send the binaries back
# (bin.tgz: carry it as .device/bin.tgz so the next call skips the build), the GPU kernel test,
# then offload.sh (Llama-3.2-3B's shape, ZeRO-3, both offloaded, DeepSpeed then Strata).
set -uo pipefail
START=$(date +%s); export START
nvidia-smi -L; free -g | head -2; df -h /tmp | tail -1
export TARGETS="strata-bench test_fused_layers_gpu train_gpt"
source bench/device/setup.sh || exit 1
(( PREBUILT )) || pack_binaries
timeout 120 /tmp/sb/bin/test_fused_layers_gpu > "$OUT/fused_gpu.log" 2>&1; echo "fused_gpu rc $?"
grep -E "^\[  (PASSED|FAILED) |FAILED \]" "$OUT/fused_gpu.log" | head
B=${B:-4} bash bench/device/offload.sh
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz --exclude bin.tgz . 2>/dev/null
echo "elapsed $(( $(date +%s) - START )) s"
