#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_gating.cu's BM_activation_topk: for the
same (rows, n, K%) shapes, times

  topk_sorted    torch.topk(scores, k, dim=-1) on fp32 scores (sorted=True)
  topk_unsorted  the same with sorted=False
  pipeline       the whole gating in PyTorch from bf16 activations and an
                 fp32 gate: scores = |a| * g, topk (unsorted), the indices
                 sorted ascending, the activations gathered -- what
                 activation_topk returns

as the median of CUDA-event timings after warm-up, each iteration on a
different copy of the input (at least 256 MB in all, so the L2 does not
serve repeats). Prints a table and writes JSON.

    python3 scripts/torch_gating.py [OUT.json]     (default torch_gating.json)

Without a CUDA device it says so and exits 0.
"""
import datetime
import json
import statistics
import sys

SHAPES = [(4096, 14336, 25), (4096, 14336, 50), (4096, 14336, 10), (1, 14336, 25), (8, 14336, 50)]
WARMUP = 5
ITERATIONS = 30


def median_us(torch, fn, copies):
    for i in range(WARMUP):
        fn(i % copies)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(ITERATIONS):
        start.record()
        fn(i % copies)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def time_shape(torch, rows, n, pct):
    k = n * pct // 100
    copies = max(1, (256 << 20) // (rows * n * 4))
    gen = torch.Generator(device="cuda").manual_seed(7)
    acts = [torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(copies)]
    gate = 0.25 + torch.rand(n, device="cuda", generator=gen)
    scores = [a.float().abs() * gate for a in acts]

    def pipeline(c):
        a = acts[c]
        s = a.float().abs() * gate
        idx = torch.topk(s, k, dim=-1, sorted=False).indices
        idx = idx.sort(dim=-1).values
        return idx.to(torch.int32), a.gather(1, idx)

    result = {
        "rows": rows,
        "n": n,
        "k_pct": pct,
        "k": k,
        "topk_sorted_us": median_us(torch, lambda c: torch.topk(scores[c], k, dim=-1, sorted=True), copies),
        "topk_unsorted_us": median_us(torch, lambda c: torch.topk(scores[c], k, dim=-1, sorted=False), copies),
        "pipeline_us": median_us(torch, pipeline, copies),
        "copies": copies,
    }
    del acts, scores
    torch.cuda.empty_cache()
    return result


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "torch_gating.json"
    try:
        import torch
    except ImportError:
        print("torch_gating.py: PyTorch is not installed; nothing to time")
        return 0
    if not torch.cuda.is_available():
        print("torch_gating.py: no CUDA device visible to PyTorch; nothing to time")
        return 0
    results = [time_shape(torch, rows, n, pct) for rows, n, pct in SHAPES]
    gpu = torch.cuda.get_device_name(0)
    print(f"torch gating baselines, torch {torch.__version__}, {gpu}")
    print(f"{'rows':>6} {'n':>6} {'k':>5} {'topk_sorted_us':>15} {'topk_unsorted_us':>17} {'pipeline_us':>12}")
    for r in results:
        print(f"{r['rows']:>6} {r['n']:>6} {r['k']:>5} {r['topk_sorted_us']:>15.1f} {r['topk_unsorted_us']:>17.1f}"
              f" {r['pipeline_us']:>12.1f}")
    report = {
        "benchmark": "torch.topk on fp32 scores |a| g (sorted and unsorted), and the whole gating pipeline",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": results,
    }
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
