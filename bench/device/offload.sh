#!/usr/bin/env bash
# Issue 60: Llama-3.2-3B's shape at ZeRO-3 with parameters and optimizer in host memory, Hugging
# Face + DeepSpeed (bench/peer_hf.py --stage 3 --offload cpu --offload-param, saves the initial
# weights and batch) and strata-bench hf from them (configs/bench_hf_zero3_offload.json with the
# micro-batch set to B), batch B x 2048 (B default 4), 10 timed steps after 3 of warm-up; each
# side's host RSS peak (getrusage of the child) and the machine's least free memory (sampled).
# Needs strata-bench built in /tmp/sb (setup.sh) and DeepSpeed installed.
set -uo pipefail
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29518
export STRATA_PEER_DIR=$PWD/.device/peers TORCH_CUDA_ARCH_LIST=9.0
B=${B:-4}; STEPS=${STEPS:-10}; ARCH=${ARCH:-llama-3b}; DIR=/tmp/${ARCH}
rss() {
  python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
print("host_peak_rss_kb", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)
sys.exit(rc)' "$@"
}
python3 -c "import json,sys; c=json.load(open('configs/bench_hf_zero3_offload.json')); c['train_micro_batch_size_per_gpu']=$B; json.dump(c, open('/tmp/z3off_B$B.json','w'))"
if [[ -z "${SKIP_PEER:-}" ]]; then
  rss python3 bench/peer_hf.py --arch "$ARCH" --stage 3 --offload cpu --offload-param --B "$B" \
    --steps "$STEPS" --log-losses --save "$DIR" > "$OUT/peer_${ARCH}_z3off_B$B.log" 2>&1
  echo "peer rc $?"; grep -E '^\{|host_peak_rss' "$OUT/peer_${ARCH}_z3off_B$B.log"
fi
src="$DIR"; [[ -f "$DIR/config.json" ]] || src="bench/device/${ARCH}.json"
batch=(); [[ -f "$DIR/batch.bin" ]] && batch=(--batch "$DIR/batch.bin")
rss /tmp/sb/bin/strata-bench hf --hf-model "$src" --config /tmp/z3off_B$B.json \
  "${batch[@]}" --B "$B" --steps "$STEPS" > "$OUT/strata_${ARCH}_z3off_B$B.log" 2>&1
echo "strata rc $?"; grep -E '^\{|host_peak_rss' "$OUT/strata_${ARCH}_z3off_B$B.log"
