#!/usr/bin/env bash
# Issue 61 on one GPU. PART=speed: dense-1.3B (batch 8 x 2048, bf16, 10 timed steps after 3 of
# warm-up), back to back: Strata without offload (ZeRO-2 on one GPU), with the optimizer on the CPU
# (ZeRO-Offload), in ZenFlow mode (configs/bench_dense_bf16_zero2_zenflow.json: topk_ratio 0.1,
# update_interval 4, overlap_step), DeepSpeed's ZeRO-Offload and DeepSpeed's ZenFlow with the same
# block (PEERS=0: Strata's three alone). PART=converge: dense-350M, bf16, STEPS (1000) steps of B x T (8 x 512) on the Python
# standard library's .py files concatenated (byte-level), exact ZeRO-Offload mode, ZenFlow mode
# and DeepSpeed's ZenFlow side by side, each step's loss in $OUT. Needs strata-bench and train_gpt (setup.sh).
set -uo pipefail
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29519
export TORCH_CUDA_ARCH_LIST=9.0
peer=$PWD/.device/peers/peer_deepspeed_gpt.py
zf='zenflow={"topk_ratio":0.1,"update_interval":4,"overlap_step":true,"full_warm_up_rounds":0}'
B=/tmp/sb/bin
if [[ "${PART:-speed}" == speed ]]; then
  for c in ${RUNS:-zero2 zero2_offload zero2_zenflow}; do
    # ZenFlow: then 8 steps (two windows) under the op profile: the GPU's time by op and its idle
    # share, beside the row's zenflow_ms (the CPU update, its copy wait, the training thread's stall).
    prof=; [[ $c == zero2_zenflow ]] && prof="--profile 8"
    $B/strata-bench gpt --config configs/bench_dense_bf16_$c.json --model dense-1.3B --steps 10 $prof \
      > "$OUT/strata_1.3b_$c.log" 2>&1; echo "strata $c rc $?"; grep '^{' "$OUT/strata_1.3b_$c.log" | tail -1
  done
  [[ "${PEERS:-1}" == 0 ]] && exit 0  # PEERS=0: Strata's three runs alone
  python3 "$peer" --dense-1.3b --stage 2 --offload cpu --steps 10 > "$OUT/ds_1.3b_offload.log" 2>&1
  echo "ds offload rc $?"; grep '^{' "$OUT/ds_1.3b_offload.log" | tail -1
  python3 "$peer" --dense-1.3b --stage 2 --offload cpu --steps 10 --zero "$zf" > "$OUT/ds_1.3b_zenflow.log" 2>&1
  echo "ds zenflow rc $?"; grep '^{' "$OUT/ds_1.3b_zenflow.log" | tail -1
else
  data=/tmp/stdlib.txt
  python3 -c 'import glob, sysconfig, sys
files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
with open(sys.argv[1], "wb") as out:
    for f in files: out.write(open(f, "rb").read())
print(len(files), "files")' $data; ls -la $data
  S=${STEPS:-1000}
  # The three runs side by side on the one GPU (the curves, not the speed, are measured here): each
  # is bound by its CPU step, so they share the cores (OMP_NUM_THREADS 5 each) and overlap.
  # PEERS=0: Strata's two alone (8 threads each); CONVERGE_S bounds the runs' wall time (each
  # step's row is written as it ends: a cut run still gives its curve so far).
  export OMP_NUM_THREADS=$([[ "${PEERS:-1}" == 0 ]] && echo 8 || echo 5)
  for c in zero2_offload zero2_zenflow; do
    timeout ${CONVERGE_S:-100000} $B/train_gpt --device cuda --config configs/bench_dense_bf16_$c.json --model dense-350M \
      --seq-len 512 --steps $S --data $data --metrics-jsonl "$OUT/converge_$c.jsonl" > "$OUT/converge_$c.log" 2>&1 &
  done
  [[ "${PEERS:-1}" == 0 ]] || MASTER_PORT=29521 timeout ${CONVERGE_S:-100000} python3 "$peer" --stage 2 --offload cpu \
    --B 8 --T 512 --steps $S --data $data --log-losses --zero "$zf" > "$OUT/converge_ds_zenflow.log" 2>&1 &
  wait
  for c in zero2_offload zero2_zenflow; do echo "strata $c"; tail -1 "$OUT/converge_$c.jsonl"; done
  [[ "${PEERS:-1}" == 0 ]] || { echo "ds zenflow"; tail -2 "$OUT/converge_ds_zenflow.log"; }
fi
