#!/usr/bin/env bash
# Issue #34 on one GPU: every config of ../shared/ds-configs that `strata-config check` accepts
# and that enables fp16 trains `--model tiny` with train_gpt as its program would run it, until
# 2 optimizer steps are applied (steps skipped for an fp16 gradient overflow do not count), in at
# most 20 steps, with finite losses. Prints one row per config (steps run, steps skipped for
# overflow, applied steps, final loss) and `N of M trained`; exits non-zero unless all trained.
#
#   BUILD_DIR=build-cuda scripts/ds_configs_gpu.sh            (after scripts/build_cuda.sh)
#
# Environment: BUILD_DIR (build-cuda), CONFIGS (../shared/ds-configs), SCRATCH (a new folder
# under /tmp; NVMe paths of the configs point into it, and each run's log and metrics stay there),
# TIMEOUT seconds per config (300), MAX_STEPS (20), APPLIED (2), DEVICE (cuda; cpu only to try
# the script itself: the engine refuses fp16 on a CPU). Nothing but nvme_path is edited; batch
# sizes written as a number with "auto" factors are met with --micro-batch/--grad-accum, as
# tests/examples/test_train_gpt_ds_configs.cpp does.
set -uo pipefail
cd "$(dirname "$0")/.."
bin="${BUILD_DIR:-build-cuda}/bin"
configs="${CONFIGS:-../shared/ds-configs}"
scratch="${SCRATCH:-$(mktemp -d /tmp/strata-ds-configs-gpu.XXXXXX)}"
timeout_s="${TIMEOUT:-300}"
max_steps="${MAX_STEPS:-20}"
applied="${APPLIED:-2}"
device="${DEVICE:-cuda}"
for tool in train_gpt strata-config; do
  [[ -x "$bin/$tool" ]] || { echo "no $bin/$tool: build first (scripts/build_cuda.sh) or set BUILD_DIR" >&2; exit 2; }
done
[[ -d "$configs" ]] || { echo "no config folder $configs (set CONFIGS)" >&2; exit 2; }
mkdir -p "$scratch/nvme" "$scratch/runs"
echo "configs: $configs; scratch: $scratch; device: $device; per-config timeout ${timeout_s}s"
[[ "$device" == cuda ]] && { nvidia-smi -L 2>/dev/null | head -1 || echo "(nvidia-smi not found)"; }

# prepare FILE OUT: exit 0 when FILE enables fp16 (then OUT is the copy to run, nvme paths in the
# scratch folder, and the batch flags are printed), 1 when it does not, 2 when it is not JSON.
prepare() {
  python3 - "$1" "$2" "$scratch/nvme" <<'PY'
import json, sys
path, out, nvme = sys.argv[1:4]
try:
    doc = json.load(open(path))
except Exception:
    sys.exit(2)
fp16 = doc.get("fp16")
if not (isinstance(fp16, dict) and fp16.get("enabled") is True):
    sys.exit(1)
zero = doc.get("zero_optimization")
if isinstance(zero, dict):
    for block in ("offload_param", "offload_optimizer"):
        b = zero.get(block)
        if isinstance(b, dict) and "nvme_path" in b:
            b["nvme_path"] = nvme
json.dump(doc, open(out, "w"), indent=2)
t = doc.get("train_batch_size")
if isinstance(t, int) and not isinstance(t, bool) and \
        doc.get("train_micro_batch_size_per_gpu") == "auto" and doc.get("gradient_accumulation_steps") == "auto":
    micro = 8 if t % 8 == 0 else 1
    print(f"--micro-batch {micro} --grad-accum {t // micro}")
PY
}

# summarize METRICS: "RAN SKIPPED APPLIED FINAL_LOSS FINITE" from train_gpt's metrics rows.
summarize() {
  python3 - "$1" <<'PY'
import json, math, sys
rows = []
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except Exception:
    pass
skipped = sum(1 for r in rows if r.get("skipped"))
losses = [r.get("loss") for r in rows]
finite = all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses) and len(rows) > 0
final = f"{losses[-1]:.4f}" if rows and isinstance(losses[-1], (int, float)) else "-"
print(len(rows), skipped, len(rows) - skipped, final, "yes" if finite else "no")
PY
}

total=0
trained=0
rows=()
for file in "$configs"/*.json; do
  name=$(basename "$file")
  "$bin/strata-config" check "$file" > /dev/null 2>&1 || continue
  copy="$scratch/runs/$name"
  flags=$(prepare "$file" "$copy")
  [[ $? -eq 0 ]] || continue
  total=$((total + 1))
  metrics="$scratch/runs/${name%.json}.jsonl"
  log="$scratch/runs/${name%.json}.log"
  rm -f "$metrics"
  # shellcheck disable=SC2086  # the batch flags are words
  timeout -k 10 "$timeout_s" "$bin/train_gpt" --config "$copy" --model tiny --device "$device" \
    --steps "$max_steps" --applied-steps "$applied" --metrics-jsonl "$metrics" $flags \
    > "$log" 2>&1
  rc=$?
  read -r ran skipped done_steps final finite < <(summarize "$metrics")
  status=ok
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    status="timeout (${timeout_s}s)"
  elif [[ $rc -ne 0 ]]; then
    status="exit $rc: $(grep -m1 -E 'error' "$log" | cut -c1-110)"
  elif [[ "$finite" != yes ]]; then
    status="a loss is not finite"
  elif [[ "$done_steps" -lt "$applied" ]]; then
    status="only $done_steps applied"
  fi
  [[ "$status" == ok ]] && trained=$((trained + 1))
  rows+=("$(printf '%-88s %5s %7s %7s %8s  %s' "${name%.json}" "$ran" "$skipped" "$done_steps" "$final" "$status")")
done

printf '%-88s %5s %7s %7s %8s  %s\n' config steps skipped applied "loss" status
printf '%s\n' "${rows[@]}"
echo "$trained of $total trained (fp16 configs accepted by strata-config; $max_steps steps at most, until $applied applied)"
echo "logs and metrics: $scratch/runs"
if [[ -n "$(ls -A "$scratch/nvme" 2>/dev/null)" ]]; then
  echo "warning: $scratch/nvme is not empty after the runs (a swap folder was left behind)"
fi
[[ $total -gt 0 && $trained -eq $total ]]
