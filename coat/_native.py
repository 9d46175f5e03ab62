"""Loads coat's native extension (coat._C) and turns a missing or broken build into an error that says
what to do."""
import importlib

import torch

_REBUILD = (
    "Rebuild it against the torch you run with: `pip install --no-build-isolation -v .` from the coat "
    "source tree (add -e for a development install; COAT_FORCE_CPU=1 for a CPU-only build)."
)


def _load():
    try:
        return importlib.import_module("coat._C")
    except ImportError as error:
        raise ImportError(
            f"coat's native extension coat._C could not be loaded ({error}). It is missing, or it was built "
            f"for another torch than this one ({torch.__version__}). {_REBUILD}"
        ) from error


native = _load()
# Read once: torch.compile cannot trace a call into the extension module.
BUILT_WITH_CUDA = bool(native.built_with_cuda())


def check_device_supported(tensor: torch.Tensor, op: str) -> None:
    """Refuses CUDA tensors when the extension was built without CUDA, with the fix in the message."""
    if tensor.is_cuda and not BUILT_WITH_CUDA:
        raise RuntimeError(
            f"{op}: got a CUDA tensor, but coat was built without CUDA kernels (at build time torch had no "
            f"CUDA, nvcc was not found, or COAT_FORCE_CPU was set). {_REBUILD}"
        )
