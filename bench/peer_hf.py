"""A copy of ../shared/bench/peer_hf_deepspeed.py (the peer of issues 59 and 60) with what comparing
losses and larger shapes needs; everything else as there:
  --save DIR    writes the model's initial weights (save_pretrained, bf16) and the batch
                (DIR/batch.bin: B x T int64, row-major) before training: `strata-bench hf
                --hf-model DIR --batch DIR/batch.bin` starts from the same weights and tokens
  --load DIR    starts from DIR's weights (and DIR/batch.bin when there) instead of a random init
  --log-losses  the JSON line gains "losses": every step's, warm-up steps first
  --arch llama-3b   Llama-3.2-3B: d 3072, 28 layers, 24 heads / 8 KV, FFN 8192, vocab 128256, tied
  --warmup N    warm-up steps (the original's 3)
Below, the original's docstring.

Peer: what a user runs today to train a published architecture: Hugging Face transformers'
own model classes (random init from a config, no download) trained by DeepSpeed, or by plain
PyTorch AdamW. Real architectures, so Strata's own C++ models of them can be held against it.
  torchrun --nproc-per-node N peer_hf_deepspeed.py --arch llama-1b [--stage 2] [--offload cpu]
      [--layers L] [--B 4] [--T 2048] [--zero KEY=JSON] [--plain] [--checkpoint]
Archs (published shapes; --layers cuts depth, widths stay):
  llama-1b    Llama-3.2-1B: d 2048, 16 layers, 32 heads / 8 KV, FFN 8192, vocab 128256, tied
  llama-8b    Llama-3.1-8B: d 4096, 32 layers, 32 / 8, FFN 14336, vocab 128256
  qwen3-moe   Qwen3-30B-A3B: d 2048, 48 layers, 32 / 4 heads of 128, 128 experts of FFN 768, top-8
Prints one JSON line per run (rank 0): tok_s per GPU, TFLOP/s = (6 x the parameters a token's
matrix products use: attention, MLP or the k routed experts, router, output head; not the
embedding lookup) x tokens + causal attention's 6 L d T per token, over the step time.
Qwen3-MoE trains without the router's auxiliary loss (Hugging Face's .loss leaves it out unless
output_router_logits); the JSON says which experts kernel transformers chose."""
import argparse, json, os, sys, time
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
PEER_DIR = os.environ.get("STRATA_PEER_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                          "..", "..", "shared", "bench"))
sys.path.insert(0, PEER_DIR)
from peer_torch_gpt import peak_bf16  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--arch", default="llama-1b", choices=["llama-1b", "llama-3b", "llama-8b", "qwen3-moe"])
ap.add_argument("--layers", type=int, default=0)
ap.add_argument("--stage", type=int, default=2)
ap.add_argument("--offload", default="none", choices=["none", "cpu"])
ap.add_argument("--offload-param", action="store_true", help="stage 3: parameters in host memory too")
ap.add_argument("--zero", action="append", default=[], metavar="KEY=JSON")
ap.add_argument("--plain", action="store_true", help="no DeepSpeed: bf16 weights, torch fused AdamW")
ap.add_argument("--checkpoint", action="store_true", help="HF gradient checkpointing per layer")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--B", type=int, default=4)
ap.add_argument("--T", type=int, default=2048)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--save", default="")
ap.add_argument("--load", default="")
ap.add_argument("--log-losses", action="store_true")


def make_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    if args.arch.startswith("llama"):
        shape = {"llama-1b": (2048, 8192, 16, 32), "llama-3b": (3072, 8192, 28, 24),
                 "llama-8b": (4096, 14336, 32, 32)}[args.arch]
        big = args.arch == "llama-8b"
        cfg = LlamaConfig(vocab_size=128256, hidden_size=shape[0], intermediate_size=shape[1],
                          num_hidden_layers=args.layers or shape[2],
                          num_attention_heads=shape[3], num_key_value_heads=8, rope_theta=500000.0,
                          max_position_embeddings=131072, tie_word_embeddings=not big,
                          attn_implementation="sdpa")
        model = (LlamaForCausalLM.from_pretrained(args.load, attn_implementation="sdpa",
                                                  dtype=torch.float32)
                 if args.load else LlamaForCausalLM(cfg))
        cfg = model.config
        d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
        kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
        per_layer = d * d * 2 + 2 * d * kv + 3 * d * f
        active = per_layer * L + cfg.vocab_size * d  # the head; the embedding is a lookup
    else:
        cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                             num_hidden_layers=args.layers or 48, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                             max_position_embeddings=40960, attn_implementation="sdpa")
        model = (Qwen3MoeForCausalLM.from_pretrained(args.load, attn_implementation="sdpa",
                                                     dtype=torch.float32)
                 if args.load else Qwen3MoeForCausalLM(cfg))
        cfg = model.config
        d, L, hd = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
        attn = d * 32 * hd * 2 + 2 * d * 4 * hd
        per_layer = attn + 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok + d * 128
        active = per_layer * L + cfg.vocab_size * d  # the head; the embedding is a lookup
    if args.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, cfg, active


def main():
    args, _ = ap.parse_known_args()
    torch.distributed.init_process_group("nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model, cfg, active = make_model(args)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    idx = torch.randint(0, cfg.vocab_size, (args.B, args.T), device="cuda", generator=g)
    batch_file = os.path.join(args.load, "batch.bin") if args.load else ""
    if batch_file and os.path.exists(batch_file):
        idx = torch.from_numpy(__import__("numpy").fromfile(batch_file, dtype="<i8")).view(
            args.B, args.T).cuda()
    if args.save and rank == 0:
        model.to(torch.bfloat16).save_pretrained(args.save)
        model.float()
        idx.cpu().numpy().astype("<i8").tofile(os.path.join(args.save, "batch.bin"))
    if args.plain:
        model = model.to("cuda", torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

        def step(idx):
            loss = model(input_ids=idx, labels=idx).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad(set_to_none=True)
            return loss
    else:
        import deepspeed
        ds = {"train_micro_batch_size_per_gpu": args.B, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
              "zero_optimization": {"stage": args.stage, "overlap_comm": True,
                                    "contiguous_gradients": True, "reduce_bucket_size": 5e7}}
        z = ds["zero_optimization"]
        if args.offload == "cpu":
            z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if args.offload_param:
            z["offload_param"] = {"device": "cpu", "pin_memory": True}
        for kv in args.zero:
            key, val = kv.split("=", 1); z[key] = json.loads(val)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds)

        def step(idx):
            loss = engine(input_ids=idx, labels=idx).loss
            engine.backward(loss); engine.step()
            return loss
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.warmup): losses.append(step(idx).detach())
    torch.cuda.synchronize(); warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
    for _ in range(args.steps): losses.append(loss := step(idx).detach())
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / args.steps
    tok = args.B * args.T
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    flops = 6 * active * tok + 12 * L * d * args.T * tok / 2
    how = "plain-adamw" if args.plain else f"deepspeed stage{args.stage}" + (
        " offload-cpu" if args.offload == "cpu" else "") + (" offload-param" if args.offload_param else "")
    r = dict(name=f"hf {args.arch} L{L} {how}{' ckpt' if args.checkpoint else ''} x{world}",
             active_M=round(active / 1e6, 1), B=args.B, T=args.T, step_ms=round(dt * 1e3, 1),
             tok_s=round(tok / dt), tflops=round(flops / dt / 1e12, 1),
             mfu=round(flops / dt / 1e12 / peak_bf16() * 100, 1),
             mem_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2), warm_s=round(warm, 1),
             loss=round(loss.item(), 3),
             experts_impl=str(getattr(cfg, "experts_implementation", None) or
                              getattr(cfg, "_experts_implementation", None)))
    if args.log_losses: r["losses"] = [round(x.item(), 5) for x in losses]
    if rank == 0: print(json.dumps(r), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
