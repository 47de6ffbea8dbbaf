#!/usr/bin/env python3
"""Seeded faults for the differential matrix (issue 30, docs/matrix.md).

Each fault below is a plausible one-line bug in a different file of zero/, offload/, moe/ or
runtime/, on a path the matrix's oracle (one process, stage 0, no offload, ep_size 1) does not
share, written down before the matrix ran on it. For each: a scratch worktree of HEAD gets the
fault, train_gpt and strata-run are built there, and the matrix's CI sample (the fixed seed,
random descriptions not written for any fault) runs against them until its first failure.

    tests/matrix/seeded_faults.py [--build BUILD_DIR] [--work DIR] [--only N,...] [--soak N]

Prints one line per fault (caught or not, by which description) and writes report.md in --work.
A fault the CI sample misses gets, with --soak N, N more random descriptions (seed 31, up to 4
ranks, as scripts/soak.sh draws them) until the first failure.
"""
import argparse
import json
import os
import subprocess
import sys
import time

# (file, the line as it is, the line with the fault, what the bug is)
FAULTS = [
    ("zero/gradient_reducer.cpp",
     "bucket.work = group_->all_reduce_async(bucket.flat, comm::ReduceOp::Avg);",
     "bucket.work = group_->all_reduce_async(bucket.flat, comm::ReduceOp::Sum);",
     "stage-0 buckets summed over the ranks, not averaged"),
    ("offload/cpu_adam.cpp",
     "const int64_t per = ((n + threads - 1) / threads + 63) / 64 * 64;",
     "const int64_t per = (n / threads + 63) / 64 * 64;",
     "the CPU Adam's per-thread split drops the last n % threads elements"),
    ("zero/partitioned_optimizer.cpp",
     "    group_->all_reduce(sum_squares, comm::ReduceOp::Sum);",
     "    ;",
     "the partitions' squared norms not summed over the ranks (each rank clips by its own)"),
    ("runtime/engine_checkpoint.cpp",
     "const int64_t micro_steps = global_steps * gradient_accumulation_steps();",
     "const int64_t micro_steps = saved_micro_steps;",
     "the saved micro-step counter restored as is (another accumulation after a world change)"),
    ("runtime/engine_experts.cpp",
     "void Engine::follow_lr_schedule() {",
     "void Engine::follow_lr_schedule() { return;",
     "the experts' optimizer never follows the LR schedule"),
    ("offload/optimizer_swapper.cpp",
     "      start_write(cur, t, 0b111);",
     "      if (t + 1 < n) start_write(cur, t, 0b111);",
     "NVMe optimizer state: the last tile is never written back (stale after the step)"),
    ("moe/layer.cpp",
     "      group->all_reduce(t, comm::ReduceOp::Max);",
     "      group->all_reduce(t, comm::ReduceOp::Min);",
     "the EP group agrees on the smallest load / token count instead of the largest"),
    ("zero/param_offload.cpp",
     "    partition_.narrow(0, lo, n).copy_(values, /*non_blocking=*/values.is_pinned());",
     "    partition_.narrow(0, lo, n - 1).copy_(values.narrow(0, 0, n - 1), values.is_pinned());",
     "offload_param cpu: the last element of each written range is not stored"),
    ("zero/shard_map.cpp",
     "    const int64_t n = std::min(p.length, flat.numel() - p.flat_begin);\n"
     "    part.narrow(0, p.offset, n).copy_(flat.narrow(0, p.flat_begin, n));",
     "    const int64_t n = std::min(p.length, flat.numel() - p.flat_begin) - 1;\n"
     "    part.narrow(0, p.offset, n).copy_(flat.narrow(0, p.flat_begin, n));",
     "ShardMap::gather leaves the last element of each piece at zero (master init, resume)"),
    ("runtime/engine.cpp",
     "  return (micro_steps_ + 1) % gradient_accumulation_steps() == 0;",
     "  return micro_steps_ % gradient_accumulation_steps() == 0;",
     "the accumulation boundary one micro-step early"),
    ("runtime/util/recompute.h",
     "    value = r->tape[r->cursor++];",
     "    value = std::forward<Compute>(compute)(), ++r->cursor;",
     "activation checkpointing: the recomputation draws a new value (the MoE gate's noise key) "
     "instead of replaying the forward's"),
    ("runtime/checkpointing/saved_inputs.cpp",
     "        if (a.live == 0) a.used = 0;",
     "        if (a.live <= 1) a.used = 0;",
     "contiguous_memory_optimization: the buffer restarts while a checkpoint in it is still live "
     "(the next checkpoint overwrites its inputs)"),
    ("runtime/checkpointing/replay_state.cpp",
     "  set_state(at::detail::getDefaultCPUGenerator(), g.cpu);",
     "  ;",
     "activation checkpointing: the CPU generator is not put back (the recomputation's dropout "
     "draws other masks than the forward's)"),
]


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=True, text=True, capture_output=True, **kw)


def main():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(repo, "build"))
    ap.add_argument("--work", default=os.path.join(repo, "build", "seeded-faults"))
    ap.add_argument("--only", default="")
    ap.add_argument("--soak", type=int, default=0)
    args = ap.parse_args()
    only = {int(x) for x in args.only.split(",") if x}
    work = os.path.abspath(args.work)
    tree = os.path.join(work, "tree")
    os.makedirs(work, exist_ok=True)
    if not os.path.isdir(tree):
        r = sh(f"git -C {repo} worktree add --detach {tree} HEAD")
        if r.returncode:
            sys.exit(r.stderr)
    sh(f"git -C {tree} checkout --detach {sh(f'git -C {repo} rev-parse HEAD').stdout.strip()}")
    r = sh(f"cmake -S {tree} -B {tree}/build -G Ninja -DCMAKE_BUILD_TYPE=Release")
    if r.returncode:
        sys.exit(r.stdout + r.stderr)
    matrix = os.path.join(args.build, "bin", "strata-matrix")
    rows = []
    for i, (path, before, after, what) in enumerate(FAULTS, 1):
        if only and i not in only:
            continue
        sh(f"git -C {tree} checkout -- .")
        text = open(os.path.join(tree, path)).read()
        if text.count(before) != 1:
            sys.exit(f"fault {i}: {path} holds {text.count(before)} copies of the line")
        open(os.path.join(tree, path), "w").write(text.replace(before, after))
        t0 = time.time()
        b = sh(f"cmake --build {tree}/build -j2 --target train_gpt strata-run")
        if b.returncode:
            rows.append((i, path, what, "BUILD FAILED", b.stdout[-2000:]))
            print(f"{i:2d} {path}: build failed", flush=True)
            continue
        out = os.path.join(work, f"fault{i}")
        sh(f"rm -rf {out}")
        found, ran, sample = None, 0, "the CI sample"
        for mode in ["--ci"] + ([f"--seed 31 --count {args.soak} --max-world 4"] if args.soak else []):
            sh(f"rm -rf {out} {out}.jsonl")
            sh(f"{matrix} {mode} --no-shrink --first-failure --bin {tree}/build/bin "
               f"--tools {args.build}/bin --work {out} --jsonl {out}.jsonl")
            ran = 0
            if os.path.exists(out + ".jsonl"):
                for line in open(out + ".jsonl"):
                    row = json.loads(line)
                    ran += 1
                    if row["outcome"] not in ("pass", "refused-as-predicted"):
                        found = row
            if found:
                break
            sample = f"{args.soak} soak descriptions (seed 31)"
        verdict = (f"CAUGHT by description {ran} of {sample} ({found['outcome']}): "
                   f"{found['summary']}\n"
                   f"      {found.get('detail', '').splitlines()[0] if found.get('detail') else ''}"
                   if found else f"not caught ({ran} descriptions of {sample})")
        print(f"{i:2d} {path}: {what}: {verdict} [{time.time() - t0:.0f} s]", flush=True)
        rows.append((i, path, what, verdict, ""))
    sh(f"git -C {tree} checkout -- .")
    caught = sum(1 for r in rows if r[3].startswith("CAUGHT"))
    with open(os.path.join(work, "report.md"), "w") as f:
        f.write(f"# Seeded faults: {caught} of {len(rows)} caught\n\n")
        for i, path, what, verdict, extra in rows:
            f.write(f"{i}. `{path}`: {what}. {verdict}\n{extra}\n")
    print(f"{caught} of {len(rows)} caught; report in {work}/report.md")


if __name__ == "__main__":
    main()
