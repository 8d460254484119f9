#!/usr/bin/env python3
"""The hisparse torch ops against PyTorch on the same cache contents, in one
run: one decode step of the 7B GQA model (32 query / 8 KV heads, head_dim
128, bf16) for B = 8, T = 256K, preset standard.

  * hisparse: PagedKVCache.decode (torch.ops.hisparse.cache_decode), eager and
    replayed from a CUDA graph, warm and cold (a 256 MB write before each
    timed replay evicts L2, as bench_attention's cold figures do); and
    hisparse_out, the same step into given tensors (cache_decode_out), also
    as 20 steps captured in one graph (graph_step_of_20_us), as
    bench_attention replays its steps;
  * dense: scaled_dot_product_attention over every token;
  * flex: FlexAttention (compiled) with a block mask of exactly the slices the
    contract keeps plus the window, 64-token KV blocks: the same attended set;
  * host overhead: the CPU time of one call while the GPU is busy (a long
    sleep kernel queued first), for the decode ops, the top-k op and torch.add;
  * prefill: PagedKVCache.prefill of one whole 256K prompt (every query)
    against SDPA's causal attention over the same keys and values.

    python3 scripts/torch_ops_bench.py [OUT.json]     (default torch_ops.json)

Needs the extension installed (pip install --no-build-isolation .); without a
CUDA device it says so and exits 0.
"""
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from torch_decode import graphed, timed  # the same timing as the PyTorch decode baselines

B, HQ, HKV, D, T = 8, 32, 8, 128, 262144
C, F, KC, KF, W = 1024, 64, 32, 16, 512
ITERATIONS = 50
PREFILL_ITERATIONS = 3  # SDPA's causal 256K prefill takes about a second


def host_us(torch, fn, calls=200):
    """CPU time of one call with the GPU kept busy, so no call waits on it."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the launch queue never drains
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def kept_slices(torch, k, q):
    """The contract's kept slices per (sequence, KV head) for T a multiple of C:
    [B, Hkv, KF] slice ids, ascending."""
    slice_means = k.float().view(B, HKV, T // F, F, D).mean(3)
    ws = (T - W) // F * F
    spb = C // F
    # The block holding ws is only partly far: its mean is over its far slices.
    far_slices = ws // F
    block_sums = torch.zeros(B, HKV, (ws + C - 1) // C, D, device=k.device)
    block_sums.index_add_(2, torch.arange(far_slices, device=k.device) // spb, slice_means[:, :, :far_slices])
    counts = torch.bincount(torch.arange(far_slices, device=k.device) // spb).float()
    block_means = block_sums / counts[:, None]
    qsum = q.view(B, HKV, HQ // HKV, D).float().sum(2)
    order = torch.einsum("bhd,bhnd->bhn", qsum, block_means).double()
    kept_blocks = torch.sort(order, dim=-1, descending=True, stable=True).indices[..., :KC]
    cand = (kept_blocks[..., None] * spb + torch.arange(spb, device=k.device)).flatten(2)
    cand = torch.where(cand < far_slices, cand, -1)
    cand = torch.sort(cand, dim=-1).values
    means = torch.gather(slice_means, 2, cand.clamp(min=0)[..., None].expand(-1, -1, -1, D))
    score = torch.einsum("bhd,bhnd->bhn", qsum, means).double()
    score = torch.where(cand >= 0, score, -float("inf"))
    best = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :KF]
    return torch.sort(torch.gather(cand, 2, best), dim=-1).values, ws


def commit():
    """HISPARSE_BUILD_COMMIT where set (a copied tree's .git may be stale), else git's HEAD."""
    if os.environ.get("HISPARSE_BUILD_COMMIT"):
        return os.environ["HISPARSE_BUILD_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def driver():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.split("\n")[0].strip()
    except OSError:
        return "unknown"


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "torch_ops.json"
    import torch
    import torch.nn.functional as fnn
    if not torch.cuda.is_available():
        print("torch_ops_bench: no CUDA device; nothing to measure")
        return 0
    import hisparse
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(5)
    k = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    q3 = q.view(B, HQ, D)

    cache = hisparse.PagedKVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, num_q_heads=HQ, max_sequences=B,
                                  max_context=T, max_prefill_tokens=T)
    slots = [cache.add_sequence(T) for _ in range(B)]
    for b, slot in enumerate(slots):
        cache.append(0, [slot], k[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous(), counts=[T])
    slots_t = torch.tensor(slots, dtype=torch.int32, device=dev)
    flush = torch.zeros(64 * 1024 * 1024, device=dev)  # 256 MB

    out_h = torch.empty_like(q3)
    out_d = torch.empty_like(q)
    out_o, lse_o = torch.empty_like(q3), torch.empty(B, HQ, device=dev)

    def sparse():
        out_h.copy_(cache.decode(q3, slots_t)[0])

    def sparse_out():
        cache.decode(q3, slots_t, out=out_o, lse=lse_o)

    def dense():
        out_d.copy_(fnn.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    results = {}
    for name, fn in (("hisparse", sparse), ("hisparse_out", sparse_out), ("sdpa_dense", dense)):
        replay = graphed(torch, fn)
        results[name] = {"eager_us": timed(torch, fn, ITERATIONS), "graph_us": timed(torch, replay, ITERATIONS),
                         "graph_cold_us": timed(torch, replay, ITERATIONS, flush)}

    steps = 20
    many = graphed(torch, lambda: [sparse_out() for _ in range(steps)])
    results["hisparse_out"]["graph_step_of_20_us"] = timed(torch, many, ITERATIONS) / steps

    # FlexAttention over the same attended set.
    kept, ws = kept_slices(torch, k, q)
    window = torch.arange(ws // F, T // F, device=dev).expand(B, HKV, -1)
    blocks = torch.cat([kept, window], dim=2).repeat_interleave(HQ // HKV, dim=1)  # [B, Hq, n]
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        # kv_indices spans every KV block (T / F); the first kv_num_blocks are the attended ones.
        indices = torch.zeros(B, HQ, 1, T // F, dtype=torch.int32, device=dev)
        indices[..., :blocks.shape[2]] = blocks[:, :, None, :]
        mask = BlockMask.from_kv_blocks(torch.full((B, HQ, 1), blocks.shape[2], dtype=torch.int32, device=dev),
                                        indices,
                                        BLOCK_SIZE=(128, F), seq_lengths=(1, T))
        flex = torch.compile(flex_attention, dynamic=False)
        out_f = torch.empty_like(q)

        def flexed():
            out_f.copy_(flex(q, k, v, block_mask=mask, enable_gqa=True))

        flexed()
        torch.cuda.synchronize()
        err = (out_f.view(B, HQ, D).float() - out_h.float()).abs().max().item()
        results["flex_block_sparse"] = {"eager_us": timed(torch, flexed, ITERATIONS), "max_abs_diff_vs_hisparse": err}
    except Exception as e:  # report, never hide, a FlexAttention failure
        results["flex_block_sparse"] = {"error": f"{type(e).__name__}: {e}"[:500]}

    small = torch.randn(64, 4096, device=dev)
    decode_op = torch.ops.hisparse.cache_decode.default
    decode_out_op = torch.ops.hisparse.cache_decode_out.default
    x = torch.randn(16, device=dev)
    results["host_us"] = {
        "cache_decode": host_us(torch, lambda: cache.decode(q3, slots_t)),
        "cache_decode_op": host_us(torch, lambda: decode_op(cache.lengths, cache.handle, 0, q3, slots_t, "standard")),
        "cache_decode_out": host_us(torch, lambda: cache.decode(q3, slots_t, out=out_o, lse=lse_o)),
        "cache_decode_out_op": host_us(torch, lambda: decode_out_op(cache.lengths, cache.handle, 0, q3, slots_t,
                                                                    "standard", out_o, lse_o)),
        "two_empty_like": host_us(torch, lambda: (torch.empty_like(q3), torch.empty_like(q3))),
        "topk": host_us(torch, lambda: hisparse.topk(small, 16)),
        "torch_add": host_us(torch, lambda: torch.add(x, x)),
    }
    # Prefill: sequence 0's whole prompt, every query, against SDPA causal.
    del flush
    qp = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    qd = qp.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D] (a view)

    def prefill():
        cache.prefill(qp, [slots[0]], [0], [T])

    def prefill_dense():
        fnn.scaled_dot_product_attention(qd, k[:1], v[:1], is_causal=True, enable_gqa=True)

    results["prefill_hisparse"] = {"eager_us": timed(torch, prefill, PREFILL_ITERATIONS, warmup=1)}
    results["prefill_sdpa_dense"] = {"eager_us": timed(torch, prefill_dense, PREFILL_ITERATIONS, warmup=1)}
    results["prefill_sdpa_dense"]["hisparse_speedup_eager"] = (results["prefill_sdpa_dense"]["eager_us"] /
                                                               results["prefill_hisparse"]["eager_us"])
    h = results["hisparse"]
    for name in ("sdpa_dense", "flex_block_sparse"):
        if "eager_us" in results[name]:
            results[name]["hisparse_speedup_eager"] = results[name]["eager_us"] / h["eager_us"]
    for name, r in results.items():
        print(f"{name:18s} " + ", ".join(f"{key} {val:.4g}" if isinstance(val, float) else f"{key} {val}"
                                          for key, val in r.items()))
    props = torch.cuda.get_device_properties(0)
    doc = {
        "context": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
                    "driver": driver(), "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit(),
                    "shape": {"B": B, "Hq": HQ, "Hkv": HKV, "D": D, "T": T},
                    "config": {"C": C, "F": F, "top_k_coarse": KC, "top_k_fine": KF, "window": W}},
        "results": results,
    }
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=2)
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
