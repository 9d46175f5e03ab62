"""Shared fixtures: the device axis and per-test seeded random generators."""
import zlib

import pytest
import torch

import coat


def cuda_skip_reason() -> str | None:
    """Why the CUDA cases cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if not coat.built_with_cuda():
        return (
            "a CUDA device is present but coat was built without CUDA kernels (CPU-only torch, no nvcc, or "
            "COAT_FORCE_CPU at build time): rebuild coat with CUDA to run the CUDA cases"
        )
    return None


_CUDA_SKIP = cuda_skip_reason()


@pytest.fixture(
    params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(_CUDA_SKIP is not None, reason=_CUDA_SKIP or ""))]
)
def device(request) -> str:
    """Every test that takes `device` runs once per device."""
    return request.param


@pytest.fixture
def cuda_device() -> str:
    """For tests that only mean something with a GPU (e.g. tensors on two different devices)."""
    if _CUDA_SKIP is not None:
        pytest.skip(_CUDA_SKIP)
    return "cuda"


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: every test gets its own fixed data, on every machine.
    Inputs are always drawn on the CPU and then moved, so the CPU and CUDA cases see the same values."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
