"""coat._native: a missing or broken extension, and CUDA tensors on a CPU-only build, give errors that say
how to fix them."""
import importlib

import pytest
import torch

import coat

# Not `import coat._native as ...`: coat/__init__.py binds the name coat._native to the extension module
# (`from coat._native import native as _native`), which shadows the submodule as an attribute of coat.
native_module = importlib.import_module("coat._native")


@pytest.mark.parametrize(
    "failure",
    [
        ModuleNotFoundError("No module named 'coat._C'"),
        ImportError("coat/_C.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKcS2_jRKSs"),
    ],
    ids=["missing", "built-for-another-torch"],
)
def test_load_failure_says_how_to_rebuild(monkeypatch, failure):
    def import_module(name, *args, **kwargs):
        assert name == "coat._C"
        raise failure

    monkeypatch.setattr(native_module.importlib, "import_module", import_module)
    with pytest.raises(ImportError) as caught:
        native_module._load()
    message = str(caught.value)
    assert "coat's native extension coat._C could not be loaded" in message
    assert str(failure) in message, "the original error must be quoted"
    assert torch.__version__ in message, "the running torch version must be named"
    assert "pip install --no-build-isolation -v ." in message and "COAT_FORCE_CPU=1" in message
    assert caught.value.__cause__ is failure


def test_load_returns_the_extension():
    module = native_module._load()
    assert module is native_module.native
    assert module.__name__ == "coat._C"
    assert isinstance(module.built_with_cuda(), bool)
    assert coat.built_with_cuda() is module.built_with_cuda() is native_module.BUILT_WITH_CUDA


class FakeCudaTensor:
    """Stands in for a CUDA tensor: check_device_supported only reads is_cuda, before any op runs."""

    is_cuda = True


def test_cuda_tensor_on_cpu_only_build_is_refused(monkeypatch):
    monkeypatch.setattr(native_module, "BUILT_WITH_CUDA", False)
    with pytest.raises(RuntimeError) as caught:
        native_module.check_device_supported(FakeCudaTensor(), "coat.ops.some_op")
    message = str(caught.value)
    assert message.startswith("coat.ops.some_op: got a CUDA tensor, but coat was built without CUDA kernels")
    assert "pip install --no-build-isolation -v ." in message
    # CPU tensors are fine on a CPU-only build, and CUDA tensors on a CUDA build.
    native_module.check_device_supported(torch.ones(1), "coat.ops.some_op")
    monkeypatch.setattr(native_module, "BUILT_WITH_CUDA", True)
    native_module.check_device_supported(FakeCudaTensor(), "coat.ops.some_op")


@pytest.mark.parametrize(
    "name, call",
    [
        pytest.param("quantize_group", lambda x: coat.ops.quantize_group(x), id="quantize_group"),
        pytest.param("group_amax", lambda x: coat.ops.group_amax(x), id="group_amax"),
        pytest.param("quantize_tensor", lambda x: coat.ops.quantize_tensor(x), id="quantize_tensor"),
        pytest.param("dequantize", lambda x: coat.ops.dequantize(x, torch.ones(())), id="dequantize"),
        pytest.param("quantize_fp4", lambda x: coat.ops.quantize_fp4(x), id="quantize_fp4"),
        pytest.param("dequantize_fp4", lambda x: coat.ops.dequantize_fp4(x, torch.ones(1), 2), id="dequantize_fp4"),
        pytest.param("fp4_to_e4m3", lambda x: coat.ops.fp4_to_e4m3(x, torch.ones(1), 2), id="fp4_to_e4m3"),
        pytest.param("quantize_blocks", lambda x: coat.ops.quantize_blocks(x, "fp6"), id="quantize_blocks"),
        pytest.param(
            "dequantize_blocks", lambda x: coat.ops.dequantize_blocks(x, torch.ones(1), 2, "fp6"), id="dequantize_blocks"
        ),
        pytest.param("blocks_to_e4m3", lambda x: coat.ops.blocks_to_e4m3(x, torch.ones(1), 2, "fp6"), id="blocks_to_e4m3"),
        pytest.param("rmsnorm_requantize", lambda x: coat.ops.rmsnorm_requantize(x, x, x, x, x), id="rmsnorm_requantize"),
        pytest.param(
            "silu_mul_requantize", lambda x: coat.ops.silu_mul_requantize(x, x, x, x, None, x), id="silu_mul_requantize"
        ),
    ],
)
def test_every_op_checks_the_device_first(monkeypatch, name, call):
    monkeypatch.setattr(native_module, "BUILT_WITH_CUDA", False)
    with pytest.raises(RuntimeError, match=rf"^coat\.ops\.{name}: got a CUDA tensor, but coat was built without CUDA"):
        call(FakeCudaTensor())

