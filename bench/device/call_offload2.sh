#!/usr/bin/env bash
# Issue 60, second call: the 3B pair (offload.sh, B=4), then Llama-3.1-8B's shape (random init from
# bench/device/llama-8b.json), Strata alone, ZeRO-3 with both offloaded, with what is left of
# LIMIT s; a watchdog ends the 8B run if the machine's available memory falls under 1.5 GiB (it
# does not fit) and says so. CONFIG8 names the 8B run's config (default: both in host memory, 16
# bytes per parameter there; configs/bench_hf_zero3_param_nvme.json keeps the weights on NVMe, 14;
# configs/bench_hf_zero3_optimizer_split.json keeps 6e9 elements of the optimizer in host memory
# and the rest on NVMe, offload_optimizer.max_in_cpu: ~4 + 9 bytes per parameter in host for 8B).
set -uo pipefail
START=$(date +%s); export START
nvidia-smi -L; free -g | head -2; df -h /tmp | tail -1
export TARGETS="strata-bench test_fused_layers_gpu train_gpt"
source bench/device/setup.sh || exit 1
(vmstat -S M 5 > "$OUT/vmstat.log" 2>&1 &)
B=4 bash bench/device/offload.sh
left=$(( ${LIMIT:-585} - ($(date +%s) - START) ))
echo "left for 8B: $left s"
if (( left > 120 )); then
  ( while sleep 1; do a=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
      if (( a < 1572864 )); then echo "WATCHDOG: MemAvailable ${a} kB: ending the 8B run"; pkill -9 -f "strata-bench hf"; fi
    done ) > "$OUT/watchdog.log" 2>&1 &
  wd=$!
  export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  mkdir -p /tmp/strata-nvme
  python3 -c "import json; c=json.load(open('${CONFIG8:-configs/bench_hf_zero3_offload.json}')); c['train_micro_batch_size_per_gpu']=${B8:-2}; json.dump(c, open('/tmp/z3off_8b.json','w'))"
  timeout $(( left - 10 )) python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
print("host_peak_rss_kb", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)
sys.exit(rc)' /tmp/sb/bin/strata-bench hf --hf-model bench/device/llama-8b.json --config /tmp/z3off_8b.json \
    --B "${B8:-2}" --warmup 2 --steps "${S8:-18}" > "$OUT/strata_llama8b.log" 2>&1
  echo "8b rc $?"; grep -E '^\{|host_peak_rss|rror' "$OUT/strata_llama8b.log" | tail -5; cat "$OUT/watchdog.log"
  kill $wd
fi
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz --exclude bin.tgz . 2>/dev/null
echo "elapsed $(( $(date +%s) - START )) s"
