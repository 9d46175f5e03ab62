import pytest
import torch


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
        ),
    ]
)
def device(request):
    """Runs a test on the C core (cpu) and on the CUDA kernels (cuda). CUDA cases also compare against the
    C core bit for bit."""
    return request.param
