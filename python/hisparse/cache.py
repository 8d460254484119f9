"""PagedKVCache: the library's paged KV cache and its planned decode step,
owned by a Python object. Setup (create, add and free sequences) is plain
Python over a small C interface; the per-step work (append, decode) is two
torch ops, so a step traces under torch.compile and replays from a CUDA graph.
"""
import ctypes
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _library_path

# The built-in presets (include/hisparse/config.hpp) and their slice/block
# sizes: a cache serves the presets whose sizes match its own.
PRESETS = {
    "standard": (64, 1024),
    "high_recall": (64, 1024),
    "short_context": (32, 512),
    "standard_bf16_summaries": (64, 1024),
    "standard_key_bounds": (64, 1024),
    "key_bounds_both": (64, 1024),
}
_FINE_SUMMARIES = {"mean": 0, "mean_bf16": 1, "key_bounds": 2}
_COARSE_SUMMARIES = {"mean": 0, "key_bounds": 1}
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}

# The overloads themselves: resolving them per call costs host time.
_append = torch.ops.hisparse.cache_append.default
_decode = torch.ops.hisparse.cache_decode.default
_decode_out = torch.ops.hisparse.cache_decode_out.default
_decode_kept = torch.ops.hisparse.cache_decode_kept.default
_prefill = torch.ops.hisparse.cache_prefill.default

_c = ctypes.CDLL(_library_path)
_c.hisparse_last_error.restype = ctypes.c_char_p
_c.hisparse_cache_create.restype = ctypes.c_int64
_c.hisparse_cache_create.argtypes = ([ctypes.c_int] * 7 + [ctypes.c_int64] + [ctypes.c_int] * 5
                                     + [ctypes.c_int64, ctypes.c_int64])
_c.hisparse_cache_move.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_int, ctypes.c_void_p]
_c.hisparse_cache_host_pages.restype = ctypes.c_int64
_c.hisparse_cache_host_pages.argtypes = [ctypes.c_int64]
_c.hisparse_cache_kept_width.argtypes = [ctypes.c_int64, ctypes.c_char_p]
_c.hisparse_cache_destroy.argtypes = [ctypes.c_int64]
_c.hisparse_cache_add_sequence.argtypes = [ctypes.c_int64, ctypes.c_int64]
_c.hisparse_cache_free_sequence.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
_c.hisparse_cache_length.restype = ctypes.c_int64
_c.hisparse_cache_length.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int]


# (cache handle, preset) -> (kv_heads, top_k_fine): the shape of a row's kept
# slices, which the fake kernel of cache_decode_kept reads while tracing.
_KEPT_SHAPE: Dict[Tuple[int, str], Tuple[int, int]] = {}


class Selection(NamedTuple):
    """What a decode step attended besides its window: per (row, KV head)
    the kept slice ids (ascending, then -1), their count, and per row the
    first position of the window [window_begin, length)."""
    slices: torch.Tensor        # int32 [batch, kv_heads, top_k_fine]
    counts: torch.Tensor        # int32 [batch, kv_heads]
    window_begin: torch.Tensor  # int32 [batch]


def _checked(result):
    if result < 0:
        raise RuntimeError("hisparse: " + _c.hisparse_last_error().decode())
    return result


class PagedKVCache:
    """K/V pages of ``fine_slice`` tokens for ``max_sequences`` sequence
    slots of ``num_layers`` layers, with the summaries the selection reads,
    and the sparse decode step planned for every batch up to max_sequences.

    Memory comes from a stream-ordered pool of the library's own on
    ``device`` (not torch's caching allocator), grown page by page as
    sequences grow; ``close()`` (or the end of the object) gives it back.

    ``max_prefill_tokens`` > 0 plans ``prefill`` for calls of up to that
    many queries (0: decode only).

    ``fine_summary`` ("mean", "mean_bf16", "key_bounds") and
    ``coarse_summary`` ("mean", "key_bounds"; key bounds of blocks need
    them of slices) say what the cache keeps for the selection, and so which
    presets it serves: "key_bounds_both" needs both as "key_bounds", and is
    served for decode only.

    The steps of one cache share its plan's workspace (and the prefill its
    segment buffer): run them on one stream at a time, as torch's current
    stream orders them, not concurrently on several.

    ``lengths`` is a [max_sequences, num_layers] int32 tensor on the device:
    the tokens each (sequence, layer) holds, written by ``append``.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_q_heads: int,
                 max_sequences: int, max_context: int, dtype: torch.dtype = torch.bfloat16,
                 device=None, fine_slice: int = 64, coarse_block: int = 1024,
                 fine_summary: str = "mean", coarse_summary: str = "mean", topk_cache_slices: int = 0,
                 max_prefill_tokens: int = 0, max_host_bytes: int = 0):
        if dtype not in _DTYPES:
            raise ValueError(f"hisparse.PagedKVCache: dtype must be bfloat16 or float16, not {dtype}")
        if fine_summary not in _FINE_SUMMARIES:
            raise ValueError(f"hisparse.PagedKVCache: fine_summary must be one of {sorted(_FINE_SUMMARIES)}")
        if coarse_summary not in _COARSE_SUMMARIES:
            raise ValueError(f"hisparse.PagedKVCache: coarse_summary must be one of {sorted(_COARSE_SUMMARIES)}")
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda":
            raise ValueError("hisparse.PagedKVCache: the cache lives on a CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._handle = -1
        self.device, self.dtype = device, dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_q_heads, self.max_sequences = num_q_heads, max_sequences
        self._handle = _checked(_c.hisparse_cache_create(
            device.index, _DTYPES[dtype], num_layers, num_kv_heads, head_dim, num_q_heads, max_sequences,
            max_context, fine_slice, coarse_block, _FINE_SUMMARIES[fine_summary], _COARSE_SUMMARIES[coarse_summary],
            topk_cache_slices, max_prefill_tokens, max_host_bytes))
        for name in PRESETS:
            width = _c.hisparse_cache_kept_width(self._handle, name.encode())
            if width > 0:
                _KEPT_SHAPE[(self._handle, name)] = (num_kv_heads, width)
        self.lengths = torch.zeros(max_sequences, num_layers, dtype=torch.int32, device=device)

    @property
    def handle(self) -> int:
        if self._handle < 0:
            raise RuntimeError("hisparse.PagedKVCache: the cache is closed")
        return self._handle

    def add_sequence(self, reserved_length: int) -> int:
        """Claims a free slot for a sequence of up to ``reserved_length`` tokens."""
        return _checked(_c.hisparse_cache_add_sequence(self.handle, reserved_length))

    def free_sequence(self, slot: int) -> None:
        """Gives the slot's pages back, ordered after work queued on the current stream."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _checked(_c.hisparse_cache_free_sequence(self.handle, slot, ctypes.c_void_p(stream)))
        self.lengths[slot].zero_()

    def offload(self, slot: int, layer: int, slices: Sequence[int]) -> None:
        """Moves complete slices of (slot, layer) to pinned host memory (the
        ``max_host_bytes`` tier); steps read them there over PCIe, exactly.
        Ordered on the current stream, like ``append``."""
        self._move(slot, layer, slices, True)

    def fetch(self, slot: int, layer: int, slices: Sequence[int]) -> None:
        """Brings offloaded slices of (slot, layer) back to device pages."""
        self._move(slot, layer, slices, False)

    @property
    def host_pages(self) -> int:
        """Pages the host tier holds now."""
        return _checked(_c.hisparse_cache_host_pages(self.handle))

    def _move(self, slot: int, layer: int, slices: Sequence[int], to_host: bool) -> None:
        ids = (ctypes.c_int32 * len(slices))(*[int(s) for s in slices])
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _checked(_c.hisparse_cache_move(self.handle, slot, layer, ids, len(slices), int(to_host),
                                        ctypes.c_void_p(stream)))

    def length(self, slot: int, layer: int = 0) -> int:
        """Tokens stored for (slot, layer), from the host's bookkeeping (no sync)."""
        return _checked(_c.hisparse_cache_length(self.handle, slot, layer))

    def append(self, layer: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor,
               counts: Optional[Sequence[int]] = None) -> None:
        """Appends rows of k and v ([rows, kv_heads, head_dim], the cache's
        dtype, contiguous) to the end of each sequence in ``slots`` for
        ``layer``: ``counts[i]`` rows to slots[i] in order (one row each when
        counts is None: a decode step). All or nothing."""
        slots = [int(s) for s in slots]
        counts = [1] * len(slots) if counts is None else [int(c) for c in counts]
        _append(self.lengths, self.handle, layer, slots, counts, k, v)

    def decode(self, q: torch.Tensor, slots: torch.Tensor, layer: int = 0, preset: str = "standard", *,
               out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One sparse decode step: q [batch, q_heads, head_dim] (the cache's
        dtype), slots int32 [batch] on the device. Returns (out like q, lse
        fp32 [batch, q_heads], natural log), written into ``out`` and ``lse``
        where both are given (no allocation at all). No allocation by the
        library, no sync: capturable in a CUDA graph."""
        if out is None and lse is None:
            return _decode(self.lengths, self.handle, layer, q, slots, preset)
        if out is None or lse is None:
            raise ValueError("hisparse.PagedKVCache.decode: give both out and lse, or neither")
        _decode_out(self.lengths, self.handle, layer, q, slots, preset, out, lse)
        return out, lse

    def decode_kept(self, q: torch.Tensor, slots: torch.Tensor, layer: int = 0, preset: str = "standard"
                    ) -> Tuple[torch.Tensor, torch.Tensor, Selection]:
        """``decode``, also returning the step's ``Selection``."""
        out, lse, slices, counts, window_begin = _decode_kept(self.lengths, self.handle, layer, q, slots, preset)
        return out, lse, Selection(slices, counts, window_begin)

    def prefill(self, q: torch.Tensor, slots: Sequence[int], q_begins: Sequence[int], counts: Sequence[int],
                layer: int = 0, preset: str = "standard") -> Tuple[torch.Tensor, torch.Tensor]:
        """Causal sparse attention for prompt chunks whose keys and values
        are already appended: chunk i is the ``counts[i]`` queries of
        sequence ``slots[i]`` from position ``q_begins[i]`` (a multiple of
        the preset's query tile, 64), packed in order in q [queries, q_heads,
        head_dim]. Each query attends to its tile's kept slices and its
        window up to itself. Returns (out like q, lse fp32 [queries,
        q_heads]). Needs ``max_prefill_tokens`` >= queries. No sync;
        capturable (a replay repeats the captured chunks)."""
        return _prefill(self.lengths, self.handle, layer, q, [int(s) for s in slots], [int(b) for b in q_begins],
                        [int(c) for c in counts], preset)

    def close(self) -> None:
        """Frees the cache's memory (after its last queued work). Safe to call twice."""
        if self._handle >= 0:
            handle, self._handle = self._handle, -1
            for name in PRESETS:
                _KEPT_SHAPE.pop((handle, name), None)
            _checked(_c.hisparse_cache_destroy(handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@torch.library.register_fake("hisparse::cache_append")
def _cache_append_fake(lengths, cache, layer, slots, counts, k, v):
    return None


def _check_q(q, op):
    torch._check(q.dim() == 3, lambda: f"hisparse.{op}: q must be [rows, q_heads, head_dim]")


@torch.library.register_fake("hisparse::cache_decode")
def _cache_decode_fake(lengths, cache, layer, q, slots, preset):
    _check_q(q, "cache_decode")
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.register_fake("hisparse::cache_decode_out")
def _cache_decode_out_fake(lengths, cache, layer, q, slots, preset, out, lse):
    _check_q(q, "cache_decode_out")
    torch._check(out.shape == q.shape and out.dtype == q.dtype,
                 lambda: "hisparse.cache_decode_out: out must be like q")
    torch._check(lse.shape == q.shape[:2] and lse.dtype == torch.float32,
                 lambda: "hisparse.cache_decode_out: lse must be float32 [batch, q_heads]")
    return None


@torch.library.register_fake("hisparse::cache_decode_kept")
def _cache_decode_kept_fake(lengths, cache, layer, q, slots, preset):
    _check_q(q, "cache_decode_kept")
    shape = _KEPT_SHAPE.get((cache, preset))
    torch._check(shape is not None, lambda: f"hisparse.cache_decode_kept: cache {cache} does not serve '{preset}'")
    batch, (kv_heads, width) = q.shape[0], shape
    i32 = torch.int32
    return (torch.empty_like(q), q.new_empty(batch, q.shape[1], dtype=torch.float32),
            q.new_empty(batch, kv_heads, width, dtype=i32), q.new_empty(batch, kv_heads, dtype=i32),
            q.new_empty(batch, dtype=i32))


@torch.library.register_fake("hisparse::cache_prefill")
def _cache_prefill_fake(lengths, cache, layer, q, slots, q_begins, counts, preset):
    _check_q(q, "cache_prefill")
    torch._check(len(slots) == len(q_begins) == len(counts),
                 lambda: "hisparse.cache_prefill: one first position and one query count per sequence")
    torch._check(sum(counts) == q.shape[0], lambda: "hisparse.cache_prefill: the chunks must hold q's queries")
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
