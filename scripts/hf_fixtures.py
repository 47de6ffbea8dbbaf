#!/usr/bin/env python3
"""Hugging Face oracle fixtures for Strata's C++ Llama-3 and Qwen3 re-implementations.

What it makes: for each family (llama3, llama3_tied, qwen3) a directory
tests/models/fixtures/<name>/ holding
  config.json         written by HF save_pretrained (transformers 5 spelling, see below)
  model.safetensors   the random initial weights, fp32, HF state-dict names
  oracle.safetensors  what HF computes from them on one batch (B=2, T=32):
      input_ids  I64 [2,32]          random tokens in [0, vocab)
      labels     I64 [2,32]          input_ids with labels[1, 3/17/31] = -100
      logits     F32 [2,32,V]        forward(input_ids), model.train() mode
      loss       F32 []  (0-d)       HF's loss for (input_ids, labels)
      grad.<n>   F32 like param <n>  d loss / d param after one backward
      loss_step0, loss_step1, loss_step2  F32 [] (0-d): loss before each AdamW step
      adamw3.<n> F32 like param <n>  params after 3 AdamW steps on the same batch
    plus __metadata__ strings (versions, optimizer settings, loss reduction, ...).
  <n> is every name in model.safetensors. With tied embeddings lm_head.weight does not
  exist in model.safetensors; the one shared parameter is model.embed_tokens.weight and its
  gradient is the sum of both uses (embedding lookup + output projection).

Loss (transformers 5.25.0, loss/loss_utils.py ForCausalLMLoss + fixed_cross_entropy):
  labels are padded on the right with -100 and shifted left by one, so logits[b, t] is
  scored against labels[b, t+1] and the last position of every row is ignored; logits are
  upcast to fp32; then nn.functional.cross_entropy(logits.view(-1, V), shift_labels.view(-1),
  ignore_index=-100, reduction="mean"), i.e. the SUM of per-token NLL over all non-ignored
  target tokens of the whole batch divided by their COUNT (a token mean, not a mean of row
  means). Here count = 2*31 - 3 = 59. (num_items_in_batch is not passed, so the "sum /
  num_items_in_batch" branch is not taken.)

Model construction: torch.manual_seed(seed); config -> <Family>ForCausalLM(config) (HF init:
Linear/Embedding ~ N(0, initializer_range=0.02), RMSNorm weights = 1); then every RMSNorm
weight (input/post_attention/final norms, Qwen3 q_norm/k_norm) is set to 1 + 0.1*N(0,1)
from a separate seeded generator, so a reader that skips or misplaces norm weights (or uses
Gemma-style 1+w) is caught by the logits, not only by the gradients. CPU, fp32,
attn_implementation="sdpa" (torch SDPA, available on CPU; it matches eager to ~1e-7, and
--check-faults prints the sdpa-vs-eager difference). dropout is 0 (attention_dropout=0.0).

AdamW: torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
weight_decay=0.01), one param group, so decoupled weight decay applies to every parameter
(norm weights and embeddings included); default (foreach/for-loop, not fused, amsgrad off,
maximize off). Each step: zero_grad(set_to_none=True), forward with labels, backward, step.
The 3 steps start from the same initial weights as model.safetensors.

Run by hand, never by tests/CI (needs a Python env with torch + transformers):
    python3 -m venv /work/venv-hf
    /work/venv-hf/bin/pip install torch transformers safetensors
    /work/venv-hf/bin/python scripts/hf_fixtures.py               # writes the fixtures
    /work/venv-hf/bin/python scripts/hf_fixtures.py --check-faults # prints sensitivity figures
    /work/venv-hf/bin/python scripts/hf_fixtures.py --fetch-published  # published config.json files
Last run with: Python 3.11.7, torch 2.15.0 (+cu132 wheel, run on CPU), transformers 5.25.0,
safetensors 0.8.0, huggingface_hub 2.4.0.

config.json spelling: transformers 5 writes RoPE settings as one "rope_parameters" object
({"rope_type", "rope_theta", and for llama3 "factor", "low_freq_factor", "high_freq_factor",
"original_max_position_embeddings"}) and no top-level "rope_theta"/"rope_scaling". Published
checkpoints (written by transformers 4.x) use top-level "rope_theta" plus "rope_scaling"
({"rope_type" (older: "type"), "factor", ...} or null). transformers 5 still reads both
(PreTrainedConfig.convert_rope_params_to_dict); a C++ reader should too.
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys

import torch
from torch import nn

import safetensors
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "models", "fixtures")

B, T = 2, 32
IGNORED = [(1, 3), (1, 17), (1, 31)]  # (row, position) of labels set to -100
NORM_JITTER = 0.1
ATTN = "sdpa"
LR, BETAS, EPS, WD, STEPS = 1e-3, (0.9, 0.999), 1e-8, 0.01, 3

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    hidden_act="silu",
    attention_bias=False,
    initializer_range=0.02,
    rms_norm_eps=1e-5,
    attention_dropout=0.0,
)

# original_max_position_embeddings = 64 (not 32): with head_dim 16 and theta 5e5 the RoPE
# wavelengths are 6.3, 32.5, 168, ... so old_context_len 64 puts one frequency in each
# llama3 regime: kept (< 64/4), smoothly interpolated (16..64) and divided by factor (> 64).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

FAMILIES = {
    "llama3": dict(
        cls=LlamaForCausalLM, cfg=LlamaConfig, seed=1234,
        kw=dict(COMMON, head_dim=16, mlp_bias=False, tie_word_embeddings=False,
                rope_parameters=dict(LLAMA3_ROPE)),
    ),
    "llama3_tied": dict(
        cls=LlamaForCausalLM, cfg=LlamaConfig, seed=4321,
        kw=dict(COMMON, head_dim=16, mlp_bias=False, tie_word_embeddings=True,
                rope_parameters=dict(LLAMA3_ROPE)),
    ),
    "qwen3": dict(
        cls=Qwen3ForCausalLM, cfg=Qwen3Config, seed=2024,
        kw=dict(COMMON, head_dim=32, tie_word_embeddings=True, use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ),
}

LOSS_REDUCTION = (
    "HF ForCausalLMLoss: shift (logits[:, t] vs labels[:, t+1], last position ignored), "
    "fp32 cross_entropy(ignore_index=-100, reduction='mean') over the flattened batch = "
    "sum of NLL over non-ignored target tokens / their count"
)


def save_safetensors_sorted(tensors, path, metadata):
    """safetensors writer with a byte-for-byte repeatable header (safetensors.torch.save_file
    emits __metadata__ in hash-map order, so reruns would differ). Layout as the reference
    writer: data ordered by element size (largest first) then name; header JSON padded with
    spaces so that 8 + len(header) is a multiple of 8."""
    dt = {torch.float32: "F32", torch.int64: "I64"}
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, blobs, off = {"__metadata__": dict(sorted(metadata.items()))}, [], 0
    for k in order:
        t = tensors[k].detach().contiguous().cpu()
        raw = t.numpy().tobytes()
        header[k] = {"dtype": dt[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for raw in blobs:
            f.write(raw)
    from safetensors.torch import load_file
    back = load_file(path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def make_config(name, **overrides):
    fam = FAMILIES[name]
    kw = copy.deepcopy(fam["kw"])
    kw.update(overrides)
    cfg = fam["cfg"](**kw)
    cfg._attn_implementation = ATTN
    return cfg


def build_model(name):
    fam = FAMILIES[name]
    torch.manual_seed(fam["seed"])
    model = fam["cls"](make_config(name)).to(torch.float32)
    gen = torch.Generator().manual_seed(fam["seed"] + 1)
    with torch.no_grad():
        for mod in model.modules():
            if "RMSNorm" in type(mod).__name__:
                mod.weight.copy_(1.0 + NORM_JITTER * torch.randn(mod.weight.shape, generator=gen))
    return model


def make_batch(name, vocab):
    gen = torch.Generator().manual_seed(FAMILIES[name]["seed"] + 2)
    input_ids = torch.randint(0, vocab, (B, T), generator=gen, dtype=torch.int64)
    labels = input_ids.clone()
    for r, c in IGNORED:
        labels[r, c] = -100
    return input_ids, labels


def saved_names(model):
    """Parameter names as they appear in model.safetensors (tied lm_head dropped)."""
    names = [n for n, _ in model.named_parameters()]  # remove_duplicate=True: tied -> one name
    return names


def write_fixture(name):
    out = os.path.join(FIXTURES, name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)

    model = build_model(name)
    model.train()
    cfg = model.config
    init_state = copy.deepcopy(model.state_dict())

    model.save_pretrained(out)
    for f in os.listdir(out):
        if f not in ("config.json", "model.safetensors", "generation_config.json"):
            os.remove(os.path.join(out, f))
        else:
            os.chmod(os.path.join(out, f), 0o644)  # save_pretrained leaves 0600 on the weights

    # The names in model.safetensors must be exactly the parameter names we record.
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        file_names = sorted(f.keys())
        for k in file_names:
            assert f.get_tensor(k).dtype == torch.float32, k
    names = saved_names(model)
    assert sorted(names) == file_names, (sorted(names), file_names)

    input_ids, labels = make_batch(name, cfg.vocab_size)
    oracle = {"input_ids": input_ids, "labels": labels}

    # Forward + backward at the initial weights.
    out_fb = model(input_ids=input_ids, labels=labels)
    oracle["logits"] = out_fb.logits.detach().clone().contiguous()
    oracle["loss"] = out_fb.loss.detach().clone()
    # Cross-check the documented reduction.
    shift_logits = out_fb.logits[:, :-1].reshape(-1, cfg.vocab_size)
    shift_labels = labels[:, 1:].reshape(-1)
    keep = shift_labels != -100
    nll = -torch.log_softmax(shift_logits[keep].double(), -1).gather(1, shift_labels[keep, None]).squeeze(1)
    manual = nll.sum() / keep.sum()
    assert keep.sum().item() == B * (T - 1) - sum(1 for _, c in IGNORED if c >= 1)
    assert abs(manual.item() - out_fb.loss.item()) < 1e-5, (manual.item(), out_fb.loss.item())
    out_fb.loss.backward()
    params = dict(model.named_parameters())
    for n in names:
        oracle["grad." + n] = params[n].grad.detach().clone().contiguous()

    # 3 AdamW steps from the same initial weights.
    model.load_state_dict(init_state)
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        o = model(input_ids=input_ids, labels=labels)
        oracle[f"loss_step{s}"] = o.loss.detach().clone()
        o.loss.backward()
        opt.step()
    assert torch.equal(oracle["loss_step0"], oracle["loss"])
    params = dict(model.named_parameters())
    for n in names:
        oracle["adamw3." + n] = params[n].detach().clone().contiguous()

    meta = {
        "family": name,
        "hf_class": type(model).__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "python_version": sys.version.split()[0],
        "attn_implementation": ATTN,
        "device": "cpu",
        "dtype": "float32",
        "seed": str(FAMILIES[name]["seed"]),
        "norm_weight_init": f"1 + {NORM_JITTER} * N(0,1) (HF default would be ones)",
        "batch": f"B={B} T={T}",
        "ignored_labels": json.dumps(IGNORED),
        "mode": "model.train(), dropout 0",
        "loss_reduction": LOSS_REDUCTION,
        "loss_shape": "0-d (shape [])",
        "optimizer": "torch.optim.AdamW, one param group (weight decay on all params), not fused, amsgrad=False",
        "lr": repr(LR),
        "betas": json.dumps(list(BETAS)),
        "eps": repr(EPS),
        "weight_decay": repr(WD),
        "steps": str(STEPS),
        "step": "zero_grad(set_to_none=True); loss = forward(labels); loss.backward(); opt.step()",
        "tied_embeddings": str(bool(cfg.tie_word_embeddings)).lower(),
    }
    save_safetensors_sorted(oracle, os.path.join(out, "oracle.safetensors"), meta)

    print(f"{name}: loss {oracle['loss'].item():.6f} steps "
          + " ".join(f"{oracle[f'loss_step{s}'].item():.6f}" for s in range(STEPS)))
    for f in sorted(os.listdir(out)):
        print(f"  {f:24s} {os.path.getsize(os.path.join(out, f)):8d} bytes")


# ----------------------------------------------------------------------------------------
# --check-faults: each single change must move the logits by > 1e-3 relative.

def logits_of(model, input_ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def rebuilt(name, state, **overrides):
    """Same weights, config changed."""
    torch.manual_seed(0)
    m = FAMILIES[name]["cls"](make_config(name, **overrides)).to(torch.float32)
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    return m, missing


def permute_heads(state, layer_count, n_heads, head_dim, perm):
    """Reorder q heads (q_proj rows, o_proj columns): emulates a kv-head mapping change."""
    st = copy.deepcopy(state)
    idx = torch.cat([torch.arange(p * head_dim, (p + 1) * head_dim) for p in perm])
    for l in range(layer_count):
        q = f"model.layers.{l}.self_attn.q_proj.weight"
        o = f"model.layers.{l}.self_attn.o_proj.weight"
        st[q] = st[q][idx].clone()
        st[o] = st[o][:, idx].clone()
    return st


def interleaved_rope_state(state, cfg):
    """Weights on which HF's rotate_half RoPE equals GPT-J/Meta interleaved RoPE on the
    original weights: within every q/k head put dims (0,2,4,..,1,3,5,..)."""
    st = copy.deepcopy(state)
    d = cfg.head_dim
    within = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    for l in range(cfg.num_hidden_layers):
        for proj, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads)):
            k = f"model.layers.{l}.self_attn.{proj}.weight"
            idx = torch.cat([h * d + within for h in range(heads)])
            st[k] = st[k][idx].clone()
        for nrm in ("q_norm", "k_norm"):
            k = f"model.layers.{l}.self_attn.{nrm}.weight"
            if k in st:
                st[k] = st[k][within].clone()
    return st


def check_faults():
    results = []

    def report(fam, what, a, b):
        r = rel(a, b)
        results.append((fam, what, r))
        print(f"  {fam:12s} {what:58s} {r:.3e} {'ok' if r > 1e-3 else 'TOO SMALL'}")

    for name in ("llama3", "llama3_tied", "qwen3"):
        model = build_model(name)
        cfg = model.config
        state = copy.deepcopy(model.state_dict())  # includes lm_head.weight even when tied
        input_ids, _ = make_batch(name, cfg.vocab_size)
        ref = logits_of(model, input_ids)

        # sanity: sdpa vs eager (should be ~1e-7, i.e. not a fault)
        m_eager, _ = rebuilt(name, state)
        m_eager.config._attn_implementation = "eager"
        print(f"  {name:12s} {'(sdpa vs eager, not a fault)':58s} {rel(logits_of(m_eager, input_ids), ref):.3e}")

        if name == "llama3":
            d = cfg.head_dim
            base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
            rp = cfg.rope_parameters
            wl = 2 * math.pi / base
            lo, hi = rp["original_max_position_embeddings"] / rp["low_freq_factor"], rp["original_max_position_embeddings"] / rp["high_freq_factor"]
            bands = ["keep" if w < hi else ("divide" if w > lo else "smooth") for w in wl.tolist()]
            print(f"  llama3 rope wavelengths {[round(w, 1) for w in wl.tolist()]}")
            print(f"  llama3 rope bands       {bands}")

        rope = dict(cfg.rope_parameters)
        m, _ = rebuilt(name, state, rope_parameters=dict(rope, rope_theta=10000.0))
        report(name, "rope_theta = 10000", logits_of(m, input_ids), ref)

        if rope["rope_type"] == "llama3":
            m, _ = rebuilt(name, state, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]})
            report(name, "rope_scaling removed", logits_of(m, input_ids), ref)
            # smooth band handled as 'keep' (no interpolation)
            m, _ = rebuilt(name, state)
            rp = cfg.rope_parameters
            base = 1.0 / (rp["rope_theta"] ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
            wl = 2 * math.pi / base
            lo = rp["original_max_position_embeddings"] / rp["low_freq_factor"]
            hi = rp["original_max_position_embeddings"] / rp["high_freq_factor"]
            wrong = torch.where(wl > lo, base / rp["factor"], base)
            m.model.rotary_emb.inv_freq = wrong
            report(name, "llama3 smooth band not interpolated", logits_of(m, input_ids), ref)

        m, _ = rebuilt(name, state, rms_norm_eps=1e-6)
        report(name, "rms_norm_eps = 1e-6", logits_of(m, input_ids), ref)

        # kv mapping: HF gives q head h the kv head h // n_rep (repeat_interleave). A
        # 'tiled' mapping (h % n_kv) equals HF on weights with q heads reordered [0,2,1,3].
        n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        perm = [kv + r * cfg.num_key_value_heads for kv in range(cfg.num_key_value_heads) for r in range(n_rep)]
        # slot s = kv*n_rep + r must hold the q head h with h % n_kv == kv
        m, _ = rebuilt(name, permute_heads(state, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, perm))
        report(name, f"kv heads tiled (h % n_kv), q-head order {perm}", logits_of(m, input_ids), ref)

        m, _ = rebuilt(name, interleaved_rope_state(state, cfg))
        report(name, "RoPE interleaved pairs instead of rotate_half", logits_of(m, input_ids), ref)

        if cfg.tie_word_embeddings:
            st = copy.deepcopy(state)
            g = torch.Generator().manual_seed(99)
            st["lm_head.weight"] = torch.randn(st["lm_head.weight"].shape, generator=g) * cfg.initializer_range
            m, _ = rebuilt(name, st, tie_word_embeddings=False)
            report(name, "untied: separate random lm_head", logits_of(m, input_ids), ref)
        else:
            st = {k: v for k, v in state.items() if k != "lm_head.weight"}
            m, _ = rebuilt(name, st, tie_word_embeddings=True)
            assert m.lm_head.weight is m.model.embed_tokens.weight
            report(name, "tied: lm_head = embed_tokens", logits_of(m, input_ids), ref)

        if name == "qwen3":
            m, _ = rebuilt(name, state)
            for layer in m.model.layers:
                layer.self_attn.q_norm = nn.Identity()
                layer.self_attn.k_norm = nn.Identity()
            report(name, "q_norm/k_norm replaced by identity", logits_of(m, input_ids), ref)
            m, _ = rebuilt(name, state)
            for layer in m.model.layers:
                layer.self_attn.q_norm.weight.data.fill_(1.0)
                layer.self_attn.k_norm.weight.data.fill_(1.0)
            report(name, "q_norm/k_norm weights ignored (ones)", logits_of(m, input_ids), ref)

        m, _ = rebuilt(name, state)
        for mod in m.modules():
            if "RMSNorm" in type(mod).__name__:
                mod.weight.data.fill_(1.0)
        report(name, "all RMSNorm weights ignored (ones)", logits_of(m, input_ids), ref)

    bad = [r for r in results if r[2] <= 1e-3]
    print("all faults > 1e-3" if not bad else f"{len(bad)} fault(s) at or below 1e-3")
    return not bad


# ----------------------------------------------------------------------------------------
# --fetch-published: real config.json files, saved byte for byte.

PUBLISHED = [
    ("meta-llama/Llama-3.1-8B", "unsloth/Meta-Llama-3.1-8B"),
    ("meta-llama/Llama-3.2-1B", "unsloth/Llama-3.2-1B"),
    ("Qwen/Qwen3-0.6B", None),
    ("Qwen/Qwen3-8B", None),
]


def fetch_published():
    from huggingface_hub import hf_hub_download
    dst_dir = os.path.join(FIXTURES, "published")
    for repo, mirror in PUBLISHED:
        for src in [repo] + ([mirror] if mirror else []):
            try:
                p = hf_hub_download(src, "config.json")
            except Exception as e:  # gated / unreachable
                print(f"  {src}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                continue
            os.makedirs(dst_dir, exist_ok=True)
            dst = os.path.join(dst_dir, src.replace("/", "--") + ".config.json")
            shutil.copyfile(p, dst)
            print(f"  {src}: saved {dst}")
            break


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-faults", action="store_true", help="print logits sensitivity figures only")
    ap.add_argument("--fetch-published", action="store_true", help="download published config.json files only")
    args = ap.parse_args()
    torch.set_num_threads(1)  # bit-for-bit repeatable CPU reductions
    if args.check_faults:
        sys.exit(0 if check_faults() else 1)
    if args.fetch_published:
        fetch_published()
        return
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, attn {ATTN}")
    for name in FAMILIES:
        write_fixture(name)


if __name__ == "__main__":
    main()
