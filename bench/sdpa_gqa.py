#!/usr/bin/env python3
"""Times causal SDPA forward + backward with grouped kv heads on this GPU, two ways: kv heads
copied for every query head (transformers' repeat_kv) then SDPA, or SDPA's enable_gqa; each with
LibTorch's own backend choice and with each backend forced. Which backend wins decides
models/causal_lm.cpp's grouped_causal_attention. Shapes: Llama-3.2-1B's and Qwen3-MoE's at
4 x 2048, and Llama-3.2-1B's at 1 x 32768."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

def repeat_kv(x, n):
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, n, t, d).reshape(b, kv * n, t, d)

def timed(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters

def case(name, b, h, kv, t, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda heads: torch.randn(b, t, heads, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    q, k, v = mk(h), mk(kv), mk(kv)
    grad = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    n = h // kv
    ways = {
        "repeat": lambda: F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), is_causal=True),
        "gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    backends = [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    ref = None
    for way, f in ways.items():
        for bname, backend in backends:
            def step():
                q.grad = k.grad = v.grad = None
                f().backward(grad)
            try:
                if backend is None:
                    ms = timed(step)
                else:
                    with sdpa_kernel([backend]):
                        ms = timed(step)
                out = f().float()
                if ref is None:
                    ref = out
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                print(f"{name:10s} {way:6s} {bname:9s} fwd+bwd {ms:8.3f} ms  (rel diff {err:.1e})")
            except Exception as e:
                print(f"{name:10s} {way:6s} {bname:9s} unavailable: {str(e).splitlines()[0][:100]}")

print(torch.__version__, torch.cuda.get_device_name())
case("llama-1b", 4, 32, 8, 2048, 64)
case("qwen3-moe", 4, 32, 4, 2048, 128)
case("llama-32k", 1, 32, 8, 32768, 64)
