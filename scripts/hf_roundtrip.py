#!/usr/bin/env python3
"""Strata's Hugging Face export against transformers itself (issue 56).

For each fixture family (tests/models/fixtures: llama3, llama3_tied, qwen3, qwen3_moe,
qwen3_moe_nonorm, mixtral): train_gpt imports the fixture folder (--hf-model) and trains it 10
steps at ZeRO-3 on 2 CPU ranks, the dense models built in shards (--zero-init), the MoE ones with
their experts split over the ranks (moe.ep_size 2), saving a checkpoint and exporting a Hugging
Face folder (--hf-export: the experts back to per-expert names). Then, here:
  1. the exported folder's tensor names, shapes and dtypes equal the fixture's (what
     save_pretrained wrote);
  2. transformers' AutoModelForCausalLM.from_pretrained loads it with no missing, unexpected or
     mismatched key;
  3. its logits (fp32, CPU, eval) on random ids equal Strata's on the same folder (the hf_logits
     tool: Strata's model, weights imported from the folder) within 1e-5 relative
     (max |a - b| / max |b|);
  4. the exported weights are not the fixture's (training moved them).
Prints one JSON line per family and exits non-zero when any check fails.

  python3 scripts/hf_roundtrip.py [--build build] [--steps 10] [--keep DIR]
Needs torch, transformers and safetensors (pip), and the build's train_gpt, strata-run, hf_logits.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def specs(folder):
    """name -> (dtype, shape) of every tensor of a Hugging Face folder."""
    index = os.path.join(folder, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index)
             else ["model.safetensors"])
    out = {}
    for f in files:
        with safe_open(os.path.join(folder, f), "pt") as st:
            for name in st.keys():
                s = st.get_slice(name)
                out[name] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def run_family(family, args, work):
    fixture = os.path.join(ROOT, "tests/models/fixtures", family)
    config = json.load(open(os.path.join(fixture, "config.json")))
    vocab = config["vocab_size"]
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (40000,), generator=g, dtype=torch.int32).to(torch.int16)
    data = os.path.join(work, family + ".bin")
    tokens.numpy().tofile(data)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    moe = "num_local_experts" in config or "num_experts" in config
    if moe:  # experts over both ranks (a model built in shards takes no MoE layer)
        ds["moe"] = {"ep_size": 2}
    ds_path = os.path.join(work, family + ".json")
    json.dump(ds, open(ds_path, "w"))
    save, export = os.path.join(work, family + "_ckpt"), os.path.join(work, family + "_hf")
    bin_dir = os.path.join(args.build, "bin")
    cmd = [os.path.join(bin_dir, "strata-run"), "--num_gpus", "2", "--",
           os.path.join(bin_dir, "train_gpt"), "--device", "cpu", "--config", ds_path,
           "--hf-model", fixture, "--data", "tokens:" + data, "--seq-len", "32",
           "--steps", str(args.steps), "--save-dir", save, "--hf-export", export]
    if not moe:
        cmd.append("--zero-init")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("%s: train_gpt failed:\n%s%s" % (family, r.stdout[-4000:], r.stderr[-4000:]))
    out = os.path.join(export, "step%d" % args.steps)

    result = {"family": family, "folder": out}
    ok = True
    want, got = specs(fixture), specs(out)
    result["same_names_shapes_dtypes"] = want == got
    ok &= want == got
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=torch.float32)
    keys = {k: sorted(map(str, v)) for k, v in info.items() if v}
    result["loading_info"] = keys or "clean"
    ok &= not keys
    model.eval()
    ids = torch.randint(0, vocab, (2, 32), generator=g)
    with torch.no_grad():
        theirs = model(ids).logits.float()
    ids_file, logits_file = os.path.join(work, family + "_ids.safetensors"), os.path.join(
        work, family + "_logits.safetensors")
    save_file({"input_ids": ids}, ids_file)
    subprocess.run([os.path.join(bin_dir, "hf_logits"), out, ids_file, logits_file], check=True,
                   capture_output=True, text=True)
    ours = load_file(logits_file)["logits"]
    rel = ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()
    result["logits_rel"] = rel
    ok &= rel <= 1e-5
    trained = load_file(os.path.join(out, "model.safetensors")) if os.path.exists(
        os.path.join(out, "model.safetensors")) else {}
    start = load_file(os.path.join(fixture, "model.safetensors"))
    moved = max((trained[k] - start[k]).abs().max().item() for k in trained) if trained else 0.0
    result["max_moved_by_training"] = moved
    ok &= moved > 0
    result["ok"] = bool(ok)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--keep", help="work folder to keep (default: a temporary one)")
    p.add_argument("--families", default="llama3,llama3_tied,qwen3,qwen3_moe,qwen3_moe_nonorm,mixtral")
    args = p.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="strata_hf_roundtrip.")
    os.makedirs(work, exist_ok=True)
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__}))
    ok = True
    for family in args.families.split(","):
        r = run_family(family, args, work)
        ok &= r["ok"]
        print(json.dumps(r), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
