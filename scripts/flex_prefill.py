#!/usr/bin/env python3
"""PyTorch baselines for bench/bench_prefill.cu's sparse prefill (one prompt of
T tokens, 32 query heads, 8 KV heads, head_dim 128, bf16, preset standard:
query tiles of 64, slices of 64, top-16 slices, window 512):

  * flex: FlexAttention (torch.compile'd) with a BlockMask of 64 x 64 blocks
    holding exactly the kept slices the library's selection chose (dumped by
    bench_prefill with HISPARSE_DUMP_KEPT=DIR) plus each tile's window,
    causal inside the diagonal block -- the same tokens the library attends;
  * sdpa: dense causal scaled_dot_product_attention (cuDNN / flash backends,
    whichever PyTorch picks), GQA by repeating K/V heads.

Timing: median of CUDA-event timings after warm-up. Inputs are random normal
(the cost does not depend on the values).

    python3 scripts/flex_prefill.py DIR T [OUT.json]

Without a CUDA device it says so and exits 0.
"""
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_decode import timed  # noqa: E402  (median of CUDA-event timings, us)

HQ, HKV, D = 32, 8, 128
M, F, KF, W = 64, 64, 16, 512
WARMUP, ITERATIONS = 3, 10


def timed_ms(torch, fn, iterations=ITERATIONS, warmup=WARMUP):
    return timed(torch, fn, iterations=iterations, warmup=warmup) * 1e-3


def block_mask(torch, np, directory, t):
    """The library's kept slices and each tile's window as a FlexAttention
    BlockMask: full blocks (no mask_mod) for the kept slices and the window's
    whole slices before the tile, the diagonal block causal."""
    from torch.nn.attention.flex_attention import BlockMask

    tiles = (t + M - 1) // M
    kept = np.fromfile(f"{directory}/kept_{t}.i32", dtype=np.int32).reshape(tiles, HKV, KF)
    num = np.fromfile(f"{directory}/num_{t}.i32", dtype=np.int32).reshape(tiles, HKV)
    full = np.zeros((tiles, HKV, KF + W // F), dtype=np.int32)
    full_num = np.zeros((tiles, HKV), dtype=np.int32)
    for tile in range(tiles):
        ws = max(0, tile * M - W + 1) // F * F  # contract::window_begin
        window = np.arange(ws // F, tile * M // F, dtype=np.int32)
        for h in range(HKV):
            n = int(num[tile, h])
            assert 0 <= n <= KF and (n == 0 or kept[tile, h, n - 1] < ws // F), "not a kept list"
            row = np.concatenate([kept[tile, h, :n], window])
            full[tile, h, : len(row)] = row
            full_num[tile, h] = len(row)
    diag = np.arange(tiles, dtype=np.int32).reshape(tiles, 1, 1).repeat(HKV, 1)
    group = HQ // HKV

    def per_q_head(a):  # [tiles, HKV(, n)] -> [1, HQ, tiles(, tiles)]
        x = torch.from_numpy(np.ascontiguousarray(a)).cuda()
        if x.dim() == 3:  # BlockMask reads an index row as wide as the key blocks
            x = torch.nn.functional.pad(x, (0, tiles - x.shape[-1]))
        return x.movedim(1, 0).repeat_interleave(group, 0).unsqueeze(0).contiguous()

    def causal(b, h, q, k):
        return q >= k

    mask = BlockMask.from_kv_blocks(
        per_q_head(np.ones((tiles, HKV), dtype=np.int32)),
        per_q_head(diag),
        per_q_head(full_num),
        per_q_head(full),
        BLOCK_SIZE=(M, F),
        mask_mod=causal,
        seq_lengths=(t, t),
    )
    keys = float(full_num.sum()) * F * group * M + tiles * HQ * M * (M + 1) / 2
    return mask, keys


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    directory, t = sys.argv[1], int(sys.argv[2])
    out = sys.argv[3] if len(sys.argv) > 3 else "flex_prefill.json"
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(f"flex_prefill: {e}; skipped")
        return 0
    if not torch.cuda.is_available():
        print("flex_prefill: no CUDA device; skipped")
        return 0
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    q = torch.randn(1, HQ, t, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, t, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, HKV, t, D, device="cuda", dtype=torch.bfloat16)
    mask, keys = block_mask(torch, np, directory, t)
    flex = torch.compile(flex_attention, fullgraph=True)
    results = {}
    for name, options in (("flex", None), ("flex_64x64", {"BLOCK_M": 64, "BLOCK_N": 64})):
        try:
            ms = timed_ms(torch, lambda: flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options))
            results[name] = {"ms": ms, "attended_TFLOPs": 4 * D * keys / (ms * 1e-3) * 1e-12}
        except Exception as e:  # a kernel option this PyTorch rejects
            results[name] = {"error": str(e).splitlines()[0][:200]}
        print(name, results[name], flush=True)
    kd, vd = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = timed_ms(torch, lambda: sdpa(q, kd, vd, is_causal=True), iterations=3, warmup=1)
    results["sdpa_dense_causal"] = {"ms": ms, "attended_TFLOPs": 4 * D * HQ * t * (t + 1) / 2 / (ms * 1e-3) * 1e-12}
    print("sdpa_dense_causal", results["sdpa_dense_causal"], flush=True)
    doc = {
        "context": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "T": t,
            "attended_keys_per_query": keys / (t * HQ),
        },
        "results": results,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
