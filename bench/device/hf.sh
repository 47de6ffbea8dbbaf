#!/usr/bin/env bash
# Issue 59: the peer (bench/peer_hf.py, saves weights + batch) and strata-bench hf from them;
# PEERS="q4 ds q4ds" adds Qwen3-MoE (4 layers), DeepSpeed ZeRO-2 on Llama and on that Qwen3-MoE
# (after q4, which saves its weights); AB=1 the A/B variants.
set -uo pipefail
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517
export STRATA_PEER_DIR=$PWD/.device/peers TORCH_CUDA_ARCH_LIST=9.0
START=${START:-$(date +%s)}; LIMIT=${LIMIT:-590}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
B=/tmp/sb/bin/strata-bench
run() {  # run NAME NEED_S CMD...
  local name=$1 need=$2; shift 2
  if (( $(left) < need )); then echo "skip $name (left $(left) s)"; return; fi
  timeout $(( $(left) - 5 )) "$@" > "$OUT/$name.log" 2>&1; echo "$name rc $?"
  grep -E '^\{' "$OUT/$name.log" | tail -2 || true
  grep -E "tok/s|tokens/s|peak|loss" "$OUT/$name.log" | tail -4 || true
}
if [[ ! -f /tmp/l1b/config.json ]]; then
  run peer_llama_plain 60 python3 bench/peer_hf.py --arch llama-1b --plain --steps 20 --log-losses --save /tmp/l1b
fi
run strata_llama 60 $B hf --hf-model /tmp/l1b --config configs/bench_hf_bf16.json --batch /tmp/l1b/batch.bin --steps 20 --profile 2
[[ -n "${AB:-}" ]] && run strata_llama_nofuse 40 $B hf --hf-model /tmp/l1b --config configs/bench_hf_bf16.json --batch /tmp/l1b/batch.bin --steps 10 --fused-projections 0
[[ -n "${AB:-}" ]] && run strata_llama_nogqa 40 $B hf --hf-model /tmp/l1b --config configs/bench_hf_bf16.json --batch /tmp/l1b/batch.bin --steps 10 --sdpa-gqa 0
for p in ${PEERS:-}; do case $p in
  ds) run peer_llama_ds 90 python3 bench/peer_hf.py --arch llama-1b --stage 2 --steps 20 --log-losses --load /tmp/l1b ;;
  q4) [[ -f /tmp/q4/config.json ]] || run peer_qwen_plain 90 python3 bench/peer_hf.py --arch qwen3-moe --layers 4 --plain --steps 20 --log-losses --save /tmp/q4
      run strata_qwen 60 $B hf --hf-model /tmp/q4 --config configs/bench_hf_bf16.json --batch /tmp/q4/batch.bin --steps 20 --profile 2 ;;
  q4ds) run peer_qwen_ds 120 python3 bench/peer_hf.py --arch qwen3-moe --layers 4 --stage 2 --steps 20 --log-losses --load /tmp/q4 ;;
esac; done
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
echo "elapsed $(( $(date +%s) - START )) s"
