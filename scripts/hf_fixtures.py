#!/usr/bin/env python3
"""Hugging Face oracle fixtures for Strata's C++ Llama-3, Qwen3, Qwen3-MoE and Mixtral re-implementations.

What it makes: for each family (llama3, llama3_tied, qwen3; MoE: qwen3_moe, qwen3_moe_nonorm,
mixtral, see below) a directory tests/models/fixtures/<name>/ holding
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
  <n> is every name in model.safetensors (for the MoE families the per-expert FILE names, which
  differ from the in-memory stacked parameters, see below). With tied embeddings lm_head.weight
  does not exist in model.safetensors; the one shared parameter is model.embed_tokens.weight and its
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
    /work/venv-hf/bin/python scripts/hf_fixtures.py --families qwen3_moe,mixtral  # only these
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

MoE families (transformers 5.25.0; paths below are relative to site-packages/transformers/):
  qwen3_moe         Qwen3MoeForCausalLM, num_experts 4, num_experts_per_tok 2, moe_intermediate_size
                    32, norm_topk_prob true, both layers MoE (decoder_sparse_step 1, mlp_only_layers
                    []), seed 3014
  qwen3_moe_nonorm  the same with norm_topk_prob false and mlp_only_layers [1]: layer 0 MoE, layer 1
                    a dense SwiGLU MLP (intermediate_size 128), seed 3303
  mixtral           MixtralForCausalLM, num_local_experts 4, num_experts_per_tok 2, intermediate_size
                    32 (per expert), router_jitter_noise 0, both layers MoE, seed 8007
  All three: COMMON dims, head_dim 16, untied lm_head (both configs' default), rope_parameters
  {"rope_type": "default", "rope_theta": 1e6}, router_aux_loss_coef 0.01, output_router_logits false
  in config.json. HF init also draws the router weight and the stacked expert tensors from
  N(0, 0.02) (Qwen3MoePreTrainedModel/MixtralPreTrainedModel._init_weights). Seeds were picked (a
  scan of a few dozen) so that in every forward made for the fixture (plain and aux passes, all 3
  AdamW steps) the k-th routing probability beats the (k+1)-th by more than MIN_TOPK_MARGIN = 1e-4
  (the minimum is ~2e-4, stored as metadata min_topk_margin; write_fixture asserts it): fp32
  rounding differences in a re-implementation cannot flip an expert choice. (HF-default seeds give
  margins down to ~4e-6.) experts_implementation is set explicitly to "grouped_mm", transformers'
  default (also on CPU with torch >= 2.9); on this batch the eager per-expert loop gives
  bit-identical logits (--check-faults prints it).

  Extra oracle tensors (MoE families only):
      router_logits.<l>   F32 [B*T, E]  MoE layer l's router logits, rows b*T + t, at the initial
                                        weights (separate forward, output_router_logits=True). One per
                                        MoE layer: qwen3_moe_nonorm has only router_logits.0.
      aux.loss            F32 []        LM loss + router_aux_loss_coef * aux_loss (output_router_logits=True)
      aux.aux_loss        F32 []        the load-balancing loss alone (model output .aux_loss)
      aux.grad.<n>, aux.loss_step0..2, aux.adamw3.<n>  as the plain set, but with that total loss
  The plain set (logits, loss, grad.*, loss_step*, adamw3.*) is output_router_logits=False, i.e. the
  LM loss only. (aux.logits would equal logits bit for bit, checked, and is not stored.)

  Expert weights, in memory vs in model.safetensors. In memory transformers 5.25 keeps each MoE
  layer's experts FUSED AND STACKED in two nn.Parameters, no per-expert nn.Linear
  (models/qwen3_moe/modeling_qwen3_moe.py:211-220 Qwen3MoeExperts, models/mixtral/modeling_mixtral.py:
  57-66 MixtralExperts), plus the router (TopKRouter) weight:
      model.layers.L.mlp.experts.gate_up_proj  [E, 2*I, H]   rows [:I] = gate, rows [I:] = up
      model.layers.L.mlp.experts.down_proj     [E, H, I]
      model.layers.L.mlp.gate.weight           [E, H]
  save_pretrained(save_original_format=True, the default; modeling_utils.py:3331, 3542-3543) runs
  revert_weight_conversion (core_model_loading.py:2024) with the conversion_mapping.py rules
  ("qwen3_moe" uses the "qwen2_moe" rules, lines 68 and 1463-1475; "mixtral", lines 1436-1462), so
  the FILE holds the per-expert (transformers-4 / published-checkpoint) layout. Per MoE layer here
  (E=4, I=32, H=64), besides the attention and norm tensors of the dense families:
    qwen3_moe (layers 0 and 1), qwen3_moe_nonorm (layer 0):
      model.layers.L.mlp.gate.weight                        [4, 64]
      model.layers.L.mlp.experts.{0,1,2,3}.gate_proj.weight [32, 64]  = gate_up_proj[e, :32]
      model.layers.L.mlp.experts.{0,1,2,3}.up_proj.weight   [32, 64]  = gate_up_proj[e, 32:]
      model.layers.L.mlp.experts.{0,1,2,3}.down_proj.weight [64, 32]  = down_proj[e]
    qwen3_moe_nonorm layer 1 (dense): model.layers.1.mlp.gate_proj.weight [128, 64],
      model.layers.1.mlp.up_proj.weight [128, 64], model.layers.1.mlp.down_proj.weight [64, 128]
    mixtral (layers 0 and 1; the module is called block_sparse_moe in the file, mlp in memory):
      model.layers.L.block_sparse_moe.gate.weight               [4, 64]
      model.layers.L.block_sparse_moe.experts.{0,1,2,3}.w1.weight [32, 64]  gate = gate_up_proj[e, :32]
      model.layers.L.block_sparse_moe.experts.{0,1,2,3}.w3.weight [32, 64]  up   = gate_up_proj[e, 32:]
      model.layers.L.block_sparse_moe.experts.{0,1,2,3}.w2.weight [64, 32]  down = down_proj[e]
  from_pretrained accepts that per-expert file (per target: MergeModulelist(dim=0) stacks the experts,
  Concatenate(dim=1) puts [gate; up], core_model_loading.py:259/187) and also a stacked file written
  with save_original_format=False (names = the in-memory names). write_fixture checks that the file
  equals the in-memory tensors split by to_file_names bit for bit, and that from_pretrained(fixture
  dir) returns the same state dict and bit-identical logits. grad.<n>, adamw3.<n> and the aux.*
  versions are keyed by the FILE names and shapes: the stacked gradients / parameters are split per
  expert in the same way (AdamW is elementwise, so splitting after the steps equals stepping the
  per-expert tensors).
  config.json: Qwen3MoeConfig has attribute_map {"num_experts": "num_local_experts"}
  (models/qwen3_moe/configuration_qwen3_moe.py:50-52), so the written config.json says
  "num_local_experts": 4 and has NO "num_experts" key, while published Qwen3-MoE config.json files
  (transformers 4) say "num_experts"; transformers reads both, a C++ reader should too.

  Routing, per MoE block (x = post_attention_layernorm output flattened to [N = B*T, H]):
    router_logits = F.linear(x, gate.weight)          [N, E], model dtype (fp32 here)
    qwen3_moe (modeling_qwen3_moe.py:259-268, Qwen3MoeTopKRouter.forward):
      probs = softmax(router_logits, dim=-1, dtype=float32)   over ALL E experts
      w, idx = topk(probs, k)                                 slot 0 = most probable
      if norm_topk_prob: w /= w.sum(-1, keepdim=True)         in float32
      w = w.to(router_logits.dtype)                           cast back to the model dtype
    mixtral (modeling_mixtral.py:104-111, MixtralTopKRouter.forward): probs = softmax(router_logits
      .float(), -1); w, idx = topk(probs, k); w /= w.sum(-1) ALWAYS (there is no norm_topk_prob);
      w stays float32 (no cast back). In training MixtralSparseMoeBlock multiplies its input by
      U(1-j, 1+j) noise when router_jitter_noise j > 0 (lines 124-125); j = 0 here.
    experts (integrations/moe.py:424-537 grouped_mm_experts_forward; the eager loop is
      modeling_qwen3_moe.py:223-247 / modeling_mixtral.py:69-93): for token t, slot j, e = idx[t, j]:
        gate, up = (x_t @ gate_up_proj[e]^T).chunk(2, -1)      first I outputs = gate
        y_tj = (silu(gate) * up) @ down_proj[e]^T              (integrations/moe.py:568-579)
      out_t = sum_j w[t, j] * y_tj    (grouped_mm: rows sorted by expert, weighted, un-permuted, summed
      over the k slots by reshape+sum; eager: index_add_ in expert order; with k = 2 both are one
      fp32 add, so identical)
      The LM loss reaches the router only through w (topk values); the expert choice is constant.
    dense layer (Qwen3MoeMLP, modeling_qwen3_moe.py:205-206): down_proj(silu(gate_proj(x)) * up_proj(x)).
    A qwen3_moe layer is MoE iff (line 310) layer_idx not in mlp_only_layers and num_experts > 0 and
    (layer_idx + 1) % decoder_sparse_step == 0.

  Load-balancing loss: load_balancing_loss_func (modeling_qwen3_moe.py:504-573; an identical copy at
  modeling_mixtral.py:475-544), called by <Family>ForCausalLM.forward (qwen3_moe 654-662, mixtral
  625-633) only when output_router_logits is true (argument, else config), with gate_logits = the
  tuple of the MoE layers' router_logits (captured by OutputRecorder(<Family>TopKRouter, index=0);
  dense layers contribute nothing), num_experts = E, top_k = num_experts_per_tok, and the forward's
  attention_mask (None here, so the unmasked branch). Over the L MoE layers:
    p_l      = softmax(router_logits_l, -1)        over all E experts (fp32 here)
    sel_l    = topk(p_l, k).indices                same choice as the routing
    count_e  = #(row, slot) pairs, all layers together, with sel = e   (torch.histc, fp32 on CPU)
    psum_e   = sum over all layers and rows of p_l[row, e]
    R        = L * N rows in total
    tokens_per_expert = count / R  (sums to k);  router_prob_per_expert = psum / R
    aux_loss = E * sum_e tokens_per_expert_e * router_prob_per_expert_e
  That equals the older formulation (torch.cat all layers' logits into [L*N, E], mean over rows of
  the one-hot top-k mask and of the softmax), written as running sums; it is NOT the mean of the
  per-layer losses (--check-faults). Perfectly balanced routing gives aux_loss = k = 2. Gradient
  flows only through router_prob_per_expert (the softmax); the counts are constants. With an
  attention_mask each row is weighted by the flat [B*T] mask (counts: scatter_add of the mask
  repeated k times; psum weighted by the mask; R = L * mask.sum()). Labels do not enter: all B*T
  rows count, including the three with label -100. The final loss: loss = ForCausalLMLoss(...) (as
  above), then `loss += router_aux_loss_coef * aux_loss.to(loss.device)` (0-d fp32; .to is only a
  device move). write_fixture checks aux.aux_loss against ref_aux_loss (a plain re-implementation of
  the formula above) and aux.loss == loss + 0.01 * aux.aux_loss bit for bit, and each MoE block's
  output against ref_moe_block (routing as above from the FILE's per-expert tensors).

--check-faults (optionally --families a,b) prints, per family, the relative change (max|a-b| /
max|b|) of the logits under seeded faults, which must exceed 1e-3. MoE families add: renormalising
the top-k weights when the family does not (qwen3_moe_nonorm) or not renormalising when it does
(qwen3_moe, mixtral); the aux loss as the mean of per-layer losses (figure: aux_loss, must exceed
1e-4; n/a with one MoE layer); silu(up) * gate instead of silu(gate) * up in the experts (and in
the dense layer of qwen3_moe_nonorm); experts shifted by one. The LM-loss change is printed too:
it is often below 1e-5 (e.g. 1e-7 for Mixtral without renormalisation), so a C++ test must compare
logits (and aux.aux_loss, router grads), not only the loss.
"""

import argparse
import copy
import json
import math
import os
import re
import shutil
import sys

import torch
from torch import nn

import safetensors
import transformers
from transformers import (
    LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

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
    # MoE families ("moe" = file layout of the experts, see to_file_names). Untied heads (the
    # HF default of both configs, as in Qwen3-30B-A3B and Mixtral-8x7B).
    "qwen3_moe": dict(
        cls=Qwen3MoeForCausalLM, cfg=Qwen3MoeConfig, seed=3014, moe="qwen3_moe",
        kw=dict(COMMON, head_dim=16, tie_word_embeddings=False, use_sliding_window=False,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01,
                output_router_logits=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ),
    "qwen3_moe_nonorm": dict(
        cls=Qwen3MoeForCausalLM, cfg=Qwen3MoeConfig, seed=3303, moe="qwen3_moe",
        kw=dict(COMMON, head_dim=16, tie_word_embeddings=False, use_sliding_window=False,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.01,
                output_router_logits=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ),
    "mixtral": dict(
        cls=MixtralForCausalLM, cfg=MixtralConfig, seed=8007, moe="mixtral",
        kw=dict(dict(COMMON, intermediate_size=32), head_dim=16, tie_word_embeddings=False,
                num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                router_jitter_noise=0.0, output_router_logits=False, sliding_window=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ),
}
DENSE = [n for n in FAMILIES if "moe" not in FAMILIES[n]]
MOE = [n for n in FAMILIES if "moe" in FAMILIES[n]]
EXPERTS = "grouped_mm"  # transformers' default experts_implementation (also on CPU with torch >= 2.9)
# Seeds of the MoE families are chosen so that, in every forward made for the fixture, the k-th
# routing probability beats the (k+1)-th by more than this (expert choice robust to fp32 noise).
MIN_TOPK_MARGIN = 1e-4

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
    if "moe" in fam:
        cfg._experts_implementation = EXPERTS
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


# ----------------------------------------------------------------------------------------
# MoE helpers.

def is_moe(name):
    return "moe" in FAMILIES[name]


def to_file_names(name, tensors):
    """In-memory state-dict names/shapes -> the names/shapes save_pretrained writes (what
    transformers' revert_weight_conversion does for these two families; write_fixture checks
    the result against model.safetensors bit for bit). Identity for the dense families.
      qwen3_moe: model.layers.L.mlp.experts.gate_up_proj [E, 2I, H] -> for e in 0..E-1
                   model.layers.L.mlp.experts.e.gate_proj.weight = gate_up_proj[e, :I]   [I, H]
                   model.layers.L.mlp.experts.e.up_proj.weight   = gate_up_proj[e, I:]   [I, H]
                 model.layers.L.mlp.experts.down_proj [E, H, I] ->
                   model.layers.L.mlp.experts.e.down_proj.weight = down_proj[e]          [H, I]
      mixtral:   same split with gate -> w1, up -> w3, down -> w2, and every
                 model.layers.L.mlp.* renamed model.layers.L.block_sparse_moe.* (router too)."""
    kind = FAMILIES[name].get("moe")
    if kind is None:
        return dict(tensors)
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if kind == "qwen3_moe" else ("w1", "w3", "w2")
    out = {}
    for k, v in tensors.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(.+)", k)
        if not m:
            out[k] = v
            continue
        prefix = f"model.layers.{m.group(1)}." + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
        rest = m.group(2)
        if rest == "experts.gate_up_proj":
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.{gate}.weight"] = v[e, :inter].clone().contiguous()
                out[f"{prefix}experts.{e}.{up}.weight"] = v[e, inter:].clone().contiguous()
        elif rest == "experts.down_proj":
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.{down}.weight"] = v[e].clone().contiguous()
        else:
            out[prefix + rest] = v
    return out


def moe_layers(model):
    """Indices of the decoder layers whose mlp is a routed MoE block (order of router_logits)."""
    return [i for i, layer in enumerate(model.model.layers)
            if "TopKRouter" in type(getattr(layer.mlp, "gate", None)).__name__]


def routers(model):
    return [model.model.layers[i].mlp.gate for i in moe_layers(model)]


def route(router_logits, top_k, renorm):
    """The documented routing: fp32 softmax over all experts, top-k, optional renormalisation."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


def ref_moe_block(x, file_w, prefix, kind, num_experts, top_k, renorm):
    """Plain reference of one MoE block from the FILE's per-expert weights (checks the
    documented routing and the gate/up split order)."""
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if kind == "qwen3_moe" else ("w1", "w3", "w2")
    h = x.reshape(-1, x.shape[-1])
    logits = h @ file_w[prefix + "gate.weight"].T
    w, idx = route(logits, top_k, renorm)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(top_k):
            e = idx[t, j].item()
            g = h[t] @ file_w[f"{prefix}experts.{e}.{gate}.weight"].T
            u = h[t] @ file_w[f"{prefix}experts.{e}.{up}.weight"].T
            a = nn.functional.silu(g) * u
            out[t] += w[t, j] * (a @ file_w[f"{prefix}experts.{e}.{down}.weight"].T)
    return out.reshape(x.shape), logits


def ref_aux_loss(router_logits, num_experts, top_k, per_layer_mean=False):
    """Switch-Transformer load balancing loss as transformers computes it (no attention mask):
    all MoE layers' rows concatenated, [L*N, E]; f_e = (# of top-k slots that picked e) / (L*N);
    P_e = mean softmax prob of e over the L*N rows; loss = E * sum_e f_e * P_e.
    per_layer_mean=True is the seeded fault (mean over layers of the per-layer loss)."""
    if per_layer_mean:
        return sum(ref_aux_loss((rl,), num_experts, top_k) for rl in router_logits) / len(router_logits)
    cat = torch.cat([rl.float() for rl in router_logits], dim=0)
    probs = torch.softmax(cat, dim=-1)
    _, sel = torch.topk(probs, top_k, dim=-1)
    f = nn.functional.one_hot(sel, num_experts).float().sum(dim=1).mean(dim=0)  # [E], sums to top_k
    P = probs.mean(dim=0)
    return num_experts * (f * P).sum()


class TopkMargin:
    """Forward hooks on every router: smallest gap between the k-th and (k+1)-th routing
    probability seen in any forward (a tiny gap would make expert choice fragile)."""

    def __init__(self, model):
        self.min_gap = float("inf")
        self.handles = [r.register_forward_hook(self.hook) for r in routers(model)]

    def hook(self, mod, inp, out):
        probs = torch.softmax(out[0].detach().float(), dim=-1)
        srt = probs.sort(dim=-1, descending=True).values
        self.min_gap = min(self.min_gap, (srt[:, mod.top_k - 1] - srt[:, mod.top_k]).min().item())

    def remove(self):
        for h in self.handles:
            h.remove()


def oracle_pass(model, init_state, input_ids, labels, names, to_file, prefix="", **fwd):
    """Forward + backward at the initial weights and 3 AdamW steps; returns (out, tensors).
    fwd: extra forward kwargs (output_router_logits=True for the aux-loss pass)."""
    res = {}
    model.load_state_dict(init_state)
    model.zero_grad(set_to_none=True)
    out_fb = model(input_ids=input_ids, labels=labels, **fwd)
    res[prefix + "loss"] = out_fb.loss.detach().clone()
    out_fb.loss.backward()
    grads = to_file({n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()})
    for n in names:
        res[prefix + "grad." + n] = grads[n]

    model.load_state_dict(init_state)
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        o = model(input_ids=input_ids, labels=labels, **fwd)
        res[f"{prefix}loss_step{s}"] = o.loss.detach().clone()
        o.loss.backward()
        opt.step()
    assert torch.equal(res[prefix + "loss_step0"], res[prefix + "loss"])
    params = to_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters()})
    for n in names:
        res[prefix + "adamw3." + n] = params[n]
    return out_fb, res


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
        file_w = {k: f.get_tensor(k) for k in file_names}
        for k in file_names:
            assert file_w[k].dtype == torch.float32, k
    if is_moe(name):
        # In memory the experts are stacked; the file holds them per expert (see docstring).
        to_file = lambda tensors: to_file_names(name, tensors)  # noqa: E731
        mapped = to_file({n: p for n, p in model.named_parameters()})
        assert sorted(mapped) == file_names, (sorted(mapped), file_names)
        assert all(torch.equal(mapped[k].detach(), file_w[k]) for k in file_names)
        names = file_names
        margin = TopkMargin(model)
    else:
        to_file = dict
        names = saved_names(model)
        assert sorted(names) == file_names, (sorted(names), file_names)

    input_ids, labels = make_batch(name, cfg.vocab_size)
    oracle = {"input_ids": input_ids, "labels": labels}

    # Forward + backward at the initial weights, then 3 AdamW steps from the same weights.
    out_fb, res = oracle_pass(model, init_state, input_ids, labels, names, to_file)
    oracle["logits"] = out_fb.logits.detach().clone().contiguous()
    oracle.update(res)
    # Cross-check the documented reduction.
    shift_logits = out_fb.logits[:, :-1].reshape(-1, cfg.vocab_size)
    shift_labels = labels[:, 1:].reshape(-1)
    keep = shift_labels != -100
    nll = -torch.log_softmax(shift_logits[keep].double(), -1).gather(1, shift_labels[keep, None]).squeeze(1)
    manual = nll.sum() / keep.sum()
    assert keep.sum().item() == B * (T - 1) - sum(1 for _, c in IGNORED if c >= 1)
    assert abs(manual.item() - out_fb.loss.item()) < 1e-5, (manual.item(), out_fb.loss.item())

    if is_moe(name):
        oracle.update(moe_extras(name, model, init_state, input_ids, labels, names, to_file, oracle, file_w, out))
        margin.remove()
        assert margin.min_gap > MIN_TOPK_MARGIN, f"{name}: top-k margin {margin.min_gap:.3e}, pick another seed"

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
    if is_moe(name):
        meta.update({
            "experts_implementation": EXPERTS,
            "moe_layers": json.dumps(moe_layers(model)),
            "num_experts": str(len(routers(model)[0].weight)),
            "top_k": str(cfg.num_experts_per_tok),
            "norm_topk_prob": ("true (Mixtral always renormalises)" if FAMILIES[name]["moe"] == "mixtral"
                               else str(bool(cfg.norm_topk_prob)).lower()),
            "router_aux_loss_coef": repr(cfg.router_aux_loss_coef),
            "plain_set": "input_ids labels logits loss grad.* loss_step0..2 adamw3.*: output_router_logits=False "
                         "(loss = LM loss only)",
            "aux_set": "aux.loss aux.aux_loss aux.grad.* aux.loss_step0..2 aux.adamw3.*: output_router_logits=True "
                       "(loss = LM loss + router_aux_loss_coef * aux_loss, no attention_mask passed)",
            "router_logits": "router_logits.<layer>: F32 [B*T, num_experts] = post_attention_layernorm(h) @ gate.weight^T "
                             "at the initial weights, one per MoE layer, rows b*T + t",
            "param_names": "grad.*/adamw3.* keyed by the model.safetensors names (per-expert), not the "
                           "in-memory stacked experts.gate_up_proj/down_proj",
            "min_topk_margin": f"{margin.min_gap:.3e} (smallest p_k - p_(k+1) over all forwards made here)",
        })
    save_safetensors_sorted(oracle, os.path.join(out, "oracle.safetensors"), meta)

    print(f"{name}: loss {oracle['loss'].item():.6f} steps "
          + " ".join(f"{oracle[f'loss_step{s}'].item():.6f}" for s in range(STEPS)))
    if is_moe(name):
        print(f"  aux: loss {oracle['aux.loss'].item():.6f} aux_loss {oracle['aux.aux_loss'].item():.6f} steps "
              + " ".join(f"{oracle[f'aux.loss_step{s}'].item():.6f}" for s in range(STEPS))
              + f"; min top-k margin {margin.min_gap:.3e}")
    for f in sorted(os.listdir(out)):
        print(f"  {f:24s} {os.path.getsize(os.path.join(out, f)):8d} bytes")


def moe_extras(name, model, init_state, input_ids, labels, names, to_file, oracle, file_w, out):
    """aux.* set, router_logits.<layer>, and the checks of the documented MoE semantics."""
    cfg = model.config
    kind = FAMILIES[name]["moe"]
    layers = moe_layers(model)
    n_exp = len(routers(model)[0].weight)
    top_k = cfg.num_experts_per_tok
    renorm = True if kind == "mixtral" else bool(cfg.norm_topk_prob)
    extra = {}

    # Router logits at the initial weights (separate forward, no labels), and the MoE blocks'
    # inputs/outputs for the reference check.
    model.load_state_dict(init_state)
    model.zero_grad(set_to_none=True)
    seen = {}
    hooks = [model.model.layers[i].mlp.register_forward_hook(
        lambda mod, inp, o, i=i: seen.__setitem__(i, (inp[0].detach().clone(), o.detach().clone())))
        for i in layers]
    with torch.no_grad():
        o = model(input_ids=input_ids, output_router_logits=True)
    for h in hooks:
        h.remove()
    assert torch.equal(o.logits, oracle["logits"]), "output_router_logits changed the logits"
    assert len(o.router_logits) == len(layers)
    for i, rl in zip(layers, o.router_logits):
        assert rl.shape == (B * T, n_exp) and rl.dtype == torch.float32
        extra[f"router_logits.{i}"] = rl.detach().clone().contiguous()
        prefix = f"model.layers.{i}." + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
        x, y = seen[i]
        ref, ref_logits = ref_moe_block(x, file_w, prefix, kind, n_exp, top_k, renorm)
        assert (ref_logits - rl).abs().max().item() < 1e-6
        d = (ref - y).abs().max().item()
        assert d < 1e-6 * max(1.0, y.abs().max().item()), (name, i, d)

    # Aux-loss pass.
    out_aux, res = oracle_pass(model, init_state, input_ids, labels, names, to_file, prefix="aux.",
                               output_router_logits=True)
    extra.update(res)
    extra["aux.aux_loss"] = out_aux.aux_loss.detach().clone()
    assert torch.equal(out_aux.logits, oracle["logits"])
    ref_aux = ref_aux_loss([extra[f"router_logits.{i}"] for i in layers], n_exp, top_k)
    assert abs(ref_aux.item() - out_aux.aux_loss.item()) < 1e-6, (ref_aux.item(), out_aux.aux_loss.item())
    total = oracle["loss"] + cfg.router_aux_loss_coef * out_aux.aux_loss.detach()
    assert torch.equal(total, extra["aux.loss"]), (total.item(), extra["aux.loss"].item())

    # Reload the written files: from_pretrained must merge the per-expert tensors back.
    re_model = FAMILIES[name]["cls"].from_pretrained(out, attn_implementation=ATTN, experts_implementation=EXPERTS)
    re_model.train()
    for k, v in re_model.state_dict().items():
        assert torch.equal(v, init_state[k]), k
    with torch.no_grad():
        assert torch.equal(re_model(input_ids=input_ids).logits, oracle["logits"])
    return extra


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


def loss_of(model, input_ids, labels, **fwd):
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids, labels=labels, **fwd)


def swap_swiglu_state(state, name):
    """Weights on which HF's silu(gate) * up equals silu(up) * gate on the original weights
    (equivalently: a reader that swaps gate/up, w1/w3, when splitting or loading)."""
    st = copy.deepcopy(state)
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            st[k] = torch.cat([v[:, inter:], v[:, :inter]], dim=1).contiguous()
    return st


def no_renorm_router_forward(self, hidden_states):
    """MixtralTopKRouter.forward without the renormalisation of the top-k probabilities."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    return router_logits, router_top_value, router_indices


def check_faults(families=None):
    results = []
    families = list(FAMILIES) if families is None else families

    def report(fam, what, r, thr=1e-3, note=""):
        results.append((fam, what, r, thr))
        print(f"  {fam:16s} {what:58s} {r:.3e} {'ok' if r > thr else 'TOO SMALL'}{note}")

    def info(fam, what, r):
        print(f"  {fam:16s} {what:58s} {r:.3e}")

    for name in families:
        model = build_model(name)
        cfg = model.config
        state = copy.deepcopy(model.state_dict())  # includes lm_head.weight even when tied
        input_ids, labels = make_batch(name, cfg.vocab_size)
        ref = logits_of(model, input_ids)

        # sanity: sdpa vs eager (should be ~1e-7, i.e. not a fault)
        m_eager, _ = rebuilt(name, state)
        m_eager.config._attn_implementation = "eager"
        print(f"  {name:16s} {'(sdpa vs eager, not a fault)':58s} {rel(logits_of(m_eager, input_ids), ref):.3e}")
        if is_moe(name):
            m_eager, _ = rebuilt(name, state)
            m_eager.set_experts_implementation("eager")
            assert m_eager.config._experts_implementation == "eager"
            info(name, "(grouped_mm vs eager experts loop, not a fault)", rel(logits_of(m_eager, input_ids), ref))

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
        report(name, "rope_theta = 10000", rel(logits_of(m, input_ids), ref))

        if rope["rope_type"] == "llama3":
            m, _ = rebuilt(name, state, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]})
            report(name, "rope_scaling removed", rel(logits_of(m, input_ids), ref))
            # smooth band handled as 'keep' (no interpolation)
            m, _ = rebuilt(name, state)
            rp = cfg.rope_parameters
            base = 1.0 / (rp["rope_theta"] ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
            wl = 2 * math.pi / base
            lo = rp["original_max_position_embeddings"] / rp["low_freq_factor"]
            hi = rp["original_max_position_embeddings"] / rp["high_freq_factor"]
            wrong = torch.where(wl > lo, base / rp["factor"], base)
            m.model.rotary_emb.inv_freq = wrong
            report(name, "llama3 smooth band not interpolated", rel(logits_of(m, input_ids), ref))

        m, _ = rebuilt(name, state, rms_norm_eps=1e-6)
        report(name, "rms_norm_eps = 1e-6", rel(logits_of(m, input_ids), ref))

        # kv mapping: HF gives q head h the kv head h // n_rep (repeat_interleave). A
        # 'tiled' mapping (h % n_kv) equals HF on weights with q heads reordered [0,2,1,3].
        n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        perm = [kv + r * cfg.num_key_value_heads for kv in range(cfg.num_key_value_heads) for r in range(n_rep)]
        # slot s = kv*n_rep + r must hold the q head h with h % n_kv == kv
        m, _ = rebuilt(name, permute_heads(state, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, perm))
        report(name, f"kv heads tiled (h % n_kv), q-head order {perm}", rel(logits_of(m, input_ids), ref))

        m, _ = rebuilt(name, interleaved_rope_state(state, cfg))
        report(name, "RoPE interleaved pairs instead of rotate_half", rel(logits_of(m, input_ids), ref))

        if cfg.tie_word_embeddings:
            st = copy.deepcopy(state)
            g = torch.Generator().manual_seed(99)
            st["lm_head.weight"] = torch.randn(st["lm_head.weight"].shape, generator=g) * cfg.initializer_range
            m, _ = rebuilt(name, st, tie_word_embeddings=False)
            report(name, "untied: separate random lm_head", rel(logits_of(m, input_ids), ref))
        else:
            st = {k: v for k, v in state.items() if k != "lm_head.weight"}
            m, _ = rebuilt(name, st, tie_word_embeddings=True)
            assert m.lm_head.weight is m.model.embed_tokens.weight
            report(name, "tied: lm_head = embed_tokens", rel(logits_of(m, input_ids), ref))

        if hasattr(model.model.layers[0].self_attn, "q_norm"):  # qwen3, qwen3_moe*
            m, _ = rebuilt(name, state)
            for layer in m.model.layers:
                layer.self_attn.q_norm = nn.Identity()
                layer.self_attn.k_norm = nn.Identity()
            report(name, "q_norm/k_norm replaced by identity", rel(logits_of(m, input_ids), ref))
            m, _ = rebuilt(name, state)
            for layer in m.model.layers:
                layer.self_attn.q_norm.weight.data.fill_(1.0)
                layer.self_attn.k_norm.weight.data.fill_(1.0)
            report(name, "q_norm/k_norm weights ignored (ones)", rel(logits_of(m, input_ids), ref))

        m, _ = rebuilt(name, state)
        for mod in m.modules():
            if "RMSNorm" in type(mod).__name__:
                mod.weight.data.fill_(1.0)
        report(name, "all RMSNorm weights ignored (ones)", rel(logits_of(m, input_ids), ref))

        if is_moe(name):
            check_faults_moe(name, model, state, input_ids, labels, ref, report, info)

    bad = [r for r in results if r[2] <= r[3]]
    print("all faults above their thresholds (logits 1e-3, aux_loss 1e-4)" if not bad
          else f"{len(bad)} fault(s) at or below their threshold")
    return not bad


def check_faults_moe(name, model, state, input_ids, labels, ref, report, info):
    """MoE faults. Each: max relative change of the logits and of the (LM) loss; for the
    aux-loss fault, relative change of aux_loss (the pass figure) and of the total loss."""
    cfg = model.config
    kind = FAMILIES[name]["moe"]
    ref_loss = loss_of(model, input_ids, labels).loss

    def both(what, m):
        o = loss_of(m, input_ids, labels)
        report(name, what + ": logits", rel(o.logits, ref))
        info(name, what + ": loss", rel(o.loss, ref_loss))

    # 1. renormalisation of the top-k probabilities flipped.
    if kind == "mixtral":
        m, _ = rebuilt(name, state)
        for r in routers(m):
            r.forward = no_renorm_router_forward.__get__(r)
        both("top-k probs NOT renormalised (Mixtral always does)", m)
    elif cfg.norm_topk_prob:
        m, _ = rebuilt(name, state, norm_topk_prob=False)
        both("top-k probs NOT renormalised (norm_topk_prob true)", m)
    else:
        m, _ = rebuilt(name, state, norm_topk_prob=True)
        both("top-k probs renormalised (norm_topk_prob false)", m)

    # 2. aux loss as the mean of per-layer losses instead of over all layers' rows concatenated.
    lb = sys.modules[type(model).__module__].load_balancing_loss_func
    o = loss_of(model, input_ids, labels, output_router_logits=True)
    n_exp, top_k = len(routers(model)[0].weight), cfg.num_experts_per_tok
    per_layer = sum(lb((rl,), n_exp, top_k) for rl in o.router_logits) / len(o.router_logits)
    assert abs(ref_aux_loss(o.router_logits, n_exp, top_k, per_layer_mean=True) - per_layer) < 1e-6
    what = "aux loss = mean over layers of per-layer loss"
    if len(o.router_logits) == 1:
        info(name, what + " (n/a: 1 MoE layer)", rel(per_layer, o.aux_loss))
    else:
        report(name, what + ": aux_loss", rel(per_layer, o.aux_loss), thr=1e-4)
        wrong_total = o.loss - cfg.router_aux_loss_coef * o.aux_loss + cfg.router_aux_loss_coef * per_layer
        info(name, what + ": total loss", rel(wrong_total, o.loss))

        def router_grads(fault):
            m, _ = rebuilt(name, state)
            m.train()
            o = m(input_ids=input_ids, labels=labels, output_router_logits=True)
            loss = o.loss
            if fault:
                wrong = sum(lb((rl,), n_exp, top_k) for rl in o.router_logits) / len(o.router_logits)
                loss = loss - cfg.router_aux_loss_coef * o.aux_loss + cfg.router_aux_loss_coef * wrong
            loss.backward()
            return {n: p.grad for n, p in m.named_parameters() if n.endswith("mlp.gate.weight")}
        g0, g1 = router_grads(False), router_grads(True)
        info(name, what + ": router grads", max(rel(g1[n], g0[n]) for n in g0))

    # 3. SwiGLU order swapped inside the experts: silu(up) * gate instead of silu(gate) * up.
    m, _ = rebuilt(name, swap_swiglu_state(state, name))
    both("experts silu(up) * gate instead of silu(gate) * up", m)
    if any(k.endswith("mlp.gate_proj.weight") for k in state):  # dense layer of qwen3_moe_nonorm
        st = copy.deepcopy(state)
        for k in state:
            if k.endswith("mlp.gate_proj.weight"):
                u = k.replace("gate_proj", "up_proj")
                st[k], st[u] = state[u].clone(), state[k].clone()
        m, _ = rebuilt(name, st)
        both("dense-layer MLP silu(up) * gate", m)

    # 4. (reader faults) experts' tensors permuted: expert e gets expert (e+1) % E's weights.
    st = copy.deepcopy(state)
    for k, v in state.items():
        if ".mlp.experts." in k:
            st[k] = v.roll(-1, dims=0).contiguous()
    m, _ = rebuilt(name, st)
    both("experts shifted by one (router row e -> expert e+1)", m)


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
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help="comma-separated families to write / check (default: all: %(default)s)")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {list(FAMILIES)}")
    torch.set_num_threads(1)  # bit-for-bit repeatable CPU reductions
    if args.check_faults:
        sys.exit(0 if check_faults(families) else 1)
    if args.fetch_published:
        fetch_published()
        return
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, attn {ATTN}")
    for name in families:
        write_fixture(name)


if __name__ == "__main__":
    main()
