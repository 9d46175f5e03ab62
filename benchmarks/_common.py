"""Shared benchmark plumbing: CUDA-event timing (warm-up, median), the metadata every result file carries,
and the table printed at the end of each benchmark script."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--results-dir", default=RESULTS_DIR, help="where the JSON result file is written")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before timing")
    p.add_argument("--repeat", type=int, default=50, help="timed runs; the median is reported")
    return p


def time_cuda_ms(fn, warmup: int, repeat: int) -> float:
    """Median milliseconds of fn() on the current CUDA stream, timed with CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms(fn, warmup: int, repeat: int, device: torch.device | str) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, time.perf_counter on the CPU, where the benchmarks
    only run their smoke mode (tiny shapes, to check that they still work, not to time anything)."""
    if torch.device(device).type == "cuda":
        return time_cuda_ms(fn, warmup, repeat)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def metadata() -> dict:
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }


def write_results(results_dir: str, name: str, rows: list[dict], summary: dict | None = None) -> str:
    meta = metadata()
    device_tag = meta["device"].replace(" ", "_").replace("/", "_")
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{name}-{device_tag}.json")
    with open(path, "w") as f:
        json.dump({**meta, "summary": summary or {}, "rows": rows}, f, indent=2)
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in columns))
