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
# under nice; one description at a time. Environment: BUILD_DIR (default build), SOAK_DIR,
# SOAK_MAX_WORLD (default 4). Exit status: 1 if any description failed.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/soak.sh N [SEED]}
seed=${2:-$(date +%s)}
build_dir=${BUILD_DIR:-build}
out=${SOAK_DIR:-$build_dir/soak/$(date +%Y%m%d-%H%M%S)-seed$seed}
nice -n 10 cmake --build "$build_dir" -j2 --target strata-matrix train_gpt strata-run strata-ckpt || exit 2
mkdir -p "$out"
echo "soak: $n descriptions, seed $seed, in $out"
nice -n 10 "$build_dir/bin/strata-matrix" --bin "$PWD/$build_dir/bin" --work "$PWD/$out/work" \
  --seed "$seed" --count "$n" --max-world "${SOAK_MAX_WORLD:-4}" \
  --report "$out/report.md" --jsonl "$out/descriptions.jsonl"
rc=$?
rm -rf "$out/work/nvme"
echo "soak: report in $out/report.md (exit $rc)"
exit "$rc"
