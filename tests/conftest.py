"""Shared fixtures: the device axis, seeded random generators, and `run`, which calls an op on the device
under test and, on CUDA, checks the result against the C core on the CPU bit for bit."""
import os
import zlib

import pytest
import torch

import coat
import reference


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

# For tests that only mean something on a GPU, e.g. comparing a CUDA run with a CPU run.
requires_cuda = pytest.mark.skipif(_CUDA_SKIP is not None, reason=_CUDA_SKIP or "")

# Under pytest-xdist, one CPU thread per worker and per process a test starts: with torch's default of a thread per
# core in each of them, `-n 2` on two cores ran four or more threads on two and the suite took longer.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(
    params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(_CUDA_SKIP is not None, reason=_CUDA_SKIP or ""))]
)
def device(request) -> str:
    """Every test that takes `device` (directly or through `run`) runs once per device."""
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


def to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """t on `device` with the same sizes, strides and storage contents: a strided view (x[:, :k] of a
    wider tensor) stays a strided view, with the same bytes between its rows."""
    if t.device.type == device:
        return t
    storage = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    return storage.to(device).as_strided(t.size(), t.stride(), t.storage_offset())


def _map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


@pytest.fixture
def move(device):
    """move(t): t on the device under test, layout kept (see to_device)."""
    return lambda t: to_device(t, device)


@pytest.fixture
def run(device):
    """run(fn, *args, **kwargs) calls fn with its tensor arguments (given on the CPU) moved to the device
    under test, checks that every tensor it returns is on that device, and returns the result on the CPU.
    On CUDA it also calls fn on the CPU arguments and asserts that both results agree bit for bit: the
    CPU path is the C core, the reference every CUDA kernel must reproduce."""

    def call(fn, *args, **kwargs):
        if device == "cpu":
            out = fn(*args, **kwargs)
        else:
            out = fn(*_map(args, lambda t: to_device(t, device)), **_map(kwargs, lambda t: to_device(t, device)))
        for t in _tensors(out):
            assert t.device.type == device, f"an output is on {t.device}, expected {device}"
        out = _map(out, lambda t: t.cpu())
        if device != "cpu":
            reference.assert_same_bits(out, fn(*args, **kwargs), f"{device} vs cpu")
        return out

    return call
