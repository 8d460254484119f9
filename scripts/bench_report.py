#!/usr/bin/env python3
"""Markdown tables, comparisons and a plot from the JSON of bench/results/.

Reads Google Benchmark JSON (bench/bench_*.cu) and the PyTorch baselines of
scripts/torch_topk.py and scripts/torch_decode.py. A PATH is a results folder
(searched recursively for *.json), a JSON file or a glob (quoted or not).

    python3 scripts/bench_report.py bench/results/2026-12-01-h200-targets-2e9e964
    python3 scripts/bench_report.py 'bench/results/*/step*.json'
    python3 scripts/bench_report.py --compare OLD_RESULTS NEW_RESULTS [--metric step_us]
    python3 scripts/bench_report.py --plot step.png bench/results/A bench/results/B
    python3 scripts/bench_report.py --self-test

Only --plot needs matplotlib; it exits 2 without it.
"""
import argparse
import contextlib
import glob
import io
import json
import math
import os
import re
import signal
import sys
import tempfile
from dataclasses import dataclass

# Name segments that say how a benchmark was run, not what it measures.
RUN_SEGMENT = re.compile(r"iterations:.*|manual_time|real_time|min_time:.*|repeats:.*")
# Old BM_decode_step names gave the preset as its fine top-k.
TOPK_PRESETS = {"16": "standard", "32": "high_recall"}
# Google Benchmark's own fields of a row; every other number is a user counter.
GBENCH_FIELDS = {"name", "run_name", "run_type", "family_index", "per_family_instance_index", "repetitions",
                 "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit",
                 "aggregate_name", "aggregate_unit", "error_occurred", "error_message", "label"}
# Counter columns of the known families, by family prefix; the first match wins.
TUNED_COLUMNS = (
    ("BM_append", ("median_us", "GBps", "copy_GBps", "pct_of_copy")),
    ("BM_hisparse_topk", ("median_us", "floor_us")),
    ("BM_cub_", ("median_us", "floor_us")),
    ("BM_decode_selection", ("replay_us", "eager_us", "warm_replay_us", "MB_read", "GBps")),
    ("BM_prefill_selection", ("ms", "TFLOPs")),
    ("BM_decode_step", ("step_us", "selection_us", "attention_us", "dense_us", "speedup_vs_dense",
                        "attention_GBps", "attention_of_copy", "tokens_per_query")),
    ("BM_step_tile", ("step_us", "splits", "stages", "ctas_per_sm")),
)
CONTEXT_KEYS = ("date", "host_name", "gpu_name", "gpu_cc", "gpu_sms", "gpu_sm_clock_max_mhz",
                "gpu_mem_clock_max_mhz", "gpu_memory_gib", "gpu_driver", "cuda_driver_api", "cuda_runtime", "hisparse_commit",
                "hisparse_dirty")
COMPARE_METRICS = ("step_us", "selection_us", "attention_us", "dense_us", "speedup_vs_dense", "replay_us",
                   "eager_us", "median_us", "ms")
MICROSECONDS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


@dataclass
class Doc:
    path: str
    kind: str  # "gbench", "torch_topk", "torch_decode" or "skipped"
    data: object = None
    note: str = ""  # why it was skipped, or that the run stopped early


# ---------------------------------------------------------------- loading

def collect(spec):
    """The JSON files that a PATH argument names: a folder (recursively), a file or a glob."""
    if os.path.isdir(spec):
        return sorted(glob.glob(os.path.join(glob.escape(spec), "**", "*.json"), recursive=True))
    if os.path.isfile(spec):
        return [spec]
    files = []
    for match in sorted(glob.glob(spec, recursive=True)):
        if os.path.isdir(match) or match.endswith(".json"):
            files += collect(match)
    return files


def parse(text):
    """The JSON of `text` and a note; a benchmark run that died mid-array keeps its complete rows."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as error:
        try:
            return json.loads(text.rstrip().rstrip(",") + "]}"), "truncated file (the run stopped early)"
        except json.JSONDecodeError:
            raise error from None


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            data, note = parse(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return Doc(path, "skipped", note=f"unreadable JSON ({error})")
    kind = kind_of(data)
    if kind == "skipped":
        top = ", ".join(map(str, data))[:80] if isinstance(data, dict) else type(data).__name__
        note = f"not Google Benchmark or PyTorch baseline JSON (top level: {top})"
    return Doc(path, kind, data, note)


def kind_of(data):
    if not isinstance(data, dict):
        return "skipped"
    if isinstance(data.get("benchmarks"), list):
        return "gbench"
    results = data.get("results")
    if isinstance(results, list) and all(isinstance(r, dict) and {"rows", "n", "k", "median_us"} <= r.keys()
                                         for r in results):
        return "torch_topk"
    if isinstance(results, dict) and all(isinstance(results.get(m), dict) for m in ("dense", "hierarchical")):
        return "torch_decode"
    return "skipped"


def context(doc):
    ctx = doc.data.get("context")
    return ctx if isinstance(ctx, dict) else {}


# ---------------------------------------------------------------- names and rows

def normalize(name):
    """'BM_decode_step/B:8/T:262144/topk:16/iterations:30/manual_time'
    -> 'BM_decode_step/B:8/T:262144/preset:standard'."""
    family, *segments = name.split("/")
    kept = [s for s in segments if not RUN_SEGMENT.fullmatch(s)]
    if family.startswith("BM_decode_step"):
        kept = [preset_segment(s) for s in kept]
    return "/".join([family, *kept])


def preset_segment(segment):
    """An old decode step name's 'topk:16' as the preset it meant."""
    name, _, value = segment.partition(":")
    return f"preset:{TOPK_PRESETS[value]}" if name == "topk" and value in TOPK_PRESETS else segment


def split_key(key):
    """'BM_x/B:8/T:1024' -> ('BM_x', {'B': '8', 'T': '1024'})."""
    family, *segments = key.split("/")
    return family, {k: v for k, _, v in (s.partition(":") for s in segments)}


def runs(doc):
    """{normalised name: row}: with repetitions, the median aggregate (the mean where there is no median)."""
    picked = {}
    for row in doc.data["benchmarks"]:
        if not isinstance(row, dict) or not isinstance(row.get("name"), str):
            continue
        aggregate = row.get("aggregate_name")
        rank = {None: 0, "mean": 1, "median": 2}.get(aggregate, -1)
        key = normalize(row.get("run_name") or row["name"].removesuffix(f"_{aggregate}"))
        if rank >= 0 and rank >= picked.get(key, (0, None))[0]:
            picked[key] = (rank, row)
    return {key: row for key, (_, row) in picked.items()}


def number(row, name):
    """A counter of a row, real_time in microseconds, None where absent."""
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value * MICROSECONDS.get(row.get("time_unit", "ns"), 1.0) if name == "real_time" else value


def counters(row):
    return [k for k in row if k not in GBENCH_FIELDS and number(row, k) is not None]


def fmt(value):
    """A number with about three significant digits; '-' for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    size = abs(value)
    if not math.isfinite(value) or size >= 1e6:
        return f"{value:.4g}"
    if float(value).is_integer():
        return str(int(value))
    decimals = 0 if size >= 100 else 1 if size >= 10 else 2 if size >= 1 else None
    return f"{value:.3g}" if decimals is None else f"{value:.{decimals}f}"


def ratio(num, den):
    return f"{num / den:.3f}" if fmt(num) != "-" and fmt(den) != "-" and den else "-"


def table(header, rows, text_columns=1):
    """A markdown table: text columns first, left-aligned, then numbers."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * text_columns + "---:|" * (len(header) - text_columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


# ---------------------------------------------------------------- report

def report(specs):
    """Tables of every JSON file under the PATHs, one section per PATH."""
    groups = [(spec, collect(spec)) for spec in specs]
    docs = {path: load(path) for _, files in groups for path in files}
    for spec, files in groups:
        print(f"# {spec}\n")
        if not files:
            print("no JSON files\n")
        for path in files:
            print(f"## {os.path.relpath(path, spec) if os.path.isdir(spec) else path}\n")
            show(docs[path], docs.values())
    return 0 if docs else 1


def show(doc, all_docs):
    """One file's section: its context line and a table per benchmark family."""
    if doc.kind == "skipped":
        print(f"skipped: {doc.note}\n")
        return
    if doc.kind != "gbench":
        print(f"PyTorch baseline from scripts/{doc.kind}.py: shown beside the tables of its folder\n")
        return
    ctx = context(doc)
    print(", ".join(f"{k}={ctx[k]}" for k in CONTEXT_KEYS if k in ctx) or "no context", end="\n\n")
    rows = runs(doc)
    if doc.note:
        print(doc.note + "\n")
    if any("aggregate_name" in row for row in rows.values()):
        print("repetitions: medians shown\n")
    if not rows:
        print("no benchmark rows\n")
    for family in dict.fromkeys(split_key(key)[0] for key in rows):
        print(f"### {family}\n")
        family_table(family, {k: r for k, r in rows.items() if split_key(k)[0] == family})
        if family in BASELINE_TABLES:
            kind, baseline_table = BASELINE_TABLES[family]
            baselines = nearest(doc.path, [d for d in all_docs if d.kind == kind])
            if baselines:
                baseline_table(rows, baselines)


def family_table(family, rows):
    """The tuned columns of a known family, else real_time and every counter."""
    tuned = next((cols for prefix, cols in TUNED_COLUMNS if family.startswith(prefix)), None)
    columns = tuned or list(dict.fromkeys(c for row in rows.values() for c in counters(row)))
    lines = []
    for key, row in rows.items():
        time = [] if tuned else [f"{fmt(row.get('real_time'))} {row.get('time_unit', '')}"]
        lines.append([label(key, row), *time, *(fmt(number(row, c)) for c in columns)])
    table(["benchmark", *([] if tuned else ["real_time"]), *columns], lines)


def label(key, row):
    name = key.partition("/")[2] or key
    return f"{name} (error: {row.get('error_message', '?')})" if row.get("error_occurred") else name


def nearest(path, baselines):
    """The baselines in the deepest folder that holds `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        found = [d for d in baselines if os.path.dirname(os.path.abspath(d.path)) == folder]
        if found or folder == os.path.dirname(folder):
            return found
        folder = os.path.dirname(folder)


def topk_beside_baselines(rows, baselines):
    torch = {f"rows:{r['rows']}/n:{r['n']}/k:{r['k']}": number(r, "median_us")
             for d in baselines for r in d.data["results"]}
    shapes = {}
    for key, row in rows.items():
        family, _, shape = key.partition("/")
        shapes.setdefault(shape, {})[family] = number(row, "median_us")
    files = ", ".join(os.path.basename(d.path) for d in baselines)
    print(f"Side by side with {files} (us; x = their time / ours):\n")
    table(["shape", "hisparse", "CUB seg. sort", "CUB seg. radix", "torch.topk", "x CUB sort", "x torch"],
          [[shape, fmt(ours), fmt(m.get("BM_cub_segmented_sort")), fmt(m.get("BM_cub_segmented_radix_sort")),
            fmt(torch.get(shape)), ratio(m.get("BM_cub_segmented_sort"), ours), ratio(torch.get(shape), ours)]
           for shape, m in shapes.items() if (ours := m.get("BM_hisparse_topk")) is not None])


def step_beside_torch(rows, baselines):
    for doc in baselines:
        shape = context(doc).get("shape")
        shape = shape if isinstance(shape, dict) else {}
        key = torch_counterpart(rows, shape)
        ours = number(rows[key], "step_us") if key else None
        print(f"{os.path.basename(doc.path)}: PyTorch on B = {shape.get('B')}, T = {shape.get('T')}, "
              f"against {key.partition('/')[2] if key else 'no matching row'}:\n")
        results = doc.data["results"]
        table(["PyTorch", "eager us", "graph us", "HiSparse step us", "x (graph)"],
              [[name, fmt(number(results[name], "eager_us")), fmt(number(results[name], "graph_us")), fmt(ours),
                ratio(number(results[name], "graph_us"), ours)] for name in ("dense", "hierarchical")])


def torch_counterpart(rows, shape):
    """The BM_decode_step row of scripts/torch_decode.py's shape (bf16, standard preset), or None."""
    want = {"B": str(shape.get("B")), "T": str(shape.get("T")), "D": str(shape.get("D")), "dtype": "bf16",
            "preset": "standard"}
    for key in rows:
        family, params = split_key(key)
        if family == "BM_decode_step" and {"B", "T"} <= params.keys() and all(
                v == want[p] for p, v in params.items() if p in want):
            return key
    return None


# Tables printed after a family's own, against the PyTorch baseline of that kind nearest the file.
BASELINE_TABLES = {"BM_hisparse_topk": ("torch_topk", topk_beside_baselines),
                   "BM_decode_step": ("torch_decode", step_beside_torch)}


# ---------------------------------------------------------------- compare

def merged_runs(spec):
    """All benchmark rows under a PATH argument; later files win on a name."""
    files, rows = collect(spec), {}
    for path in files:
        doc = load(path)
        if doc.kind == "gbench":
            rows.update(runs(doc))
    return files, rows


def contains(key_a, key_b):
    """Same family and one name's parameters hold the other's (an old and a new name of one benchmark)."""
    (family_a, params_a), (family_b, params_b) = split_key(key_a), split_key(key_b)
    return family_a == family_b and (params_a.items() <= params_b.items() or params_b.items() <= params_a.items())


def pair_up(keys_a, keys_b):
    """(A name, B name) pairs: the same normalised name, else the one B name of the family that `contains` A's."""
    pairs, unmatched = [], [k for k in keys_b if k not in keys_a]
    for key in keys_a:
        candidates = [key] if key in keys_b else [k for k in unmatched if contains(key, k)]
        if len(candidates) == 1:
            pairs.append((key, candidates[0]))
            if candidates[0] in unmatched:
                unmatched.remove(candidates[0])
    return pairs


def compare(spec_a, spec_b, metric=None):
    """A, B and B/A of the key metrics (or `metric`) of the benchmarks in both; 1 where there are none."""
    (files_a, a), (files_b, b) = merged_runs(spec_a), merged_runs(spec_b)
    for side, spec, files, rows in (("A", spec_a, files_a, a), ("B", spec_b, files_b, b)):
        print(f"{side}: {spec}: {len(files)} file(s), {len(rows)} benchmarks")
    print()
    pairs = pair_up(list(a), list(b))
    lines = []
    for key_a, key_b in pairs:
        names = [metric] if metric else [m for m in COMPARE_METRICS if m in a[key_a] and m in b[key_b]]
        names = names or ["real_time"]
        name = key_a if key_a == key_b else f"{key_a} -> {key_b}"
        for m in names:
            va, vb = number(a[key_a], m), number(b[key_b], m)
            if va is not None and vb is not None:
                lines.append([name, "real_time_us" if m == "real_time" else m, fmt(va), fmt(vb), ratio(vb, va)])
    if lines:
        table(["benchmark", "metric", "A", "B", "B/A"], lines, text_columns=2)
    else:
        print(f"nothing to compare: no benchmark in both{f' has {metric}' if metric else ''}\n")
    for side, keys, paired in (("A", a, {p[0] for p in pairs}), ("B", b, {p[1] for p in pairs})):
        only = [k for k in keys if k not in paired]
        print(f"Only in {side} ({len(only)}):" + "".join(f"\n- {k}" for k in only) + "\n")
    return 0 if lines else 1


# ---------------------------------------------------------------- plot

def file_labels(paths):
    """Folder names where they tell the files apart, else paths below the common folder."""
    if len(paths) < 2:
        return {p: "" for p in paths}
    folders = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    if len(set(folders)) == len(paths):
        return dict(zip(paths, folders))
    base = os.path.commonpath([os.path.abspath(p) for p in paths])
    return {p: os.path.relpath(os.path.abspath(p), base).removesuffix(".json") for p in paths}


def step_series(docs):
    """{(file label, parameters but T): [(T, row)]} from the BM_decode_step rows."""
    rows = {d.path: {k: r for k, r in runs(d).items() if split_key(k)[0] == "BM_decode_step"
                     and "T" in split_key(k)[1] and number(r, "step_us") is not None} for d in docs}
    labels = file_labels([p for p, r in rows.items() if r])
    series = {}
    for path, found in rows.items():
        for key, row in found.items():
            params = split_key(key)[1]
            rest = tuple((p, v) for p, v in params.items() if p != "T")
            series.setdefault((labels[path], rest), []).append((int(params["T"]), row))
    return series


def legend(series_key, all_keys):
    """A series' file label and the parameters that differ between series."""
    label, params = series_key
    shown = [f"{p}:{v}" for p, v in params if len(all_keys) == 1 or len({dict(k[1]).get(p) for k in all_keys}) > 1]
    return " ".join([label, *shown]).strip() or "all"


def plot(specs, out):
    """Step time and speed-up against T of the BM_decode_step rows; 1 without such rows, 2 without matplotlib."""
    docs = [d for d in map(load, dict.fromkeys(f for s in specs for f in collect(s))) if d.kind == "gbench"]
    series = step_series(docs)
    if not series:
        print(f"bench_report: no BM_decode_step rows in {' '.join(specs)}; nothing to plot", file=sys.stderr)
        return 1
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_report: --plot needs matplotlib (pip install matplotlib); no plot written", file=sys.stderr)
        return 2
    from matplotlib.ticker import FuncFormatter
    fig, (time_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    names = {key: legend(key, list(series)) for key in series}
    for key, points in series.items():
        points.sort(key=lambda p: p[0])
        name = names[key]
        time_ax.plot([t for t, _ in points], [number(r, "step_us") for _, r in points], "o-", label=name)
        speed = [(t, number(r, "speedup_vs_dense")) for t, r in points if number(r, "speedup_vs_dense") is not None]
        speed_ax.plot([t for t, _ in speed], [s for _, s in speed], "o-", label=name)
    time_ax.set(yscale="log", ylabel="step time (us)", title="decode step")
    time_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    time_ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    speed_ax.set(ylabel="speed-up vs dense (x)", title="speed-up against the dense step")
    for ax in (time_ax, speed_ax):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}K"))
        ax.set_xlabel("context T (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    columns = max(1, min(4, len(series), 140 // max(map(len, names.values()))))
    fig.legend(*time_ax.get_legend_handles_labels(), loc="outside lower center", ncols=columns, fontsize="small")
    fig.suptitle(plot_title(docs))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")
    return 0


def plot_title(docs):
    gpus = dict.fromkeys(str(context(d)["gpu_name"]) for d in docs if "gpu_name" in context(d))
    commits = dict.fromkeys(str(context(d)["hisparse_commit"])
                            + ("-dirty" if str(context(d).get("hisparse_dirty")).lower() in ("1", "true") else "")
                            for d in docs if "hisparse_commit" in context(d))
    return " | ".join(["HiSparse decode step", *gpus, *(f"commit {c}" for c in commits)])


# ---------------------------------------------------------------- self-test

def _row(name, **fields):
    return {"name": name, "run_name": name, "run_type": "iteration", "iterations": 30, "real_time": 1.5,
            "cpu_time": 2.0, "time_unit": "us", **fields}


def _write(folder, name, doc):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))


def _fixtures(tmp):
    """An old and a new results folder; returns their paths."""
    old, new = os.path.join(tmp, "old"), os.path.join(tmp, "new")
    old_ctx = {"date": "2026-11-30", "host_name": "box"}
    new_ctx = {**old_ctx, "date": "2027-01-01", "gpu_name": "Test GPU", "hisparse_commit": "abc1234"}
    _write(old, "step.json", {"context": old_ctx, "benchmarks": [
        _row("BM_decode_step/B:8/T:32768/topk:16/iterations:30/manual_time", step_us=20.0, speedup_vs_dense=5.0),
        _row("BM_decode_step/B:8/T:262144/topk:16/iterations:30/manual_time", step_us=40.0, speedup_vs_dense=12.0),
        _row("BM_decode_step/B:8/T:262144/topk:32/iterations:30/manual_time", step_us=50.0),
        _row("BM_widget/size:3", widgets_per_s=123.0)]})
    _write(old, "select.json", {"context": old_ctx, "benchmarks": [
        _row("BM_decode_selection/B:8/T:262144/key_mean:0/iterations:100/manual_time", replay_us=8.0, eager_us=9.5)]})
    _write(old, "notes.json", {"hello": 1})
    _write(old, "torch_decode.json", {"context": {"shape": {"B": 8, "T": 262144, "D": 128}}, "results": {
        "dense": {"eager_us": 410.0, "graph_us": 400.0}, "hierarchical": {"eager_us": 150.0, "graph_us": 80.0}}})
    _write(old, "cut.json", json.dumps({"context": old_ctx, "benchmarks": [_row("BM_cut/n:1")]})[:-2])
    step = "BM_decode_step/preset:standard/dtype:bf16/D:128"
    _write(new, "step.json", {"context": new_ctx, "benchmarks": [
        _row(f"{step}/B:8/T:32768", step_us=10.0, speedup_vs_dense=9.0),
        _row(f"{step}/B:8/T:262144", step_us=30.0, speedup_vs_dense=16.0),
        _row(f"{step}/B:32/T:262144", step_us=70.0, speedup_vs_dense=20.0),
        _row("BM_decode_selection/B:8/T:262144/key_mean:0", replay_us=6.0, eager_us=9.5)]})
    median = "BM_decode_step/preset:high_recall/B:1/T:65536/repeats:3"
    _write(new, "reps.json", {"context": new_ctx, "benchmarks": [
        _row(median, step_us=1.25), _row(median, step_us=2.25),
        _row(f"{median}_mean", run_name=median, run_type="aggregate", aggregate_name="mean", step_us=33.5),
        _row(f"{median}_median", run_name=median, run_type="aggregate", aggregate_name="median", step_us=22.4),
        _row(f"{median}_stddev", run_name=median, run_type="aggregate", aggregate_name="stddev", step_us=0.125)]})
    return old, new


def _capture(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = fn(*args)
    return rc, out.getvalue()


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        old, new = _fixtures(tmp)
        _, tables = _capture(report, [old, os.path.join(new, "*.json"), os.path.join(tmp, "nothing*")])
        rc_cmp, cmp = _capture(compare, old, new)
        _, cmp_metric = _capture(compare, old, new, "replay_us")
        checks = [
            ("old name, run segments dropped", tables, "| B:8/T:32768/preset:standard | 20 | - |", True),
            ("new name", tables, "| preset:standard/dtype:bf16/D:128/B:8/T:262144 | 30 | - |", True),
            ("context", tables, "date=2027-01-01, host_name=box, gpu_name=Test GPU, hisparse_commit=abc1234", True),
            ("unknown family, generic", tables, "| size:3 | 1.50 us | 123 |", True),
            ("non-benchmark file skipped", tables, "skipped: not Google Benchmark or PyTorch baseline JSON", True),
            ("truncated file kept", tables, "truncated file (the run stopped early)\n\n### BM_cut", True),
            ("PyTorch decode baseline", tables, "| dense | 410 | 400 | 40 | 10.000 |", True),
            ("repetitions: median row", tables, "| preset:high_recall/B:1/T:65536 | 22.4 |", True),
            ("repetitions: mean hidden", tables, "33.5", False),
            ("glob without match", tables, "no JSON files", True),
            ("compare, old name against new", cmp, "| BM_decode_step/B:8/T:32768/preset:standard -> "
             "BM_decode_step/preset:standard/dtype:bf16/D:128/B:8/T:32768 | step_us | 20 | 10 | 0.500 |", True),
            ("compare, normalised name", cmp,
             "| BM_decode_selection/B:8/T:262144/key_mean:0 | replay_us | 8 | 6 | 0.750 |", True),
            ("compare, only in A", cmp,
             "Only in A (3):\n- BM_cut/n:1\n- BM_decode_step/B:8/T:262144/preset:high_recall", True),
            ("compare, only in B", cmp, "- BM_decode_step/preset:standard/dtype:bf16/D:128/B:32/T:262144", True),
            ("compare rc", str(rc_cmp), "0", True),
            ("--metric", cmp_metric, "| replay_us | 8 | 6 | 0.750 |", True),
            ("--metric, nothing else", cmp_metric, "step_us", False),
        ]
        png = os.path.join(tmp, "step.png")
        rc_plot, _ = _capture(plot, [old, new], png)  # 2: no matplotlib here, which the plot says
        checks.append(("plot", str(rc_plot == 2 or rc_plot == 0 and os.path.getsize(png) > 0), "True", True))
        rc_none, _ = _capture(plot, [os.path.join(old, "select.json")], os.path.join(tmp, "none.png"))
        checks.append(("plot without step rows fails", str(rc_none), "1", True))
    for what, output, needle, wanted in checks:
        if (needle in output) != wanted:
            where = "missing from" if wanted else "found in"
            print(f"bench_report self-test: FAILED: {what}: {needle!r} {where}:\n{output}")
            return 1
    print("bench_report self-test: ok")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", metavar="PATH", help="results folder, JSON file or glob")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two files, folders or globs")
    parser.add_argument("--metric", metavar="NAME", help="with --compare: only this counter")
    parser.add_argument("--plot", metavar="OUT.png", help="plot the BM_decode_step rows of the PATHs")
    parser.add_argument("--self-test", action="store_true", help="check this script on synthetic JSON")
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    if args.metric and not args.compare:
        parser.error("--metric goes with --compare")
    if args.compare:
        if args.paths or args.plot:
            parser.error("--compare takes no PATH and no --plot")
        return compare(*args.compare, args.metric)
    if not args.paths:
        parser.error("give at least one PATH")
    return plot(args.paths, args.plot) if args.plot else report(args.paths)


if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `bench_report.py ... | head` ends quietly
    sys.exit(main())
