#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_topk.cu: times torch.topk(x, k, dim=-1,
sorted=True) on random-normal fp32 CUDA tensors for the same five (rows, n, k)
shapes, as the median of CUDA-event timings after warm-up, prints a table and
writes JSON.

    python3 scripts/torch_topk.py [OUT.json]     (default torch_topk.json)

Like the C++ benchmark, each iteration reads a different copy of the input
(at least 256 MB in all), so repeated runs do not measure the 60 MB L2.
Without a CUDA device it says so and exits 0.
"""
import datetime
import json
import statistics
import sys

SHAPES = [(32768, 256, 32), (8192, 4096, 64), (1024, 65536, 64), (4096, 1024, 16), (128, 65536, 2048)]
WARMUP = 10
ITERATIONS = 100
HBM_BYTES_PER_SECOND = 4.8e12


def time_topk(torch, rows, n, k):
    bytes_per_copy = rows * n * 4
    copies = max(1, (256 << 20) // bytes_per_copy)
    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = [torch.randn(rows, n, device="cuda", dtype=torch.float32, generator=gen) for _ in range(copies)]
    for i in range(WARMUP):
        torch.topk(inputs[i % copies], k, dim=-1, sorted=True)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times_us = []
    for i in range(ITERATIONS):
        x = inputs[i % copies]
        start.record()
        torch.topk(x, k, dim=-1, sorted=True)
        stop.record()
        stop.synchronize()
        times_us.append(start.elapsed_time(stop) * 1e3)
    del inputs
    torch.cuda.empty_cache()
    median_us = statistics.median(times_us)
    return {
        "rows": rows,
        "n": n,
        "k": k,
        "median_us": median_us,
        "GBps": bytes_per_copy / (median_us * 1e-6) * 1e-9,
        "floor_us": bytes_per_copy / HBM_BYTES_PER_SECOND * 1e6,
        "iterations": ITERATIONS,
        "copies": copies,
    }


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "torch_topk.json"
    try:
        import torch
    except ImportError:
        print("torch_topk.py: PyTorch is not installed; nothing to time")
        return 0
    if not torch.cuda.is_available():
        print("torch_topk.py: no CUDA device visible to PyTorch; nothing to time")
        return 0
    results = [time_topk(torch, rows, n, k) for rows, n, k in SHAPES]
    gpu = torch.cuda.get_device_name(0)
    print(f"torch.topk (sorted=True), torch {torch.__version__}, {gpu}")
    print(f"{'rows':>7} {'n':>7} {'k':>5} {'median_us':>11} {'GBps':>8} {'floor_us':>9}")
    for r in results:
        print(f"{r['rows']:>7} {r['n']:>7} {r['k']:>5} {r['median_us']:>11.1f} {r['GBps']:>8.1f} {r['floor_us']:>9.1f}")
    report = {
        "benchmark": "torch.topk(x, k, dim=-1, sorted=True), fp32 random normal",
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
