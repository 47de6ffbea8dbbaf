"""Peer for long sequences on one GPU (issue 58): DeepSpeed's ALST (Arctic Long Sequence Training)
single-GPU parts on Hugging Face's own Llama, as ALST's recipe runs them:
  - TiledMLP (deepspeed.runtime.sequence_parallel.ulysses_sp) patched into LlamaMLP.forward,
    ceil(seqlen / hidden) shards, as its docstring's example does;
  - the loss through TiledFusedLogitsLoss: the logits never whole (tiles of ~1 GiB of fp32 logits);
  - activation checkpointing per decoder layer, the layer's input kept in pinned host memory until
    its recomputation (ArcticTraining's checkpoint offload);
  - ZeRO-3 with the optimizer in host memory (DeepSpeed's CPU Adam), bf16;
  - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before torch is imported).
Random init from the published config (no download), batch 1, random tokens:
  python3 bench/peer_alst.py --arch llama-1b --T 65536 [--steps 2] [--warmup 1] [--layers L]
Prints one JSON line: tok_s, peak GPU bytes and bytes per token, the host's peak RSS.
Built on ../shared/bench/peer_hf_deepspeed.py (its make_model); STRATA_PEER_DIR overrides where
that lives. Needs DeepSpeed >= 0.17 (ulysses_sp's TiledMLP and TiledFusedLogitsLoss)."""
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse, json, math, resource, sys, time  # noqa: E402
import torch  # noqa: E402

PEER_DIR = os.environ.get("STRATA_PEER_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                          "..", "..", "shared", "bench"))
sys.path.insert(0, PEER_DIR)

ap = argparse.ArgumentParser()
ap.add_argument("--arch", default="llama-1b", choices=["llama-1b", "llama-8b"])
ap.add_argument("--layers", type=int, default=0)
ap.add_argument("--T", type=int, default=32768)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--warmup", type=int, default=1)
ap.add_argument("--logits-tile-gib", type=float, default=1.0)


def patch_tiled_mlp():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama import modeling_llama

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_forward(self, x):
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp, self, x, shards, params)

    modeling_llama.LlamaMLP.forward = tiled_forward


class OffloadedCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint of one decoder layer whose input waits in pinned host memory."""

    @staticmethod
    def forward(ctx, run, x, *rest):
        ctx.run, ctx.rest, ctx.device = run, rest, x.device
        ctx.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        ctx.host.copy_(x.detach(), non_blocking=True)
        ctx.rng = torch.cuda.get_rng_state(x.device)
        with torch.no_grad():
            out = run(x, *rest)
        return out[0] if isinstance(out, tuple) else out

    @staticmethod
    def backward(ctx, grad):
        x = ctx.host.to(ctx.device, non_blocking=True).requires_grad_(True)
        state = torch.cuda.get_rng_state(ctx.device)
        torch.cuda.set_rng_state(ctx.rng, ctx.device)
        with torch.enable_grad():
            out = ctx.run(x, *ctx.rest)
            out = out[0] if isinstance(out, tuple) else out
        torch.cuda.set_rng_state(state, ctx.device)
        torch.autograd.backward(out, grad)
        ctx.host = None
        return (None, x.grad) + (None,) * len(ctx.rest)


def offloaded_checkpoint(fn, *args, **kwargs):
    return OffloadedCheckpoint.apply(lambda x, *rest: fn(x, *rest, **kwargs), *args)


class TiledLossModel(torch.nn.Module):
    """Hugging Face's causal-LM loss (labels = inputs, shifted), the head and loss over tiles."""

    def __init__(self, lm, tile_gib):
        super().__init__()
        self.lm, self.tile_gib = lm, tile_gib

    def forward(self, idx):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
        h = self.lm.model(input_ids=idx).last_hidden_state[:, :-1]
        y = idx[:, 1:]
        V = self.lm.config.vocab_size
        shards = max(1, math.ceil(h.shape[1] * V * 4 / (self.tile_gib * 2**30)))

        def loss_fn(head, x, t):
            logits = head(x).float()
            return torch.nn.functional.cross_entropy(logits.view(-1, V), t.reshape(-1), reduction="sum")

        loss = TiledFusedLogitsLoss.apply(loss_fn, self.lm.lm_head, h, y, None, shards,
                                          [self.lm.lm_head.weight], "sum")
        return loss / y.numel()


def main():
    args, _ = ap.parse_known_args()
    import deepspeed
    from peer_hf_deepspeed import make_model  # noqa: E402
    patch_tiled_mlp()
    torch.cuda.set_device(0)
    deepspeed.init_distributed()
    margs = argparse.Namespace(arch=args.arch, layers=args.layers, checkpoint=True)
    lm, cfg, active = make_model(margs)  # gradient checkpointing on: replaced below
    for m in lm.modules():
        if hasattr(m, "_gradient_checkpointing_func"):
            m._gradient_checkpointing_func = offloaded_checkpoint
    lm.config.use_cache = False
    model = TiledLossModel(lm, args.logits_tile_gib)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "overlap_comm": True, "contiguous_gradients": True,
                                "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    g = torch.Generator(device="cuda").manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (1, args.T), device="cuda", generator=g)

    def step():
        loss = engine(idx)
        engine.backward(loss)
        engine.step()
        return loss

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / args.steps
    peak = torch.cuda.max_memory_allocated()
    r = dict(name=f"alst hf {args.arch} L{cfg.num_hidden_layers} zero3 offload-cpu tiled-mlp "
                  f"tiled-loss ckpt-offload", B=1, T=args.T, step_ms=round(dt * 1e3, 1),
             tok_s=round(args.T / dt, 1), peak_bytes=peak, bytes_per_token=round(peak / args.T, 1),
             reserved_bytes=torch.cuda.max_memory_reserved(),
             host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             warm_s=round(warm, 1), loss=round(loss.item(), 3))
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
