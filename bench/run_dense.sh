#!/usr/bin/env bash
# dense-350M on the GPUs of this machine: Strata (strata-bench) beside the PyTorch peer
# (../shared/bench/peer_torch_gpt.py), in the same run, with the ratios.
#   bench/run_dense.sh PEER_SCRIPT [BUILD_DIR]      (BUILD_DIR default: build)
# COMPILE=1 adds the peer's torch.compile run on one GPU. On two GPUs it also runs stage 2 with
# one gradient bucket (reduction after backward, no overlap) beside the bucketed default, and
# ZeRO-3 (configs/bench_dense_bf16_zero3.json: units released after use, as FSDP2 reshards)
# beside FSDP2 and, when DS_PEER names ../shared/bench/peer_deepspeed_gpt.py and DeepSpeed
# imports, DeepSpeed's ZeRO-3. Stage 3 on one GPU is timed against stage 0 in one process.
# ONLY=stage3 runs just what ZeRO-3's comparison needs (Strata 1 GPU stage 0 and 3, FSDP2, Strata
# stage 2 and 3 on two GPUs, DeepSpeed's ZeRO-3).
set -uo pipefail
cd "$(dirname "$0")/.."
peer="$1"
bin="${2:-build}/bin"
out=$(mktemp -d)
gpus=$(nvidia-smi -L | wc -l)

only="${ONLY:-}"
skip() { [[ "$only" == stage3 ]]; }  # a run ZeRO-3's comparison does not need
skip || "$bin/strata-bench" adam | tee "$out/adam.jsonl"
skip || python3 "$peer" ${COMPILE:+--compile} | tee "$out/peer1.jsonl"
"$bin/strata-bench" gpt --config configs/bench_dense_bf16.json --model dense-350M | tee "$out/strata1.jsonl"
"$bin/strata-bench" gpt --config configs/bench_dense_bf16_zero3.json --model dense-350M | tee "$out/strata1_stage3.jsonl"
if [[ $gpus -ge 2 ]]; then
  skip || torchrun --nproc-per-node 2 "$peer" --fsdp --no-reshard | tee "$out/peer2_noreshard.jsonl"
  torchrun --nproc-per-node 2 "$peer" --fsdp | tee "$out/peer2.jsonl"
  skip || "$bin/strata-run" --num_gpus 2 -- "$bin/strata-bench" gpt --model dense-350M \
    --config configs/bench_dense_bf16.json | tee "$out/strata2_stage0.jsonl"
  "$bin/strata-run" --num_gpus 2 -- "$bin/strata-bench" gpt --model dense-350M \
    --config configs/bench_dense_bf16_zero2.json | tee "$out/strata2_stage2.jsonl"
  python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["zero_optimization"]["reduce_bucket_size"]=2**31-1; json.dump(c,open(sys.argv[2],"w"))' \
    configs/bench_dense_bf16_zero2.json "$out/zero2_one_bucket.json"
  skip || "$bin/strata-run" --num_gpus 2 -- "$bin/strata-bench" gpt --model dense-350M \
    --config "$out/zero2_one_bucket.json" | tee "$out/strata2_stage2_one_bucket.jsonl"
  "$bin/strata-run" --num_gpus 2 -- "$bin/strata-bench" gpt --model dense-350M \
    --config configs/bench_dense_bf16_zero3.json | tee "$out/strata2_stage3.jsonl"
  if [[ -n "${DS_PEER:-}" ]] && python3 -c 'import deepspeed' 2>/dev/null; then
    TORCH_CUDA_ARCH_LIST=9.0 torchrun --nproc-per-node 2 "$DS_PEER" --stage 3 | tee "$out/ds2_stage3.jsonl"
  fi
fi

PYTHONPATH=bench python3 - "$out" <<'PY'
import os, re, sys
import bench_rows
out = sys.argv[1]
def rows(name): return bench_rows.rows(out, name)
def pick(name, key): return bench_rows.pick(out, name, key)
eager = pick("peer1.jsonl", "dense-350M eager")
compiled = pick("peer1.jsonl", "dense-350M compile")
s1 = pick("strata1.jsonl", "dense-350M")
if eager and s1:
    print(f"1 GPU  stage 0 bf16: Strata {s1['tok_s']:.0f} tok/s, {s1['mem_GiB']:.1f} GiB; "
          f"PyTorch eager {eager['tok_s']} tok/s, {eager['mem_GiB']} GiB; ratio {s1['tok_s'] / eager['tok_s']:.3f}"
          + (f"; torch.compile {compiled['tok_s']} tok/s ({compiled['tok_s'] / eager['tok_s']:.3f}x eager): "
             f"Strata/compile {s1['tok_s'] / compiled['tok_s']:.3f}" if compiled else ""))
nr, fs = pick("peer2_noreshard.jsonl", "fsdp2"), pick("peer2.jsonl", "fsdp2")
s20, s22 = pick("strata2_stage0.jsonl", "dense-350M"), pick("strata2_stage2.jsonl", "dense-350M")
for label, s in (("stage 0 (DP)", s20), ("stage 2", s22)):
    if s and nr:
        print(f"2 GPUs {label}: Strata {s['tok_s']:.0f} tok/s/GPU, {s['mem_GiB']:.1f} GiB; FSDP2 no-reshard "
              f"{nr['tok_s']} ({nr['mem_GiB']} GiB): ratio {s['tok_s'] / nr['tok_s']:.3f}"
              + (f"; FSDP2 {fs['tok_s']}: ratio {s['tok_s'] / fs['tok_s']:.3f}" if fs else "")
              + (f"; vs Strata 1 GPU {s['tok_s'] / s1['tok_s']:.3f}" if s1 else ""))
s13 = pick("strata1_stage3.jsonl", "stage 0 (same run")
if s13:
    print(f"1 GPU  stage 3 bf16: Strata {s13['tok_s'] / s13['stage3_over_stage0']:.0f} tok/s against its stage 0 "
          f"{s13['tok_s']:.0f} in the same process: {1 / s13['stage3_over_stage0']:.3f}x")
s23 = pick("strata2_stage3.jsonl", "dense-350M")
ds3 = next((r for r in rows("ds2_stage3.jsonl") if "tok_s" in r), None)
if s23:
    print(f"2 GPUs stage 3: Strata {s23['tok_s']:.0f} tok/s/GPU, {s23['mem_GiB']:.1f} GiB"
          + (f"; FSDP2 {fs['tok_s']} ({fs['mem_GiB']} GiB): ratio {s23['tok_s'] / fs['tok_s']:.3f}" if fs else "")
          + (f"; DeepSpeed ZeRO-3 {ds3['tok_s']}: ratio {s23['tok_s'] / ds3['tok_s']:.3f}" if ds3 else "")
          + (f"; vs Strata 1 GPU stage 0 {s23['tok_s'] / s1['tok_s']:.3f}" if s1 else "")
          + (f"; Strata stage 2 {s22['mem_GiB']:.1f} GiB" if s22 else ""))
one = pick("strata2_stage2_one_bucket.jsonl", "dense-350M")
if one and s22:
    print(f"2 GPUs stage 2, overlap: bucketed {s22['step_ms']:.1f} ms/step, one bucket after backward "
          f"{one['step_ms']:.1f} ms/step: overlap saves {one['step_ms'] - s22['step_ms']:.1f} ms ({one['step_ms'] / s22['step_ms']:.3f}x)")
PY
