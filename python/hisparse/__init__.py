"""HiSparse as PyTorch ops: hierarchical sparse attention over a paged KV
cache, batched top-k and activation top-k gating.

The ops live in ``torch.ops.hisparse``; this package adds their fake
(meta) kernels, so they trace under ``torch.compile``, and the Python
objects around them (``PagedKVCache``).
"""
from pathlib import Path

import torch

_libs = sorted(Path(__file__).parent.glob("_C*.so"))
if not _libs:
    raise ImportError("hisparse: the compiled extension (_C*.so) is missing; install with "
                      "`pip install --no-build-isolation .` from the repository root")
torch.ops.load_library(str(_libs[0]))
_library_path = str(_libs[0])

from .ops import activation_topk, gated_gemv, topk  # noqa: E402  (registers the fake kernels)
from .cache import PagedKVCache, PRESETS, Selection  # noqa: E402

__all__ = ["PagedKVCache", "PRESETS", "Selection", "activation_topk", "gated_gemv", "topk"]
