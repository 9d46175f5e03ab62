"""scripts/gpu_check.sh and scripts/gpu_background.sh, the parts that run without a GPU: a script stage, and a
background run that a later call waits for and packs."""
from __future__ import annotations

import os
import pathlib
import subprocess
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*command, env=None, timeout=300):
    return subprocess.run([str(ROOT / "scripts" / command[0]), *command[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_a_script_stage_runs_the_script_and_keeps_its_output(tmp_path):
    result = run("gpu_check.sh", str(tmp_path), "script:check_sdpa_backward")
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "logs" / "script_check_sdpa_backward.log").read_text()
    assert "seq  64 no mask logits ~-120.0" in log and "every default gradient was finite" in log
    assert "every default gradient was finite" in result.stdout


def test_a_background_run_is_waited_for_and_packed(tmp_path):
    """start returns at once; wait reports the stages' output and the exit status (2: an unknown stage), and packs
    the folder into $OUT."""
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    started = run("gpu_background.sh", "start", str(work), "no-such-stage")
    assert started.returncode == 0 and "started" in started.stdout
    waited = run("gpu_background.sh", "wait", str(work), "120", env={"OUT": str(out)})
    assert "unknown stage no-such-stage" in waited.stdout and "finished, exit status 2" in waited.stdout
    with tarfile.open(out / "work.tgz") as archive:
        assert {"work/gpu_check.out", "work/exit_status", "work/logs/env.txt"} <= set(archive.getnames())


def test_a_beside_stage_runs_in_the_background_and_is_waited_for_before_packing(tmp_path):
    """beside:STAGE returns at once; the script waits for it before it packs, keeps its output, and fails when it
    fails."""
    result = run("gpu_check.sh", str(tmp_path), "beside:script:check_sdpa_backward", "beside:no-such-stage")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "beside no-such-stage: failed" in result.stdout
    assert "unknown stage no-such-stage" in (tmp_path / "logs" / "beside_no-such-stage.out").read_text()
    assert "gpu_check status: 0" in (tmp_path / "logs" / "beside_script_check_sdpa_backward.out").read_text()
    with tarfile.open(tmp_path / "gpu_check.tgz") as archive:
        assert "logs/script_check_sdpa_backward.log" in archive.getnames()
