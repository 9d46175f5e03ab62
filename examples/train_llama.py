"""Pretrain a HuggingFace Llama on real text, in BF16 or, with --coat, in FP8 with coat.

The script is the kind users already have: a transformers LlamaForCausalLM built from a config (or loaded
from a local directory with --model; --family qwen3 or phi3 builds the same sizes as Qwen3 or Phi-3), float32 master weights, bf16 autocast, AdamW with warm-up and cosine
decay, gradient clipping. --coat changes two lines of it:

    coat.convert(model)                       # decoder layers compute and save activations in FP8
    optimizer = coat.optim.AdamW(...)         # FP8 moments with dynamic range expansion

and --bf16-weights (no float32 master copy, stochastic rounding) and --fp8-grads e5m2 (gradients kept in FP8)
take the model state from 10.1 bytes per parameter to 6.1 and 5.1.

The text is the Python standard library's sources, as bytes (see training_common.py). A progress bar shows
the loss and tokens/s; every --log-every steps a row goes to OUT/NAME.csv; at the end OUT/NAME.json holds
the summary, and OUT/NAME.png plots the loss of this run and of every --compare CSV.

With --coat --report-every N, every N-th step is captured by coat.report: a line names the tensor with the
largest quantization error, OUT/NAME-report.csv gets a row per (step, layer, tensor), and at the end
OUT/NAME-report.png draws the last captured step's relative errors, layers x tensors. --saved-format auto
converts with FP4-kept activations and captures the first two steps: after each, a layer whose kept inputs
measured outside coat.report's bound goes one format wider, FP4 to FP6 to E4M3
(QuantizationReport.choose_saved_formats); the others keep theirs.

    python examples/train_llama.py                                   # tiny preset, BF16, a few minutes on a CPU
    python examples/train_llama.py --coat --compare runs/tiny-bf16.csv
    python examples/train_llama.py --coat --report-every 50          # + quantization report
    python examples/train_llama.py --coat --saved-format auto        # 4, 6 or 8 bits per layer, as the report allows
    python examples/train_llama.py --preset 100m [--coat]            # ~100M parameters, 2000 steps, one GPU
    python examples/train_llama.py --family phi3 --coat              # the preset as Phi-3 (or qwen3) instead

Outside coat's FP8 layers a run computes in bf16 under autocast, except on a CPU without native bf16 (a bf16
matrix product measured more than 3 times as slow as a float32 one, e.g. AVX2-only x86): there torch
emulates bf16 several times slower than float32, so both runs compute in float32 instead, and say so in
their output, summary and plot. --compute-dtype bfloat16 or float32 chooses for itself.

--uniform-fp4 (with --coat --saved-format fp4) also keeps attention's saved activations in FP4
(coat.nn.saved_in_fp4): the uniform-4-bit arm of AGoQ's ablation, for comparison only.
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
from tqdm import tqdm

import coat
from training_common import (
    NonFiniteStep,
    TrainingLog,
    add_device_arguments,
    add_find_nonfinite_argument,
    add_training_arguments,
    autocast_for,
    build_model,
    build_optimizer,
    check_device_arguments,
    choose_compute_dtype,
    choose_sdpa_backends,
    convert_gradient_format,
    cosine_schedule,
    expert_token_shares,
    held_out_loss,
    load_text,
    locate_nonfinite,
    parameter_count,
    print_comparison,
    resolve,
    training_step,
    try_plot,
)

# --saved-format auto: captured steps that decide the formats; a layer moves at most FP4 -> FP6 -> E4M3.
CHOOSING_STEPS = 2


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    add_device_arguments(parser)
    add_find_nonfinite_argument(parser)
    parser.add_argument("--report-every", type=int, metavar="N",
                        help="with --coat: capture every N-th step in a coat.report quantization report "
                             "(OUT/NAME-report.csv and .png); captured steps take longer")
    parser.add_argument("--uniform-fp4", action="store_true",
                        help="with --coat --saved-format fp4: keep attention's saved activations (and every other "
                             "16-bit one) in FP4 as well (coat.nn.saved_in_fp4): the uniform-4-bit ablation")
    args = resolve(parser.parse_args())
    if args.uniform_fp4 and (not args.coat or args.saved_format != "fp4"):
        raise SystemExit("--uniform-fp4 extends coat's FP4-kept activations to every saved activation: "
                         "add --coat --saved-format fp4")
    if args.report_every is not None and (not args.coat or args.report_every < 1):
        raise SystemExit("--report-every needs --coat (only coat's FP8 layers are reported on) and N >= 1, "
                         f"got N = {args.report_every}{'' if args.coat else ' without --coat'}")
    check_device_arguments(args)
    return args


def token_count(tokens: int) -> str:
    return f"{tokens / 1e6:.1f}M" if tokens >= 100_000 else f"{tokens:,}"


def main() -> None:
    args = parse_arguments()
    device = torch.device(args.device)
    compute_dtype, bf16_time_ratio, compute_note = choose_compute_dtype(args, device)
    choose_sdpa_backends(args.sdpa_backends, device)
    model, tokenizer = build_model(args, device)
    if args.bf16_weights:
        model.to(torch.bfloat16)  # no float32 master copy: coat.optim.AdamW updates the bf16 weights themselves
    if args.coat:
        coat.convert(model, saved_format="fp4" if args.saved_format == "auto" else args.saved_format,
                     fast_accum=args.fast_accum, group_size=args.group_size,
                     fused_loss=not args.unfused_loss, gradient_format=convert_gradient_format(args),
                     skip_modules=args.bf16_modules)
    optimizer = build_optimizer(args, model)
    scheduler = cosine_schedule(optimizer, args.warmup, args.steps)
    data = load_text(args, tokenizer)
    validation = data.validation_batches(args.eval_batches, args.batch)
    bf16 = compute_dtype == torch.bfloat16
    print(f"{args.name}: {parameter_count(model) / 1e6:.1f}M parameters, "
          f"{'coat FP8' if args.coat else 'baseline'} with {'bf16 autocast' if bf16 else 'float32 compute'}, "
          f"{args.steps} steps of {args.batch} x {args.seq} tokens on {device}: "
          f"{token_count(args.steps * args.batch * args.seq)} tokens trained, drawn from "
          f"{token_count(data.train.numel())} tokens of training text")
    if compute_note:
        print(f"{args.name}: {compute_note} (a bf16 matrix product took {bf16_time_ratio:.0f}x as long as a "
              "float32 one); --compute-dtype bfloat16 runs bf16 autocast anyway")

    autocast = autocast_for(device, compute_dtype)
    setup = {"coat": args.coat, "bf16_weights": args.bf16_weights, "param_rounding": args.param_rounding,
             "fp8_grads": args.fp8_grads, "saved_format": args.saved_format, "group_size": args.group_size,
             "fast_accum": args.fast_accum, "gradient_format": args.gradient_format if args.coat else None,
             "torch_adamw": args.torch_adamw, "bf16_modules": args.bf16_modules,
             "uniform_fp4": args.uniform_fp4, "sdpa_backends": args.sdpa_backends,
             "lr": args.lr, "warmup": args.warmup,
             "compute_dtype": str(compute_dtype).removeprefix("torch."), "compute_note": compute_note,
             "bf16_matmul_time_ratio": bf16_time_ratio, "preset": None if args.model else args.preset,
             "family": args.family, "fused_loss": args.coat and not args.unfused_loss,
             "parameters": parameter_count(model), "batch": args.batch, "seq": args.seq}
    log = TrainingLog(args, first_step=0, tokens_per_step=args.batch * args.seq, device=device, setup=setup)
    report = QuantizationLog(args, model, optimizer) if args.report_every else None
    # --saved-format auto: the first steps are captured to choose each layer's format, starting from FP4
    chooser = coat.report.QuantizationReport(model) if args.saved_format == "auto" else None
    saved_formats = None
    interval_loss = torch.zeros((), device=device)
    model.train()
    for step in range(args.steps):
        batch = data.train_batch(step, args.batch).to(device, non_blocking=True)
        done = step + 1
        capturing = report is not None and done % args.report_every == 0
        choosing = chooser is not None and step < CHOOSING_STEPS
        capture = report.capture(done) if capturing else chooser.capture(done) if choosing else contextlib.nullcontext()
        if capturing:
            report.log_pending()  # the last capture's rows, before this capture replaces them
        with capture, coat.nn.saved_in_fp4() if args.uniform_fp4 else contextlib.nullcontext():
            try:
                interval_loss += training_step(model, optimizer, scheduler, batch, args.clip, autocast,
                                               args.find_nonfinite)
            except NonFiniteStep as failure:
                log.stop_nonfinite(done, failure, locate_nonfinite(model, batch, autocast))
        if capturing:
            report.pending_step = done
        elif report is not None:
            report.log_pending()  # read once the next step is enqueued: the GPU has work while the host waits
        if choosing:
            saved_formats = {**(saved_formats or {}),
                             **(report.report if capturing else chooser).choose_saved_formats()}
            counts = ", ".join(f"{fmt.upper()} in {sum(chosen == fmt for chosen in saved_formats.values())}"
                               for fmt in ("fp4", "fp6", "e4m3"))
            tqdm.write(f"saved formats after step {done}'s report: {counts} of {len(saved_formats)} layers"
                       + "".join(f"; {layer} {fmt.upper()}" for layer, fmt in saved_formats.items() if fmt != "fp4"))
        log.step_done()
        if done % args.log_every == 0 or done == args.steps:
            intervals = done % args.log_every or args.log_every
            train_loss = interval_loss.item() / intervals  # .item() waits for the device: the timing is true
            interval_loss.zero_()
            evaluate = done % args.eval_every == 0 or done == args.steps
            log.record(done, train_loss, scheduler.get_last_lr()[0],
                       (lambda: held_out_loss(model, validation, device, autocast).item()) if evaluate else None)

    shares = expert_token_shares(model, validation, device, autocast)
    summary = log.finish({"expert_token_shares": shares, "saved_formats_chosen": saved_formats})
    print(f"{args.name}: held-out loss {summary['final_val_loss']:.4f}, training loss (last 10%) "
          f"{summary['final_train_loss_last_10pct']:.4f}, {summary['median_tokens_per_s']:,.0f} tokens/s"
          + (f", peak memory {summary['peak_memory_gib']:.2f} GiB" if summary["peak_memory_gib"] else ""))
    if shares is not None:
        print(f"{args.name}: held-out share of the routed tokens per expert, smallest-largest per MoE layer: "
              + ", ".join(f"{min(layer):.3f}-{max(layer):.3f}" for layer in shares))
    print(f"log: {log.csv_path}, summary: {log.summary_path}")
    with contextlib.suppress(ValueError):
        args.compare.remove(log.csv_path)
    print_comparison(args.compare, log.csv_path)
    try_plot(args.compare + [log.csv_path], log.csv_path[: -len(".csv")] + ".png")
    if report is not None:
        report.finish()


class QuantizationLog:
    """coat.report for the training loop: captures the steps it is given, prints the worst tensors of each,
    appends its rows to OUT/NAME-report.csv and draws the last one at the end."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.report = coat.report.QuantizationReport(model, optimizer)
        self.capture = self.report.capture
        self.csv_path = os.path.join(args.out, f"{args.name}-report.csv")
        self.captured = False
        self.pending_step: int | None = None  # captured, not logged yet
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.csv_path)  # a new run, like the training log

    def log_pending(self) -> None:
        """Logs the captured step not logged yet, if any: its rows are waited for here, not at its end."""
        if self.pending_step is None:
            return
        step, self.pending_step = self.pending_step, None
        self.captured = True
        self.report.to_csv(self.csv_path)
        parts = []
        for metric in ("rel_error", "flushed"):
            layer, tensor, value = self.report.worst(metric)
            parts.append(f"max {metric} {value:.3g} ({layer}/{tensor})")
        layer, tensor, nonfinite = self.report.worst("nonfinite")
        parts.append(f"NaN/Inf: {nonfinite:.3g} of {layer}/{tensor}" if nonfinite else "no NaN/Inf")
        tqdm.write(f"quantization report, step {step}: " + ", ".join(parts))

    def finish(self) -> None:
        self.log_pending()
        if not self.captured:
            print("no step was captured for the quantization report: --report-every is larger than --steps")
            return
        png_path = self.csv_path[: -len(".csv")] + ".png"
        try:
            self.report.heatmap(png_path, metric="rel_error")
        except ImportError:
            print(f"matplotlib is not installed, so no heat map was drawn; the report is in {self.csv_path}")
            return
        print(f"quantization report: {self.csv_path}, heat map: {png_path}")


if __name__ == "__main__":
    main()
