#!/usr/bin/env bash
# Two builds of Strata side by side on one GPU (e.g. a commit before and after a change): each
# config run by each build in turn, ROUNDS rounds, then the median tokens/s of each and their
# ratio. The default configs are the engine's four (issue 31): dense-350M at stages 0 and 3,
# moe-8x at stages 2 and 3; AB_RUNS ("MODEL CONFIG" pairs separated by ";") chooses others.
#   bench/run_ab.sh BIN_DIR_A BIN_DIR_B [ROUNDS] [STEPS]      (ROUNDS 3, STEPS 10)
# Each run's whole JSON line goes to stderr (memory peaks, step times), the table to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
a="$1" b="$2" rounds="${3:-3}" steps="${4:-10}"
runs=("dense-350M configs/bench_dense_bf16.json"
      "dense-350M configs/bench_dense_bf16_zero3.json"
      "moe-8x configs/bench_moe8x_bf16_zero2.json"
      "moe-8x configs/bench_moe8x_bf16_zero3.json")
if [[ -n "${AB_RUNS:-}" ]]; then IFS=';' read -r -a runs <<<"$AB_RUNS"; fi
out=$(mktemp -d)
median() { sort -n "$1" | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
for ((r = 1; r <= rounds; ++r)); do
  for run in "${runs[@]}"; do
    read -r model config <<<"$run"
    for side in A B; do
      bin=$a; [[ $side == B ]] && bin=$b
      line=$("$bin/strata-bench" gpt --model "$model" --config "$config" --steps "$steps" \
               --warmup 2 2>/dev/null | grep -m1 '"tok_s"')
      echo "$side $line" >&2
      tok=$(sed -E 's/.*"tok_s":([0-9.]+).*/\1/' <<<"$line")
      echo "round $r $side $model $(basename "$config") ${tok:-FAILED}"
      echo "${tok:-0}" >>"$out/$side.$model.$(basename "$config")"
    done
  done
done
echo "median tokens/s over $rounds rounds (A = $a, B = $b):"
for run in "${runs[@]}"; do
  read -r model config <<<"$run"
  key="$model.$(basename "$config")"
  ma=$(median "$out/A.$key") mb=$(median "$out/B.$key")
  awk -v k="$key" -v a="$ma" -v b="$mb" 'BEGIN { printf "%-44s A %10.0f  B %10.0f  B/A %.4f\n", k, a, b, (a > 0 ? b / a : 0) }'
done
rm -rf "$out"
