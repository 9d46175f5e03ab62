"""What coat.report costs a training loop of a converted Llama (forward and backward under bf16 autocast,
float32 master weights, coat.optim.AdamW step), timed in one process on the same batch.

Each timed run is a loop of training steps back to back, with no wait between, as a training loop runs them
(40 on a GPU), with a capture every 10 steps (steps 5, 15, 25 and 35; RUNS), by kind of run:

    off             no capture: the QuantizationReport is built, never used
    at once         each capture (``with report.capture():``, every quantized tensor and both moments of every
                    parameter measured, one device-to-host copy at the end) read at once (report.stats(), which
                    waits for that copy, so the GPU drains before the next step): with the default 64 evenly
                    spaced rows of each matrix (sample_rows=64; amax over the whole tensor), and with every row
                    (sample_rows=None)
    after the next step   each capture (64 rows) read once the next step is enqueued, as
                    examples/train_llama.py reads it: the GPU stays busy through the capture's end

Runs alternate, in an order rotated every round; a run's time is the sum of its steps' intervals between CUDA
events recorded after each step (host time on the CPU). What a capture costs is (median run - median plain
run) / captures per run: the captured step's own time and whatever lands after it (a drained GPU, a host that
fell behind, slower steps after it: on the H200s measured here, which run at their power cap under this load,
the steps after a capture were at times a few ms slower, which timing the captured step alone would miss).
Target: a captured step at most 5% slower than a plain one: "capture / off" is (off + that cost) / off, "off"
the plain runs' mean step; "every N" is the overhead of capturing every N-th step, cost / (N * off). Outside a
capture each coat autograd Function reads one module global (coat.nn._capture.active) in forward and in
backward: "switch" times that read and multiplies it by the reads per step, the whole cost of the report when
off, as a share of the step.

Whole runs carry the host's noise: at 4 x 2048 tokens, plain runs of the same 40 steps differed by up to 25% on
some H200s, more than the 5% measured. On a GPU the capture's two parts are therefore also measured apart
(cost_apart): the GPU time it adds to a step, with the host kept out of the way by a GPU sleep, and the host CPU
time it adds (time.thread_time, the read of its results included), beside a plain step's host time. Where the
plain step's host time plus the capture's stays under the step's time ("host_keeps_ahead" in the summary), the
host stays ahead of the GPU through a capture, and the capture costs the step its GPU time: "GPU-bound capture /
off" = 1 + GPU ms added / off.

    python benchmarks/report.py            (a CUDA GPU if there is one, else the CPU, train_llama.py's tiny model)
    python benchmarks/report.py --batch 16 (more tokens per step: at batch 4 the plain step's host time is about
                                            its GPU time on an H200, so whatever a capture adds on the host adds
                                            to the step; at 16 the GPU's work hides it, as in a GPU-bound run)
    python benchmarks/report.py --smoke    (a smaller model on the CPU, one short run each: checks that the script runs)
    python benchmarks/report.py --host-profile 10
                                           (also: where a captured step spends host time that a plain one does not,
                                            from cProfile over 10 steps of each, enqueued while a GPU sleep keeps
                                            the GPU busy, so that only a real synchronization waits for it)
"""
import cProfile
import os
import pstats
import statistics
import time
import timeit

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import coat
from coat.nn import _capture

from _common import _sleep_cycles, loop_ms, parser, print_table, time_cuda_gpu_ms, write_results

# (hidden, intermediate, layers, heads, seq, batch)
MODELS = {
    "cuda": (2048, 5504, 4, 16, 2048, 4),  # the 1b preset's layers, four of them
    "cpu": (128, 384, 4, 4, 128, 16),  # examples/train_llama.py's tiny preset
    "smoke": (64, 176, 2, 4, 32, 2),
}
EVERY = (10, 100)
# Steps per timed run, a capture every how many, the first captured: on a GPU steps 5, 15, 25 and 35.
RUNS = {"cuda": (40, 10, 5), "cpu": (12, 10, 5), "smoke": (5, 2, 1)}
FUNCTIONS_PER_LAYER = 3  # before_attention, after_attention, mlp_residual: each reads the switch twice


def build(shape, device):
    hidden, intermediate, layers, heads, seq, batch = shape
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = coat.convert(LlamaForCausalLM(config))
    optimizer = coat.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (batch, seq), device=device)
    return model, optimizer, tokens


def training_step(model, optimizer, tokens, device):
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def switch_seconds() -> float:
    """Seconds per read of the switch outside a capture: the forward's and the backward's, averaged."""
    ctx = type("Ctx", (), {"report_site": None})()
    reads = 200_000
    forward = min(timeit.repeat(_capture.forward_site, number=reads, repeat=5)) / reads
    backward = min(timeit.repeat(lambda: _capture.backward_site(ctx), number=reads, repeat=5)) / reads
    return (forward + backward) / 2


def host_thread_ms(step, repeat: int, after=lambda: None) -> float:
    """Median CPU time of the host thread over step(), each call enqueued behind a GPU sleep longer than its
    host time, so that it never waits for the GPU (a wait that spins would count); after() runs untimed once the
    GPU is done."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    after()
    sleep_cycles = _sleep_cycles(2e3 * (time.perf_counter() - start) + 5.0)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        start = time.thread_time()
        step()
        times.append((time.thread_time() - start) * 1e3)
        torch.cuda.synchronize()
        after()
    return statistics.median(times)


def cost_apart(plain_step, capture, read, repeat: int) -> dict:
    """What a capture adds to a step on a GPU, its two parts measured apart, with less noise than whole runs give:
    "GPU ms added", a captured step's GPU time less a plain one's, each enqueued behind a GPU sleep so that the
    host never holds the GPU back (_common.time_cuda_gpu_ms); "host ms added", a captured step's host CPU time
    less a plain one's (host_thread_ms), plus reading the capture's results; "host ms", a plain step's. Where a
    plain step's host time plus what a capture adds stays below the step's time, the host keeps ahead of the GPU
    through a capture, which then costs the step its GPU time alone."""
    read_ms = []

    def timed_read():
        start = time.thread_time()
        read()
        read_ms.append((time.thread_time() - start) * 1e3)

    plain_host = host_thread_ms(plain_step, repeat)
    captured_host = host_thread_ms(capture, repeat, timed_read)
    gpu_added = time_cuda_gpu_ms(capture, 1, repeat) - time_cuda_gpu_ms(plain_step, 1, repeat)
    return {"GPU ms added": gpu_added, "host ms added": captured_host - plain_host + statistics.median(read_ms),
            "host ms": plain_host}


def _function_label(key: tuple) -> str:
    """cProfile's (file, line, function) as a short label: built-ins by name, files relative to here."""
    file, line, function = key
    if file == "~":
        return function
    path = os.path.relpath(file) if file.startswith(os.getcwd()) else os.path.basename(file)
    return f"{path}:{line} {function}"


def host_profile(plain_step, captured_step, steps: int, device: str, top: int = 30) -> None:
    """Prints the functions whose host time per step (cProfile's own time, profiler overhead included) grows
    most from a plain step to a captured one, and each step's total. On a GPU each profiled step is enqueued
    behind a sleep kernel longer than the step's host time, so a function that waits for the GPU shows the
    wait: the capture's end waits once, for its copy to the host (Event.synchronize)."""
    def per_step(step) -> dict:
        profile = cProfile.Profile()
        for _ in range(steps):
            if device == "cuda":
                torch.cuda.synchronize()
                start = timeit.default_timer()
                step()
                torch.cuda.synchronize()
                torch.cuda._sleep(_sleep_cycles(3e3 * (timeit.default_timer() - start) + 5.0))
            profile.enable()
            step()
            profile.disable()
        stats = pstats.Stats(profile).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, callers)
        return {key: (calls / steps, own * 1e3 / steps) for key, (_, calls, own, _, _) in stats.items()}

    plain, captured = per_step(plain_step), per_step(captured_step)
    rows = []
    for key in captured.keys() | plain.keys():
        plain_calls, plain_ms = plain.get(key, (0.0, 0.0))
        calls, ms = captured.get(key, (0.0, 0.0))
        rows.append({"function": _function_label(key)[-90:], "calls off": plain_calls, "calls capture": calls,
                     "own ms off": plain_ms, "own ms capture": ms, "added ms": ms - plain_ms})
    rows.sort(key=lambda row: -row["added ms"])
    print(f"\nhost time per step under cProfile, {steps} steps each: plain {sum(r['own ms off'] for r in rows):.2f} ms, "
          f"captured {sum(r['own ms capture'] for r in rows):.2f} ms; the {top} functions that add the most:")
    print_table(rows[:top], list(rows[0]))


def main():
    p = parser(__doc__)
    p.set_defaults(warmup=1, repeat=8)  # whole runs (RUNS), per kind of run
    p.add_argument("--smoke", action="store_true", help="a small model on the CPU, one short run each")
    p.add_argument("--batch", type=int, help="sequences per step (default: the model's, 4 on a GPU)")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="also profile the host time of STEPS plain and captured steps (cProfile) and print where they differ")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and coat.built_with_cuda() and not args.smoke else "cpu"
    shape = MODELS["smoke" if args.smoke else device]
    if args.batch is not None:
        if args.batch < 1:
            p.error(f"--batch must be a positive number of sequences, got {args.batch}")
        shape = (*shape[:-1], args.batch)
    steps, every, first = RUNS["smoke" if args.smoke else device]
    captured = range(first, steps - 1, every)  # each has a next step, after which "after the next step" reads it
    if args.smoke:
        args.warmup, args.repeat = 1, 1
    model, optimizer, tokens = build(shape, device)
    samplings = {"64": 64, "all": None}
    reports = {rows: coat.report.QuantizationReport(model, optimizer, sample_rows=value) for rows, value in samplings.items()}

    def plain_step():
        training_step(model, optimizer, tokens, device)

    def captured_step(report, read_at_once: bool):
        with report.capture():
            training_step(model, optimizer, tokens, device)
        if read_at_once:
            report.stats()

    def read_after_step(report):
        plain_step()
        report.stats()

    def run(capture=None, after_capture=plain_step):
        return [capture if capture and i in captured else after_capture if capture and i - 1 in captured
                else plain_step for i in range(steps)]

    captured_runs = {  # (read, rows measured) -> the run's steps
        ("at once", "64"): run(lambda: captured_step(reports["64"], True)),
        ("at once", "all"): run(lambda: captured_step(reports["all"], True)),
        ("after the next step", "64"): run(lambda: captured_step(reports["64"], False),
                                           lambda: read_after_step(reports["64"])),
    }
    runs = {"off": run(), **captured_runs}
    for _ in range(args.warmup):
        for steps_of_run in runs.values():
            loop_ms(steps_of_run, device)
    times = {kind: [] for kind in runs}
    kinds = list(runs)
    for repeat in range(args.repeat):
        # Alternated, so that a machine whose speed drifts slows all alike, and in an order rotated every round, so
        # that what one kind of run leaves behind (a GPU hotter after measuring every row) lands on each kind alike.
        for kind in kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]:
            times[kind].append(loop_ms(runs[kind], device))
    totals = {kind: statistics.median(sum(run_ms) for run_ms in kind_times) for kind, kind_times in times.items()}
    step_medians = {kind: [statistics.median(run_ms[i] for run_ms in kind_times) for i in range(steps)]
                    for kind, kind_times in times.items()}
    off_ms = totals["off"] / steps
    layers = shape[2]
    switch_ms = switch_seconds() * 1e3 * 2 * FUNCTIONS_PER_LAYER * layers
    hidden, intermediate, _, heads, seq, batch = shape
    rows = []
    for (read, sampled) in captured_runs:
        cost_ms = (totals[(read, sampled)] - totals["off"]) / len(captured)
        rows.append({"hidden": hidden, "layers": layers, "batch x seq": f"{batch}x{seq}", "rows measured": sampled,
                     "read": read, "off ms": off_ms, "capture ms": off_ms + cost_ms,
                     "capture / off": 1 + cost_ms / off_ms, **{f"every {n}": cost_ms / (n * off_ms) for n in EVERY},
                     "switch us": switch_ms * 1e3, "switch / off": switch_ms / off_ms,
                     "tensors": len(reports[sampled].rows())})
    if device == "cuda":
        apart = cost_apart(plain_step, lambda: captured_step(reports["64"], False), reports["64"].stats, args.repeat)
        for row in rows:
            if row["rows measured"] == "64":
                row.update(apart)
                row["GPU-bound capture / off"] = 1 + apart["GPU ms added"] / off_ms
    print_table(rows, list(dict.fromkeys(key for row in rows for key in row)))
    for row, kind in zip(rows, captured_runs):
        row.update({"run ms": totals[kind], "off run ms": totals["off"],
                    "runs ms": [sum(run_ms) for run_ms in times[kind]],
                    "off runs ms": [sum(run_ms) for run_ms in times["off"]],
                    "step medians ms": step_medians[kind], "off step medians ms": step_medians["off"]})
    default, every_row, in_loop = rows
    summary = {"smoke": args.smoke, "device": device, "steps_per_run": steps, "captured_steps": list(captured),
               "runs": args.repeat, "capture_over_off": default["capture / off"],
               "capture_over_off_every_row": every_row["capture / off"],
               "capture_over_off_in_loop": in_loop["capture / off"], "target_capture_over_off": 1.05,
               **{f"overhead_every_{n}": default[f"every {n}"] for n in EVERY},
               **{f"overhead_every_{n}_in_loop": in_loop[f"every {n}"] for n in EVERY}, "switch_over_off": default["switch / off"]}
    if "GPU-bound capture / off" in default:
        summary.update({"capture_gpu_ms_added": default["GPU ms added"], "capture_host_ms_added": default["host ms added"],
                        "plain_step_host_ms": default["host ms"],
                        "capture_over_off_gpu_bound": default["GPU-bound capture / off"],
                        "host_keeps_ahead": default["host ms"] + default["host ms added"] < off_ms})
    name = "report-smoke" if args.smoke else "report" if args.batch is None else f"report-batch{args.batch}"
    path = write_results(args.results_dir, name, rows, summary)
    print(f"wrote {path}")
    if args.host_profile:
        host_profile(plain_step, lambda: captured_step(reports["64"], True), args.host_profile, device)


if __name__ == "__main__":
    main()
