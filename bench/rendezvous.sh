#!/bin/sh
# Rendezvous time of N ranks (default 4) under strata-run, RUNS times (default 10) for each build
# given, the builds taking turns so that both see the same machine load:
#   bench/rendezvous.sh RUNS NRANKS BIN_DIR_A [BIN_DIR_B]
# (a BIN_DIR holds strata-run and strata-rendezvous-bench). Prints each run's "after the last
# arrival" (last leave - last entry) and slowest-rank times, then their medians per build.
set -eu
runs=${1:-10}; n=${2:-4}; shift 2
out=$(mktemp -d)
i=0
while [ "$i" -lt "$runs" ]; do
  for dir in "$@"; do
    tag=$(echo "$dir" | tr '/' '_')
    "$dir/strata-run" --nproc-per-node "$n" -- "$dir/strata-rendezvous-bench" > "$out/run" 2>&1 ||
      { cat "$out/run"; exit 1; }
    awk '/rendezvous [0-9]/ { for (f = 1; f <= NF; ++f) if ($f == "rendezvous") break;
           e = $(f+2); l = $(f+3); m = $(f+4);
           if (e > E) E = e; if (l > L) L = l; if (m > M) M = m }
         END { printf "%.3f %.3f\n", (L - E) / 1000.0, M }' "$out/run" >> "$out/$tag"
  done
  i=$((i + 1))
done
for dir in "$@"; do
  tag=$(echo "$dir" | tr '/' '_')
  echo "== $dir: after-last-arrival-ms slowest-rank-ms per run"
  cat "$out/$tag"
  sort -n -k1 "$out/$tag" | awk '{ a[NR] = $1 } END { printf "median after last arrival: %.3f ms\n", (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2 }'
  sort -n -k2 "$out/$tag" | awk '{ a[NR] = $2 } END { printf "median slowest rank: %.3f ms\n", (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2 }'
done
rm -rf "$out"
