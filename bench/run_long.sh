#!/usr/bin/env bash
# Long sequences on one GPU (issue 58): Llama-3.2-1B's shape (Hugging Face's LlamaConfig, random
# weights written once by transformers into a folder train_gpt imports), batch 1, bf16, ZeRO-3
# with the optimizer in host memory, every decoder layer checkpointed with its input in host
# memory, the MLP tiled (configs/bench_long_context.json), against DeepSpeed's ALST single-GPU parts
# on Hugging Face's own model (bench/peer_alst.py: TiledMLP, the tiled logits loss, checkpoint
# offload, expandable_segments), each length in a process of its own, 1 warm-up step and 2 timed.
# Strata's line: train_gpt's last metrics row (device_peak_bytes, device_bytes_per_token,
# tokens_per_s); the peer's: its JSON line. A failed run (out of memory) says so and goes on.
#   bench/run_long.sh OUT_DIR [LENGTHS...]   (default 32768 65536 131072 262144; build/bin, or $BIN)
# SIDES (default "strata alst"): which sides run, in that order (one alone: a length split over
# two calls).
# LLAMA_DIR: where the random-weight model folder is written once (default OUT_DIR's; 2.5 GB).
# The peer runs as rank 0 of 1 (DeepSpeed's own environment variables, no launcher needed).
set -uo pipefail
cd "$(dirname "$0")/.."
out="$1"; shift
lengths=("$@")
((${#lengths[@]})) || lengths=(32768 65536 131072 262144)
bin="${BIN:-build/bin}"
mkdir -p "$out"
folder="${LLAMA_DIR:-$out/llama-3.2-1b-random}"
if [[ ! -f "$folder/config.json" ]]; then
  python3 - "$folder" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                  max_position_embeddings=262144, tie_word_embeddings=True, torch_dtype="bfloat16")
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
fi
run_strata() {
  echo "== T $1: strata"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$bin/train_gpt" --device cuda \
    --config configs/bench_long_context.json --hf-model "$folder" --seq-len "$1" --steps 3 \
    --activation-checkpointing every --metrics-jsonl "$out/strata_$1.jsonl" >"$out/strata_$1.log" 2>&1
  echo "rc $?"
  tail -1 "$out/strata_$1.jsonl" 2>/dev/null || tail -3 "$out/strata_$1.log"
}
run_alst() {
  echo "== T $1: alst peer"
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    python3 bench/peer_alst.py --arch llama-1b --T "$1" --steps 2 --warmup 1 >"$out/alst_$1.log" 2>&1
  echo "rc $?"
  grep '^{' "$out/alst_$1.log" || tail -3 "$out/alst_$1.log"
}
# Each length: the sides in SIDES's order ("alst strata" runs the peer first).
for T in "${lengths[@]}"; do
  for side in ${SIDES:-strata alst}; do
    case "$side" in
      strata) run_strata "$T" ;;
      alst) run_alst "$T" ;;
      *) echo "run_long.sh: SIDES names '$side'; known: strata alst" >&2; exit 2 ;;
    esac
  done
done
# The slope of peak bytes over tokens, fitted over the lengths that ran (least squares), each side.
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def fit(points):
    if len(points) < 2: return None
    n = len(points); mx = sum(t for t, _ in points) / n; my = sum(b for _, b in points) / n
    return sum((t - mx) * (b - my) for t, b in points) / sum((t - mx) ** 2 for t, _ in points)
strata, alst = [], []
for f in glob.glob(os.path.join(out, "strata_*.jsonl")):
    rows = [json.loads(l) for l in open(f) if l.strip()]
    if rows and "device_peak_bytes" in rows[-1]:
        strata.append((int(f.rsplit("_", 1)[1].split(".")[0]), rows[-1]["device_peak_bytes"]))
for f in glob.glob(os.path.join(out, "alst_*.log")):
    for l in open(f):
        if l.startswith("{"): alst.append((json.loads(l)["T"], json.loads(l)["peak_bytes"]))
s, a = fit(sorted(strata)), fit(sorted(alst))
print(json.dumps({"strata_bytes_per_token_slope": s, "alst_bytes_per_token_slope": a,
                  "ratio": s / a if s and a else None, "strata": sorted(strata), "alst": sorted(alst)}))
PY
