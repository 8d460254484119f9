#!/usr/bin/env python3
"""Turns the JSON that scripts/gpu-check.sh writes into the markdown tables
of bench/results/: append throughput against the in-run copy, batched top-k
against CUB and torch.topk, decode selection.

    python3 scripts/bench_report.py RESULTS_DIR > RESULTS_DIR/README.md
"""
import json
import os
import sys


def load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def rows(doc, prefix):
    return [b for b in (doc or {}).get("benchmarks", []) if b["name"].startswith(prefix)]


def main():
    d = sys.argv[1]
    kv = load(os.path.join(d, "bench_kv.json"))
    topk = load(os.path.join(d, "bench_topk.json"))
    sel = load(os.path.join(d, "bench_select.json"))
    torch = load(os.path.join(d, "torch_topk.json"))
    step = load(os.path.join(d, "bench_attention.json"))
    torch_step = load(os.path.join(d, "torch_decode.json"))
    ctx = (kv or topk or sel or step or {}).get("context", {})
    print(f"Measured {ctx.get('date', '?')} (benchmark clock).\n")
    if kv:
        print("## KV append (one layer, 8 KV heads x 128, bf16) vs in-run device-to-device copy\n")
        print("| benchmark | median us | GB/s | copy GB/s | % of copy |")
        print("|---|---:|---:|---:|---:|")
        for b in rows(kv, "BM_append"):
            print(f"| {b['name'].split('/iterations')[0]} | {b['median_us']:.2f} | {b['GBps']:.1f} | "
                  f"{b['copy_GBps']:.1f} | {b['pct_of_copy']:.1f} |")
        for b in rows(kv, "BM_page_pool"):
            print(f"\n{b['name']}: {b['items_per_second'] / 1e6:.0f} M pages/s")
        print()
    if topk:
        print("## Batched top-k (fp32 scores) vs CUB segmented sorts and torch.topk, same shapes\n")
        shapes = {}
        for b in topk["benchmarks"]:
            name, _, rest = b["name"].partition("/")
            key = rest.split("/iterations")[0].split("/manual_time")[0]
            shapes.setdefault(key, {})[name] = b
        tmap = {}
        for t in (torch or {}).get("results", []):
            tmap[f"rows:{t['rows']}/n:{t['n']}/k:{t['k']}"] = t["median_us"]
        print("| shape | hisparse us | CUB seg. sort us | CUB seg. radix us | torch.topk us | read floor us |"
              " x CUB sort | x torch |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for key, m in shapes.items():
            h = m.get("BM_hisparse_topk")
            if not h:
                continue
            s = m.get("BM_cub_segmented_sort", {}).get("median_us", float("nan"))
            r = m.get("BM_cub_segmented_radix_sort", {}).get("median_us", float("nan"))
            t = tmap.get(key, float("nan"))
            print(f"| {key} | {h['median_us']:.1f} | {s:.1f} | {r:.1f} | {t:.1f} | {h['floor_us']:.1f} | "
                  f"{s / h['median_us']:.1f} | {t / h['median_us']:.1f} |")
        print()
    if sel:
        print("## Decode selection (coarse + fine, one launch), 32/8 heads, head_dim 128, defaults\n")
        print("| benchmark | graph replay us | eager us | MB read | GB/s |")
        print("|---|---:|---:|---:|---:|")
        for b in rows(sel, "BM_decode_selection"):
            print(f"| {b['name'].split('/iterations')[0]} | {b['replay_us']:.2f} | {b['eager_us']:.2f} | "
                  f"{b['MB_read']:.2f} | {b['GBps']:.0f} |")

        print()
    if step:
        print("## Decode step (selection + attention), 32/8 heads, head_dim 128, bf16; graph replay\n")
        print("| benchmark | step us | selection us | attention us | dense us | x dense | attention GB/s |"
              " % of copy | dense % of copy | tokens/query |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for b in rows(step, "BM_decode_step"):
            print(f"| {b['name'].split('/iterations')[0]} | {b['step_us']:.1f} | {b['selection_us']:.1f} | "
                  f"{b['attention_us']:.1f} | {b['dense_us']:.0f} | {b['speedup_vs_dense']:.1f} | "
                  f"{b['attention_GBps']:.0f} | {100 * b['attention_of_copy']:.1f} | "
                  f"{100 * b['dense_of_copy']:.1f} | {b['tokens_per_query']:.0f} |")
        if torch_step:
            r = torch_step["results"]
            ours = next((b for b in rows(step, "BM_decode_step/B:8/T:262144/topk:16")), None)
            print("\nPyTorch on the same shape (B = 8, T = 256K), scripts/torch_decode.py:\n")
            print("| PyTorch | eager us | graph us | HiSparse step us | x (graph) |")
            print("|---|---:|---:|---:|---:|")
            for name in ("dense", "hierarchical"):
                x = f"{r[name]['graph_us'] / ours['step_us']:.1f}" if ours else "-"
                print(f"| {name} | {r[name]['eager_us']:.1f} | {r[name]['graph_us']:.1f} | "
                      f"{ours['step_us'] if ours else float('nan'):.1f} | {x} |")
    tiles = rows(step, "BM_step_tile")
    if tiles:
        print("\n## Attention tile policies (the composed step, graph replay)\n")
        print("| benchmark | step us | splits | stages | CTAs/SM |")
        print("|---|---:|---:|---:|---:|")
        for b in tiles:
            print(f"| {b['name'].split('/iterations')[0]} | {b['step_us']:.1f} | {b['splits']:.0f} | "
                  f"{b['stages']:.0f} | {b['ctas_per_sm']:.0f} |")


if __name__ == "__main__":
    main()
