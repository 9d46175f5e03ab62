"""Fine-tune a small Qwen2.5-VL to answer questions about pictures, in BF16 or, with --coat, in FP8 with coat.

A vision-language SFT run of the kind users have: a transformers Qwen2_5_VLForConditionalGeneration (vision
encoder, patch merger, language model) built from a config and randomly initialised, float32 master weights, bf16
autocast, AdamW with warm-up and cosine decay, gradient clipping, the loss on the answers only. --coat changes two
lines of it:

    coat.convert(model)                       # the language model's decoder layers in FP8
    optimizer = coat.optim.AdamW(...)         # FP8 moments with dynamic range expansion

--vision-linears converts the vision encoder's and the merger's linear layers too (coat.convert(model,
vision_linears=True)), as for training the whole model; --bf16-weights and --fp8-grads e5m2 are train_llama.py's.
coat.convert keeps the vision attention off cuDNN's SDPA kernel, whose backward made NaN here on an H100
(coat.nn.attention), and attends within the batch's equal-sized pictures in one call; the BF16 run does the same
(coat.nn.vision.convert_vision_attention), so that only the precision differs.

The data (shapes_vqa.py) are pictures the script draws itself, coloured shapes on a dark background, each with a
question whose answer needs the picture: "what colour is the circle?" red, "which shape is blue?" triangle, "where
is the square?" top left, "how many shapes are there?" three. Tokens are bytes, plus the image and end tokens. The
training stream and the held-out set are drawn from --seed. Every --eval-every steps the held-out loss (the answer
tokens') and the answer accuracy are measured: the share of held-out questions whose answer model.generate(),
greedy, from the picture and the question, gives exactly (its bytes, then the end token). The first lines give the
accuracy of the best answers to the question alone (its most frequent answer in the training stream): what a model
that does not look at the picture reaches at most.

As in train_llama.py, a progress bar shows the loss and tokens/s (the language model's tokens: image placeholders,
question and answer); every --log-every steps a row goes to OUT/NAME.csv (with answer_accuracy, and
answer_accuracy_colour, _shape, _position and _count, where evaluated, and _position_row and _position_column: the
position answers' row and column scored apart); OUT/NAME.json holds the summary (with the
final accuracy per kind of question); OUT/NAME.png plots loss and accuracy, overall and per kind of question, of this
run and of every --compare CSV.

    python examples/train_vlm.py                                     # tiny preset, BF16, a few minutes on a CPU
    python examples/train_vlm.py --coat --compare runs/tiny-vlm-bf16.csv
    python examples/train_vlm.py --coat --vision-linears --compare runs/tiny-vlm-bf16.csv
    python examples/train_vlm.py --preset gpu [--coat]               # 36M parameters, 3000 steps, one GPU

The compute dtype is train_llama.py's choice (--compute-dtype): bf16 autocast, except float32 on a CPU without
native bf16.
"""
from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass

import torch

import coat
from coat.nn.vision import convert_vision_attention
from shapes_vqa import END, IMAGE, KINDS, PAD, POSITION_AXES, VIDEO, VISION_END, VISION_START, VOCAB_SIZE, \
    ShapesVQA, accuracy_by_kind, decode_answer, score, text_only_accuracy
from training_common import (
    NonFiniteStep,
    TrainingLog,
    add_coat_arguments,
    add_device_arguments,
    add_find_nonfinite_argument,
    add_run_arguments,
    autocast_for,
    build_optimizer,
    check_device_arguments,
    choose_compute_dtype,
    choose_sdpa_backends,
    convert_gradient_format,
    cosine_schedule,
    held_out_loss,
    locate_nonfinite,
    parameter_count,
    print_comparison,
    resolve,
    training_step,
    try_plot,
)


@dataclass(frozen=True)
class VLMPreset:
    # the language model
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    # the vision encoder (its output merged 2 x 2 into the language model's width)
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    # the pictures: image x image pixels in patch x patch squares, 1 to max_objects shapes
    image: int
    patch: int
    max_objects: int
    # the language model's rotary base. mrope_section gives the picture's width the lowest 3/8 of the frequencies:
    # one column turns them by at most rope_theta ** (-5 / 8) radians, 0.0032 at 1e4, 0.056 at 100
    rope_theta: float
    # the run
    batch: int
    steps: int
    lr: float
    warmup: int
    held_out: int  # held-out samples


def shape_count(max_objects: int) -> str:
    return "one shape" if max_objects == 1 else f"1 to {max_objects} shapes"


PRESETS = {
    # 48 x 48 pictures of one shape (with up to three, a model this small stays within 8 points of the question
    # alone's accuracy over 400 to 1,000 steps), 36 patches, 9 image tokens: a cell of the 3 x 3 grid per token
    "tiny": VLMPreset(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, vision_hidden=64,
                      vision_intermediate=128, vision_layers=2, vision_heads=2, image=48, patch=8, max_objects=1,
                      rope_theta=1e4, batch=32, steps=400, lr=2e-3, warmup=40, held_out=256),
    # 112 x 112 pictures in Qwen2.5-VL's 14 x 14 patches, 64 patches, 16 image tokens; up to six shapes. At lr 1e-3
    # two of four 3,000-step H100 runs (BF16 and coat alike) diverged to NaN by step 380. Rotary base 100, not 1e4:
    # at 1e4 a picture's four columns span 0.013 radians of M-RoPE's width frequencies, and whether "where is the
    # X?" was learnt by step 3,000 forked from run to run, BF16's too (benchmarks/NOTES.md); the sequences are
    # under 100 tokens, which base 100's slowest frequency (0.012 radians a token) tells apart.
    "gpu": VLMPreset(hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, vision_hidden=384,
                     vision_intermediate=1024, vision_layers=4, vision_heads=6, image=112, patch=14, max_objects=6,
                     rope_theta=100.0, batch=64, steps=3000, lr=5e-4, warmup=200, held_out=1024),
}
PRESET_HELP = "model size, pictures and run length: " + "; ".join(
    f"{name}: language model hidden {p.hidden} x {p.layers} layers, vision encoder {p.vision_hidden} x "
    f"{p.vision_layers}, {p.image} x {p.image} pictures of {shape_count(p.max_objects)}, batch {p.batch}, "
    f"{p.steps} steps" for name, p in PRESETS.items())


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help=PRESET_HELP)
    add_coat_arguments(parser, auto_saved_format=False)
    parser.add_argument("--vision-linears", action="store_true",
                        help="with --coat: the vision encoder's and the patch merger's linear layers in FP8 too "
                             "(coat.convert(vision_linears=True)); without it they train as in the BF16 run")
    add_run_arguments(parser)
    add_find_nonfinite_argument(parser)
    parser.add_argument("--held-out", type=int, help="held-out samples, each evaluation's loss and accuracy")
    parser.add_argument("--rope-theta", type=float,
                        help="the language model's rotary base (the preset's: tiny 1e4, gpu 100; the gpu preset's "
                             "runs before 2026-12-07 21:30 UTC took 1e4)")
    add_device_arguments(parser)
    args = parser.parse_args()
    if args.vision_linears and not args.coat:
        raise SystemExit("--vision-linears is an option of coat.convert: add --coat")
    args = resolve(args, PRESETS, model_name=f"{args.preset}-vlm")
    if args.held_out is None:
        args.held_out = PRESETS[args.preset].held_out
    if args.held_out < 1:
        raise SystemExit(f"--held-out must be at least 1, got {args.held_out}")
    if args.rope_theta is None:
        args.rope_theta = PRESETS[args.preset].rope_theta
    if args.rope_theta <= 1:
        raise SystemExit(f"--rope-theta is a rotary base, more than 1, got {args.rope_theta}")
    check_device_arguments(args)
    return args


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary frequencies (head_dim / 2) between the temporal, height and width
    positions, in its proportions (16, 24, 24 of 64)."""
    half = head_dim // 2
    spatial = 3 * half // 8
    return [half - 2 * spatial, spatial, spatial]


def build_model(args: argparse.Namespace, device: torch.device):
    """A float32 Qwen2.5-VL of the preset's sizes over the byte vocabulary, initialised from --seed alone (a BF16
    and a coat run start from the same weights)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    preset = PRESETS[args.preset]
    head_dim = preset.hidden // preset.heads
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
                num_hidden_layers=preset.layers, num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
                max_position_embeddings=1024, bos_token_id=None, eos_token_id=END, pad_token_id=PAD,
                rope_parameters=dict(rope_type="default", rope_theta=args.rope_theta,
                                     mrope_section=mrope_section(head_dim)))
    # One attention window covering the whole picture: Qwen2.5-VL's windows (112 pixels) are for large images.
    vision = dict(depth=preset.vision_layers, hidden_size=preset.vision_hidden,
                  intermediate_size=preset.vision_intermediate, num_heads=preset.vision_heads,
                  out_hidden_size=preset.hidden, patch_size=preset.patch, window_size=preset.image,
                  fullatt_block_indexes=[preset.vision_layers - 1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                              tie_word_embeddings=False, attn_implementation=args.attention)
    torch.manual_seed(args.seed)
    with torch.device(device):
        return Qwen2_5_VLForConditionalGeneration(config)


class TrainingStream(torch.utils.data.Dataset):
    """Training batch ``step`` of ``data``, drawn, rendered and tokenised on the CPU."""

    def __init__(self, data: ShapesVQA, batch: int, steps: int):
        self.data, self.batch, self.steps = data, batch, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict:
        return self.data.batch(self.data.samples(step, self.batch), "cpu")


def training_batches(data: ShapesVQA, batch: int, steps: int, device: torch.device):
    """The batches of steps 0 to ``steps`` - 1 in order, on ``device``. Two worker processes draw, render and
    tokenise them on the CPU ahead of the steps that take them, so the training process spends no time between steps
    on the data (rendering a batch of the gpu preset takes about 0.1 s of a core). On a GPU they arrive in pinned
    memory, so their copies to the device do not hold the training process up."""
    loader = torch.utils.data.DataLoader(TrainingStream(data, batch, steps), batch_size=None, num_workers=2,
                                         pin_memory=device.type == "cuda")
    for inputs in loader:
        yield {name: value.to(device, non_blocking=True) for name, value in inputs.items()}


@torch.no_grad()
def answers(model, data: ShapesVQA, prompts: list[dict], autocast) -> list[str | None]:
    """The answers model.generate() gives, greedy, to the held-out prompts (batches of ShapesVQA.prompts); None
    where it gives no end token."""
    model.eval()
    generated = []
    for inputs in prompts:
        with autocast():
            tokens = model.generate(**inputs, max_new_tokens=data.longest_answer() + 1, do_sample=False,
                                    pad_token_id=PAD, eos_token_id=END)
        generated += [decode_answer(row) for row in tokens[:, inputs["input_ids"].shape[1]:].tolist()]
    model.train()
    return generated


def accuracy(data: ShapesVQA, generated: list[str | None]) -> dict[str, float]:
    right = collections.Counter()
    for sample, answer in zip(data.held_out, generated, strict=True):
        right.update(score(sample, answer))
    return accuracy_by_kind(data.held_out, right)


def main() -> None:
    args = parse_arguments()
    device = torch.device(args.device)
    compute_dtype, bf16_time_ratio, compute_note = choose_compute_dtype(args, device)
    preset = PRESETS[args.preset]
    choose_sdpa_backends(args.sdpa_backends, device)
    model = build_model(args, device)
    if args.bf16_weights:
        model.to(torch.bfloat16)  # no float32 master copy: coat.optim.AdamW updates the bf16 weights themselves
    if args.coat:
        coat.convert(model, vision_linears=args.vision_linears, saved_format=args.saved_format,
                     fast_accum=args.fast_accum, group_size=args.group_size, fused_loss=not args.unfused_loss,
                     gradient_format=convert_gradient_format(args), skip_modules=args.bf16_modules)
    else:  # the vision attention as coat.convert runs it, so that only the precision differs
        convert_vision_attention(model)
    optimizer = build_optimizer(args, model)
    scheduler = cosine_schedule(optimizer, args.warmup, args.steps)

    data = ShapesVQA(args.seed, preset.image, preset.patch, preset.max_objects, args.held_out)
    chunks = [data.held_out[start:start + args.batch] for start in range(0, args.held_out, args.batch)]
    validation = [data.batch(chunk, device) for chunk in chunks]
    prompts = [data.prompts(chunk, device) for chunk in chunks]
    # What the question alone gives, from the training samples (up to the first 10,000: enough for each question's
    # most frequent answer).
    seen = [s for step in range(min(args.steps, -(-10_000 // args.batch))) for s in data.samples(step, args.batch)]
    blind = text_only_accuracy(seen, data.held_out)
    tokens_per_sample = sum(int((batch["input_ids"] != PAD).sum()) for batch in validation) / args.held_out
    vision = sum(p.numel() for p in model.model.visual.parameters())
    bf16 = compute_dtype == torch.bfloat16
    print(f"{args.name}: {parameter_count(model) / 1e6:.1f}M parameters ({vision / 1e6:.1f}M of them the vision "
          f"encoder's), {'coat FP8' if args.coat else 'baseline'}"
          f"{' with FP8 vision linears' if args.vision_linears else ''} with "
          f"{'bf16 autocast' if bf16 else 'float32 compute'}, {args.steps} steps of {args.batch} samples on {device}: "
          f"{preset.image} x {preset.image} pictures of {shape_count(preset.max_objects)}, {data.image_tokens} image "
          f"tokens and {tokens_per_sample:.1f} tokens in all a sample")
    print(f"{args.name}: the question alone answers {blind['all']:.1%} of the {args.held_out} held-out questions "
          "(its most frequent answer in the training stream): " + ", ".join(
              f"{kind} {value:.1%}" for kind, value in blind.items() if kind != "all"))
    if compute_note:
        print(f"{args.name}: {compute_note} (a bf16 matrix product took {bf16_time_ratio:.0f}x as long as a "
              "float32 one); --compute-dtype bfloat16 runs bf16 autocast anyway")

    autocast = autocast_for(device, compute_dtype)
    setup = {"coat": args.coat, "vision_linears": args.vision_linears, "bf16_weights": args.bf16_weights,
             "param_rounding": args.param_rounding, "fp8_grads": args.fp8_grads, "saved_format": args.saved_format,
             "group_size": args.group_size, "fast_accum": args.fast_accum,
             "gradient_format": args.gradient_format if args.coat else None, "torch_adamw": args.torch_adamw,
             "bf16_modules": args.bf16_modules,
             "fused_loss": args.coat and not args.unfused_loss,
             "compute_dtype": str(compute_dtype).removeprefix("torch."), "compute_note": compute_note,
             "bf16_matmul_time_ratio": bf16_time_ratio, "preset": args.preset, "seed": args.seed, "lr": args.lr,
             "rope_theta": args.rope_theta,
             "warmup": args.warmup, "sdpa_backends": args.sdpa_backends,
             "vision_attention_without_cudnn": True, "parameters": parameter_count(model),
             "vision_parameters": vision, "batch": args.batch, "held_out": args.held_out,
             "text_only_accuracy": blind}
    log = TrainingLog(args, first_step=0, tokens_per_step=round(args.batch * tokens_per_sample), device=device,
                      setup=setup, accuracy_kinds=(*KINDS, *POSITION_AXES))
    last_accuracy = {}

    def evaluate() -> tuple[float, dict[str, float]]:
        last_accuracy.clear()
        last_accuracy.update(accuracy(data, answers(model, data, prompts, autocast)))
        return held_out_loss(model, validation, device, autocast).item(), dict(last_accuracy)

    interval_loss = torch.zeros((), device=device)
    model.train()
    for step, batch in enumerate(training_batches(data, args.batch, args.steps, device)):
        done = step + 1
        try:
            interval_loss += training_step(model, optimizer, scheduler, batch, args.clip, autocast, args.find_nonfinite)
        except NonFiniteStep as failure:
            log.stop_nonfinite(done, failure, locate_nonfinite(model, batch, autocast))
        log.step_done()
        if done % args.log_every == 0 or done == args.steps:
            intervals = done % args.log_every or args.log_every
            train_loss = interval_loss.item() / intervals  # .item() waits for the device: the timing is true
            interval_loss.zero_()
            evaluating = done % args.eval_every == 0 or done == args.steps
            log.record(done, train_loss, scheduler.get_last_lr()[0], evaluate if evaluating else None)

    summary = log.finish({"answer_accuracy_by_kind": last_accuracy})
    print(f"{args.name}: held-out loss {summary['final_val_loss']:.4f}, answer accuracy "
          f"{summary['final_answer_accuracy']:.1%} (" + ", ".join(
              f"{kind} {value:.1%}" for kind, value in last_accuracy.items() if kind != "all")
          + f"; the question alone: {blind['all']:.1%}), training loss (last 10%) "
          f"{summary['final_train_loss_last_10pct']:.4f}, {summary['median_tokens_per_s']:,.0f} tokens/s"
          + (f", peak memory {summary['peak_memory_gib']:.2f} GiB" if summary["peak_memory_gib"] else ""))
    print(f"log: {log.csv_path}, summary: {log.summary_path}")
    compared = [path for path in args.compare if path != log.csv_path]
    print_comparison(compared, log.csv_path)
    try_plot(compared + [log.csv_path], log.csv_path[: -len(".csv")] + ".png")


if __name__ == "__main__":
    main()
