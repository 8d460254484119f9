"""The stateless ops against the float64 contract (contract.py), on the CPU
(the reference kernels) and on the GPU (the library's kernels)."""
import math

import pytest
import torch

import hisparse
from conftest import needs_cuda
import contract

ops = torch.ops.hisparse


def scores_with_ties(rows, n, gen, device):
    s = torch.randn(rows, n, generator=gen)
    if n > 3:
        s[:, ::7] = s[:, 3:4]  # exact ties, to check they go to the lower index
    return s.to(device)


@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (3, 50, 7), (8, 1000, 64), (2, 5000, 300), (4, 70000, 2048),
                                      (300, 257, 16)])
def test_topk_matches_contract(device, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 131 + n + k)
    s = scores_with_ties(rows, n, gen, device)
    values, indices = hisparse.topk(s, k)
    ref_v, ref_i = contract.topk(s, k)
    assert torch.equal(indices.cpu().long(), ref_i)
    assert torch.equal(values.cpu().double(), ref_v)


def test_topk_row_lengths_padding_and_nan(device):
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(5, 300, generator=gen)
    s[0, 10] = math.nan
    s[1, 20] = -math.inf
    s[1, 21] = math.nan
    s = s.to(device)
    lengths = torch.tensor([300, 300, 5, 0, 1000], dtype=torch.int32, device=device)
    values, indices = hisparse.topk(s, 310, lengths)  # k > n: the rest is padding
    ref_v, ref_i = contract.topk(s, 310, lengths.cpu())
    assert torch.equal(indices.cpu().long(), ref_i)
    v, r = values.cpu().double(), ref_v
    assert torch.equal(torch.isnan(v), torch.isnan(r))
    assert torch.equal(torch.nan_to_num(v), torch.nan_to_num(r))
    assert (indices[3] == -1).all() and torch.isneginf(values[3]).all()


def test_topk_strided_rows(device):
    base = torch.randn(6, 900, generator=torch.Generator().manual_seed(9)).to(device)
    view = base[:, 100:700]  # rows 900 apart
    values, indices = hisparse.topk(view, 40)
    ref_v, ref_i = contract.topk(view, 40)
    assert torch.equal(indices.cpu().long(), ref_i)


def test_topk_rejects_bad_input(device):
    s = torch.randn(4, 10, device=device)
    with pytest.raises(RuntimeError, match="k 0 must be in"):
        hisparse.topk(s, 0)
    with pytest.raises(RuntimeError, match="must be float32"):
        hisparse.topk(s.double(), 3)
    with pytest.raises(RuntimeError, match="2 dimensions"):
        hisparse.topk(s[0], 3)
    with pytest.raises(RuntimeError, match="one row length per row"):
        hisparse.topk(s, 3, torch.zeros(3, dtype=torch.int32, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1), (5, 300), (3, 14336)])
def test_activation_topk_matches_contract(device, dtype, gate_dtype, rows, n):
    gen = torch.Generator().manual_seed(n + rows)
    a = torch.randn(rows, n, generator=gen).to(dtype).to(device)
    gate = (torch.rand(n, generator=gen) + 0.5).to(gate_dtype).to(device)
    k_max = max(1, n // 4)
    k = torch.randint(0, k_max + 3, (rows,), generator=gen, dtype=torch.int32)  # some past k_max: clamped
    k[0] = 0 if rows > 1 else k[0]
    for kwargs in ({}, {"k_per_row": k.to(device)}, {"threshold": 0.8}):
        idx, vals, counts = hisparse.activation_topk(a, gate, k_max, **kwargs)
        ref = contract.activation_topk(a, gate, k_max, k_per_row=kwargs.get("k_per_row"),
                                       threshold=kwargs.get("threshold"))
        assert torch.equal(idx.cpu().long(), ref[0]), kwargs
        assert torch.equal(vals.cpu().double(), ref[1]), kwargs
        assert torch.equal(counts.cpu().long(), ref[2]), kwargs


def test_activation_topk_strided_rows_and_bad_input(device):
    base = torch.randn(4, 2000, generator=torch.Generator().manual_seed(2)).bfloat16().to(device)
    a = base[:, 3:1203]
    gate = torch.rand(1200, device=device)
    idx, vals, counts = hisparse.activation_topk(a, gate, 100)
    ref = contract.activation_topk(a, gate, 100)
    assert torch.equal(idx.cpu().long(), ref[0])
    with pytest.raises(RuntimeError, match="k_max 0 must be in"):
        hisparse.activation_topk(a, gate, 0)
    with pytest.raises(RuntimeError, match="the threshold is NaN"):
        hisparse.activation_topk(a, gate, 10, threshold=math.nan)
    with pytest.raises(RuntimeError, match="not both"):
        hisparse.activation_topk(a, gate, 10, k_per_row=counts, threshold=1.0)
    with pytest.raises(RuntimeError, match="gate must be"):
        hisparse.activation_topk(a, gate[:10], 10)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        hisparse.activation_topk(a.float(), gate, 10)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_gated_gemv_matches_contract(device, rows):
    gen = torch.Generator().manual_seed(rows)
    n, outs = 3000, 700
    a = torch.randn(rows, n, generator=gen).bfloat16().to(device)
    gate = torch.rand(n, generator=gen).to(device)
    wt = torch.randn(n, outs, generator=gen).bfloat16().to(device)
    k = torch.randint(0, n // 2, (rows,), generator=gen, dtype=torch.int32).to(device)
    idx, vals, counts = hisparse.activation_topk(a, gate, n // 2, k_per_row=k)
    y = hisparse.gated_gemv(wt, idx, vals, counts)
    ref = contract.gated_gemv(wt, idx, vals, counts)
    # fp32 accumulation of up to n/2 products: a few fp32 ulps of the sum of |terms|
    scale = contract.gated_gemv(wt.abs(), idx, vals.abs(), counts)
    assert ((y.cpu().double() - ref).abs() <= 1e-5 * scale + 1e-30).all()


def test_gated_gemv_rejects_bad_input(device):
    wt = torch.randn(100, 20, device=device).bfloat16()
    idx = torch.zeros(2, 10, dtype=torch.int32, device=device)
    vals = torch.zeros(2, 10, device=device).bfloat16()
    counts = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="counts \\[rows\\]"):
        hisparse.gated_gemv(wt, idx, vals, counts[:1])
    with pytest.raises(RuntimeError, match="wt must be"):
        hisparse.gated_gemv(wt.float(), idx, vals, counts)


def sample_args(device):
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(6, 500, generator=gen).to(device)
    a = torch.randn(4, 640, generator=gen).bfloat16().to(device)
    gate = torch.rand(640, generator=gen).to(device)
    wt = torch.randn(640, 96, generator=gen).bfloat16().to(device)
    idx, vals, counts = hisparse.activation_topk(a, gate, 64)
    return [
        (ops.topk.default, (s, 9), {}),
        (ops.topk.default, (s, 9, torch.full((6,), 300, dtype=torch.int32, device=device)), {}),
        (ops.activation_topk.default, (a, gate, 64), {}),
        (ops.activation_topk.default, (a, gate, 64), {"threshold": 0.5}),
        (ops.gated_gemv.default, (wt, idx, vals, counts), {}),
    ]


def test_opcheck(device):
    for op, args, kwargs in sample_args(device):
        torch.library.opcheck(op, args, kwargs)


def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def gate_and_project(a, gate, wt):
        idx, vals, counts = hisparse.activation_topk(a, gate, 64)
        return hisparse.gated_gemv(wt, idx, vals, counts), hisparse.topk(a.float(), 5)[1]

    samples = sample_args(device)
    a, gate, _ = samples[2][1]
    wt = samples[4][1][0]
    compiled = torch.compile(gate_and_project, fullgraph=True)
    y, top = compiled(a, gate, wt)
    y_eager, top_eager = gate_and_project(a, gate, wt)
    assert torch.equal(y, y_eager) and torch.equal(top, top_eager)


@needs_cuda
def test_cuda_graph_capture():
    a = torch.randn(4, 4096, device="cuda").bfloat16()
    gate = torch.rand(4096, device="cuda")
    wt = torch.randn(4096, 256, device="cuda").bfloat16()
    s = torch.randn(16, 3000, device="cuda")

    def step():
        idx, vals, counts = hisparse.activation_topk(a, gate, 1024)
        return hisparse.gated_gemv(wt, idx, vals, counts), hisparse.topk(s, 100)

    expected = step()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on a side stream, as torch recommends before capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(g):
        captured = step()
    a.copy_(torch.randn_like(a))  # new inputs: the replay must see them
    expected = step()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], expected[0])
    assert torch.equal(captured[1][1], expected[1][1])
