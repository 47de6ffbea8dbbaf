#!/usr/bin/env bash
# Scaling over the GPUs of one host (issue 18), for any number of GPUs. At each count N of COUNTS
# (default: 1, then every power of two up to the GPUs here, then their number), per GPU:
#   - dense-350M and dense-1.3B at ZeRO-3 (configs/bench_dense_bf16_zero3.json): Strata, FSDP2
#     (peer_torch_gpt.py --fsdp) and, when DeepSpeed imports, DeepSpeed ZeRO-3
#     (peer_deepspeed_gpt.py --stage 3); tokens/s and peak memory;
#   - moe-8x at ep_size N (ZeRO-2, one expert per GPU at N = 8; N must divide its 8 experts):
#     Strata (dropped-route fraction from its row) and DeepSpeed-MoE --ep N; at N > 1 the
#     all_to_all bus bandwidth through Strata's group beside NCCL's own (nccl_bw.py);
#   - with NVME_DIR set, dense-350M at ZeRO-3 with the optimizer on NVMe there
#     (configs/bench_dense_bf16_zero3_nvme.json), its swap pass's GB/s beside fio's (FIO names
#     the fio binary) with N jobs, 1 MiB blocks, queue depth 16, direct I/O, in the same folder.
# Then one table: each figure beside Strata's 1-GPU one (scaling efficiency) and the peers'.
#   bench/run_scaling.sh PEER_DIR [BUILD_DIR]   (PEER_DIR: ../shared/bench; BUILD_DIR: build)
# Environment: COUNTS ("1 4 8"), MODELS ("dense-350M dense-1.3B"), NVME_DIR, FIO, OUT (keep the
# JSON lines there; default a fresh temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
peers="$1"
bin="${2:-build}/bin"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
gpus=$(nvidia-smi -L | wc -l)
if [[ -z "${COUNTS:-}" ]]; then
  COUNTS=1
  for ((n = 2; n <= gpus; n *= 2)); do COUNTS+=" $n"; done
  [[ " $COUNTS " == *" $gpus "* ]] || COUNTS+=" $gpus"
fi
models="${MODELS:-dense-350M dense-1.3B}"
have_ds() { python3 -c 'import deepspeed' 2>/dev/null; }
export TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed's op builder cannot parse torch's "9.0a"
echo "run_scaling: GPU counts $COUNTS, models $models; JSON lines in $out"

# A copy of a config with keys set: cfg SRC DST 'python statements on c'.
cfg() {
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); $3; json.dump(c,open(sys.argv[2],'w'))" \
    "$1" "$2"
}
strata() {  # strata N OUTFILE strata-bench arguments...
  local n=$1 file=$2
  shift 2
  if ((n == 1)); then
    "$bin/strata-bench" "$@"
  else
    "$bin/strata-run" --num_gpus "$n" -- "$bin/strata-bench" "$@"
  fi | tee "$out/$file"
}

for n in $COUNTS; do
  for m in $models; do
    flag=$([[ $m == dense-1.3B ]] && echo --dense-1.3b)
    strata "$n" "strata_${m}_x$n.jsonl" gpt --model "$m" --config configs/bench_dense_bf16_zero3.json
    torchrun --nproc-per-node "$n" "$peers/peer_torch_gpt.py" --fsdp $flag \
      | tee "$out/fsdp_${m}_x$n.jsonl"
    have_ds && torchrun --nproc-per-node "$n" "$peers/peer_deepspeed_gpt.py" --stage 3 $flag \
      | tee "$out/ds_${m}_x$n.jsonl"
  done
  if ((8 % n == 0)); then
    cfg configs/bench_moe8x_bf16_zero2.json "$out/moe_ep$n.json" "c['moe']['ep_size']=$n"
    strata "$n" "strata_moe_x$n.jsonl" gpt --model moe-8x --config "$out/moe_ep$n.json"
    have_ds && torchrun --nproc-per-node "$n" "$peers/peer_deepspeed_gpt.py" --stage 2 --moe \
      --ep "$n" | tee "$out/ds_moe_x$n.jsonl"
    if ((n > 1)); then
      strata "$n" "a2a_x$n.jsonl" a2a --sizes-mib 16,64,256,1024
      torchrun --nproc-per-node "$n" "$peers/nccl_bw.py" | tee "$out/nccl_x$n.txt"
    fi
  fi
  if [[ -n "${NVME_DIR:-}" ]]; then
    cfg configs/bench_dense_bf16_zero3_nvme.json "$out/nvme.json" \
      "c['zero_optimization']['offload_optimizer']['nvme_path']='$NVME_DIR'"
    strata "$n" "strata_nvme_x$n.jsonl" gpt --model dense-350M --config "$out/nvme.json" \
      --steps 4 --warmup 1
    if [[ -n "${FIO:-}" ]]; then
      for rw in write read; do
        sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
        "$FIO" --name=scaling --directory="$NVME_DIR" --rw="$rw" --bs=1M --iodepth=16 --size=4G \
          --numjobs="$n" --ioengine=io_uring --direct=1 --group_reporting --output-format=json \
          > "$out/fio_${rw}_x$n.json"
      done
      rm -f "$NVME_DIR"/scaling.*
    fi
  fi
done

PYTHONPATH=bench python3 - "$out" "$COUNTS" "$models" <<'PY'
import json, os, re, sys
import bench_rows
out, counts, models = sys.argv[1], [int(n) for n in sys.argv[2].split()], sys.argv[3].split()
def row(name, key=""): return bench_rows.pick(out, name, key)
def tok(r): return r["tok_s"] if r else None
def fmt(x, spec=".0f"): return format(x, spec) if x is not None else "—"
def ratio(a, b): return fmt(a / b, ".3f") if a and b else "—"
print("\nper-GPU tokens/s, bf16, 8 x 2048 tokens per GPU; eff = per-GPU / Strata's 1-GPU figure")
print(f"{'run':22s} {'GPUs':>4s} {'Strata':>9s} {'eff':>6s} {'GiB':>5s} {'FSDP2':>9s} {'S/FSDP2':>7s}"
      f" {'DeepSpeed':>9s} {'S/DS':>6s}")
for m in models + ["moe-8x"]:
    base = base2 = None
    for n in counts:
        if m == "moe-8x":
            s, f, d = row(f"strata_moe_x{n}.jsonl", "moe-8x"), None, row(f"ds_moe_x{n}.jsonl", "moe-8x")
        else:
            s, f, d = row(f"strata_{m}_x{n}.jsonl", f"{m} bf16 stage 3"), row(f"fsdp_{m}_x{n}.jsonl", "fsdp2"), \
                row(f"ds_{m}_x{n}.jsonl", "deepspeed")
        if s is None and f is None and d is None: continue
        if n == 1 and s: base = tok(s)
        if n == 2 and s: base2 = tok(s)
        label = m + (f" ep {n}" if m == "moe-8x" else " ZeRO-3")
        extra = f"  dropped {s['moe_dropped_route_fraction']:.4f}" if s and "moe_dropped_route_fraction" in s else ""
        if m == "moe-8x" and n > 2: extra += f"  vs ep 2 {ratio(tok(s), base2)}"
        print(f"{label:22s} {n:4d} {fmt(tok(s)):>9s} {ratio(tok(s), base):>6s} {fmt(s and s.get('mem_GiB'), '.1f'):>5s}"
              f" {fmt(tok(f)):>9s} {ratio(tok(s), tok(f)):>7s} {fmt(tok(d)):>9s} {ratio(tok(s), tok(d)):>6s}{extra}")
for n in counts:
    nccl = {}
    p = os.path.join(out, f"nccl_x{n}.txt")
    if os.path.exists(p):
        for line in open(p):
            mm = re.match(r"all_to_all\s+([\d.]+) MiB.*busbw\s+([\d.]+) GB/s", line.strip())
            if mm: nccl[round(float(mm.group(1)))] = float(mm.group(2))
    for r in bench_rows.rows(out, f"a2a_x{n}.jsonl"):
        if "busbw_GBs" not in r: continue
        b = nccl.get(r["mib"])
        print(f"all_to_all x{n} {r['mib']:5d} MiB: Strata {r['busbw_GBs']:7.1f} GB/s bus"
              + (f", NCCL via PyTorch {b:7.1f} GB/s, ratio {r['busbw_GBs'] / b:.3f}" if b else ""))
    s = row(f"strata_nvme_x{n}.jsonl", "dense-350M")
    if s:
        sw = s.get("nvme_swap", {})
        line = f"NVMe optimizer x{n}: {s['tok_s']:.0f} tok/s per GPU, swap pass {fmt(sw.get('GB_s'), '.2f')} GB/s per rank"
        for rw in ("write", "read"):
            p = os.path.join(out, f"fio_{rw}_x{n}.json")
            if os.path.exists(p):
                j = json.load(open(p))["jobs"][0][rw]
                line += f"; fio {rw} {j['bw_bytes'] / 1e9:.2f} GB/s over {n} jobs"
        print(line)
PY
