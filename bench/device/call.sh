#!/usr/bin/env bash
# One call: build, GPU kernel test, issue 59's runs (hf.sh, up to B_LIMIT s from the start), then
# issue 58's long runs (LENGTHS) with what is left of 585 s.
set -uo pipefail
START=$(date +%s); export START
nvidia-smi -L
export TARGETS="strata-bench test_fused_layers_gpu train_gpt"
source bench/device/setup.sh || exit 1
timeout 120 /tmp/sb/bin/test_fused_layers_gpu > "$OUT/fused_gpu.log" 2>&1; echo "fused_gpu rc $?"
grep -E "^\[  (PASSED|FAILED) |FAILED \]|Failure|Expected|Which is|actual|^rms_norm" "$OUT/fused_gpu.log" | head -30
LIMIT=${B_LIMIT:-400} bash bench/device/hf.sh 2>&1 | grep -v '^{' | grep -v "^\[strata\]"
for f in "$OUT"/strata_*.log "$OUT"/peer_*.log; do grep -h '^{' "$f" | tail -1 | python3 -c "
import json,sys
d=json.loads(sys.stdin.readline()); print(d['name'], 'tok_s', round(d['tok_s']), 'step_ms', round(d['step_ms'],1), 'mem', round(d['mem_GiB'],2), 'tflops', round(d['tflops'],1), 'idle', d.get('gpu_idle_share'), 'losses', [round(x,4) for x in d['losses']])"; done
left=$(( 585 - ($(date +%s) - START) ))
echo "left for long runs: $left s"
if (( left > 120 )); then
  export BIN=/tmp/sb/bin TORCH_CUDA_ARCH_LIST=9.0 LLAMA_DIR=/tmp/llama-long STRATA_PEER_DIR=$PWD/.device/peers
  mkdir -p "$OUT/long"
  timeout $left bash bench/run_long.sh "$OUT/long" ${LENGTHS:-32768 65536} 2>&1 | tail -20
  tar czf "$OUT/long.tgz" -C "$OUT" long && rm -rf "$OUT/long"
fi
rm -f "$OUT"/logs.tgz; tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz --exclude long.tgz . 2>/dev/null
echo "elapsed $(( $(date +%s) - START )) s"
