"""What runs without a GPU for the cache ops: their fake kernels give the
output shapes torch.compile traces with, and a cache asked for where no
device exists fails with the reason instead of crashing."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hisparse
from conftest import HAS_CUDA

ops = torch.ops.hisparse


def test_cache_fake_kernels_give_shapes():
    with FakeTensorMode(allow_non_fake_inputs=False):
        lengths = torch.empty(4, 2, dtype=torch.int32, device="cuda")
        q = torch.empty(3, 32, 128, dtype=torch.bfloat16, device="cuda")
        slots = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = ops.cache_decode(lengths, 1, 0, q, slots, "standard")
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
        assert lse.shape == (3, 32) and lse.dtype == torch.float32
        kv = torch.empty(5, 8, 128, dtype=torch.bfloat16, device="cuda")
        assert ops.cache_append(lengths, 1, 0, [0, 1], [2, 3], kv, kv) is None
        assert ops.cache_decode_out(lengths, 1, 0, q, slots, "standard", out, lse) is None
        out, lse = ops.cache_prefill(lengths, 1, 0, q, [0, 1], [0, 64], [1, 2], "standard")
        assert out.shape == q.shape and lse.shape == (3, 32)
        with pytest.raises(RuntimeError, match="must hold q's queries"):
            ops.cache_prefill(lengths, 1, 0, q, [0, 1], [0, 64], [1, 1], "standard")
        with pytest.raises(RuntimeError, match="out must be like q"):
            ops.cache_decode_out(lengths, 1, 0, q, slots, "standard", lse, lse)


def test_decode_kept_fake_kernel_needs_a_known_cache():
    """The kept slices' width comes from the cache (its preset's top_k_fine):
    for a handle no PagedKVCache made, tracing fails with the reason."""
    with FakeTensorMode():
        lengths = torch.empty(4, 2, dtype=torch.int32, device="cuda")
        q = torch.empty(3, 32, 128, dtype=torch.bfloat16, device="cuda")
        slots = torch.empty(3, dtype=torch.int32, device="cuda")
        with pytest.raises(RuntimeError, match="does not serve 'standard'"):
            ops.cache_decode_kept(lengths, 12345, 0, q, slots, "standard")


def test_select_fake_kernels_give_shapes():
    with FakeTensorMode():
        values, indices = ops.topk(torch.empty(7, 100), 9)
        assert values.shape == (7, 9) and indices.dtype == torch.int32
        idx, vals, counts = ops.activation_topk(torch.empty(4, 50, dtype=torch.float16), torch.empty(50), 10)
        assert idx.shape == (4, 10) and vals.dtype == torch.float16 and counts.shape == (4,)
        y = ops.gated_gemv(torch.empty(50, 30, dtype=torch.bfloat16), idx, vals, counts)
        assert y.shape == (4, 30) and y.dtype == torch.float32


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-device path")
def test_cache_without_a_device_says_why():
    with pytest.raises(RuntimeError, match="hisparse: "):
        hisparse.PagedKVCache(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, max_sequences=1,
                              max_context=1024, device="cuda:0")


def test_cache_arguments_checked_before_any_device_work():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        hisparse.PagedKVCache(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, max_sequences=1,
                              max_context=1024, dtype=torch.float32)
    with pytest.raises(ValueError, match="fine_summary"):
        hisparse.PagedKVCache(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, max_sequences=1,
                              max_context=1024, fine_summary="max")
    with pytest.raises(ValueError, match="coarse_summary"):
        hisparse.PagedKVCache(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, max_sequences=1,
                              max_context=1024, coarse_summary="mean_bf16")
    with pytest.raises(ValueError, match="CUDA device"):
        hisparse.PagedKVCache(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, max_sequences=1,
                              max_context=1024, device="cpu")
