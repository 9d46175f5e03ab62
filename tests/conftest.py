import pytest
import torch

import coat


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if not coat.built_with_cuda():
        return "coat was built without CUDA kernels"
    return None


# For tests that compare a CUDA run with a CPU run.
requires_cuda = pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason()))


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason()))
        ),
    ]
)
def device(request):
    """Runs a test on the C core (cpu) and on the CUDA kernels (cuda). CUDA cases also compare against the
    C core bit for bit."""
    return request.param
