"""The stateless ops: Python entry points with their contracts, and the fake
kernels that give output shapes from input shapes (torch.compile, opcheck)."""
from typing import Optional, Tuple

import torch

_topk = torch.ops.hisparse.topk.default
_activation_topk = torch.ops.hisparse.activation_topk.default
_gated_gemv = torch.ops.hisparse.gated_gemv.default


def topk(scores: torch.Tensor, k: int, row_lengths: Optional[torch.Tensor] = None
         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of fp32 ``scores`` [rows, n], in descending
    order, ties to the lower index, NaN after every number.

    Returns (values fp32 [rows, k], indices int32 [rows, k]). ``row_lengths``
    (int32 [rows]) limits row r to its first row_lengths[r] scores. Where a
    row has fewer than k scores the rest is padding: value -inf, index -1
    (torch.topk raises instead). 1 <= k <= 2048; any n.
    """
    return _topk(scores, k, row_lengths)


def activation_topk(a: torch.Tensor, gate: torch.Tensor, k_max: int,
                    k_per_row: Optional[torch.Tensor] = None,
                    threshold: Optional[float] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activation top-k gating: per row of ``a`` [rows, n] (fp16/bf16), keep
    the columns with the largest scores fl32(|a_i| * gate_i) (gate fp32, fp16
    or bf16 [n]).

    K per row: ``k_per_row[r]`` clamped to [0, k_max] (int32 [rows]; k_max in
    every row without it), or with ``threshold`` the columns scoring at least
    it, the k_max best where more do. Ties to the lower index; NaN scores
    rank below every number.

    Returns (indices int32 [rows, k_max], ascending then -1; values [rows,
    k_max] in a's dtype, then 0; counts int32 [rows]): the index cache apart
    from the value cache.
    """
    return _activation_topk(a, gate, k_max, k_per_row, threshold)


def gated_gemv(wt: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """y[r] = W[:, kept_r] @ values[r] over activation_topk's outputs, for W
    stored by column: ``wt`` = W.T, [n, outs], fp16/bf16. Returns fp32
    [rows, outs]. Each column any row keeps is read once for every 8 rows;
    a row's indices must ascend (as activation_topk writes them); a
    non-finite weight reaches only the rows that keep its column."""
    return _gated_gemv(wt, indices, values, counts)


@torch.library.register_fake("hisparse::topk")
def _topk_fake(scores, k, row_lengths=None):
    torch._check(scores.dim() == 2, lambda: "hisparse.topk: scores must be [rows, n]")
    torch._check(scores.dtype == torch.float32, lambda: "hisparse.topk: scores must be float32")
    torch._check(1 <= k <= 2048, lambda: f"hisparse.topk: k {k} must be in [1, 2048]")
    rows = scores.shape[0]
    return scores.new_empty(rows, k), scores.new_empty(rows, k, dtype=torch.int32)


@torch.library.register_fake("hisparse::activation_topk")
def _activation_topk_fake(a, gate, k_max, k_per_row=None, threshold=None):
    torch._check(a.dim() == 2, lambda: "hisparse.activation_topk: a must be [rows, n]")
    torch._check(a.dtype in (torch.float16, torch.bfloat16),
                 lambda: "hisparse.activation_topk: a must be float16 or bfloat16")
    rows = a.shape[0]
    return (a.new_empty(rows, k_max, dtype=torch.int32), a.new_empty(rows, k_max),
            a.new_empty(rows, dtype=torch.int32))


@torch.library.register_fake("hisparse::gated_gemv")
def _gated_gemv_fake(wt, indices, values, counts):
    torch._check(wt.dim() == 2, lambda: "hisparse.gated_gemv: wt must be [n, outs]")
    return wt.new_empty(indices.shape[0], wt.shape[1], dtype=torch.float32)
