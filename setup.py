"""Build coat's native extension, coat._C.

The C core (csrc/common.c, csrc/cpu/*.c) is compiled as C99 with the plain C compiler and linked into
the extension; the ATen bindings (csrc/bindings/*.cpp) and, in CUDA builds, the CUDA core
(csrc/cuda/*.cu) go through torch's BuildExtension.

CPU or CUDA: a CUDA build where torch has CUDA and nvcc is found (CUDA_HOME, or the nvcc on the PATH),
otherwise a CPU-only one, saying why. Where nvcc is found but CUDA_HOME/include lacks the toolkit's headers,
the build stops with what to set (check_cuda_headers) rather than fall back to CPU or fail in the compiler.

Switches (environment variables):
  COAT_FORCE_CPU=1          build without CUDA even when torch and nvcc support it
  TORCH_CUDA_ARCH_LIST      GPU architectures to compile for, e.g. "9.0" or "8.9;9.0". Defaults to the
                            visible GPUs' architectures, or "9.0" (H100/H200) when none is visible.

The objects stay in build/temp.<platform>-<python>/ (BuildCoat), so that with ninja a rebuild compiles only
what changed. The extension records the torch (and CUDA) version it is compiled against; `import coat` warns
when the running torch differs. A wheel (build_backend.build_wheel) requires that torch release; editable
installs require torch>=2.11 like the source tree. build_backend.py refuses builds that cannot see the
torch they must compile against (pip's build isolation).
"""
import glob
import os
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# Set by build_backend.py while it prepares a wheel's metadata or builds the wheel.
PIN_TORCH_ENV = "COAT_BUILDING_WHEEL"
INCLUDE = os.path.join(ROOT, "csrc", "include")


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def build_with_cuda():
    if os.environ.get("COAT_FORCE_CPU", "0") not in ("", "0"):
        print("coat: COAT_FORCE_CPU is set, building the CPU-only extension")
        return False
    if torch.version.cuda is None:
        print("coat: this torch has no CUDA, building the CPU-only extension")
        return False
    if CUDA_HOME is None:
        print("coat: nvcc not found (set CUDA_HOME), building the CPU-only extension")
        return False
    check_cuda_headers(CUDA_HOME)
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return True


# Where the C++ compiler looks without being told, besides torch's include_paths, CPATH and CPLUS_INCLUDE_PATH.
COMPILER_INCLUDE_DIRS = ("/usr/include", "/usr/local/include")


def check_cuda_headers(cuda_home):
    """A CUDA build needs the toolkit's headers in CUDA_HOME/include. Unless CUDA_HOME is set, torch takes the
    folder above the bin/ of the nvcc on the PATH, and an nvcc wrapper outside the toolkit (/usr/local/bin/nvcc)
    gives one without them: stop before the compiler fails, saying what to set. nvcc is there, so a CUDA build
    is meant: a CPU-only fallback would only show on the GPU."""
    header = "cuda_runtime_api.h"
    searched = [os.path.join(cuda_home, "include"), os.environ.get("CUDA_INC_PATH"), *COMPILER_INCLUDE_DIRS]
    for variable in ("CPATH", "CPLUS_INCLUDE_PATH"):
        searched += os.environ.get(variable, "").split(os.pathsep)
    if any(folder and os.path.isfile(os.path.join(folder, header)) for folder in searched):
        return
    usual = "/usr/local/cuda"
    hint = f" (here: CUDA_HOME={usual})" if os.path.isfile(os.path.join(usual, "include", header)) else ""
    raise SystemExit(
        f"coat: this torch has CUDA {torch.version.cuda} and nvcc was found, but CUDA_HOME={cuda_home} has no "
        f"include/{header}. Set CUDA_HOME to the CUDA toolkit's folder, the one with bin/nvcc and include/{header}"
        f"{hint}, or COAT_FORCE_CPU=1 to build the CPU-only extension."
    )


C_SOURCES = sources("csrc/common.c") + sources("csrc/cpu/*.c")
# IEEE division and square root, no flush-to-zero and no a*b+c contraction into FMA: the C core (C99, which
# gcc does not contract) and the CUDA kernels then round identically, bit for bit. .ci/run compiles with
# the same file.
with open(os.path.join(ROOT, "csrc", "cuda", "nvcc.flags")) as flags_file:
    NVCC_FLAGS = flags_file.read().split()
C_FLAGS = ["-std=c99", "-O3", "-fPIC", "-fopenmp", "-Wall", "-Wextra"]


class BuildCoat(BuildExtension):
    """Compiles the C99 core with the C compiler, then the rest with torch's BuildExtension.

    The objects go to build/temp.<platform>-<python>/ in the source tree, also for an editable install
    (setuptools would use a new temporary folder each time): with ninja, which torch uses when it is on
    the PATH, a rebuild then compiles only what changed (a source, a header, or a compile command: another
    torch, CUDA or flags) and links. The C core is compiled each time (about 2 s)."""

    def finalize_options(self):
        super().finalize_options()
        # setuptools skips an extension whose .cpp/.cu files are older than it, blind to the headers, the C
        # core and torch: always link, and let ninja choose what to compile (torch forces this with ninja too).
        self.force = True
        build = self.get_finalized_command("build")
        self.build_temp = os.path.join(ROOT, "build", f"temp.{build.plat_name}-{sys.implementation.cache_tag}")

    def build_extensions(self):
        objects = self.compiler.compile(
            C_SOURCES, output_dir=self.build_temp, include_dirs=[INCLUDE], extra_postargs=C_FLAGS
        )
        for extension in self.extensions:
            extension.extra_objects = list(extension.extra_objects or []) + objects
        super().build_extensions()


def extension():
    with_cuda = build_with_cuda()
    common = dict(
        name="coat._C",
        include_dirs=[INCLUDE],
        extra_link_args=["-fopenmp"],
    )
    # The C++ standard is left to torch, whose headers set their minimum. The torch version goes into the
    # binary itself (csrc/bindings/library.cpp), so that it cannot drift from the build it describes.
    cxx_flags = ["-O3", f'-DCOAT_TORCH_VERSION="{torch.__version__}"']
    if torch.version.cuda is not None:
        cxx_flags.append(f'-DCOAT_TORCH_CUDA_VERSION="{torch.version.cuda}"')
    if not with_cuda:
        return CppExtension(sources=sources("csrc/bindings/*.cpp"), extra_compile_args={"cxx": cxx_flags}, **common)
    return CUDAExtension(
        sources=sources("csrc/bindings/*.cpp") + sources("csrc/cuda/*.cu"),
        define_macros=[("COAT_WITH_CUDA", None)],
        extra_compile_args={
            "cxx": cxx_flags,
            "nvcc": NVCC_FLAGS,
        },
        **common,
    )


def requirements():
    """A wheel (also the one `pip install .` builds) holds an extension compiled against this torch: it
    requires this torch release (the public version, 2.13.0 for 2.13.0+cu128, as torchvision pins torch), so
    that pip installs the torch it runs with. An editable install requires torch>=2.11, as the source tree does."""
    torch_requirement = "torch>=2.11"
    if os.environ.get(PIN_TORCH_ENV) == "1":
        torch_requirement = f"torch=={torch.__version__.split('+')[0]}"
    return [torch_requirement, "tqdm"]


if __name__ == "__main__":  # as pip's backend and `python setup.py` run it; tests import it
    setup(ext_modules=[extension()], cmdclass={"build_ext": BuildCoat}, install_requires=requirements())
