"""The GPU benchmarks' CPU smoke modes: the scripts run end to end and write their JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["linear", "layer"])
def test_benchmark_smoke_mode(script, tmp_path):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", f"{script}.py"), "--smoke", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result_file,) = tmp_path.iterdir()
    result = json.loads(result_file.read_text())
    assert result["summary"]["smoke"] and result["rows"]
    assert {"device", "torch", "date", "command"} <= result.keys()
    if script == "layer":
        # The saved bytes do not depend on the device, so the memory target can be checked here too.
        assert result["summary"]["min_memory_ratio"] >= result["summary"]["memory_target"]
