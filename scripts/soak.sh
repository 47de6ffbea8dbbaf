#!/usr/bin/env bash
# The differential test matrix's soak (issue 30, docs/matrix.md): N random descriptions drawn
# from the whole feature space (world sizes up to 4), each run black-box through train_gpt /
# strata-run beside its one-process stage-0 oracle; failures are shrunk to a minimal description
# and printed as the command that reproduces it.
#
#   scripts/soak.sh N [SEED]      # e.g. scripts/soak.sh 1000 overnight
#
# Writes $SOAK_DIR (default build/soak/<date>-seed<SEED>/): report.md (counts per outcome and
# every failure with its reproduction) and descriptions.jsonl (one row per description). Runs
# under nice. Environment: BUILD_DIR (default build), SOAK_DIR (relative to the repository or
# absolute), SOAK_MAX_WORLD (default 4), SOAK_JOBS (default 1): that many strata-matrix workers side
# by side on a machine with the cores for them, worker k drawing from seed SEED+k (disjoint
# descriptions) on its own cores/SOAK_JOBS cores into $SOAK_DIR/wK/, their reports merged into $SOAK_DIR/report.md. Exit status:
# 1 if any description failed.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/soak.sh N [SEED]}
seed=${2:-$(date +%s)}
build_dir=${BUILD_DIR:-build}
out=${SOAK_DIR:-$build_dir/soak/$(date +%Y%m%d-%H%M%S)-seed$seed}
nice -n 10 cmake --build "$build_dir" -j2 --target strata-matrix train_gpt strata-run strata-ckpt || exit 2
case $out in /*) ;; *) out=$PWD/$out ;; esac
case $build_dir in /*) ;; *) build_dir=$PWD/$build_dir ;; esac
jobs=${SOAK_JOBS:-1}
mkdir -p "$out"
echo "soak: $n descriptions, seed $seed, $jobs worker(s), in $out"
# Worker k runs on its own share of the cores (taskset): a rank sizes its thread pools from its
# affinity (runtime/cpu_threads.cpp), so unpinned workers would each take every core (12 workers
# on 16 cores ran a tiny model at 10 tokens/s).
cores=$(nproc)
per=$((cores / jobs > 0 ? cores / jobs : 1))
run_worker() {  # run_worker K COUNT DIR
  local pin=()
  if ((jobs > 1)) && command -v taskset >/dev/null; then
    local lo=$(($1 * per % cores))
    pin=(taskset -c "$lo-$((lo + per - 1))")
  fi
  nice -n 10 "${pin[@]}" "$build_dir/bin/strata-matrix" --bin "$build_dir/bin" --work "$3/work" \
    --seed "$((seed + $1))" --count "$2" --max-world "${SOAK_MAX_WORLD:-4}" \
    ${SOAK_BUDGET_S:+--budget-s "$SOAK_BUDGET_S"} --report "$3/report.md" --jsonl "$3/descriptions.jsonl"
}
if ((jobs <= 1)); then
  run_worker 0 "$n" "$out"
  rc=$?
else
  pids=()
  for ((k = 0; k < jobs; ++k)); do
    count=$((n / jobs + (k < n % jobs ? 1 : 0)))
    mkdir -p "$out/w$k"
    run_worker "$k" "$count" "$out/w$k" >"$out/w$k/log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  # One report: the outcome counts summed over the workers, then each worker's failures.
  {
    echo "# soak report"
    echo
    echo "$n descriptions, seeds $seed..$((seed + jobs - 1)) ($jobs workers), max world ${SOAK_MAX_WORLD:-4}"
    echo
    echo "| outcome | count |"
    echo "|---|---|"
    cat "$out"/w*/report.md | awk -F'|' '/^\| [A-Za-z-]+ \| [0-9]+ \|$/ { gsub(/ /, "", $2); c[$2] += $3 }
      END { for (k in c) printf "| %s | %d |\n", k, c[k] }' | sort
    for ((k = 0; k < jobs; ++k)); do
      echo
      echo "## worker $k (seed $((seed + k)))"
      sed -n '/^## Failures/,$p' "$out/w$k/report.md" | tail -n +2
    done
  } >"$out/report.md"
  cat "$out"/w*/descriptions.jsonl >"$out/descriptions.jsonl"
fi
rm -rf "$out"/work/nvme "$out"/w*/work/nvme
echo "soak: report in $out/report.md (exit $rc)"
exit "$rc"
