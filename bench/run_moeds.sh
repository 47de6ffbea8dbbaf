#!/usr/bin/env bash
# moe-ds (DeepSeek-V3-style: 64 routed experts of FFN 512, top-6, sigmoid + bias, 2 shared,
# dropless) and moe-8x on one GPU, Strata beside the PyTorch peer, ROUNDS rounds taking turns
# (issue 33's bounds: moe-ds >= 1.15x `peer_torch_gpt.py --deepseek` at <= its memory; moe-8x
# >= 1.04x `--grouped`; the peer runs those two rows alone, through its `run`). Then one more
# moe-ds run with the op profile, the memory phases and the
# census of one MoE layer on the GPU (strata-bench moe-ops), to say where a step goes.
#   bench/run_moeds.sh PEER_SCRIPT [BUILD_DIR] [ROUNDS]     (BUILD_DIR default build, ROUNDS 2)
set -uo pipefail
cd "$(dirname "$0")/.."
peer="$1"
bin="${2:-build}/bin"
rounds="${3:-2}"
out=$(mktemp -d)
for ((r = 1; r <= rounds; ++r)); do
  "$bin/strata-bench" gpt --model moe-ds --config configs/bench_moeds_bf16_zero2.json \
    | tee -a "$out/strata_ds.jsonl"
  python3 - "$peer" <<'PY' | tee -a "$out/peer.jsonl"
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import peer_torch_gpt as p
p.run("moe-ds grouped_mm", dict(V=32000, d=1024, L=12, h=16, f=512,
      moe=dict(E=64, k=6, n_shared=2, deepseek=True)), 8, 2048)
p.run("moe-8x grouped_mm", dict(V=32000, d=1024, L=12, h=16, f=4096,
      moe=dict(E=8, k=2, cf=1.25, grouped=True)), 8, 2048)
PY
  "$bin/strata-bench" gpt --model moe-8x --config configs/bench_moe8x_bf16_zero2.json \
    | tee -a "$out/strata_8x.jsonl"
done
"$bin/strata-bench" gpt --model moe-ds --config configs/bench_moeds_bf16_zero2.json --steps 5 \
  --profile 3 2>&1 | tee "$out/profile.txt"
"$bin/strata-bench" moe-ops --device cuda --top 25 2>&1 | tee "$out/moe_ops.txt"

PYTHONPATH=bench python3 - "$out" <<'PY'
import statistics, sys
import bench_rows
out = sys.argv[1]
def named(file, key): return [r for r in bench_rows.rows(out, file) if key in r.get("name", "")]
def line(label, rs):
    if not rs: print(f"{label:34s} missing"); return None
    tok = [r["tok_s"] for r in rs]
    mem = max(r.get("mem_GiB", 0) for r in rs)
    print(f"{label:34s} " + " ".join(f"{t:9.0f}" for t in tok)
          + f"  median {statistics.median(tok):9.0f} tok/s  mem {mem:5.1f} GiB")
    return statistics.median(tok), mem
print("\nbf16, 8 x 2048 tokens, one GPU; tokens/s per round")
s = line("Strata moe-ds (ZeRO-2)", named("strata_ds.jsonl", "moe-ds"))
p = line("peer moe-ds (--deepseek)", named("peer.jsonl", "moe-ds"))
s8 = line("Strata moe-8x (ZeRO-2)", named("strata_8x.jsonl", "moe-8x"))
p8 = line("peer moe-8x (--grouped)", named("peer.jsonl", "moe-8x grouped"))
if s and p:
    print(f"moe-ds: Strata / peer {s[0] / p[0]:.3f} (bound 1.15), memory {s[1]:.1f} vs {p[1]:.1f} GiB")
if s8 and p8:
    print(f"moe-8x: Strata / peer {s8[0] / p8[0]:.3f} (bound 1.04)")
PY
