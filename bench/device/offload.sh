#!/usr/bin/env bash
# Issue 60: Llama-3.2-3B's shape at ZeRO-3 with parameters and optimizer in host memory, Hugging
# Face + DeepSpeed (bench/peer_hf.py --stage 3 --offload cpu --offload-param, saves the initial
# weights and batch) and strata-bench hf from them (configs/bench_hf_zero3_offload.json), batch
# B x 2048 (B default 4), 10 timed steps after 3 of warm-up; each side's host RSS peak (getrusage
# of the child).
# Needs strata-bench built in /tmp/sb (setup.sh) and DeepSpeed installed.
set -uo pipefail
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29518
export STRATA_PEER_DIR=$PWD/.device/peers TORCH_CUDA_ARCH_LIST=9.0
B=${B:-4}
rss() {
  python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
print("host_peak_rss_kb", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)
sys.exit(rc)' "$@"
}
rss python3 bench/peer_hf.py --arch llama-3b --stage 3 --offload cpu --offload-param --B "$B" \
  --steps 10 --log-losses --save /tmp/l3b > "$OUT/peer_llama3b_z3off.log" 2>&1
echo "peer rc $?"; grep -E '^\{|host_peak_rss' "$OUT/peer_llama3b_z3off.log"
rss /tmp/sb/bin/strata-bench hf --hf-model /tmp/l3b --config configs/bench_hf_zero3_offload.json \
  --batch /tmp/l3b/batch.bin --B "$B" --steps 10 > "$OUT/strata_llama3b_z3off.log" 2>&1
echo "strata rc $?"; grep -E '^\{|host_peak_rss' "$OUT/strata_llama3b_z3off.log"
