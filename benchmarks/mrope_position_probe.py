"""Can a Qwen2.5-VL language model read where a token sits in a picture from M-RoPE alone, in BF16 and with coat's
FP8 layers? A CPU experiment behind the VLM example's "where is the X?" gap (benchmarks/NOTES.md).

Each sample is <vision_start>, a 4 x 4 grid of tokens with Qwen2.5-VL's image positions (temporal 1, height 1 +
row, width 1 + column, as ``get_rope_index`` gives a picture's tokens), then a question token, ROW or COLUMN, and
the answer: the row or column of the one grid cell that holds the MARK token (the other cells hold 15 filler
tokens in a random order). Nothing but M-RoPE tells the cells apart, so the row is read from the height section
of the rotary frequencies and the column from the width section, which Qwen2.5-VL's contiguous ``mrope_section``
gives the lowest frequencies: at this head size and theta one column turns a width frequency by at most 0.0032
radians, one row a height frequency by up to 0.1. ``--swap-axes`` puts the row in the width stream and the column
in the height stream, to tell the frequencies from the two axes' roles. ``--content-noise S`` multiplies each
element of each grid cell's input embedding by 1 + S * N(0, 1), drawn per sample: content that varies from picture
to picture as a vision tower's features do, so that FP8's rounding errors differ from sample to sample instead of
repeating with the grid's 17 fixed embeddings, 16 fillers and the mark. The default, 0, adds none.

The model: the language model of a Qwen2.5-VL built from a config (hidden 128, two layers, head size 64, theta 1e4,
``mrope_section`` 8, 12, 12: the example's gpu preset's rotary layout), trained from scratch with torch's AdamW,
bf16 autocast, gradient clipping at 1.0; ``--coat`` converts it with ``coat.convert`` (its decoder layers in FP8,
``--gradient-format`` their output gradients'). The loss is the cross-entropy of the answer token, computed here
the same way for both. Every 100 steps it prints and logs the held-out accuracy of the row and of the column
questions (1,024 samples; chance is 25%); the JSON has the log (its rows), the options (its summary), the
versions and the command.

    python benchmarks/mrope_position_probe.py --out runs/probe-bf16.json
    python benchmarks/mrope_position_probe.py --coat --out runs/probe-coat.json
    python benchmarks/mrope_position_probe.py --plot runs/probe.png runs/probe-*.json   # both accuracies per run
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch
import transformers

import coat

SIDE = 4  # cells per side of the grid
HIDDEN = 128
CELLS = SIDE * SIDE
# Token ids: 0..15 fillers, then the special tokens, then the answers 0..3; the vocabulary rounded up to 8.
VISION_START, ROW_QUESTION, COLUMN_QUESTION, MARK = CELLS, CELLS + 1, CELLS + 2, CELLS + 3
FIRST_ANSWER = CELLS + 4
VOCAB = (FIRST_ANSWER + SIDE + 7) // 8 * 8


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", metavar="PNG", help="draw the logs given as arguments instead of training")
    parser.add_argument("logs", nargs="*", help="with --plot: the JSON logs to draw")
    parser.add_argument("--coat", action="store_true", help="coat.convert the model (its decoder layers in FP8)")
    parser.add_argument("--gradient-format", default="e5m2", choices=["e5m2", "e4m3", "none"],
                        help="with --coat: the FP8 format of the layers' output gradients, or none (unquantized)")
    parser.add_argument("--swap-axes", action="store_true",
                        help="the row in the width stream and the column in the height stream")
    parser.add_argument("--content-noise", type=float, default=0.0, metavar="S",
                        help="multiply the grid cells' input embeddings by 1 + S * N(0, 1) per element and sample")
    parser.add_argument("--rope-theta", type=float, default=1e4,
                        help="the rotary base; one column turns a width frequency by at most theta ** (-40 / 64) "
                             "radians (0.0032 at 1e4, 0.056 at 100)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and training stream")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3, help="after 100 warm-up steps, constant")
    parser.add_argument("--out", help="the JSON log")
    args = parser.parse_args(argv)
    if args.rope_theta <= 1:
        parser.error(f"--rope-theta is a rotary base, more than 1, got {args.rope_theta}")
    if args.content_noise < 0:
        parser.error(f"--content-noise is a standard deviation, at least 0, got {args.content_noise}")
    if (args.plot is None) != (args.out is not None) or (args.plot is None and args.logs):
        parser.error("give --out to train, or --plot PNG with the JSON logs to draw")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                pad_token_id=None,
                rope_parameters=dict(rope_type="default", rope_theta=args.rope_theta, mrope_section=[8, 12, 12]))
    # A vision tower the probe never calls (no pictures): the class needs one.
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=128, patch_size=14)
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
        vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    if args.coat:
        coat.convert(model, gradient_format=None if args.gradient_format == "none" else args.gradient_format)
    return model


def positions(swap_axes: bool) -> torch.Tensor:
    """[3, 1 + CELLS + 2] M-RoPE positions of <vision_start>, the grid (cell i at row i // SIDE, column i % SIDE)
    and the question and answer tokens after it."""
    cell = torch.arange(CELLS)
    row, column = cell // SIDE, cell % SIDE
    height, width = (column, row) if swap_axes else (row, column)
    grid = 1 + torch.stack([torch.zeros(CELLS, dtype=torch.long), height, width])
    after = torch.arange(1 + SIDE, 1 + SIDE + 2).expand(3, -1)
    return torch.cat([torch.zeros(3, 1, dtype=torch.long), grid, after], 1)


def samples(generator: torch.Generator, size: int, content_noise: float = 0.0):
    """(token ids [size, 1 + CELLS + 2] ending in the answer, question kind (0 row, 1 column), answer index, the
    [size, CELLS, HIDDEN] factors of the grid cells' embeddings or None without content noise)."""
    fillers = torch.stack([torch.randperm(CELLS, generator=generator) for _ in range(size)])
    cell = torch.randint(0, CELLS, (size,), generator=generator)
    kind = torch.randint(0, 2, (size,), generator=generator)
    fillers[torch.arange(size), cell] = MARK
    answer = torch.where(kind == 0, cell // SIDE, cell % SIDE)
    question = torch.where(kind == 0, ROW_QUESTION, COLUMN_QUESTION)
    start = torch.full((size, 1), VISION_START)
    ids = torch.cat([start, fillers, question[:, None], (FIRST_ANSWER + answer)[:, None]], 1)
    # Drawn after the tokens, and only with noise: the runs without it see the streams they saw before the option.
    factors = 1 + content_noise * torch.randn(size, CELLS, HIDDEN, generator=generator) if content_noise else None
    return ids, kind, answer, factors


def answer_loss(model, ids: torch.Tensor, position_ids: torch.Tensor, factors: torch.Tensor | None = None):
    """(cross-entropy of the answer token, the logits of the SIDE answers) from the tokens before it; factors: the
    grid cells' embeddings are multiplied by them."""
    position_ids = position_ids[:, None, :-1].expand(-1, ids.shape[0], -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if factors is None:
            inputs = dict(input_ids=ids[:, :-1])
        else:
            embeds = model.get_input_embeddings()(ids[:, :-1])
            cells = embeds[:, 1:1 + CELLS] * factors
            inputs = dict(inputs_embeds=torch.cat([embeds[:, :1], cells, embeds[:, 1 + CELLS:]], 1))
        logits = model(**inputs, position_ids=position_ids).logits[:, -1].float()
    return torch.nn.functional.cross_entropy(logits, ids[:, -1]), logits[:, FIRST_ANSWER:FIRST_ANSWER + SIDE]


def plot(logs: list[str], png: str) -> None:
    """The row and the column accuracy over the steps, a panel each, BF16 runs in black and coat's in orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for path in logs:
        with open(path) as f:
            run = json.load(f)
        options = run["summary"]
        label = "coat" if options["coat"] else "BF16"
        if options["coat"] and options["gradient_format"] != "e5m2":
            label += f", output gradients {options['gradient_format']}"
        label += ", axes swapped" * options["swap_axes"] + f", seed {options['seed']}"
        if options.get("content_noise"):  # logs from before the option have none
            label += f", content noise {options['content_noise']:g}"
        colour = "tab:orange" if options["coat"] else "black"
        style = "--" if options["coat"] and options["gradient_format"] != "e5m2" else "-"
        steps = [entry["step"] for entry in run["rows"]]
        for ax, key in zip(axes, ("row_accuracy", "column_accuracy")):
            ax.plot(steps, [100 * entry[key] for entry in run["rows"]], style, color=colour, alpha=0.8, label=label)
    for ax, title in zip(axes, ("row questions", "column questions")):
        ax.set(title=title, xlabel="step", ylabel="held-out accuracy (%)")
        ax.axhline(100 / SIDE, color="grey", lw=0.8)
    axes[1].legend(fontsize=7)
    figure.suptitle("benchmarks/mrope_position_probe.py: a grid cell's row (M-RoPE's height stream) and column (its "
                    "width stream; the two swapped where the legend says)", fontsize=9)
    figure.tight_layout()
    figure.savefig(png, dpi=120)
    print(f"plot: {png}")


def main(argv=None) -> dict | None:
    args = parse_arguments(argv)
    if args.plot:
        plot(args.logs, args.plot)
        return None
    if args.gradient_format != "e5m2" and not args.coat:
        raise SystemExit("--gradient-format is an option of coat.convert: add --coat")
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    position_ids = positions(args.swap_axes)
    held_ids, held_kind, held_answer, held_factors = samples(torch.Generator().manual_seed(10_000 + args.seed), 1024,
                                                             args.content_noise)
    stream = torch.Generator().manual_seed(args.seed)
    name = "coat" if args.coat else "bf16"
    log, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, _, _, factors = samples(stream, args.batch, args.content_noise)
        loss, _ = answer_loss(model, ids, position_ids, factors)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        if step % 100 == 0 or step == args.steps:
            with torch.no_grad():
                held_loss, logits = answer_loss(model, held_ids, position_ids, held_factors)
            right = logits.argmax(-1) == held_answer
            row, column = (right[held_kind == kind].float().mean().item() for kind in (0, 1))
            log.append(dict(step=step, train_loss=loss.item(), held_out_loss=held_loss.item(), row_accuracy=row,
                            column_accuracy=column))
            print(f"{name} seed {args.seed} step {step}: loss {loss.item():.3f}, held-out {held_loss.item():.3f}, "
                  f"row {row:.1%}, column {column:.1%} ({time.perf_counter() - start:.0f} s)", flush=True)
    # The results files' layout (benchmarks/results_pages.py reads every one): the options as the summary, an
    # evaluation a row.
    result = dict(summary=vars(args), rows=log, device=platform.processor() or platform.machine(),
                  torch=torch.__version__, transformers=transformers.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join(["benchmarks/mrope_position_probe.py", *(sys.argv[1:] if argv is None else argv)]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
