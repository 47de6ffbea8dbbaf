#!/usr/bin/env bash
# Activation checkpointing on one GPU (issue 32): dense-1.3B, 8 x 2048 tokens, bf16. The PyTorch
# peer's eager, per-block torch.utils.checkpoint and checkpoint + save_on_cpu runs
# (../shared/bench/peer_torch_gpt.py --checkpoint), then Strata without checkpointing, with every
# block checkpointed (on the device and with cpu_checkpointing) and with selective checkpointing:
# the same config (configs/bench_dense_bf16.json) with only the activation_checkpointing block
# added. Each JSON line gives tok/s and mem_GiB (the caching allocator's peak of allocated bytes;
# Strata's also reserved_GiB); after each command, nvml_peak_GiB gives the most memory NVML saw in
# use on the device while it ran (sampled every 100 ms; the command is alone on the GPU, so this
# is its allocator's reserve, its CUDA context and anything allocated outside the allocator).
# Then the capacity run: the longest sequence (doubling from 4096) dense-1.3B trains at, batch 1,
# checkpoints in host memory, optimizer on the CPU (configs/bench_dense_bf16_ckpt_capacity.json).
#   bench/run_actckpt.sh PEER_SCRIPT [BUILD_DIR] [MAX_SEQ]   (BUILD_DIR default: build; MAX_SEQ 131072)
set -uo pipefail
cd "$(dirname "$0")/.."
peer="$1"
bin="${2:-build}/bin"
max_seq="${3:-131072}"

# Runs a command while sampling NVML's device memory in use; prints the peak after it.
with_nvml() {
  local log
  log=$(mktemp)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$log" 2>/dev/null &
  local sampler=$!
  "$@"
  local rc=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  awk -v rc="$rc" '$1 ~ /^[0-9]+$/ && $1 > m { m = $1 }
       END { printf "{\"nvml_peak_GiB\": %.1f, \"rc\": %d}\n", m / 1024, rc }' "$log"
  rm -f "$log"
  return "$rc"
}

# The peer's three runs of --checkpoint, each in a process of its own so that NVML's peak is its own.
peer_run() {  # NAME CKPT(None|"gpu"|"cpu")
  python3 - "$peer" "$1" "$2" <<'PY'
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import peer_torch_gpt as p
big = dict(V=32000, d=2048, L=24, h=16, f=8192)
ckpt = None if sys.argv[3] == "None" else sys.argv[3]
p.run(sys.argv[2], dict(big, ckpt=ckpt) if ckpt else big, 8, 2048)
PY
}
with_nvml peer_run "dense-1.3B eager" None
with_nvml peer_run "dense-1.3B checkpoint" gpu
with_nvml peer_run "dense-1.3B checkpoint+cpu" cpu
with_nvml "$bin/strata-bench" gpt --config configs/bench_dense_bf16.json --model dense-1.3B
with_nvml "$bin/strata-bench" gpt --config configs/bench_dense_bf16_ckpt.json --model dense-1.3B \
  --activation-checkpointing every
with_nvml "$bin/strata-bench" gpt --config configs/bench_dense_bf16_ckpt_cpu.json --model dense-1.3B \
  --activation-checkpointing every
with_nvml "$bin/strata-bench" gpt --config configs/bench_dense_bf16_ckpt.json --model dense-1.3B \
  --activation-checkpointing selective

seq=4096
while ((seq <= max_seq)); do
  echo "== capacity: dense-1.3B, batch 1, sequence $seq"
  with_nvml "$bin/strata-bench" gpt --config configs/bench_dense_bf16_ckpt_capacity.json \
    --model dense-1.3B --activation-checkpointing every --seq "$seq" --steps 2 --warmup 1 || break
  seq=$((seq * 2))
done
