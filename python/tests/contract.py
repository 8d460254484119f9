"""The algorithm's contract (docs/DESIGN.md section 1) and the selection
ops' contracts, written in float64 PyTorch: the oracle the tests compare the
library against. Nothing here calls the library."""
import math

import torch


def ranked(scores: torch.Tensor) -> torch.Tensor:
    """Indices of a 1-D score vector, best first: descending, ties to the
    lower index, NaN after every number."""
    key = torch.where(torch.isnan(scores), torch.full_like(scores, -math.inf), scores)
    order = torch.sort(key, descending=True, stable=True).indices
    # Among -inf and NaN (both -inf here) a real -inf comes first.
    nan = torch.isnan(scores[order])
    return torch.cat([order[~nan], order[nan]])


def topk(scores: torch.Tensor, k: int, row_lengths=None):
    rows, n = scores.shape
    values = torch.full((rows, k), -math.inf, dtype=torch.float64)
    indices = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        length = n if row_lengths is None else max(0, min(int(row_lengths[r]), n))
        row = scores[r, :length].double().cpu()
        order = ranked(row)[:k]
        values[r, :len(order)] = row[order]
        indices[r, :len(order)] = order
    return values, indices


def gating_scores(a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """fl32(|a| g): one fp32 rounding of the exact product (both factors are
    exact in fp64, so the fp64 product rounded to fp32 is that rounding)."""
    return (a.double().abs() * gate.double()).float().double()


def activation_topk(a, gate, k_max, k_per_row=None, threshold=None):
    rows, n = a.shape
    scores = gating_scores(a.cpu(), gate.cpu())
    indices = torch.full((rows, k_max), -1, dtype=torch.int64)
    values = torch.zeros((rows, k_max), dtype=torch.float64)
    counts = torch.zeros(rows, dtype=torch.int64)
    for r in range(rows):
        s = scores[r]
        if threshold is not None:
            admitted = torch.nonzero(s >= threshold).flatten()  # NaN never admitted
            k = min(k_max, len(admitted))
            kept = admitted[ranked(s[admitted])[:k]]
        else:
            k = k_max if k_per_row is None else max(0, min(int(k_per_row[r]), k_max))
            kept = ranked(s)[:k]
        kept = torch.sort(kept).values
        indices[r, :len(kept)] = kept
        values[r, :len(kept)] = a[r].cpu().double()[kept]
        counts[r] = len(kept)
    return indices, values, counts


def gated_gemv(wt, indices, values, counts):
    """y[r] = sum over row r's kept j of W^T[idx_j] * vals_j."""
    wt = wt.cpu().double()
    y = torch.zeros(indices.shape[0], wt.shape[1], dtype=torch.float64)
    for r in range(indices.shape[0]):
        c = int(counts[r])
        idx = indices[r, :c].cpu().long()
        y[r] = values[r, :c].cpu().double() @ wt[idx]
    return y


def window_start(p0: int, window: int, fine: int) -> int:
    return max(0, (p0 - window + 1) // fine * fine)


def kept_slices(keys, q_group_sums, ws, cfg):
    """Kept far slice ids (ascending) of one (tile, KV head): keys [T, D]
    float64 of one KV head, q_group_sums [m, D] each query of the tile with
    its group's heads summed, ws the tile's window start. Block and slice
    scores are the max over the tile's queries."""
    window, C, F, kc, kf = cfg
    blocks = [b for b in range(ws // C + 1) if b * C < ws]
    if not blocks:
        return []
    block_means = torch.stack([keys[b * C:min((b + 1) * C, ws)].mean(0) for b in blocks])
    kept_blocks = [blocks[i] for i in ranked((block_means @ q_group_sums.T).amax(1))[:kc].tolist()]
    slices = sorted(s for b in kept_blocks for s in range(b * C // F, (b + 1) * C // F) if (s + 1) * F <= ws)
    slice_means = torch.stack([keys[s * F:(s + 1) * F].mean(0) for s in slices])
    return sorted(slices[i] for i in ranked((slice_means @ q_group_sums.T).amax(1))[:kf].tolist())


def decode_selection(keys, q_group_sum, cfg):
    """Kept far positions and the window of one (sequence, KV head) at
    decode: q_group_sum [D] the group's queries summed."""
    window, _, F, _, _ = cfg
    T = keys.shape[0]
    ws = window_start(T - 1, window, F)
    far = [torch.arange(s * F, (s + 1) * F) for s in kept_slices(keys, q_group_sum[None], ws, cfg)]
    return torch.cat(far + [torch.arange(ws, T)])


def decode(keys, values, q, cfg, low_precision=None):
    """Decode output and LSE for one sequence: keys/values [T, Hkv, D],
    q [Hq, D]. Returns (out [Hq, D] float64, lse [Hq] float64) over the
    contract's attended set; with low_precision (a dtype) the same attention
    computed naively in that dtype (the tolerance's yardstick)."""
    T, hkv, D = keys.shape
    hq = q.shape[0]
    G = hq // hkv
    k64, v64, q64 = keys.double(), values.double(), q.double()
    out = torch.empty(hq, D, dtype=torch.float64, device=keys.device)
    lse = torch.empty(hq, dtype=torch.float64, device=keys.device)
    naive = torch.empty(hq, D, dtype=torch.float64, device=keys.device)
    for h in range(hkv):
        heads = slice(h * G, (h + 1) * G)
        pos = decode_selection(k64[:, h], q64[heads].sum(0), cfg).to(keys.device)
        s = q64[heads] @ k64[pos, h].T / math.sqrt(D)
        lse[heads] = torch.logsumexp(s, dim=1)
        out[heads] = torch.softmax(s, dim=1) @ v64[pos, h]
        if low_precision is not None:
            lp = low_precision
            s_lp = (q[heads].to(lp) @ keys[pos, h].to(lp).T) / math.sqrt(D)
            naive[heads] = (torch.softmax(s_lp.float(), dim=1).to(lp) @ values[pos, h].to(lp)).double()
    return out, lse, naive


def prefill(keys, values, q, q_begin, cfg, tile=64, low_precision=None):
    """Prefill output and LSE for the queries at positions q_begin ..
    q_begin + n - 1 of one sequence (q [n, Hq, D], q_begin a multiple of
    the tile): each tile of `tile` positions shares one selection per KV
    head, and the query at p attends its tile's kept slices and [ws, p].
    Returns (out [n, Hq, D], lse [n, Hq], naive) as decode does."""
    assert q_begin % tile == 0, "prefill chunks start on a query tile"
    _, hkv, D = keys.shape
    n, hq, _ = q.shape
    G = hq // hkv
    window, _, F, _, _ = cfg
    k64, v64, q64 = keys.double(), values.double(), q.double()
    out = torch.empty(n, hq, D, dtype=torch.float64, device=keys.device)
    lse = torch.empty(n, hq, dtype=torch.float64, device=keys.device)
    naive = torch.empty(n, hq, D, dtype=torch.float64, device=keys.device)
    for t0 in range(0, n, tile):
        rows = slice(t0, min(n, t0 + tile))
        first, last = q_begin + t0, q_begin + rows.stop - 1
        ws = window_start(first, window, F)
        positions = torch.arange(first, last + 1, device=keys.device)
        for h in range(hkv):
            heads = slice(h * G, (h + 1) * G)
            far = [torch.arange(s * F, (s + 1) * F) for s in kept_slices(k64[:, h], q64[rows, heads].sum(1), ws, cfg)]
            pos = torch.cat(far + [torch.arange(ws, last + 1)]).to(keys.device)
            hidden = pos[None, :] > positions[:, None]  # [m, keys]: the causal mask
            s = torch.einsum("mgd,kd->mgk", q64[rows, heads], k64[pos, h]) / math.sqrt(D)
            s = s.masked_fill(hidden[:, None, :], -math.inf)
            lse[rows, heads] = torch.logsumexp(s, dim=2)
            out[rows, heads] = torch.softmax(s, dim=2) @ v64[pos, h]
            if low_precision is not None:
                lp = low_precision
                s_lp = torch.einsum("mgd,kd->mgk", q[rows, heads].to(lp), keys[pos, h].to(lp)) / math.sqrt(D)
                s_lp = s_lp.float().masked_fill(hidden[:, None, :], -math.inf)
                naive[rows, heads] = (torch.softmax(s_lp, dim=2).to(lp) @ values[pos, h].to(lp)).double()
    return out, lse, naive
