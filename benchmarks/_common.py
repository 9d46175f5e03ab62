"""Shared benchmark plumbing: CUDA-event timing (warm-up, median), the metadata every result file carries,
and the table printed at the end of each benchmark script."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
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


def compile_for_fixed_shapes(fn):
    """torch.compile as a user training at one shape gets it: static shapes. The compile caches are cleared
    first, so that shapes and variants compiled earlier in the run neither turn this compile dynamic
    (torch.compile recompiles with dynamic shapes once it meets a second shape of the same code) nor fill its
    recompile limit (past which it runs the code eagerly)."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _event_ms(fn, sleep_cycles: int = 0) -> float:
    """Milliseconds between CUDA events recorded around fn(), behind a GPU sleep of sleep_cycles when nonzero."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_cuda_ms(fn, warmup: int, repeat: int) -> float:
    """Median milliseconds of fn() on the current CUDA stream, timed with CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_event_ms(fn) for _ in range(repeat))


_sleep_cycles_per_ms: dict[int, float] = {}


def _sleep_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep (a spin kernel) that keep the current GPU busy for about ``ms``."""
    device = torch.cuda.current_device()
    if device not in _sleep_cycles_per_ms:
        cycles = 10_000_000
        torch.cuda._sleep(cycles)
        _sleep_cycles_per_ms[device] = cycles / _event_ms(lambda: torch.cuda._sleep(cycles))
    return int(ms * _sleep_cycles_per_ms[device])


def time_cuda_gpu_ms(fn, warmup: int, repeat: int) -> float:
    """Median milliseconds of fn()'s GPU work alone, CUDA events after warm-up. Unlike time_cuda_ms, each call
    is enqueued while the GPU is kept busy (torch.cuda._sleep for twice the longest enqueue seen in warm-up), so
    that the host's time to enqueue it (Python, the op's checks, allocations, the launches) is not counted: what
    a kernel's bandwidth is measured on. time_cuda_ms gives what a caller that waits for the result sees."""
    host_ms = 0.0
    for _ in range(max(warmup, 1)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host_ms = max(host_ms, (time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    cycles = _sleep_cycles(2 * host_ms + 0.05)
    return statistics.median(_event_ms(fn, cycles) for _ in range(repeat))


def host_us_per_call(fn, calls: int, repeat: int, device: torch.device | str) -> float:
    """Median microseconds of host time per call of fn(): ``calls`` calls enqueued back to back, on a GPU behind
    a sleep kernel long enough that none of them waits for the GPU (Python, the op's checks, allocations and
    launches, none of the GPU work)."""
    cuda = torch.device(device).type == "cuda"
    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(_sleep_cycles(1.0 + calls * 0.2))  # 200 us per call: above any host cost seen
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e6 / calls)
        if cuda:
            torch.cuda.synchronize()
    return statistics.median(times)


def loop_ms(steps, device: torch.device | str) -> list[float]:
    """Milliseconds of each of ``steps`` (callables) run back to back without a wait, as a training loop runs them:
    on a GPU the intervals between CUDA events recorded after each (the GPU's time from the end of one step's work
    to the end of the next's, including any time it waited for the host); on the CPU, host time."""
    if torch.device(device).type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
        events[0].record()
        for step, event in zip(steps, events[1:]):
            step()
            event.record()
        events[-1].synchronize()
        return [start.elapsed_time(end) for start, end in zip(events, events[1:])]
    times = [time.perf_counter()]
    for step in steps:
        step()
        times.append(time.perf_counter())
    return [(end - start) * 1e3 for start, end in zip(times, times[1:])]


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


KERNEL_CLASSES = [
    ("GEMM", re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention", re.IGNORECASE)),
]


def kernel_class(name: str) -> str:
    return next((label for label, pattern in KERNEL_CLASSES if pattern.search(name)), "other")


def kernel_profile(fn, steps: int) -> dict:
    """GPU kernels of fn() per call, from torch.profiler: each kernel's name, class (GEMM, attention,
    other), calls and microseconds per call of fn, most time first; plus the totals per class and the
    number of kernel launches per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.self_device_time_total <= 0:
            continue
        kernels.append({"kernel": event.key[:110], "class": kernel_class(event.key), "calls": event.count / steps,
                        "us": event.self_device_time_total / steps})
    kernels.sort(key=lambda k: -k["us"])
    totals = {f"{label} us": sum(k["us"] for k in kernels if k["class"] == label) for label in ("GEMM", "attention", "other")}
    return {"launches": sum(k["calls"] for k in kernels), "total us": sum(k["us"] for k in kernels), **totals,
            "kernels": kernels}


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
