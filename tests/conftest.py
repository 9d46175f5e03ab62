"""Shared pytest fixtures: ``device`` runs a test on the CPU and, where there is one, on a CUDA GPU."""
import pytest
import torch

import coat


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if not coat.built_with_cuda():
        return "coat was built without CUDA kernels"
    return None


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason()))
        ),
    ]
)
def device(request) -> torch.device:
    return torch.device(request.param)
