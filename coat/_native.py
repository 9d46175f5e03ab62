"""Loads coat's native extension (coat._C) and turns a missing or broken build into an error that says
what to do, and warns when the extension was compiled against another torch than the running one."""
import importlib
import warnings

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


def check_built_against_this_torch(extension) -> None:
    """Warns when ``extension`` was compiled against another torch (or CUDA) than the running one: a C++
    extension is tied to the torch it was built with, and may crash or compute wrongly with another, even when
    it loads."""
    if not hasattr(extension, "built_against_torch"):
        warnings.warn(f"coat's native extension coat._C was built from older coat sources that do not record "
                      f"their torch version, so it cannot be checked against this torch ({torch.__version__}). "
                      f"{_REBUILD}", stacklevel=2)
        return
    built = tuple(extension.built_against_torch())
    running = (str(torch.__version__), torch.version.cuda)
    if built != running:
        warnings.warn(f"coat's native extension coat._C was built against {_torch_name(*built)}, but this is "
                      f"{_torch_name(*running)}. {_REBUILD}", stacklevel=2)


def _torch_name(version: str, cuda: str | None) -> str:
    return f"torch {version} ({f'CUDA {cuda}' if cuda else 'no CUDA'})"


native = _load()
check_built_against_this_torch(native)
# Read once: torch.compile cannot trace a call into the extension module.
BUILT_WITH_CUDA = bool(native.built_with_cuda())


def check_device_supported(tensor: torch.Tensor, op: str) -> None:
    """Refuses CUDA tensors when the extension was built without CUDA, with the fix in the message."""
    if tensor.is_cuda and not BUILT_WITH_CUDA:
        raise RuntimeError(
            f"{op}: got a CUDA tensor, but coat was built without CUDA kernels (at build time torch had no "
            f"CUDA, nvcc was not found, or COAT_FORCE_CPU was set). {_REBUILD}"
        )
