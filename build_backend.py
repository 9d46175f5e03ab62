"""coat's PEP 517 build backend: setuptools.build_meta, except that a wheel's metadata requires the torch
release the wheel's extension is compiled against (setup.py's requirements()); editable installs keep
torch>=2.11. The metadata pip prepares for a wheel and the wheel itself must agree (PEP 517), so both hooks
set the switch."""
import contextlib
import os

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F401,F403 (every other hook, as setuptools defines it)

PIN_TORCH_ENV = "COAT_BUILDING_WHEEL"  # read by setup.py


@contextlib.contextmanager
def _pinning_torch():
    previous = os.environ.get(PIN_TORCH_ENV)
    os.environ[PIN_TORCH_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[PIN_TORCH_ENV]
        else:
            os.environ[PIN_TORCH_ENV] = previous


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    with _pinning_torch():
        return build_meta.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with _pinning_torch():
        return build_meta.build_wheel(wheel_directory, config_settings, metadata_directory)
