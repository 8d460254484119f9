#!/usr/bin/env python3
"""PyTorch baselines for bench/bench_attention.cu: one decode step of the 7B
GQA model (32 query heads, 8 KV heads, head_dim 128, bf16 KV) for B = 8,
T = 256K, with DESIGN.md section 1's defaults (blocks 1024 keep 32, slices 64
keep 16, window 512):

  * dense: scaled_dot_product_attention over every token;
  * hierarchical: the same selection written in PyTorch -- block-mean scores
    (one fp32 matmul against precomputed block means, GQA-summed query), top-k
    blocks, their slice means gathered and scored, top-k slices, their tokens
    plus the window gathered, SDPA over them.

Both eager and replayed from a CUDA graph; median of CUDA-event timings.
Summaries are precomputed (the library keeps them current at append time), so
only the step is timed. The graph replay is also timed cold: a 256 MB buffer
is written before each timed replay (outside the events), so the step reads
HBM as a real layer's step does, not the 60 MB L2 the replay before filled --
as bench_attention's cold figures do.

    python3 scripts/torch_decode.py [OUT.json]     (default torch_decode.json)

Without a CUDA device it says so and exits 0.
"""
import datetime
import json
import statistics
import sys

B, HQ, HKV, D, T = 8, 32, 8, 128, 262144
C, F, KC, KF, W = 1024, 64, 32, 16, 512
WARMUP, ITERATIONS = 5, 30


def timed(torch, fn, iterations=ITERATIONS, flush=None, warmup=WARMUP):
    """Median of CUDA-event timings of fn() after warm-up, in us."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iterations):
        if flush is not None:
            flush.add_(1)  # evicts the last replay's lines from L2 (not timed)
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)  # us
    return statistics.median(times)


def graphed(torch, fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "torch_decode.json"
    try:
        import torch
        import torch.nn.functional as fnn
    except ImportError:
        print("torch_decode: PyTorch not installed; nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("torch_decode: no CUDA device; nothing to measure")
        return 0
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(5)
    k = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    slice_means = k.float().view(B, HKV, T // F, F, D).mean(3)  # [B, Hkv, T/F, D]
    block_means = slice_means.view(B, HKV, T // C, C // F, D).mean(3)  # [B, Hkv, T/C, D]
    ws = (T - W) // F * F
    far_blocks = ws // C  # whole far blocks (T is a multiple of C here)
    spb = C // F
    window = torch.arange(ws, T, device=dev)
    group = HQ // HKV
    offsets = torch.arange(F, device=dev)
    sub = torch.arange(spb, device=dev)
    out = torch.empty(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    flush = torch.zeros(64 * 1024 * 1024, device=dev, dtype=torch.float32)  # 256 MB

    def dense():
        out.copy_(fnn.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    def hierarchical():
        qsum = q.view(B, HKV, group, D).float().sum(2)  # [B, Hkv, D]
        bscore = torch.einsum("bhd,bhnd->bhn", qsum, block_means[:, :, :far_blocks])
        kept_blocks = bscore.topk(KC, dim=-1).indices  # [B, Hkv, KC]
        cand = (kept_blocks[..., None] * spb + sub).flatten(2)  # [B, Hkv, KC * spb]
        cmeans = torch.gather(slice_means, 2, cand[..., None].expand(-1, -1, -1, D))
        sscore = torch.einsum("bhd,bhnd->bhn", qsum, cmeans)
        kept = torch.gather(cand, 2, sscore.topk(KF, dim=-1).indices).sort(-1).values
        tokens = (kept[..., None] * F + offsets).flatten(2)  # [B, Hkv, KF * F]
        tokens = torch.cat([tokens, window.expand(B, HKV, -1)], dim=2)
        idx = tokens[..., None].expand(-1, -1, -1, D)
        ks = torch.gather(k, 2, idx)
        vs = torch.gather(v, 2, idx)
        out.copy_(fnn.scaled_dot_product_attention(q, ks, vs, enable_gqa=True))

    results = {}
    for name, fn in (("dense", dense), ("hierarchical", hierarchical)):
        eager = timed(torch, fn)
        replay_fn = graphed(torch, fn)
        replay = timed(torch, replay_fn)
        cold = timed(torch, replay_fn, flush=flush)
        results[name] = {"eager_us": eager, "graph_us": replay, "graph_cold_us": cold}
        print(f"torch {name:12s} B={B} T={T}: eager {eager:9.1f} us, graph replay {replay:9.1f} us, "
              f"cold {cold:9.1f} us")
    doc = {
        "context": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "shape": {"B": B, "Hq": HQ, "Hkv": HKV, "D": D, "T": T},
                    "config": {"C": C, "F": F, "top_k_coarse": KC, "top_k_fine": KF, "window": W}},
        "results": results,
    }
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
