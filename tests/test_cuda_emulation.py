"""The CUDA kernels' logic on a CPU: tools/cuda_emulation compiles csrc/cuda's kernels for the host (one
std::thread per CUDA thread, the warp shuffles and barriers emulated) and compares what they write with the C
core's output, byte for byte. The rope kernels (rotary_embedding, qk_norm_rope: both paths of each) and the
stats kernel take under half a minute on two cores and run with the tests; quantize (about 3 minutes), norm_act
and adamw (about 15 together) are run by hand with tools/cuda_emulation/run.sh after a change to them. On a GPU
the CUDA tests compare the same kernels with the C core on the hardware."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

RUN = pathlib.Path(__file__).resolve().parents[1] / "tools" / "cuda_emulation" / "run.sh"


@pytest.mark.parametrize("kernels", ["rope", "stats"])
def test_cuda_kernels_write_what_the_c_core_writes(kernels):
    if shutil.which("gcc") is None or shutil.which("g++") is None:
        pytest.skip("the emulation compiles csrc/cuda's kernels with gcc and g++ (C++20), and neither is on the PATH")
    result = subprocess.run(["bash", str(RUN), "quick", kernels], capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert f"{kernels}:" in result.stdout and ", ok: 0 failures" in result.stdout, output[-6000:]
