"""PagedKVCache and the decode op against the float64 contract (contract.py)
and, where everything is kept, against PyTorch's dense SDPA. GPU only."""
import pytest
import torch
import torch.nn.functional as F

import hisparse
from conftest import needs_cuda
import contract

pytestmark = needs_cuda
ops = torch.ops.hisparse

# (window, coarse_block, fine_slice, top_k_coarse, top_k_fine) of the presets (config.hpp)
CONFIGS = {"standard": (512, 1024, 64, 32, 16), "high_recall": (512, 1024, 64, 64, 32),
           "short_context": (256, 512, 32, 32, 16)}
ATOL = 1e-5


def filled_cache(lengths, *, hq=32, hkv=8, dim=128, dtype=torch.bfloat16, preset="standard", layers=1, seed=0,
                 max_prefill_tokens=0, room=64, max_host_bytes=0, summaries=("mean", "mean")):
    """A cache holding random K/V for each length, appended the way an engine
    does: the prompt in two chunks, then single-token decode appends; each
    sequence has `room` tokens reserved past its length."""
    _, block, fine, _, _ = CONFIGS[preset]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = hisparse.PagedKVCache(num_layers=layers, num_kv_heads=hkv, head_dim=dim, num_q_heads=hq,
                                  max_sequences=len(lengths), max_context=max(lengths) + room, dtype=dtype,
                                  fine_slice=fine, coarse_block=block, max_prefill_tokens=max_prefill_tokens,
                                  max_host_bytes=max_host_bytes, fine_summary=summaries[0],
                                  coarse_summary=summaries[1])
    slots = [cache.add_sequence(n + room) for n in lengths]
    keys = [torch.rand(n, hkv, dim, device="cuda", generator=gen, dtype=torch.float32).sub_(0.5).to(dtype)
            for n in lengths]
    values = [torch.rand(n, hkv, dim, device="cuda", generator=gen, dtype=torch.float32).sub_(0.5).to(dtype)
              for n in lengths]
    tail = [min(3, n - 1) for n in lengths]  # tokens appended one at a time at the end
    chunks = [[(0, (n - t) // 2), ((n - t) // 2, n - t)] for n, t in zip(lengths, tail)]
    for layer in range(layers):
        for c in range(2):
            part = [(i, *chunks[i][c]) for i in range(len(lengths)) if chunks[i][c][1] > chunks[i][c][0]]
            cache.append(layer, [slots[i] for i, _, _ in part],
                         torch.cat([keys[i][a:b] for i, a, b in part]),
                         torch.cat([values[i][a:b] for i, a, b in part]), counts=[b - a for _, a, b in part])
        for step in range(max(tail)):
            rows = [i for i, t in enumerate(tail) if step < t]
            pos = [lengths[i] - tail[i] + step for i in rows]
            cache.append(layer, [slots[i] for i in rows], torch.stack([keys[i][p] for i, p in zip(rows, pos)]),
                         torch.stack([values[i][p] for i, p in zip(rows, pos)]))
    return cache, slots, keys, values


def check_against_contract(out, lse, keys, values, q, cfg):
    for b in range(q.shape[0]):
        ref, ref_lse, naive = contract.decode(keys[b], values[b], q[b], cfg, low_precision=q.dtype)
        err = (out[b].double() - ref).abs().max().item()
        err_naive = (naive - ref).abs().max().item()
        assert err <= 2 * err_naive + ATOL, f"sequence {b}: |out - ref| {err:.3g}, naive {err_naive:.3g}"
        assert (lse[b].double() - ref_lse).abs().max().item() <= 1e-4 * ref_lse.abs().max().item() + 1e-5


@pytest.mark.parametrize("preset,lengths", [
    ("standard", [1, 300, 1500, 5000, 40000, 70001]),  # T < W, one token, partial slices, > 32 blocks
    ("high_recall", [2048, 100000]),
    ("short_context", [777, 20000, 33333]),
])
def test_decode_matches_contract(preset, lengths):
    cache, slots, keys, values = filled_cache(lengths, preset=preset, seed=len(lengths))
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = (torch.rand(len(lengths), 32, 128, device="cuda", generator=gen) * 8 - 4).bfloat16()
    slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    assert cache.lengths[slots_t, 0].tolist() == lengths
    out, lse = cache.decode(q, slots_t, 0, preset)
    check_against_contract(out, lse, keys, values, q, CONFIGS[preset])
    cache.close()


def test_key_bounds_presets_need_the_cache_to_keep_bounds():
    # Far regions of at most top_k_fine slices: every far slice is kept
    # whatever the scores, so each bounds preset gives the contract's result.
    lengths = [300, 1500]
    cache, slots, keys, values = filled_cache(lengths, seed=5, summaries=("key_bounds", "key_bounds"))
    gen = torch.Generator(device="cuda").manual_seed(9)
    q = (torch.rand(len(lengths), 32, 128, device="cuda", generator=gen) * 8 - 4).bfloat16()
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    for preset in ("key_bounds_both", "standard_key_bounds", "standard"):
        out, lse = cache.decode(q, s, 0, preset)
        check_against_contract(out, lse, keys, values, q, CONFIGS["standard"])
    cache.close()
    means, slots, _, _ = filled_cache([1500], seed=6)
    with pytest.raises(RuntimeError, match="cannot serve preset 'key_bounds_both'"):
        means.decode(q[:1], torch.tensor(slots, dtype=torch.int32, device="cuda"), 0, "key_bounds_both")
    means.close()
    with pytest.raises(RuntimeError, match="coarse_summary key_bounds needs fine_summary key_bounds"):
        hisparse.PagedKVCache(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, max_sequences=1,
                              max_context=1024, coarse_summary="key_bounds")


@pytest.mark.parametrize("hq,hkv,dim,dtype", [(8, 8, 64, torch.float16), (32, 4, 128, torch.bfloat16),
                                               (16, 2, 256, torch.bfloat16)])
def test_decode_gqa_ratios_head_dims_dtypes(hq, hkv, dim, dtype):
    lengths = [4000, 35000]
    cache, slots, keys, values = filled_cache(lengths, hq=hq, hkv=hkv, dim=dim, dtype=dtype, seed=hq + dim)
    q = (torch.rand(2, hq, dim, device="cuda") * 8 - 4).to(dtype)
    slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    out, lse = cache.decode(q, slots_t)
    check_against_contract(out, lse, keys, values, q, CONFIGS["standard"])


def test_decode_keep_everything_is_dense_sdpa():
    """Short contexts keep every far slice, so the step is dense attention."""
    lengths = [1, 700, 1500]
    cache, slots, keys, values = filled_cache(lengths, seed=3)
    q = (torch.rand(3, 32, 128, device="cuda") * 8 - 4).bfloat16()
    out, _ = cache.decode(q, torch.tensor(slots, dtype=torch.int32, device="cuda"))
    for b, n in enumerate(lengths):
        ref = F.scaled_dot_product_attention(q[b:b + 1].double().unsqueeze(2),  # [1, hq, 1, d]
                                             keys[b].double().permute(1, 0, 2).unsqueeze(0),
                                             values[b].double().permute(1, 0, 2).unsqueeze(0),
                                             enable_gqa=True).squeeze(2)[0]
        assert (out[b].double() - ref).abs().max().item() < 1e-2


def test_decode_batch_subsets_and_order():
    """Any subset of the slots, in any order, gives each row its own sequence's step."""
    lengths = [3000, 9000, 20000]
    cache, slots, keys, values = filled_cache(lengths, seed=11)
    q = (torch.rand(3, 32, 128, device="cuda") * 8 - 4).bfloat16()
    full, _ = cache.decode(q, torch.tensor(slots, dtype=torch.int32, device="cuda"))
    order = [2, 0]
    part, _ = cache.decode(q[order].contiguous(), torch.tensor([slots[i] for i in order], dtype=torch.int32,
                                                              device="cuda"))
    assert torch.equal(part, full[order])


def test_append_and_decode_errors():
    cache, slots, _, _ = filled_cache([2000], seed=1)
    q = torch.rand(1, 32, 128, device="cuda").bfloat16()
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="unknown preset name"):
        cache.decode(q, s, 0, "nonsense")
    with pytest.raises(RuntimeError, match="cannot serve preset 'short_context'"):
        cache.decode(q, s, 0, "short_context")
    with pytest.raises(RuntimeError, match="q must be bfloat16"):
        cache.decode(q.half(), s)
    with pytest.raises(RuntimeError, match="slots must be int32"):
        cache.decode(q, s.long())
    with pytest.raises(RuntimeError, match="q must be \\[batch, q_heads = 32"):
        cache.decode(q[:, :8].contiguous(), s)
    kv = torch.rand(100, 8, 128, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="past its reserved"):
        cache.append(0, [slots[0]], kv, kv, counts=[100])
    with pytest.raises(RuntimeError, match="unknown sequence id 5"):
        cache.append(0, [5], kv[:1], kv[:1])
    with pytest.raises(RuntimeError, match="add up to"):
        cache.append(0, [slots[0]], kv[:3], kv[:3], counts=[2])
    assert cache.length(slots[0]) == 2000  # nothing was appended by the failures
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.decode(q, s)
    with pytest.raises(RuntimeError, match="all 1 sequence slots are in use"):
        c2 = hisparse.PagedKVCache(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, max_sequences=1,
                                   max_context=100)
        c2.add_sequence(50)
        c2.add_sequence(50)


def test_free_sequence_reuses_the_slot():
    cache, slots, _, _ = filled_cache([5000, 6000], seed=2)
    cache.free_sequence(slots[0])
    assert cache.lengths[slots[0], 0].item() == 0
    again = cache.add_sequence(100)
    assert again == slots[0]
    kv = torch.rand(100, 8, 128, device="cuda").bfloat16()
    cache.append(0, [again], kv, kv, counts=[100])
    q = torch.rand(1, 32, 128, device="cuda").bfloat16()
    out, _ = cache.decode(q, torch.tensor([again], dtype=torch.int32, device="cuda"))
    ref = F.scaled_dot_product_attention(q.double().unsqueeze(2), kv.double().permute(1, 0, 2).unsqueeze(0),
                                         kv.double().permute(1, 0, 2).unsqueeze(0), enable_gqa=True).squeeze(2)
    assert (out.double() - ref).abs().max().item() < 1e-2


def test_opcheck_cache_ops():
    cache, slots, _, _ = filled_cache([3000, 12000], seed=4)
    q = torch.rand(2, 32, 128, device="cuda").bfloat16()
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    torch.library.opcheck(ops.cache_decode.default, (cache.lengths, cache.handle, 0, q, s, "standard"))
    kv = torch.rand(2, 8, 128, device="cuda").bfloat16()
    torch.library.opcheck(ops.cache_append.default, (cache.lengths, cache.handle, 0, slots, [1, 1], kv, kv))


def test_compile_fullgraph_step():
    """Append one token per sequence, then decode: one graph, no breaks, the same result as eager."""
    lengths = [4000, 30000]
    eager, slots, _, _ = filled_cache(lengths, seed=6)
    compiled_cache, _, _, _ = filled_cache(lengths, seed=6)
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")

    def step(cache, k, v, q):
        cache.append(0, slots, k, v)
        return cache.decode(q, s)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for i in range(3):
        k = torch.rand(2, 8, 128, device="cuda").bfloat16()
        v = torch.rand(2, 8, 128, device="cuda").bfloat16()
        q = torch.rand(2, 32, 128, device="cuda").bfloat16()
        a = step(eager, k, v, q)
        b = compiled(compiled_cache, k, v, q)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(eager.lengths, compiled_cache.lengths)


def test_cuda_graph_replay_follows_appends():
    """Planned outside capture, run inside: a replay after more appends attends the new tokens too."""
    cache, slots, _, _ = filled_cache([5000, 20000], seed=8)
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    q = (torch.rand(2, 32, 128, device="cuda") * 8 - 4).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cache.decode(q, s)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = cache.decode(q, s)
    for _ in range(2):
        kv = torch.rand(2, 8, 128, device="cuda").bfloat16() * 4
        cache.append(0, slots, kv, kv)
        q.copy_((torch.rand(2, 32, 128, device="cuda") * 8 - 4).bfloat16())
        g.replay()
        expected = cache.decode(q, s)
        torch.cuda.synchronize()
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


def test_decode_kept_is_the_contracts_selection():
    """The kept slices, their counts and the window start are the contract's,
    and the output is decode's, bit for bit."""
    lengths = [1, 700, 5000, 40000]
    cache, slots, keys, _ = filled_cache(lengths, seed=21)
    q = (torch.rand(4, 32, 128, device="cuda") * 8 - 4).bfloat16()
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    out, lse, sel = cache.decode_kept(q, s)
    plain = cache.decode(q, s)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])
    window, _, fine, _, kf = CONFIGS["standard"]
    assert sel.slices.shape == (4, 8, kf) and sel.counts.shape == (4, 8) and sel.window_begin.shape == (4,)
    for b, n in enumerate(lengths):
        ws = contract.window_start(n - 1, window, fine)
        assert sel.window_begin[b].item() == ws
        for h in range(8):
            kept = contract.kept_slices(keys[b][:, h].double(), q[b, h * 4:(h + 1) * 4].double().sum(0)[None], ws,
                                        CONFIGS["standard"])
            assert sel.counts[b, h].item() == len(kept)
            assert sel.slices[b, h].tolist() == kept + [-1] * (kf - len(kept)), f"sequence {b}, KV head {h}"


def test_decode_into_given_tensors():
    lengths = [3000, 25000]
    cache, slots, _, _ = filled_cache(lengths, seed=22)
    q = (torch.rand(2, 32, 128, device="cuda") * 8 - 4).bfloat16()
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 32), float("nan"), device="cuda")
    got = cache.decode(q, s, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    expected = cache.decode(q, s)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    with pytest.raises(RuntimeError, match="out's dimension 1 must be 32"):
        cache.decode(q, s, out=out[:, :16].contiguous(), lse=lse)
    with pytest.raises(RuntimeError, match="lse must be float32"):
        cache.decode(q, s, out=out, lse=lse.double())
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        cache.decode(q, s, out=out.transpose(0, 1).contiguous().transpose(0, 1), lse=lse)
    with pytest.raises(ValueError, match="both out and lse"):
        cache.decode(q, s, out=out)
    with pytest.raises(RuntimeError, match="must not overlap"):
        cache.decode(q, s, out=q, lse=lse)
    torch.library.opcheck(ops.cache_decode_out.default, (cache.lengths, cache.handle, 0, q, s, "standard", out, lse))
    torch.library.opcheck(ops.cache_decode_kept.default, (cache.lengths, cache.handle, 0, q, s, "standard"))


def test_cuda_graph_decode_into_given_tensors():
    cache, slots, _, _ = filled_cache([6000, 9000], seed=23)
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    q = (torch.rand(2, 32, 128, device="cuda") * 8 - 4).bfloat16()
    out, lse = torch.empty_like(q), torch.empty(2, 32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cache.decode(q, s, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cache.decode(q, s, out=out, lse=lse)
    kv = torch.rand(2, 8, 128, device="cuda").bfloat16()
    cache.append(0, slots, kv, kv)
    g.replay()
    expected = cache.decode(q, s)
    torch.cuda.synchronize()
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


def prefill_case(lengths, chunks, *, preset="standard", seed=30, max_prefill_tokens=1024):
    """A cache holding `lengths`, and queries for chunks (sequence index,
    first position, count) whose keys are all stored."""
    cache, slots, keys, values = filled_cache(lengths, preset=preset, seed=seed,
                                              max_prefill_tokens=max_prefill_tokens)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = (torch.rand(sum(c for _, _, c in chunks), 32, 128, device="cuda", generator=gen) * 8 - 4).bfloat16()
    return cache, slots, keys, values, q


@pytest.mark.parametrize("preset,lengths,chunks", [
    # a tile inside the window only, a partial last tile, far regions of > 32 blocks
    ("standard", [300, 5000, 40000], [(0, 0, 300), (1, 4864, 136), (2, 39936, 64)]),
    ("short_context", [20000], [(0, 19456, 500)]),
])
def test_prefill_matches_contract(preset, lengths, chunks):
    cache, slots, keys, values, q = prefill_case(lengths, chunks, preset=preset)
    out, lse = cache.prefill(q, [slots[i] for i, _, _ in chunks], [b for _, b, _ in chunks],
                             [c for _, _, c in chunks], 0, preset)
    row = 0
    for i, begin, count in chunks:
        rows = slice(row, row + count)
        ref, ref_lse, naive = contract.prefill(keys[i], values[i], q[rows], begin, CONFIGS[preset],
                                               low_precision=q.dtype)
        err = (out[rows].double() - ref).abs().max().item()
        err_naive = (naive - ref).abs().max().item()
        assert err <= 2 * err_naive + ATOL, f"chunk {i}: |out - ref| {err:.3g}, naive {err_naive:.3g}"
        assert (lse[rows].double() - ref_lse).abs().max().item() <= 1e-4 * ref_lse.abs().max().item() + 1e-5
        row += count


def test_prefill_chunking_does_not_change_the_result():
    """The same queries prefilled in one call or in two chunks of whole tiles."""
    cache, slots, _, _, q = prefill_case([9000], [(0, 8704, 296)])
    whole, whole_lse = cache.prefill(q, slots, [8704], [296])
    first, first_lse = cache.prefill(q[:128].contiguous(), slots, [8704], [128])
    rest, rest_lse = cache.prefill(q[128:].contiguous(), slots, [8832], [168])
    assert torch.equal(whole, torch.cat([first, rest])) and torch.equal(whole_lse, torch.cat([first_lse, rest_lse]))


def test_prefill_errors_and_opcheck():
    cache, slots, _, _, q = prefill_case([3000], [(0, 2944, 56)], max_prefill_tokens=128)
    with pytest.raises(RuntimeError, match="multiple of the query tile 64"):
        cache.prefill(q, slots, [2940], [56])
    with pytest.raises(RuntimeError, match="append a chunk's keys and values before its prefill"):
        cache.prefill(q, slots, [3008], [56])
    with pytest.raises(RuntimeError, match="the chunks hold 50 queries, q has 56"):
        cache.prefill(q, slots, [2944], [50])
    big = torch.rand(200, 32, 128, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="200 queries, more than the cache was made for \\(max_prefill_tokens = 128"):
        cache.prefill(big, slots, [2752], [200])
    empty = cache.prefill(q[:0], [], [], [])
    assert empty[0].shape == (0, 32, 128) and empty[1].shape == (0, 32)
    with pytest.raises(RuntimeError, match="chunk 0 \\(slot 1, first 0, queries 56\\) is out of range"):
        cache.prefill(q, [1], [0], [56])
    torch.library.opcheck(ops.cache_prefill.default, (cache.lengths, cache.handle, 0, q, slots, [2944], [56],
                                                      "standard"))
    cache.free_sequence(slots[0])
    with pytest.raises(RuntimeError, match="slot 0 holds no sequence"):
        cache.prefill(q, slots, [2944], [56])
    decode_only, dslots, _, _ = filled_cache([100], seed=31)
    with pytest.raises(RuntimeError, match="max_prefill_tokens = 0"):
        decode_only.prefill(q[:50].contiguous(), dslots, [0], [50])


def test_compile_fullgraph_prefill_then_decode():
    """Append a chunk, prefill it, append one token, decode: one graph, eager's result."""
    runs = []
    for compiled in (False, True):
        cache, slots, _, _ = filled_cache([4096], seed=32, max_prefill_tokens=256, room=256)
        s = torch.tensor(slots, dtype=torch.int32, device="cuda")

        def step(k, v, q, k1, v1, q1):
            cache.append(0, slots, k, v, counts=[128])
            out, _ = cache.prefill(q, slots, [4096], [128])
            cache.append(0, slots, k1, v1)
            return out, cache.decode(q1, s)[0]

        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True) if compiled else step
        gen = torch.Generator(device="cuda").manual_seed(33)
        args = [torch.rand(*shape, device="cuda", generator=gen).bfloat16()
                for shape in ((128, 8, 128), (128, 8, 128), (128, 32, 128), (1, 8, 128), (1, 8, 128), (1, 32, 128))]
        runs.append(fn(*args))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_prefill_many_chunks_in_one_call():
    """More chunks than one segment write carries (64): 70 short prompts, each whole."""
    lengths = [100 + 7 * i for i in range(70)]
    chunks = [(i, 0, n) for i, n in enumerate(lengths)]
    cache, slots, keys, values, q = prefill_case(lengths, chunks, max_prefill_tokens=sum(lengths))
    out, lse = cache.prefill(q, slots, [0] * 70, lengths)
    row = 0
    for i, n in enumerate(lengths):
        ref, ref_lse, naive = contract.prefill(keys[i], values[i], q[row:row + n], 0, CONFIGS["standard"],
                                               low_precision=q.dtype)
        err = (out[row:row + n].double() - ref).abs().max().item()
        assert err <= 2 * (naive - ref).abs().max().item() + ATOL, f"chunk {i}"
        row += n


def test_cuda_graph_replays_prefill():
    """Captured once, a prefill replays its chunks over new queries in the same buffer."""
    cache, slots, _, _, q = prefill_case([6000, 3000], [(0, 5888, 112), (1, 2944, 56)])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cache.prefill(q, slots, [5888, 2944], [112, 56])
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = cache.prefill(q, slots, [5888, 2944], [112, 56])
    cache.prefill(q[:56].contiguous(), [slots[1]], [2944], [56])  # another layout in the segment buffer
    q.copy_((torch.rand_like(q, dtype=torch.float32) * 8 - 4).bfloat16())
    g.replay()
    expected = cache.prefill(q, slots, [5888, 2944], [112, 56])
    torch.cuda.synchronize()
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


def test_offloaded_slices_give_the_same_bits():
    lengths = [5000, 40000]
    cache, slots, keys, values = filled_cache(lengths, seed=41, max_host_bytes=1 << 28)
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(slots, dtype=torch.int32, device="cuda")
    out, lse = cache.decode(q, s)
    sel = cache.decode_kept(q, s)[2].slices.cpu()
    for b, n in enumerate(lengths):
        kept = {int(x) for x in sel[b].flatten() if 0 <= int(x) < n // 64}
        cache.offload(slots[b], 0, sorted(kept | set(range(0, n // 64, 2))))
    assert cache.host_pages > 0
    out2, lse2 = cache.decode(q, s)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    check_against_contract(out2, lse2, keys, values, q, CONFIGS["standard"])
    with pytest.raises(RuntimeError, match="not complete"):
        cache.offload(slots[0], 0, [lengths[0] // 64])
    for b, n in enumerate(lengths):
        cache.fetch(slots[b], 0, range(n // 64))
    assert cache.host_pages == 0
    out3, _ = cache.decode(q, s)
    assert torch.equal(out3, out)
    cache.close()


def test_offload_needs_a_host_tier():
    cache, slots, _, _ = filled_cache([3000], seed=42)
    with pytest.raises(RuntimeError, match="no host tier"):
        cache.offload(slots[0], 0, [0])
    cache.close()
