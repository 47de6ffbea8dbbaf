#!/usr/bin/env bash
# On a GPU machine (see README, "Building against a CUDA LibTorch"): build, run the whole test
# suite (and the gpu label once more on one GPU), then train_gpt's precision and ZeRO
# comparisons on the GPUs. Logs go to LOG_DIR.
#   DEPS_PREFIX=/tmp/deps LOG_DIR=/tmp/out scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
log="${LOG_DIR:-/tmp/strata-gpu}"
mkdir -p "$log"
export BUILD_DIR="${BUILD_DIR:-/tmp/strata-build-cuda}"
if [[ -n "${DEPS_PREFIX:-}" ]]; then
  export LD_LIBRARY_PATH="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu:$DEPS_PREFIX/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
nvidia-smi -L
(time scripts/build_cuda.sh) > "$log/build.log" 2>&1 || { tail -30 "$log/build.log"; exit 1; }
grep -E "Strata:|^real" "$log/build.log"
ctest --test-dir "$BUILD_DIR" -j 12 --timeout 300 > "$log/ctest.log" 2>&1
grep -E "tests passed|\(Failed\)|sec\*proc" "$log/ctest.log"
# The GPU tests again on one GPU (the multi-GPU ones skip by name).
CUDA_VISIBLE_DEVICES=0 ctest --test-dir "$BUILD_DIR" -L gpu -j 4 --timeout 300 \
  > "$log/ctest_1gpu.log" 2>&1
grep -E "tests passed|\(Failed\)" "$log/ctest_1gpu.log"

bin="$BUILD_DIR/bin"
steps="${STEPS:-300}"
config() {  # config NAME PRECISION STAGE
  python3 - "$log/$1.json" "$2" "$3" <<'PY'
import json, sys
path, precision, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = {"train_batch_size": 32, "gradient_accumulation_steps": 1, "steps_per_print": 100,
     "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
     "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 300, "warmup_num_steps": 30}}}
if precision != "fp32": c[precision] = {"enabled": True}
json.dump(c, open(path, "w"))
PY
}
for p in fp32 bf16 fp16; do
  config "small_$p" "$p" 0
  "$bin/train_gpt" --config "$log/small_$p.json" --model small --steps "$steps" \
    --metrics-jsonl "$log/small_$p.jsonl" > "$log/small_$p.log" 2>&1
  tail -1 "$log/small_$p.log"
done
gpus=$(nvidia-smi -L | wc -l)
if [[ $gpus -ge 2 ]]; then
  for s in 1 2; do
    config "small_bf16_zero$s" bf16 "$s"
    "$bin/strata-run" --num_gpus 2 -- "$bin/train_gpt" --config "$log/small_bf16_zero$s.json" \
      --model small --steps "$steps" --metrics-jsonl "$log/small_bf16_zero$s.jsonl" \
      > "$log/small_bf16_zero$s.log" 2>&1
    tail -1 "$log/small_bf16_zero$s.log"
  done
fi
python3 - "$log" <<'PY'
import json, sys, os
log = sys.argv[1]
def read(name):
    p = os.path.join(log, name + ".jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
ref = read("small_fp32")
for name in ["small_bf16", "small_fp16", "small_bf16_zero1", "small_bf16_zero2"]:
    r = read(name)
    if not r or not ref: print(name, "missing"); continue
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(ref, r)]
    tail = lambda rows: sum(x["loss"] for x in rows[-20:]) / len(rows[-20:])
    print(f"{name}: final-20 mean loss {tail(r):.4f} vs fp32 {tail(ref):.4f}; max |gap| {max(gaps):.4f}, "
          f"mean |gap| {sum(gaps)/len(gaps):.4f}; skipped {sum(x['skipped'] for x in r)}; "
          f"model_state_bytes {r[-1]['model_state_bytes']} (fp32 {ref[-1]['model_state_bytes']})")
PY
