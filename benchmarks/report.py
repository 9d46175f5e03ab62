"""What coat.report costs a training step of a converted Llama (forward and backward under bf16 autocast,
float32 master weights, coat.optim.AdamW step), timed in one process on the same batch:

    report off      the step with a QuantizationReport built but no capture in progress
    capture on      the same step inside ``with report.capture():``, every quantized tensor and both moments
                    of every parameter measured, one device-to-host copy at the end, and the report read at
                    once (report.stats(), which waits for that copy): with the default 64 evenly spaced rows
                    of each matrix (sample_rows=64; amax over the whole tensor), and with every row
                    (sample_rows=None)
    in a loop       LOOP steps back to back as a training loop runs them, with no wait between: all plain, or
                    the first captured (64 rows) and its report read after the second step is enqueued, as
                    examples/train_llama.py reads it; what the capture adds to the loop is its cost per
                    captured step, the GPU kept busy through the capture's end

All are medians of runs alternated. Target: a captured step at most 5% slower than a plain one. "capture / off" is the
captured step's time over the plain one's (in a loop: (loop with a capture - plain loop) / plain step + 1);
"every N" is the overhead of capturing every N-th step, (capture - off) / (N * off). Outside a capture each
coat autograd Function reads one module global (coat.nn._capture.active) in forward and in backward: "switch"
times that read and multiplies it by the reads per step, the whole cost of the report when off, as a share
of the step.

    python benchmarks/report.py            (a CUDA GPU if there is one, else the CPU, train_llama.py's tiny model)
    python benchmarks/report.py --batch 16 (more tokens per step: at batch 4 the plain step's host time is about
                                            its GPU time on an H200, so whatever a capture adds on the host adds
                                            to the step; at 16 the GPU's work hides it, as in a GPU-bound run)
    python benchmarks/report.py --smoke    (a smaller model on the CPU, one run each: checks that the script runs)
    python benchmarks/report.py --host-profile 10
                                           (also: where a captured step spends host time that a plain one does not,
                                            from cProfile over 10 steps of each, enqueued while a GPU sleep keeps
                                            the GPU busy, so that only a real synchronization waits for it)
"""
import cProfile
import os
import pstats
import statistics
import timeit

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import coat
from coat.nn import _capture

from _common import _sleep_cycles, parser, print_table, time_ms, write_results

# (hidden, intermediate, layers, heads, seq, batch)
MODELS = {
    "cuda": (2048, 5504, 4, 16, 2048, 4),  # the 1b preset's layers, four of them
    "cpu": (128, 384, 4, 4, 128, 16),  # examples/train_llama.py's tiny preset
    "smoke": (64, 176, 2, 4, 32, 2),
}
EVERY = (10, 100)
LOOP = 5  # steps per timed loop
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
    p.add_argument("--smoke", action="store_true", help="a small model on the CPU, one run each")
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
    if args.smoke:
        args.warmup, args.repeat = 1, 1
    model, optimizer, tokens = build(shape, device)
    samplings = {"64": 64, "all": None}
    reports = {rows: coat.report.QuantizationReport(model, optimizer, sample_rows=value) for rows, value in samplings.items()}

    def captured_step(report):
        with report.capture():
            training_step(model, optimizer, tokens, device)
        report.stats()

    def plain_step():
        training_step(model, optimizer, tokens, device)

    def plain_loop():
        for _ in range(LOOP):
            plain_step()

    def loop_with_capture():
        report = reports["64"]
        with report.capture():
            training_step(model, optimizer, tokens, device)
        for step in range(1, LOOP):
            plain_step()
            if step == 1:
                report.stats()

    steps = {"off": plain_step, **{rows: (lambda r=report: captured_step(r)) for rows, report in reports.items()},
             "loop off": plain_loop, "loop capture": loop_with_capture}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    # Alternated, so that a machine whose speed drifts (other processes, clocks) slows all alike.
    times = {name: [] for name in steps}
    for _ in range(args.repeat):
        for name, step in steps.items():
            times[name].append(time_ms(step, 0, 1, device))
    off_ms = statistics.median(times["off"])
    layers = shape[2]
    switch_ms = switch_seconds() * 1e3 * 2 * FUNCTIONS_PER_LAYER * layers
    hidden, intermediate, _, heads, seq, batch = shape
    rows = []
    for name, report in reports.items():
        on_ms = statistics.median(times[name])
        rows.append({"hidden": hidden, "layers": layers, "batch x seq": f"{batch}x{seq}", "rows measured": name,
                     "read": "at once", "off ms": off_ms, "capture ms": on_ms, "capture / off": on_ms / off_ms,
                     **{f"every {n}": (on_ms - off_ms) / (n * off_ms) for n in EVERY},
                     "switch us": switch_ms * 1e3, "switch / off": switch_ms / off_ms, "tensors": len(report.rows())})
    loop_off_ms, loop_capture_ms = statistics.median(times["loop off"]), statistics.median(times["loop capture"])
    loop_step_ms = loop_off_ms / LOOP
    loop_on_ms = loop_step_ms + loop_capture_ms - loop_off_ms
    rows.append({**rows[0], "read": "after the next step", "off ms": loop_step_ms, "capture ms": loop_on_ms,
                 "capture / off": loop_on_ms / loop_step_ms,
                 **{f"every {n}": (loop_on_ms - loop_step_ms) / (n * loop_step_ms) for n in EVERY},
                 "switch / off": switch_ms / loop_step_ms})
    print_table(rows, list(rows[0]))
    for row, (off, on) in zip(rows, (("off", "64"), ("off", "all"), ("loop off", "loop capture"))):
        row["off runs ms"], row["capture runs ms"] = times[off], times[on]
    default, in_loop = rows[0], rows[2]
    summary = {"smoke": args.smoke, "device": device, "capture_over_off": default["capture / off"],
               "capture_over_off_every_row": rows[1]["capture / off"],
               "capture_over_off_in_loop": in_loop["capture / off"], "loop_steps": LOOP,
               "target_capture_over_off": 1.05,
               **{f"overhead_every_{n}": default[f"every {n}"] for n in EVERY},
               **{f"overhead_every_{n}_in_loop": in_loop[f"every {n}"] for n in EVERY}, "switch_over_off": default["switch / off"]}
    name = "report-smoke" if args.smoke else "report" if args.batch is None else f"report-batch{args.batch}"
    path = write_results(args.results_dir, name, rows, summary)
    print(f"wrote {path}")
    if args.host_profile:
        host_profile(plain_step, steps["64"], args.host_profile, device)


if __name__ == "__main__":
    main()
