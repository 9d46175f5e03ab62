"""What examples/train_llama.py and examples/train_fsdp2.py share: model presets, the text data, the learning
rate schedule, the CSV log with its progress bar, and the loss plot.

The text is the Python standard library's own sources (``coat.data.stdlib_tokens``), about 30 MB that ship
with every Python, read as bytes: a 256-token vocabulary that needs no tokenizer download. A model loaded
from a local path brings its own tokenizer when the directory has one.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from coat.data import stdlib_tokens
from coat.ops import GROUP_SIZES


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    steps: int
    lr: float
    warmup: int


# Byte vocabulary (256); head size 64 except in the CPU-sized "tiny".
PRESETS = {
    "tiny": Preset(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=4, seq=128, batch=16, steps=300, lr=3e-3, warmup=30),
    "100m": Preset(hidden=768, intermediate=2048, layers=14, heads=12, kv_heads=12, seq=1024, batch=16, steps=2000, lr=1e-3, warmup=200),
    "1b": Preset(hidden=2048, intermediate=5504, layers=18, heads=32, kv_heads=32, seq=2048, batch=8, steps=5000, lr=4e-4, warmup=500),
}
PRESET_HELP = "model size and run length: " + "; ".join(
    f"{name}: hidden {p.hidden}, {p.layers} layers, seq {p.seq}, batch {p.batch}, {p.steps} steps"
    for name, p in PRESETS.items()
)


@dataclass(frozen=True)
class Family:
    """A transformers model family a preset is built in: its config and causal-LM classes (names in transformers)
    and what its config needs beyond the preset's sizes."""

    config: str
    model: str
    head_dim: bool = False  # the config takes head_dim (its default does not follow hidden / heads)
    no_special_tokens: bool = False  # its default token ids lie outside the 256-byte vocabulary
    query_scalar: bool = False  # Gemma's query_pre_attn_scalar (the attention's 1/sqrt scale) set to head_dim
    experts: str | None = None  # a mixture of experts: the config field of its expert count
    expert_width: str = "intermediate_size"  # the config field of an expert's intermediate size


# The families coat.convert supports that --family builds; one entry each (sizes come from the preset).
FAMILIES = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", head_dim=True, no_special_tokens=True),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", no_special_tokens=True),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", no_special_tokens=True),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=True, query_scalar=True),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=True, no_special_tokens=True,
                        experts="num_experts", expert_width="moe_intermediate_size"),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", no_special_tokens=True, experts="num_local_experts"),
}
# The mixtures of experts: every MLP is EXPERTS experts of a quarter of the preset's intermediate width, TOP_K a
# token (half the dense MLP's compute), with the router's load-balancing loss (Switch Transformer's coefficient).
EXPERTS, TOP_K, EXPERT_WIDTH_DIVISOR, ROUTER_AUX_LOSS_COEF = 8, 2, 4, 0.01


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both text training scripts take; None means "the preset's value"."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help=PRESET_HELP)
    parser.add_argument("--family", choices=list(FAMILIES), default="llama",
                        help="the transformers model family the preset is built in (the same hidden size, layers "
                             "and heads), or that --model holds")
    parser.add_argument("--model", metavar="PATH", help="a local transformers directory of --family to train from "
                        "(its config and weights; its tokenizer if it has one, else bytes) instead of a preset model")
    add_coat_arguments(parser)
    add_run_arguments(parser)
    parser.add_argument("--seq", type=int, help="tokens per sequence")
    parser.add_argument("--eval-batches", type=int, default=8, help="batches of held-out text per validation")
    parser.add_argument("--data-bytes", type=int, help="read at most this many bytes of text (default: all)")


def add_coat_arguments(parser: argparse.ArgumentParser, auto_saved_format: bool = True) -> None:
    """--coat and the options of coat.convert and coat.optim.AdamW that the training examples take; --saved-format
    auto where the script chooses the formats from reports (``auto_saved_format``)."""
    parser.add_argument("--coat", action="store_true", help="train with coat.convert and coat.optim.AdamW (FP8)")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="with --coat: bfloat16 parameters and gradients, no float32 master copy (6.1 bytes "
                             "of model state per parameter instead of 10.1)")
    parser.add_argument("--param-rounding", choices=["stochastic", "nearest"], default="stochastic",
                        help="how --bf16-weights rounds each update (stochastic keeps updates below half an ulp)")
    parser.add_argument("--fp8-grads", choices=["e5m2", "e4m3"],
                        help="with --coat: keep gradients in FP8 with a per-tensor scale after backward (1 byte)")
    parser.add_argument("--torch-adamw", action="store_true",
                        help="with --coat: torch.optim.AdamW (float32 moments) instead of coat.optim.AdamW, the "
                             "FP8 layers as they are: to tell how much of a difference from BF16 comes from the "
                             "FP8 optimizer states")
    parser.add_argument("--saved-format", choices=["e4m3", "fp6", "fp4", *(["auto"] if auto_saved_format else [])],
                        default="e4m3",
                        help="with --coat: how RMSNorm and SiLU*mul keep their inputs for backward (fp4: 4 bits "
                             "+ a float32 scale per 16, AGoQ's low-bit storage; fp6: 6 bits + a scale per 16; "
                             "coat.convert(saved_format=...)); auto (train_llama.py): 4, 6 or 8 bits per layer, "
                             "the narrowest whose error the first steps' reports find within coat.report's bound")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=16,
                        help="with --coat: elements per scale of the 1 x G groups that non-linear layers' "
                             "activations and FP4- and FP6-kept inputs are quantized in (coat.convert(group_size=...); "
                             "128 is AGoQ's block)")
    parser.add_argument("--fast-accum", action="store_true",
                        help="with --coat: the forward GEMMs accumulate in the tensor cores' fast FP8 accumulator, "
                             "as torchao's and TransformerEngine's do (coat.convert(fast_accum=True)); faster, "
                             "less precise")
    parser.add_argument("--gradient-format", choices=["e5m2", "e4m3", "none"], default="e5m2",
                        help="with --coat: the FP8 format output gradients take in the backward GEMMs, or none: "
                             "unquantized, the backward GEMMs in the compute dtype, as the COAT paper's appendix "
                             "G.5 trains (coat.convert(gradient_format=...)); slower backward")
    parser.add_argument("--bf16-modules", nargs="+", default=[], metavar="PATTERN",
                        help="with --coat: leave the modules these fnmatch patterns name as they are "
                             "(coat.convert(skip_modules=...)), e.g. model.layers.0 to keep the first decoder layer "
                             "in BF16; a decoder layer is kept whole")
    parser.add_argument("--unfused-loss", action="store_true",
                        help="with --coat: leave the LM head and loss to transformers (the full logits, then "
                             "cross_entropy) instead of coat's fused LM head + loss (coat.convert(fused_loss=False))")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The length, schedule, logging and output options of the training examples; None means "the preset's"."""
    parser.add_argument("--steps", type=int, help="optimizer steps")
    parser.add_argument("--batch", type=int, help="sequences per step (per process under torchrun)")
    parser.add_argument("--lr", type=float, help="peak learning rate (linear warm-up, cosine decay to 10%%)")
    parser.add_argument("--warmup", type=int, help="warm-up steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: off)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    parser.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa",
                        help="attention kernel; eager gives bit-reproducible runs on GPUs")
    parser.add_argument("--sdpa-backends", nargs="+", choices=list(SDPA_BACKENDS), metavar="NAME",
                        help="with --attention sdpa: the kernels torch's scaled_dot_product_attention may choose "
                             f"from ({', '.join(SDPA_BACKENDS)}; default: all that torch enables), e.g. to leave "
                             "out one whose backward makes non-finite gradients (see --find-nonfinite)")
    parser.add_argument("--log-every", type=int, default=10, help="steps per CSV row and progress-bar update")
    parser.add_argument("--eval-every", type=int, help="steps between validation losses (default: steps / 10)")
    parser.add_argument("--out", default="runs", help="directory for the CSV log, the summary JSON and the plot")
    parser.add_argument("--name", help="run name, the file names in --out (default: PRESET-bf16 or PRESET-coat)")
    parser.add_argument("--compare", nargs="*", default=[], metavar="CSV",
                        help="CSV logs of other runs: their last held-out losses are printed beside this run's, "
                             "with the difference, and drawn in the same plot")


def resolve(args: argparse.Namespace, presets: dict = PRESETS, model_name: str | None = None) -> argparse.Namespace:
    """Fills the options left at None from the preset (``presets[args.preset]``, the fields of the same names) and
    checks them; errors say which option to change. The default run name is MODEL-VARIANT, MODEL ``model_name``
    or, for the text scripts, the preset or --model directory and the family."""
    preset = presets[args.preset]
    filled = [field for field in ("steps", "batch", "seq", "lr", "warmup") if hasattr(args, field)]
    for field in filled:
        if getattr(args, field) is None:
            setattr(args, field, getattr(preset, field))
    if args.eval_every is None:
        args.eval_every = max(args.log_every, args.steps // 10 // args.log_every * args.log_every)
    if (args.bf16_weights or args.fp8_grads) and not args.coat:
        raise SystemExit("--bf16-weights and --fp8-grads are options of coat.optim.AdamW: add --coat")
    if args.torch_adamw and not args.coat:
        raise SystemExit("--torch-adamw replaces coat.optim.AdamW in a coat run: add --coat")
    if args.torch_adamw and (args.bf16_weights or args.fp8_grads):
        raise SystemExit("--bf16-weights and --fp8-grads are options of coat.optim.AdamW: drop --torch-adamw")
    if (args.saved_format != "e4m3" or args.fast_accum or args.group_size != 16 or args.unfused_loss
            or args.gradient_format != "e5m2" or args.bf16_modules) and not args.coat:
        raise SystemExit("--saved-format, --group-size, --fast-accum, --gradient-format, --bf16-modules and "
                         "--unfused-loss are options of coat.convert: add --coat")
    if args.name is None:
        if model_name is None:
            model_name = os.path.basename(os.path.normpath(args.model)) if args.model else args.preset
            model_name += "" if args.family == "llama" else f"-{args.family}"
        args.name = f"{model_name}-{variant_name(args)}"
    counts = [field for field in ("steps", "batch", "seq", "log_every", "eval_every", "eval_batches") if hasattr(args, field)]
    for field in counts:
        if getattr(args, field) < 1:
            raise SystemExit(f"--{field.replace('_', '-')} must be at least 1, got {getattr(args, field)}")
    if args.eval_every % args.log_every:
        raise SystemExit(f"--eval-every ({args.eval_every}) must be a multiple of --log-every ({args.log_every})")
    for path in args.compare:
        if not os.path.isfile(path):
            raise SystemExit(f"--compare: no CSV log at {path}; run that configuration first")
    return args


def convert_gradient_format(args: argparse.Namespace) -> str | None:
    """coat.convert's gradient_format of --gradient-format."""
    return None if args.gradient_format == "none" else args.gradient_format


def variant_name(args: argparse.Namespace) -> str:
    """bf16 or coat and the options that differ from the defaults: the part of a run's name after the model's."""
    variant = "coat" if args.coat else "bf16"
    if getattr(args, "vision_linears", False):
        variant += "-vision"
    if args.bf16_weights:
        variant += "-bf16w" + ("-nearest" if args.param_rounding == "nearest" else "")
    if args.fp8_grads:
        variant += f"-{args.fp8_grads}-grads"
    if args.torch_adamw:
        variant += "-torch-adamw"
    if args.saved_format != "e4m3":
        variant += f"-{args.saved_format}-saved"
    if args.group_size != 16:
        variant += f"-g{args.group_size}"
    if args.fast_accum:
        variant += "-fast-accum"
    if args.gradient_format != "e5m2":
        variant += f"-{args.gradient_format}-grad-output"
    for pattern in args.bf16_modules:  # model.layers.* -> -bf16-model-layers-all
        variant += "-bf16-" + re.sub(r"[^A-Za-z0-9]+", "-", pattern.replace("*", "all")).strip("-")
    if args.unfused_loss:
        variant += "-unfused-loss"
    if getattr(args, "uniform_fp4", False):
        variant += "-uniform"
    if getattr(args, "fp8_reduce_scatter", False):
        variant += "-fp8-reduce-scatter"
    if getattr(args, "fp8_all_gather", False):
        variant += "-fp8-all-gather"
    return variant


# ----------------------------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace, device: torch.device | str):
    """A float32 causal LM of --family (master weights; compute runs in bf16 under autocast or FSDP2's mixed
    precision) and the tokenizer that goes with it (None: bytes). The initialisation depends only on
    --seed, so a BF16 and a coat run start from the same weights."""
    import transformers
    from transformers import AutoTokenizer

    family = FAMILIES[args.family]
    config_class, model_class = getattr(transformers, family.config), getattr(transformers, family.model)
    torch.manual_seed(args.seed)
    if args.model:
        model = model_class.from_pretrained(args.model, dtype=torch.float32, attn_implementation=args.attention)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
        if tokenizer is None and model.config.vocab_size < 256:
            raise SystemExit(f"{args.model} has no tokenizer and a vocabulary of {model.config.vocab_size} < 256 "
                             "tokens, too small for byte tokens; add a tokenizer to the directory")
        return model.to(device), tokenizer
    preset = PRESETS[args.preset]
    extra = {}
    if family.head_dim:
        extra["head_dim"] = preset.hidden // preset.heads
    if family.query_scalar:
        extra["query_pre_attn_scalar"] = preset.hidden // preset.heads
    if family.no_special_tokens:  # byte tokens have no special ones
        extra.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    intermediate = {"intermediate_size": preset.intermediate}
    if family.experts:
        intermediate[family.expert_width] = preset.intermediate // EXPERT_WIDTH_DIVISOR
        extra.update({family.experts: EXPERTS}, num_experts_per_tok=TOP_K, output_router_logits=True,
                     router_aux_loss_coef=ROUTER_AUX_LOSS_COEF)
    config = config_class(
        vocab_size=256,
        hidden_size=preset.hidden,
        **intermediate,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=max(args.seq, 2048),
        tie_word_embeddings=False,
        attn_implementation=args.attention,
        **extra,
    )
    with torch.device(device):
        model = model_class(config)
    return model, None


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ data


class TextData:
    """The token stream cut in two, 98% to train on and the last 2% held out. Batch ``step`` of process
    ``rank`` is a pure function of (seed, step, rank): a resumed run sees the batches an uninterrupted one
    would, with no data-loader state to checkpoint."""

    def __init__(self, tokens: torch.Tensor, seq: int, seed: int):
        held_out = max(tokens.numel() // 50, 4 * (seq + 1))
        if tokens.numel() < held_out + 4 * (seq + 1):
            raise SystemExit(f"{tokens.numel()} tokens of text are too few for sequences of {seq}; lower --seq")
        self.train, self.validation = tokens[:-held_out], tokens[-held_out:]
        self.seq, self.seed = seq, seed
        self.offsets = torch.arange(seq + 1)

    def _windows(self, tokens: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, tokens.numel() - self.seq, (count, 1), generator=generator)
        return tokens[starts + self.offsets][:, : self.seq]

    def _generator(self, stream: int, rank: int) -> torch.Generator:
        return torch.Generator().manual_seed(((self.seed * 65_537 + rank) * 1_000_000_007 + stream) % 2**63)

    def train_batch(self, step: int, batch: int, rank: int = 0) -> torch.Tensor:
        return self._windows(self.train, batch, self._generator(step, rank))

    def validation_batches(self, count: int, batch: int, rank: int = 0) -> list[torch.Tensor]:
        generator = self._generator(-1, rank)
        return [self._windows(self.validation, batch, generator) for _ in range(count)]


def load_text(args: argparse.Namespace, tokenizer) -> TextData:
    tokens = stdlib_tokens(args.data_bytes)
    if tokenizer is not None:
        text = bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
        tokens = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return TextData(tokens, args.seq, args.seed)


# ------------------------------------------------------------------------------------- device, compute dtype


COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# bf16 / float32 time of one matrix product, on one thread, above which a CPU counts as emulating bf16. On a
# Sapphire Rapids core, oneDNN limited by ONEDNN_MAX_CPU_ISA: AMX 0.2, AVX512-BF16 1.5-2, AVX512 5.7, AVX2 50-80.
NATIVE_BF16_MAX_TIME_RATIO = 3.0




def add_find_nonfinite_argument(parser: argparse.ArgumentParser) -> None:
    """--find-nonfinite, of the single-process examples."""
    parser.add_argument("--find-nonfinite", action="store_true",
                        help="check every step's loss and gradient norm (a wait for the device each step) and at the "
                             "first that is not finite, before its optimizer step, replay the step to name the module "
                             "and autograd function that made it, then stop")


# torch.backends.cuda's switch of each kernel of scaled_dot_product_attention
SDPA_BACKENDS = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "cudnn": "enable_cudnn_sdp",
                 "math": "enable_math_sdp"}
CPU_SDPA_BACKENDS = ("flash", "math")


def choose_sdpa_backends(names: list[str] | None, device: torch.device) -> None:
    """Lets scaled_dot_product_attention choose only among ``names`` (of SDPA_BACKENDS) for the rest of the process;
    None leaves torch's choice."""
    if names is None:
        return
    if device.type == "cpu" and not set(names) & set(CPU_SDPA_BACKENDS):
        raise SystemExit(f"--sdpa-backends {' '.join(names)}: on a CPU, scaled_dot_product_attention has only the "
                         f"{' and '.join(CPU_SDPA_BACKENDS)} kernels; name one of them")
    for name, switch in SDPA_BACKENDS.items():
        getattr(torch.backends.cuda, switch)(name in names)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compute-dtype", choices=["auto", *COMPUTE_DTYPES], default="auto",
                        help="what the model computes in outside coat's FP8 layers: bfloat16 (float32 master weights, "
                             "bf16 autocast) or float32 (no autocast); auto: bfloat16, except float32 on a CPU "
                             "without native bf16, where torch's bf16 is many times slower")


def check_device_arguments(args: argparse.Namespace) -> None:
    import coat

    if args.bf16_weights and args.compute_dtype == "float32":
        raise SystemExit("--bf16-weights keeps no float32 weights to compute in float32: "
                         "drop --compute-dtype float32 (bf16 weights compute in bf16)")
    if args.coat and torch.device(args.device).type == "cuda" and not coat.built_with_cuda():
        raise SystemExit("--coat on a GPU needs coat built with CUDA: pip install --no-build-isolation -e . "
                         "with nvcc on the PATH (coat.built_with_cuda() is False)")


def bf16_matmul_time_ratio(repeats: int = 3) -> float:
    """How many times as long a bf16 matrix product takes as a float32 one on this CPU: the fastest of
    ``repeats`` after a warm-up (oneDNN builds its kernel on the first call), timed in this thread's CPU time
    on one thread, so that other processes on a busy machine do not change the answer."""
    a, b = torch.randn(512, 256), torch.randn(256, 256)

    def fastest(x: torch.Tensor, y: torch.Tensor) -> float:
        x @ y
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            x @ y
            times.append(time.thread_time() - start)
        return max(min(times), 1e-9)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fastest(a.bfloat16(), b.bfloat16()) / fastest(a, b)
    finally:
        torch.set_num_threads(threads)


def choose_compute_dtype(args: argparse.Namespace, device: torch.device) -> tuple[torch.dtype, float | None, str | None]:
    """The dtype the run computes in outside coat's FP8 layers; the measured bf16_matmul_time_ratio where auto
    measured it (None elsewhere); and where auto chose float32, a note that says so and why (else None).
    bf16 on GPUs and with --bf16-weights (the weights are bf16)."""
    if args.compute_dtype != "auto":
        return COMPUTE_DTYPES[args.compute_dtype], None, None
    if device.type != "cpu" or args.bf16_weights:
        return torch.bfloat16, None, None
    ratio = bf16_matmul_time_ratio()
    if ratio <= NATIVE_BF16_MAX_TIME_RATIO:
        return torch.bfloat16, ratio, None
    what = "coat computes in float32 outside its FP8 layers" if args.coat else "baseline computes in float32"
    return torch.float32, ratio, f"{what} on this CPU: no native bf16"


def autocast_for(device: torch.device, compute_dtype: torch.dtype):
    """The context the forward passes run in: bf16 autocast, or for float32 nothing (the float32 master weights
    compute as they are)."""
    if compute_dtype == torch.bfloat16:
        return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


# ------------------------------------------------------------------------------------ optimizer, schedule


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms, biases); coat's FP8 one with --coat (unless
    --torch-adamw)."""
    import coat

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if args.coat and not args.torch_adamw:
        return coat.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), param_rounding=args.param_rounding,
                                fp8_grads=args.fp8_grads)
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused or None)


def cosine_schedule(optimizer: torch.optim.Optimizer, warmup: int, steps: int, floor: float = 0.1):
    """Linear warm-up to the peak rate, then a cosine decay to ``floor`` times it at the last step."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(steps - warmup, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ------------------------------------------------------------------------------------- step, validation


def model_inputs(batch: torch.Tensor | dict) -> dict:
    """The model's arguments for a batch: a token batch is its own labels; a dict holds the inputs and labels."""
    return batch if isinstance(batch, dict) else {"input_ids": batch, "labels": batch}


class NonFiniteStep(Exception):
    """A step whose loss or gradient norm is not finite, found before its optimizer step (--find-nonfinite)."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"loss {loss}, gradient norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm


def training_step(model, optimizer, scheduler, batch: torch.Tensor | dict, clip: float, autocast,
                  find_nonfinite: bool = False) -> torch.Tensor:
    """Forward of ``batch`` (model_inputs) under ``autocast()``, backward, gradient clipping (``clip`` > 0),
    optimizer and schedule step; returns the loss, still on the device (reading it would wait for the GPU). With
    ``find_nonfinite``, raises NonFiniteStep, with the gradients in place and the optimizer step not taken, where the
    loss or the gradient norm is not finite."""
    with autocast():
        loss = model(**model_inputs(batch)).loss
    loss.backward()
    # clipping at an infinite norm only measures it
    max_norm = clip if clip > 0 else math.inf if find_nonfinite else 0.0
    if max_norm > 0 and getattr(optimizer, "fp8_grads", None) is not None:
        norm = optimizer.clip_grad_norm_(max_norm)  # param.grad is None under fp8_grads: the optimizer holds them
    elif max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if find_nonfinite and not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
        raise NonFiniteStep(loss.item(), norm.item())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float()


def _floating_tensors(value) -> list[torch.Tensor]:
    """The floating-point tensors in a module's inputs or outputs (tensors, tuples, lists, dicts, ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [tensor for item in items for tensor in _floating_tensors(item)]


def _all_finite(tensors: list[torch.Tensor | None]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def locate_nonfinite(model: torch.nn.Module, batch: torch.Tensor | dict, autocast) -> dict:
    """Replays a step that NonFiniteStep stopped (the same weights and batch) to name what made its first non-finite
    value. With hooks on every module: ``forward``, the first module whose output is not finite though its inputs
    are; else ``backward``, the first whose backward turns finite gradients of its output into non-finite ones of its
    input (the op is in that module, outside its submodules; a module given its input as a keyword argument is seen
    through its parent). Then under autograd's anomaly mode: ``anomaly``, its error naming the autograd function
    whose backward first returned NaN (it does not look for Inf), and ``created_at``, the innermost line outside
    torch of where the forward made that function. ``replay_loss``: the replay's loss; ``nonfinite_grads``, the
    parameters whose gradients are not finite (the first ten), and ``largest_grad``, the largest gradient magnitude
    and its parameter, and ``replay_grad_norm`` (of the gradients in ``.grad``: not the FP8 ones of fp8_grads)."""
    events: list[tuple[str, str, str]] = []

    def forward_hook(name):
        def hook(module, args, kwargs, output):
            if not events and _all_finite(_floating_tensors((args, kwargs))) and not _all_finite(
                    _floating_tensors(output)):
                events.append(("forward", name, type(module).__name__))
        return hook

    def backward_hook(name):
        def hook(module, grad_input, grad_output):
            if not events and _all_finite(list(grad_output)) and not _all_finite(list(grad_input)):
                events.append(("backward", name, type(module).__name__))
        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(forward_hook(name or "model"), with_kwargs=True))
        handles.append(module.register_full_backward_hook(backward_hook(name or "model")))
    finding: dict = {"forward": None, "backward": None, "anomaly": None, "created_at": None}
    try:
        with warnings.catch_warnings():
            # modules whose backward the hooks cannot see whole (the embedding's inputs need no gradient, the whole
            # model returns a ModelOutput) say so; their submodules are seen
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            model.zero_grad(set_to_none=True)
            with autocast():
                loss = model(**model_inputs(batch)).loss
            loss.backward()
        finding["replay_loss"] = loss.item()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        finding["nonfinite_grads"] = [name for name, grad in grads.items() if not _all_finite([grad])][:10]
        largest = {name: grad.abs().max().nan_to_num(math.inf).item() for name, grad in grads.items()}
        if largest:
            name = max(largest, key=largest.get)
            finding["largest_grad"] = {"parameter": name, "abs": largest[name]}
            finding["replay_grad_norm"] = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads.values()])).item()
    finally:
        for handle in handles:
            handle.remove()
    for kind, name, module_type in events:
        finding[kind] = {"module": name, "type": module_type}
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly(check_nan=True):
        warnings.simplefilter("always")
        try:
            with autocast():
                loss = model(**model_inputs(batch)).loss
            loss.backward()
        except RuntimeError as error:
            finding["anomaly"] = str(error).splitlines()[0]
            traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
            frames = [line.strip() for line in (traces[-1].splitlines() if traces else []) if line.strip()]
            torch_files = f'File "{os.path.dirname(torch.__file__)}'
            finding["created_at"] = next((line for line in reversed(frames)
                                          if line.startswith("File ") and not line.startswith(torch_files)), None)
    model.zero_grad(set_to_none=True)
    return finding


def describe_nonfinite(finding: dict) -> str:
    """locate_nonfinite's finding in words."""
    parts = []
    for kind in ("forward", "backward"):
        if finding[kind]:
            made = "an output that is not finite from finite inputs" if kind == "forward" else \
                "non-finite gradients for its input from finite ones for its output"
            parts.append(f"the {kind} of {finding[kind]['module']} ({finding[kind]['type']}) made {made}, in an op "
                         "of its own (not of its submodules)")
    if finding["anomaly"]:
        parts.append(f"autograd's anomaly mode: {finding['anomaly']}"
                     + (f" (made at {finding['created_at']})" if finding["created_at"] else ""))
    if parts:
        return "; ".join(parts)
    largest = finding.get("largest_grad")
    if (math.isfinite(finding.get("replay_loss", math.nan)) and largest and not finding["nonfinite_grads"]
            and not math.isfinite(finding["replay_grad_norm"])):
        return (f"replayed, the loss and every gradient are finite, the largest {largest['abs']:.3g} (of "
                f"{largest['parameter']}), but the gradient norm is not: their squares overflow float32. Lower --lr")
    return (f"replayed, no module made a non-finite value (loss {finding.get('replay_loss')}): a kernel that is not "
            "deterministic, or one that reads memory it should not, made them in the step itself")


@torch.no_grad()
def held_out_loss(model, batches: list[torch.Tensor | dict], device: torch.device, autocast) -> torch.Tensor:
    """Mean loss over ``batches`` (model_inputs, on ``device``'s or the CPU) in eval mode, as a device tensor."""
    model.eval()
    total = torch.zeros((), device=device)
    for batch in batches:
        inputs = {name: value.to(device) for name, value in model_inputs(batch).items()}
        with autocast():
            total += model(**inputs).loss.float()
    model.train()
    return total / len(batches)


@torch.no_grad()
def expert_token_shares(model, batches: list[torch.Tensor], device: torch.device, autocast) -> list[list[float]] | None:
    """For a mixture of experts, the share of the routed choices each expert receives on ``batches``, per MoE layer
    ([layers][experts], each row summing to 1; None for a dense model): a router that collapses shows as one share
    near 1 and the rest near 0."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    if top_k is None:
        return None
    model.eval()
    counts = None
    for batch in batches:
        with autocast():
            router_logits = model(input_ids=batch.to(device), output_router_logits=True).router_logits
        chosen = [torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=logits.shape[-1])
                  for logits in router_logits]
        counts = chosen if counts is None else [a + b for a, b in zip(counts, chosen)]
    model.train()
    return [(layer / layer.sum()).tolist() for layer in counts]


# ----------------------------------------------------------------------------------------- logging, plot


CSV_COLUMNS = ["step", "tokens", "train_loss", "val_loss", "lr", "tokens_per_s", "elapsed_s", "peak_memory_gib"]
# Columns that a log has after CSV_COLUMNS when its script measures them (train_vlm.py), at each held-out loss: the
# answer accuracy, then that of each kind of question (accuracy_column).
ACCURACY = "answer_accuracy"


def accuracy_column(kind: str) -> str:
    return f"{ACCURACY}_{kind}"


def run_metadata() -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }


class TrainingLog:
    """The CSV log (one row every --log-every steps, appended to on resume), the progress bar with loss and
    tokens/s, and the summary JSON written at the end, or where the run stops early (a non-finite loss). Only rank 0
    writes. ``setup``: what every summary records of the run's model, options and data. With ``accuracy_kinds``
    (a sequence, possibly empty), the evaluations give answer accuracies too: over all questions, in the column
    ACCURACY and the summary's final_answer_accuracy, and for each of these kinds of question, in its
    accuracy_column (empty where an evaluation asked none of that kind)."""

    def __init__(self, args: argparse.Namespace, first_step: int, tokens_per_step: int, device: torch.device,
                 setup: dict, enabled: bool = True, accuracy_kinds: Sequence[str] | None = None):
        self.args, self.tokens_per_step, self.device, self.enabled = args, tokens_per_step, device, enabled
        self.setup = setup
        self.accuracy_kinds = accuracy_kinds
        self.columns = CSV_COLUMNS + ([] if accuracy_kinds is None else
                                      [ACCURACY, *(accuracy_column(kind) for kind in accuracy_kinds)])
        self.csv_path = os.path.join(args.out, f"{args.name}.csv")
        self.summary_path = os.path.join(args.out, f"{args.name}.json")
        self.rows: list[dict] = []
        self.elapsed_before = 0.0
        if enabled:
            os.makedirs(args.out, exist_ok=True)
            if first_step > 0 and os.path.exists(self.csv_path):
                self.rows = [row for row in read_log(self.csv_path) if row["step"] <= first_step]
                self.elapsed_before = self.rows[-1]["elapsed_s"] if self.rows else 0.0
            with open(self.csv_path, "w", newline="") as f:
                writer = csv.DictWriter(f, self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
        self.bar = tqdm(total=args.steps, initial=first_step, desc=args.name, unit="step", disable=not enabled,
                        dynamic_ncols=True)
        self.start = self.interval_start = time.perf_counter()
        self.interval_steps = 0

    def step_done(self) -> None:
        self.bar.update(1)
        self.interval_steps += 1

    def record(self, step: int, train_loss: float, lr: float, evaluate=None) -> None:
        """Row for ``step`` (the number of steps done); the caller has synchronised the device. ``evaluate()``,
        if given, returns the held-out loss (with ``accuracy_kinds``: the loss and the answer accuracies, a dict with
        "all" and the kinds asked); its time is left out of tokens/s."""
        now = time.perf_counter()
        tokens_per_s = self.interval_steps * self.tokens_per_step / max(now - self.interval_start, 1e-9)
        evaluated = evaluate() if evaluate is not None else None
        with_accuracy = self.accuracy_kinds is not None and evaluated is not None
        val_loss, accuracies = evaluated if with_accuracy else (evaluated, {})
        accuracy = accuracies.get("all")
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        row = {
            "step": step,
            "tokens": step * self.tokens_per_step,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "elapsed_s": self.elapsed_before + now - self.start,
            "peak_memory_gib": peak,
            **({ACCURACY: accuracy, **{accuracy_column(kind): accuracies.get(kind) for kind in self.accuracy_kinds}}
               if self.accuracy_kinds is not None else {}),
        }
        self.interval_start, self.interval_steps = time.perf_counter(), 0
        if self.enabled:
            self.rows.append(row)
            with open(self.csv_path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)
        if not math.isfinite(train_loss):  # every rank: the loss is the mean over them
            self.finish({"diverged_at_step": step})
            raise SystemExit(
                f"{self.args.name}: the training loss is {train_loss} over the steps up to {step}: the run diverged "
                "(a non-finite loss gives non-finite gradients, which the optimizer step puts into the weights), so it "
                "stops here; the CSV and summary keep what it did. Lower --lr or lengthen --warmup; keep --clip on; "
                "--find-nonfinite names the module and function that make the first non-finite value.")
        if not self.enabled:
            return
        postfix = {"loss": f"{train_loss:.4f}", "tok/s": f"{tokens_per_s:,.0f}"}
        if val_loss is not None:
            postfix["val"] = f"{val_loss:.4f}"
        if accuracy is not None:
            postfix["acc"] = f"{accuracy:.1%}"
        if peak is not None:
            postfix["mem"] = f"{peak:.1f}G"
        self.bar.set_postfix(postfix, refresh=False)

    def stop_nonfinite(self, step: int, failure: NonFiniteStep, finding: dict) -> None:
        """Ends a run at step ``step``, which NonFiniteStep stopped and locate_nonfinite replayed: the summary keeps
        both, under ``nonfinite``."""
        self.finish({"diverged_at_step": step,
                     "nonfinite": {"loss": failure.loss, "grad_norm": failure.grad_norm, **finding}})
        raise SystemExit(
            f"{self.args.name}: at step {step} the loss is {failure.loss} and the gradient norm {failure.grad_norm}; "
            f"{describe_nonfinite(finding)}. The step's optimizer step was not taken; the CSV and summary keep what "
            "the run did.")

    def finish(self, extra: dict | None = None) -> dict:
        """Writes and returns the summary: the setup and ``extra``, final losses, median tokens/s (the first
        interval, which holds the warm-up, left out), peak memory."""
        self.bar.close()
        if not self.enabled:
            return {}
        speeds = [row["tokens_per_s"] for row in self.rows[1:]] or [row["tokens_per_s"] for row in self.rows]
        validations = [row for row in self.rows if row["val_loss"] is not None]
        tail = [row["train_loss"] for row in self.rows[-max(len(self.rows) // 10, 1):]]
        peaks = [row["peak_memory_gib"] for row in self.rows if row["peak_memory_gib"] is not None]
        summary = {
            "name": self.args.name,
            **run_metadata(),
            **self.setup,
            **(extra or {}),
            "steps": self.rows[-1]["step"] if self.rows else 0,
            "final_val_loss": validations[-1]["val_loss"] if validations else None,
            **({"final_answer_accuracy": validations[-1][ACCURACY] if validations else None}
               if ACCURACY in self.columns else {}),
            "final_train_loss_last_10pct": sum(tail) / len(tail) if self.rows else None,
            "median_tokens_per_s": statistics.median(speeds) if speeds else None,
            "peak_memory_gib": max(peaks) if peaks else None,
            "csv": os.path.basename(self.csv_path),
        }
        with open(self.summary_path, "w") as f:
            json.dump(summary, f, indent=2)
        return summary


def read_log(path: str) -> list[dict]:
    def number(value: str):
        return None if value == "" else int(value) if value.lstrip("-").isdigit() else float(value)

    with open(path, newline="") as f:
        return [{key: number(value) for key, value in row.items()} for row in csv.DictReader(f)]


def final_held_out(csv_path: str, column: str = "val_loss") -> tuple[int, float] | None:
    """(step, value) of ``column`` in the last row of a CSV log that has one; None if no row has."""
    evaluated = [row for row in read_log(csv_path) if row.get(column) is not None]
    return (evaluated[-1]["step"], evaluated[-1][column]) if evaluated else None


def print_comparison(compared: list[str], csv_path: str) -> None:
    """For each --compare CSV log, both runs' last held-out losses and this run's difference from the other's;
    where both logs have answer accuracies, the same for those (the difference in points)."""
    name = os.path.splitext(os.path.basename(csv_path))[0]
    this, this_accuracy = final_held_out(csv_path), final_held_out(csv_path, ACCURACY)
    for path in compared:
        other_name = os.path.splitext(os.path.basename(path))[0]
        other = final_held_out(path)
        if this is None or other is None:
            print(f"held-out loss: no comparison of {name} with {other_name}: "
                  f"{name if this is None else other_name} has no held-out loss in its log")
            continue
        difference = this[1] - other[1]
        print(f"held-out loss: {name} {this[1]:.4f} (step {this[0]}), {other_name} {other[1]:.4f} (step {other[0]}): "
              f"{name} {difference:+.4f} ({difference / other[1]:+.2%})")
        other_accuracy = final_held_out(path, ACCURACY)
        if this_accuracy is not None and other_accuracy is not None:
            points = 100 * (this_accuracy[1] - other_accuracy[1])
            print(f"answer accuracy: {name} {this_accuracy[1]:.1%}, {other_name} {other_accuracy[1]:.1%}: "
                  f"{name} {points:+.1f} points")


def compute_note(csv_path: str) -> str | None:
    """What the run of this CSV log computed in, when its summary (NAME.json beside it) notes it: runs that
    chose float32 on a CPU without native bf16 do (train_llama.py's compute_note)."""
    try:
        with open(csv_path[: -len(".csv")] + ".json") as f:
            return json.load(f).get("compute_note")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def plot_runs(csv_paths: list[str], png_path: str) -> None:
    """Training loss (lines) and held-out loss (dots) against step for every run, over the whole run and over
    its second half, where runs that converge alike should lie on each other; where a log has answer accuracies,
    a third panel draws them, and a second row those of each kind of question it has columns for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {path: read_log(path) for path in csv_paths}
    with_accuracy = any(row.get(ACCURACY) is not None for rows in logs.values() for row in rows)
    kinds = list(dict.fromkeys(column.removeprefix(f"{ACCURACY}_") for rows in logs.values() for row in rows[:1]
                               for column in row if column.startswith(f"{ACCURACY}_")))
    width = max(2 + with_accuracy, len(kinds))
    figure, grid = plt.subplots(1 + bool(kinds), width, figsize=(6 * width - 6 + 5 * with_accuracy, 4.5 + 4 * bool(kinds)),
                                squeeze=False)
    axes, kind_axes = list(grid[0][:2 + with_accuracy]), list(grid[1][:len(kinds)]) if kinds else []
    for ax in [*grid[0][len(axes):], *(grid[1][len(kinds):] if kinds else [])]:
        ax.set_visible(False)
    for path, rows in logs.items():
        name = os.path.splitext(os.path.basename(path))[0]
        steps = [row["step"] for row in rows]
        validation = [(row["step"], row["val_loss"]) for row in rows if row["val_loss"] is not None]
        final = f", held-out {validation[-1][1]:.4f}" if validation else ""
        note = compute_note(path)
        for ax, start in ((axes[0], 0), (axes[1], steps[-1] // 2)):
            kept = [(s, row["train_loss"]) for s, row in zip(steps, rows) if s >= start]
            (line,) = ax.plot(*zip(*kept), linewidth=1.2, label=f"{name} (train{final})" + (f"\n{note}" if note else ""))
            points = [(s, v) for s, v in validation if s >= start]
            if points:
                ax.plot(*zip(*points), "o--", color=line.get_color(), markersize=4, linewidth=0.8)
        accuracy = [(row["step"], 100 * row[ACCURACY]) for row in rows if row.get(ACCURACY) is not None]
        if accuracy:
            axes[2].plot(*zip(*accuracy), "o-", color=line.get_color(), markersize=4, linewidth=1.2,
                         label=f"{name} ({accuracy[-1][1]:.1f}%)")
        for ax, kind in zip(kind_axes, kinds):
            points = [(row["step"], 100 * row[accuracy_column(kind)]) for row in rows
                      if row.get(accuracy_column(kind)) is not None]
            if points:
                ax.plot(*zip(*points), "o-", color=line.get_color(), markersize=3, linewidth=1.0,
                        label=f"{name} ({points[-1][1]:.1f}%)")
    axes[0].set_title("loss (lines: training, dots: held-out)")
    axes[1].set_title("second half")
    for ax in [*axes, *kind_axes]:
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats per token)" if ax is axes[0] else "")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if with_accuracy:
        axes[2].set_title("held-out answer accuracy")
        axes[2].set_ylabel("exact answers (%)")
        axes[2].legend(fontsize=8)
    for ax, kind in zip(kind_axes, kinds):
        ax.set_title(f"accuracy: {kind} questions")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=7)
    if kind_axes:
        kind_axes[0].set_ylabel("exact answers (%)")
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)
    plt.close(figure)


def try_plot(csv_paths: list[str], png_path: str) -> None:
    try:
        plot_runs(csv_paths, png_path)
    except ImportError:
        print(f"matplotlib is not installed, so no plot was drawn: pip install matplotlib, then rerun with "
              f"the same --out to redraw it from {', '.join(csv_paths)}")
        return
    print(f"plot: {png_path}")
