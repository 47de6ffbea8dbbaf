#!/usr/bin/env bash
# moe-8x on the GPUs of this machine: Strata's MoE layer (strata-bench gpt --model moe-8x, bf16,
# ZeRO-2, and ZeRO-3 with the experts in units of their own) beside the PyTorch peer's grouped-GEMM
# MoE (../shared/bench/peer_torch_gpt.py --grouped) and DeepSpeed-MoE (peer_deepspeed_gpt.py
# --moe, when DS_PEER names it and DeepSpeed imports), in the same run, with the ratios. On two
# GPUs: ep_size 2 for both, and the all_to_all bandwidth through Strata's process group beside
# NCCL's own through PyTorch (NCCL_BW names nccl_bw.py).
# Also the dispatch memory of a 64-expert layer over 4k-16k tokens (strata-bench moe-dispatch).
#   bench/run_moe.sh PEER_SCRIPT [BUILD_DIR]      (BUILD_DIR default: build)
set -uo pipefail
cd "$(dirname "$0")/.."
peer="$1"
bin="${2:-build}/bin"
out=$(mktemp -d)
gpus=$(nvidia-smi -L | wc -l)
have_ds() { [[ -n "${DS_PEER:-}" ]] && python3 -c 'import deepspeed' 2>/dev/null; }

CUDA_VISIBLE_DEVICES=0 "$bin/strata-bench" moe-dispatch --experts 64 --tokens 16384 --hidden 1024 \
  --ffn 1024 | tee "$out/dispatch.jsonl"
CUDA_VISIBLE_DEVICES=0 "$bin/strata-bench" gpt --config configs/bench_moe8x_bf16_zero2.json \
  --model moe-8x | tee "$out/strata1.jsonl"
CUDA_VISIBLE_DEVICES=0 "$bin/strata-bench" gpt --config configs/bench_moe8x_bf16_zero3.json \
  --model moe-8x | tee "$out/strata1_zero3.jsonl"
CUDA_VISIBLE_DEVICES=0 python3 "$peer" --grouped | tee "$out/peer1.jsonl"
if have_ds; then
  CUDA_VISIBLE_DEVICES=0 TORCH_CUDA_ARCH_LIST=9.0 torchrun --nproc-per-node 1 "$DS_PEER" --stage 2 \
    --moe --ep 1 | tee "$out/ds1.jsonl"
fi
if [[ $gpus -ge 2 ]]; then
  "$bin/strata-run" --num_gpus 2 -- "$bin/strata-bench" gpt --model moe-8x \
    --config configs/bench_moe8x_bf16_zero2_ep2.json | tee "$out/strata2.jsonl"
  # ZeRO-3 with experts (DeepSpeed refuses MoE at stage 3): each GPU's experts in units of their own.
  "$bin/strata-run" --num_gpus 2 -- "$bin/strata-bench" gpt --model moe-8x \
    --config configs/bench_moe8x_bf16_zero3_ep2.json | tee "$out/strata2_zero3.jsonl"
  if have_ds; then
    TORCH_CUDA_ARCH_LIST=9.0 torchrun --nproc-per-node 2 "$DS_PEER" --stage 2 --moe --ep 2 \
      | tee "$out/ds2.jsonl"
  fi
  "$bin/strata-run" --num_gpus 2 -- "$bin/strata-bench" a2a --sizes-mib 16,64,80,256 \
    | tee "$out/a2a.jsonl"
  if [[ -n "${NCCL_BW:-}" ]]; then torchrun --nproc-per-node 2 "$NCCL_BW" | tee "$out/nccl_bw.txt"; fi
fi

PYTHONPATH=bench python3 - "$out" <<'PY'
import os, re, sys
import bench_rows
out = sys.argv[1]
def rows(name): return bench_rows.rows(out, name)
def pick(name, key): return bench_rows.pick(out, name, key)
def ratio(a, b):
    return f"{a['tok_s'] / b['tok_s']:.3f}" if a and b else "n/a"
s1, s2 = pick("strata1.jsonl", "moe-8x"), pick("strata2.jsonl", "moe-8x")
z1, z2 = pick("strata1_zero3.jsonl", "moe-8x"), pick("strata2_zero3.jsonl", "moe-8x")
g1 = pick("peer1.jsonl", "moe-8x grouped_mm")
d1, d2 = pick("ds1.jsonl", "moe-8x"), pick("ds2.jsonl", "moe-8x")
def show(label, r):
    if r: print(f"{label:44s} {r['tok_s']:>10.0f} tok/s  mem {r.get('mem_GiB', 0):5.1f} GiB"
                + (f"  dropped {r['moe_dropped_route_fraction']:.3f}" if 'moe_dropped_route_fraction' in r else ""))
print("\nmoe-8x, bf16, 8 x 2048 tokens per GPU, tokens/s per GPU")
show("1 GPU  Strata (ZeRO-2, ep 1)", s1)
show("1 GPU  Strata (ZeRO-3, ep 1)", z1)
show("1 GPU  PyTorch grouped_mm MoE", g1)
show("1 GPU  DeepSpeed-MoE (ZeRO-2, ep 1)", d1)
show("2 GPUs Strata (ZeRO-2, ep 2)", s2)
show("2 GPUs Strata (ZeRO-3, ep 2)", z2)
show("2 GPUs DeepSpeed-MoE (ZeRO-2, ep 2)", d2)
print(f"1 GPU : Strata / grouped_mm {ratio(s1, g1)}   Strata / DeepSpeed-MoE {ratio(s1, d1)}")
print(f"2 GPUs: Strata / DeepSpeed-MoE {ratio(s2, d2)}   Strata 2 GPUs / Strata 1 GPU {ratio(s2, s1)}")
print(f"ZeRO-3 / ZeRO-2: 1 GPU {ratio(z1, s1)}   2 GPUs {ratio(z2, s2)}")
nccl = {}
p = os.path.join(out, "nccl_bw.txt")
if os.path.exists(p):
    for line in open(p):
        m = re.match(r"all_to_all\s+([\d.]+) MiB.*busbw\s+([\d.]+) GB/s", line.strip())
        if m: nccl[round(float(m.group(1)))] = float(m.group(2))
for r in rows("a2a.jsonl"):
    n = nccl.get(r["mib"])
    print(f"all_to_all {r['mib']:5d} MiB: Strata {r['busbw_GBs']:7.1f} GB/s bus"
          + (f", NCCL via PyTorch {n:7.1f} GB/s, ratio {r['busbw_GBs'] / n:.3f}" if n else ""))
for r in rows("dispatch.jsonl"):
    if "peak_bytes_forward_backward" in r:
        print(f"dispatch E={r['experts']} S={r['tokens']:6d} k={r['k']} d={r['hidden']}: peak "
              f"{r['peak_bytes_forward_backward'] / 2**20:8.1f} MiB = {r['peak_over_tokens_k_d_elements']:.2f} x S*k*d "
              f"elements; DeepSpeed's dense mask alone {r['dense_mask_bytes_deepspeed'] / 2**20:8.1f} MiB")
PY
