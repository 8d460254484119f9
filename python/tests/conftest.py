import pytest
import torch

hisparse = pytest.importorskip("hisparse", reason="the hisparse extension is not built (pip install --no-build-isolation .)")

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"))]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
