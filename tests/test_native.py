"""coat._native: a missing or broken extension, and CUDA tensors on a CPU-only build, give errors that say
how to fix them; an extension built against another torch warns; a wheel requires the torch it was built
against; a build that cannot see the torch it must compile against (pip's build isolation) or a CUDA build
without the toolkit's headers stops at once with what to do."""
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

import coat

# Not `import coat._native as ...`: coat/__init__.py binds the name coat._native to the extension module
# (`from coat._native import native as _native`), which shadows the submodule as an attribute of coat.
native_module = importlib.import_module("coat._native")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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



def test_the_extension_records_the_torch_it_was_built_against():
    assert native_module.native.built_against_torch() == (torch.__version__, torch.version.cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native_module.check_built_against_this_torch(native_module.native)


class OlderExtension:
    """An extension built from sources that predate built_against_torch."""


BUILT = native_module._torch_name(torch.__version__, torch.version.cuda)


@pytest.mark.parametrize("running, extension, expected", [
    (("2.14.1+cpu", None), native_module.native, f"built against {BUILT}, but this is torch 2.14.1+cpu (no CUDA)"),
    ((torch.__version__, "12.8"), native_module.native, f"built against {BUILT}, but this is torch {torch.__version__} "
                                                        "(CUDA 12.8)"),
    ((torch.__version__, torch.version.cuda), OlderExtension(), "built from older coat sources"),
], ids=["torch", "cuda", "unrecorded"])
def test_an_extension_built_for_another_torch_warns_how_to_rebuild(monkeypatch, running, extension, expected):
    monkeypatch.setattr(torch, "__version__", running[0])
    monkeypatch.setattr(torch.version, "cuda", running[1])
    with pytest.warns(UserWarning) as caught:
        native_module.check_built_against_this_torch(extension)
    message = str(caught[0].message)
    assert expected in message and "pip install --no-build-isolation -v ." in message


def test_import_coat_warns_when_torch_changed_since_the_build():
    script = "import torch; torch.__version__ = '2.99.0'; import coat"
    completed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert f"built against {BUILT}, but this is torch 2.99.0" in completed.stderr


def wheel_metadata(hook: str, directory) -> str:
    """The METADATA the build backend prepares, as pip asks for it before building (nothing is compiled)."""
    script = f"import build_backend, sys; print(build_backend.{hook}(sys.argv[1]))"
    completed = subprocess.run([sys.executable, "-c", script, str(directory)], cwd=ROOT, capture_output=True,
                               text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert completed.returncode == 0, completed.stderr[-3000:]
    return (directory / completed.stdout.split()[-1] / "METADATA").read_text()


def test_a_wheel_requires_the_torch_it_was_built_against_and_an_editable_install_any_recent_one(tmp_path):
    (tmp_path / "wheel").mkdir()
    (tmp_path / "editable").mkdir()
    public_version = torch.__version__.split("+")[0]
    assert f"Requires-Dist: torch=={public_version}\n" in wheel_metadata("prepare_metadata_for_build_wheel",
                                                                         tmp_path / "wheel")
    assert "Requires-Dist: torch>=2.11\n" in wheel_metadata("prepare_metadata_for_build_editable", tmp_path / "editable")


@pytest.fixture
def build_backend(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    return importlib.import_module("build_backend")


@pytest.mark.parametrize("editable, build_sees_torch, pip_isolated, environment_torch, expected", [
    (True, True, False, None, None),  # --no-build-isolation
    (False, True, False, None, None),
    (False, False, False, None, None),  # python -m build: a wheel for elsewhere, pinned to the torch it got
    (True, False, True, "2.13.0+cpu", "torch 2.13.0+cpu here, and pip's build isolation hides it"),
    (False, False, True, "2.13.0+cpu", "torch 2.13.0+cpu here, and pip's build isolation hides it"),
    (True, False, True, None, "none is installed here. Install torch first (on a CPU: pip install torch==2.13.0)"),
    (False, False, True, None, "none is installed here. Install torch first (on a CPU: pip install torch==2.13.0)"),
    (True, False, False, None, "the front end builds in an environment of its own, or torch is not installed"),
], ids=["editable", "wheel", "python-m-build", "pip-isolated-editable", "pip-isolated-wheel",
        "pip-isolated-editable-no-torch", "pip-isolated-wheel-no-torch", "other-front-end-editable"])
def test_a_build_that_cannot_see_its_torch_stops_with_the_command_that_works(
        build_backend, editable, build_sees_torch, pip_isolated, environment_torch, expected):
    refusal = build_backend.isolation_refusal(editable, build_sees_torch, pip_isolated, environment_torch)
    if expected is None:
        assert refusal is None
    else:
        assert expected in refusal
        assert f"pip install --no-build-isolation {'-e .' if editable else '.'}`" in refusal


@pytest.mark.parametrize("version, refused", [("65.5.0", "this environment has setuptools 65.5.0"),
                                               (None, "this environment has no setuptools"),
                                               ("76.1.0", "setuptools 76.1.0"), ("77.0.3", None), ("84.2.1", None)])
def test_a_setuptools_too_old_for_pyproject_stops_the_build_with_the_command_that_works(build_backend, version,
                                                                                        refused):
    refusal = build_backend.setuptools_refusal(version)
    if refused is None:
        assert refusal is None
    else:
        assert refused in refusal and 'pip install "setuptools>=77"' in refusal


def get_requires(hook: str, hide_site_packages: bool) -> subprocess.CompletedProcess:
    """A get_requires hook of the build backend in a fresh interpreter, where torch is not imported. pip's build
    isolation runs it with the installing interpreter, whose site-packages it drops from sys.path."""
    hide = ("hidden = {os.path.realpath(p) for p in site.getsitepackages()}; "
            "sys.path[:] = [p for p in sys.path if os.path.realpath(p) not in hidden]; ") if hide_site_packages else ""
    script = f"import os, site, sys, build_backend; {hide}print(build_backend.{hook}())"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("hook", ["get_requires_for_build_editable", "get_requires_for_build_wheel"])
def test_the_backend_finds_the_torch_that_pip_isolation_hides(hook):
    assert get_requires(hook, hide_site_packages=False).stdout.strip() == "['torch>=2.11']"
    isolated = get_requires(hook, hide_site_packages=True)
    assert isolated.returncode == 1 and not isolated.stdout
    assert f"torch {importlib.metadata.version('torch')} here, and pip's build isolation hides it" in isolated.stderr


def test_a_cuda_build_without_the_toolkit_headers_stops_before_compiling(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("coat_setup", os.path.join(ROOT, "setup.py"))
    setup_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_module)  # defines the functions; setup() runs only as __main__
    for variable in ("CUDA_INC_PATH", "CPATH", "CPLUS_INCLUDE_PATH"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(setup_module, "COMPILER_INCLUDE_DIRS", ())  # a system-wide toolkit would answer for tmp_path
    with pytest.raises(SystemExit, match=f"CUDA_HOME={tmp_path} has no include/cuda_runtime_api.h.*COAT_FORCE_CPU=1"):
        setup_module.check_cuda_headers(str(tmp_path))
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime_api.h").touch()
    setup_module.check_cuda_headers(str(tmp_path))


def test_a_wheel_packages_every_python_package_of_coat():
    """A non-editable install (pip install --no-build-isolation ., or a wheel) holds only the packages setuptools
    lists: each folder of coat/ with an __init__.py must be among them, or `import coat` fails there."""
    from setuptools.config.pyprojecttoml import read_configuration

    packaged = set(read_configuration(os.path.join(ROOT, "pyproject.toml"))["tool"]["setuptools"]["packages"])
    on_disk = {os.path.relpath(folder, ROOT).replace(os.sep, ".")
               for folder, _, files in os.walk(os.path.join(ROOT, "coat")) if "__init__.py" in files}
    assert {"coat.ops", "coat.nn.families"} <= on_disk
    assert packaged == on_disk
