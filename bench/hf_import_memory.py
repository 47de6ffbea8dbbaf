#!/usr/bin/env python3
"""Host memory of a Hugging Face import (issue 56), measured from the processes (VmHWM).

Makes a Llama folder with transformers (random weights, fp32, shards of 100 MB: files larger than
the per-rank bound below), then trains it with train_gpt --hf-model for a few steps:
  A  ZeRO-3 on 2 ranks, bf16, built in shards (--zero-init: each rank reads only its shards),
     offload_param and offload_optimizer on NVMe (swap files under --swap)
  B  the same without --zero-init: every rank builds the model whole and reads every tensor
  C  ZeRO-0 on 1 rank, bf16;  D  ZeRO-2 on 1 rank, bf16
and reads each rank's "host memory ... peak" lines (VmRSS before the model, VmHWM after the import
and at the end). The bound of an import in shards is the process before the model + its shards
(the model's elements / ranks, in the 16-bit dtype) + one tensor (below) + 2 read tiles;
A's peak after the import must be within it, and A's losses must be B's bit for bit. (The largest
tensor counts whole in fp32, as the constructor builds it, plus this rank's 16-bit chunk of it.)
Prints a JSON line per run and one summary line.

  python3 bench/hf_import_memory.py [--build build] [--hidden 1024] [--layers 8] [--steps 3]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(folder, args):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 256, max_position_embeddings=2048, rope_theta=500000.0,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder, max_shard_size="100MB")


def run(name, cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit("%s failed:\n%s\n%s" % (name, r.stdout[-3000:], r.stderr[-3000:]))
    out = r.stdout + r.stderr
    ranks = {}
    for m in re.finditer(r"rank (\d+) imported .*?read(: its shards)?\) in ([0-9.]+) s; host memory "
                         r"([0-9.]+) MB before the model, ([0-9.]+) MB built, ([0-9.]+) MB now, peak ([0-9.]+) MB", out):
        ranks[int(m.group(1))] = {"import_s": float(m.group(3)), "before_mb": float(m.group(4)),
                                  "built_mb": float(m.group(5)),
                                  "after_import_mb": float(m.group(6)),
                                  "peak_after_import_mb": float(m.group(7))}
    for m in re.finditer(r"rank (\d+) host memory peak ([0-9.]+) MB", out):
        ranks.setdefault(int(m.group(1)), {})["peak_at_end_mb"] = float(m.group(2))
    return ranks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--work", default=None)
    p.add_argument("--runs", default="A,B,C,D", help="which runs (the summary needs all four)")
    args = p.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="strata_hf_memory.")
    folder = os.path.join(work, "llama")
    if not os.path.exists(os.path.join(folder, "config.json")):
        make_model(folder, args)
    files = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                if f.endswith(".safetensors"))
    cfg = json.load(open(os.path.join(folder, "config.json")))
    # The parameters and the largest tensor (the embedding / head), from the config.
    h, l, v, i = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    numel = l * per_layer + 2 * v * h + h
    largest = v * h
    tokens = os.path.join(work, "tokens.bin")
    import numpy as np
    np.random.default_rng(0).integers(0, min(v, 65535), 200000, dtype=np.uint16).tofile(tokens)
    bin_dir = os.path.join(args.build, "bin")

    def train(name, stage, ranks, zero_init, nvme):
        ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // ranks // 1,
              "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage}}
        if stage == 3:  # the optimizer streams tiles of 1e7 elements (default 1e9: everything)
            ds["zero_optimization"]["sub_group_size"] = 10 ** 7
        if nvme:
            swap = os.path.join(work, "swap_" + name)
            os.makedirs(swap, exist_ok=True)
            ds["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": swap}
            ds["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
        cfg_path = os.path.join(work, name + ".json")
        json.dump(ds, open(cfg_path, "w"))
        metrics = os.path.join(work, name + ".jsonl")
        cmd = [os.path.join(bin_dir, "strata-run"), "--num_gpus", str(ranks), "--",
               os.path.join(bin_dir, "train_gpt"), "--device", "cpu", "--config", cfg_path,
               "--hf-model", folder, "--data", "tokens:" + tokens, "--seq-len", "64",
               "--steps", str(args.steps), "--metrics-jsonl", metrics]
        if zero_init:
            cmd.append("--zero-init")
        mem = run(name, cmd)
        losses = [json.loads(line)["loss"] for line in open(metrics)]
        return mem, losses

    results = {}
    for name, stage, ranks, zero_init, nvme in [("A_zero3_nvme_shards", 3, 2, True, True),
                                                ("B_zero3_nvme_whole", 3, 2, False, True),
                                                ("C_zero0", 0, 1, False, False),
                                                ("D_zero2", 2, 1, False, False)]:
        if name[0] not in args.runs.split(","):
            continue
        mem, losses = train(name, stage, ranks, zero_init, nvme)
        results[name] = {"ranks": mem, "losses": losses}
        print(json.dumps({"run": name, "stage": stage, "ranks": ranks, "zero_init": zero_init,
                          "nvme": nvme, "memory": mem, "losses": losses}), flush=True)
    if len(results) < 4:
        return
    tile_mb = 2 * 8 * 2 ** 20 / 1e6
    a = results["A_zero3_nvme_shards"]["ranks"]
    shard_mb = numel * 2 / 2 / 1e6
    # The one tensor: the largest, whole in fp32 as the constructor builds it, and this rank's
    # 16-bit chunk of it while it is cut.
    largest_mb = largest * 4 / 1e6 + largest * 2 / 2 / 1e6
    bound = {r: a[r]["before_mb"] + shard_mb + largest_mb + tile_mb for r in a}
    summary = {
        "files_mb": files / 1e6, "parameters": numel, "shard_mb_per_rank_bf16": shard_mb,
        "largest_tensor_fp32_plus_chunk_mb": largest_mb,
        "A_bound_mb": bound,
        "A_peak_after_import_mb": {r: a[r]["peak_after_import_mb"] for r in a},
        "A_within_bound": all(a[r]["peak_after_import_mb"] <= bound[r] for r in a),
        "A_peak_at_end_mb": {r: a[r].get("peak_at_end_mb") for r in a},
        "B_peak_after_import_mb": {r: results["B_zero3_nvme_whole"]["ranks"][r]["peak_after_import_mb"]
                                   for r in results["B_zero3_nvme_whole"]["ranks"]},
        "A_losses_equal_B": results["A_zero3_nvme_shards"]["losses"] == results["B_zero3_nvme_whole"]["losses"],
        "C_peak_after_import_mb": results["C_zero0"]["ranks"][0]["peak_after_import_mb"],
        "D_peak_after_import_mb": results["D_zero2"]["ranks"][0]["peak_after_import_mb"],
        "C_D_model_fp32_mb": numel * 4 / 1e6,
    }
    print(json.dumps(summary))
    sys.exit(0 if summary["A_within_bound"] and summary["A_losses_equal_B"] else 1)


if __name__ == "__main__":
    main()
