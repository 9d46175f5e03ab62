"""coat's PEP 517 build backend: setuptools.build_meta, with two changes.

1. coat's extension must be compiled against the torch it will run with. pip's build isolation (pip without
   --no-build-isolation) builds in an environment of its own, into which it would install the newest torch it
   finds: the compiler then fails on a CUDA build that does not match the machine, or the wheel replaces the
   installed torch with that one. So torch is not a static build requirement ([build-system] in
   pyproject.toml) but what the get_requires hooks return, which front ends call to fill an isolated
   environment, and these hooks stop first, with the command that works, where the build cannot see the
   torch it must use (isolation_refusal): an editable install anywhere, and any install in pip's isolation.
   A wheel built for elsewhere (`python -m build`) gets torch from its front end.
2. A wheel's metadata requires the torch release the wheel's extension is compiled against (setup.py's
   requirements()); editable installs keep torch>=2.11. The metadata pip prepares for a wheel and the wheel
   itself must agree (PEP 517), so both hooks set the switch.
"""
import contextlib
import importlib.metadata
import importlib.util
import os
import site
import sys

SETUPTOOLS_OLDEST = 77  # pyproject.toml's [build-system]: the first to read its SPDX `license` string


def setuptools_refusal(version):
    """Why the installed setuptools (``version``, None when there is none) cannot build coat, or None. Without
    build isolation pip builds with the environment's own setuptools, whatever [build-system] asks for: a fresh
    Python 3.12 venv has none, a 3.11 one 65.5, whose errors would not say what to do."""
    if version is not None and int(version.split(".")[0]) >= SETUPTOOLS_OLDEST:
        return None
    found = f"setuptools {version}" if version else "no setuptools"
    return (f"coat: building coat needs setuptools {SETUPTOOLS_OLDEST} or later, and this environment has {found} "
            f"(with --no-build-isolation pip builds with what is installed here). Run "
            f"`pip install \"setuptools>={SETUPTOOLS_OLDEST}\"`, then the same pip command again.")


def _installed_setuptools():
    try:
        return importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return None


if refusal := setuptools_refusal(_installed_setuptools()):
    raise SystemExit(refusal)

from setuptools import build_meta  # noqa: E402 (after the check: an old setuptools fails here unexplained)
from setuptools.build_meta import *  # noqa: E402,F401,F403 (every other hook, as setuptools defines it)

PIN_TORCH_ENV = "COAT_BUILDING_WHEEL"  # read by setup.py
TORCH_REQUIREMENT = "torch>=2.11"  # as setup.py's requirements() for an editable install


def isolation_refusal(editable, build_sees_torch, pip_isolated, environment_torch):
    """Why this build must not go on, or None when it may.

    build_sees_torch: torch is importable where the build runs (no isolation, or a front end told to add it).
    pip_isolated: pip's build isolation hides the site-packages of the environment it installs into.
    environment_torch: the torch release installed there, if pip_isolated and there is one."""
    if build_sees_torch or not (editable or pip_isolated):
        return None  # e.g. `python -m build`: a wheel for elsewhere, built against the torch the front end gives it
    rerun = ("run the same pip command with --no-build-isolation (uv pip takes the same flag), e.g. "
             f"`pip install --no-build-isolation {'-e .' if editable else '.'}`")
    cpu_torch = "(on a CPU: pip install torch==2.13.0)"
    if environment_torch:
        return (f"coat: coat's extension must be compiled against the torch it runs with, torch {environment_torch} "
                "here, and pip's build isolation hides it from the build (pip would compile against the newest torch "
                f"it finds, and install that one). Instead, {rerun}.")
    if pip_isolated:
        return (f"coat: coat's extension must be compiled against the torch it runs with, and none is installed "
                f"here. Install torch first {cpu_torch}, then {rerun}.")
    return ("coat: an editable install compiles coat's extension against the installed torch, and this build sees "
            "none: the front end builds in an environment of its own, or torch is not installed. Install torch "
            f"first if it is missing {cpu_torch}, then {rerun}.")


def hidden_site_packages():
    """This interpreter's site-packages folders that are missing from sys.path: pip's build isolation runs the
    backend with the interpreter it installs for, and drops them from its path."""
    on_path = {os.path.normcase(os.path.realpath(path)) for path in sys.path}
    return [path for path in site.getsitepackages()
            if os.path.isdir(path) and os.path.normcase(os.path.realpath(path)) not in on_path]


def torch_release(folders):
    """The version of the torch installed in these site-packages folders, or None."""
    for distribution in importlib.metadata.distributions(name="torch", path=folders):
        return distribution.version
    return None


def _build_requirements(editable):
    hidden = hidden_site_packages()
    refusal = isolation_refusal(editable, importlib.util.find_spec("torch") is not None, bool(hidden),
                                torch_release(hidden))
    if refusal:
        raise SystemExit(refusal)
    # setuptools' own hooks would run setup.py, which imports torch; it asks for nothing beyond torch.
    return [TORCH_REQUIREMENT]


def get_requires_for_build_editable(config_settings=None):
    return _build_requirements(editable=True)


def get_requires_for_build_wheel(config_settings=None):
    return _build_requirements(editable=False)


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
