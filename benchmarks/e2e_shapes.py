"""Whole training steps of today's model shapes on one GPU, whose 128k-152k vocabularies make the logits and the
loss a large share of the memory (benchmarks/e2e.py trains a Llama-2 shape with a 32k vocabulary), and supervised
fine-tuning steps of vision-language models, an image in every sample. Random weights; transformers' classes
(LlamaForCausalLM, Qwen2ForCausalLM, ...) built from a config (benchmarks/_model_shapes.py), nothing downloaded:

    llama3.2-1b   hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, vocabulary 128256, tied
                  embeddings, rope theta 500000; batch 8 x sequence 2048
    llama3.1-8b   hidden 4096, 32 layers, 32 / 8 heads, intermediate 14336, vocabulary 128256, untied, rope theta
                  500000; batch 1 x 8192
    qwen2.5-7b    hidden 3584, 28 layers, 28 / 4 heads, intermediate 18944, vocabulary 152064, q/k/v bias,
                  untied, rope theta 1e6; batch 1 x 4096
    olmoe-1b-7b   OlmoeForCausalLM, 6.9B: hidden 2048, 16 layers, 16 heads, 64 experts of intermediate 1024, top 8,
                  vocabulary 50304; batch 1 x 4096
    qwen2-moe-a2.7b  Qwen2MoeForCausalLM, 14.3B: hidden 2048, 24 layers, 16 heads, 60 experts of intermediate 1408,
                  top 4, a shared expert of 5632, vocabulary 151936; batch 1 x 4096
    qwen2.5-vl-3b Qwen2_5_VLForConditionalGeneration, 3.75B, Qwen2.5-VL-3B-Instruct's configuration: a language
                  model of hidden 2048, 36 layers, 16 / 2 heads, intermediate 11008, vocabulary 151936, tied, rope
                  theta 1e6 in M-RoPE sections 16 / 24 / 24 (3.09B); a vision tower of 32 blocks, hidden 1280, 16
                  heads, SwiGLU intermediate 3420, attention within windows of 8 x 8 patches but in blocks 7, 15,
                  23 and 31, and a merger of each 2 x 2 patches into one token of the language model's width
                  (0.67B). Batch 1 x 4096: in each sample an 896 x 896-pixel image (64 x 64 patches of 14 x 14
                  pixels x 2 frames, 1,024 tokens after the merger), then 3,072 text tokens (the image's start and
                  end tokens among them); labels -100 at the image tokens, as an SFT collator sets them; random
                  pixel values; the model computes the three M-RoPE position streams (get_rope_index)
    qwen2.5-vl-7b Qwen2.5-VL-7B-Instruct's configuration, 8.29B: qwen2.5-7b's language model (7.62B, untied) with
                  M-RoPE, and the same vision tower, merging into width 3584; the same samples
    qwen3-vl-4b   Qwen3VLForConditionalGeneration, 4.44B, Qwen3-VL-4B-Instruct's configuration: a Qwen3 language
                  model of hidden 2560, 36 layers, 32 / 8 heads of 128, intermediate 9728, vocabulary 151936, tied,
                  interleaved M-RoPE sections 24 / 20 / 20; a vision tower of 24 blocks, hidden 1024, 16 heads,
                  non-gated tanh-GELU MLPs of 4096 (coat.nn.MLP under coat-vision), deepstack features from blocks
                  5, 11 and 17 (0.42B). Batch 1 x 4096: a 1,024 x 1,024-pixel image (64 x 64 patches of 16 x 16
                  pixels, 1,024 tokens after the merger), then 3,072 text tokens, as for qwen2.5-vl-3b

Variants (rows), each a whole training step: zero_grad, forward with labels (the loss over the batch's own
tokens), backward, optimizer step; float32 master weights under torch.autocast(bfloat16) unless said otherwise,
SDPA attention, no gradient checkpointing. "compiled" is one torch.compile of the whole model (not of each
decoder layer, as in benchmarks/e2e.py): the question is whether a compiled coat model is as fast as eager. (A
vision-language model compiles into several graphs: the M-RoPE positions and the vision tower's windows are
computed from host-side lists, where Dynamo breaks the graph.)

    bf16              torch.optim.AdamW(fused=True); transformers' loss (logits materialized, upcast to float32)
    liger             bf16 with Liger-Kernel's fused linear cross-entropy (apply_liger_kernel_to_llama / _qwen2
                      with fused_linear_cross_entropy=True on the model): the logits never materialized. Its other
                      kernels (RoPE, RMSNorm, SwiGLU) stay off: they patch transformers' modules for every model
                      of the process, the other rows' included. Skipped without a GPU or Liger-Kernel
                      (pip install --no-build-isolation -e ".[bench]"), and for the vision-language shapes
    coat              coat.convert (FP8 decoder layers, activations saved in FP8) with its fused LM head +
                      cross-entropy where coat.convert has the fused_loss option; coat.optim.AdamW (FP8 moments).
                      A vision-language model's vision side stays BF16, as coat.convert leaves it by default
    bf16-batched      bf16 with the vision attention coat.convert installs (coat.nn.vision.convert_vision_attention:
                      one attention call per run of equal windows rather than per window, cuDNN's kernel left out),
                      vision-language shapes only: what of coat's speed-up over bf16 is not FP8
    coat-vision       coat with coat.convert(vision_linears=True): the vision tower's and the merger's linears too
                      run FP8 GEMMs and keep their inputs in FP8 (vision-language shapes only)
    coat-layer0-bf16  coat with the language model's first decoder layer left in BF16 (skip_modules): what the
                      setting the VLM example's first-layer arm trains with costs
    coat-unfused      coat.convert(fused_loss=False): transformers' loss, so that the fused loss's gain shows
                      (skipped where coat.convert has no fused_loss: coat's rows use that loss already)
    coat-lowmem       coat's lowest memory: bfloat16 weights, no float32 master copy (coat.optim.AdamW rounds each
                      update stochastically), FP8 (E5M2) gradients, the inputs of RMSNorm and SiLU*mul saved as
                      FP4 in 1 x 128 blocks (saved_format="fp4", group_size=128), the fused loss where available;
                      a vision-language model's vision side in FP8 too, as in coat-vision
    coat-compiled     coat, compiled
    bf16-compiled     bf16, compiled
    torchao-compiled  torchao float8 training (tensorwise scaling) of the linears coat converts by default, the
                      decoder layers' (the LM head and a vision-language model's vision side BF16), compiled; the
                      bf16 optimizer (skipped, with a note, without torchao: pip install --no-build-isolation -e
                      ".[bench]")
    liger-compiled    liger, compiled

For each row, on a fresh model: peak GiB and reserved GiB (torch.cuda.max_memory_allocated / _reserved over
--warmup + --steps steps, the first of which allocates the optimizer state), less what was allocated when the row
started ("allocated before GiB": about 0 since each row releases its parameters' storage, which the accounting
step's MemTracker keeps referenced; 9.1 GiB after the Llama-3.2-1B BF16 row on an H200 before that), the median
of the --steps timed steps (CUDA events) and tokens/s (every token of the batch: of a vision-language sample,
its image tokens too, not the vision tower's patches), and the peak's parts:
  - weights, grads and optimizer GiB, counted from the tensors after a step;
  - fwd kept GiB: what the forward leaves allocated for backward (torch.cuda.memory_allocated after the model
    call minus before), logits and loss included; "logits returned" says whether the model returned logits;
  - eager rows only, from one more step under torch.distributed._tools.mem_tracker.MemTracker, which accounts
    every live tensor: body kept GiB (what the embedding and decoder layers keep for backward, and a
    vision-language model's vision side), vision kept GiB (of that, what the vision tower and merger keep),
    head+loss kept GiB (what the LM head and the loss keep: the logits' share), and the tensors live at that step's
    peak by kind, activations (made in the forward) and temporaries (made in the backward: the logits' gradient
    among them), with the phase the peak fell in. MemTracker does not see into compiled graphs: a compiled row's
    eager twin shows its split.
A row that runs out of memory is recorded as OOM; one that fails otherwise (a compile failure included) records
its error, and the script exits 1 once everything is written.

Time on one H200, from estimates (a 1B step ~0.4 s and its build ~5 s, an 8B step at sequence 8192 ~2-3 s and
its build ~20 s, ~1 min per whole-model compile, ~2 for an 8B): the default, llama3.2-1b with every variant at
2 warm-up and 3 timed steps, ~6 min (5 eager rows ~1 min, 4 compiled ones ~4-5); an 8B shape with the rows
bf16 liger coat coat-unfused coat-lowmem coat-compiled ~5 min. The vision-language shapes, estimated the same way
(not yet measured): a 3B step ~1.0e14 FLOPs, a sixth of them in the vision tower, whose window attention runs one
SDPA call per window (64 windows x 28 blocks, each way), ~0.4-0.6 s, its build ~10 s, the whole-model compile
~2-3 min: the five rows of the qwen2.5-vl-3b command below ~5 min; the 7B's two rows ~2 min (bf16 runs out of
memory in its first step, 16 bytes of model state per parameter being 133 GB, and the row rebuilds its model once
after). Take one shape per run: each writes its own e2e-shapes-SHAPE-DEVICE.json and .png, after every row, so that
a run cut short keeps the rows it finished.

    python benchmarks/e2e_shapes.py                                     (llama3.2-1b, every variant)
    python benchmarks/e2e_shapes.py --shapes llama3.1-8b --variants NAME...     (the 8B rows above)
    python benchmarks/e2e_shapes.py --shapes qwen2.5-7b --batch 2 --seq 2048 --variants NAME...
    python benchmarks/e2e_shapes.py --shapes qwen2.5-vl-3b --variants coat coat-vision coat-lowmem torchao-compiled bf16
    python benchmarks/e2e_shapes.py --shapes qwen2.5-vl-7b --variants coat-lowmem bf16
    python benchmarks/e2e_shapes.py --shapes qwen3-vl-4b --variants coat coat-vision      (the non-gated tower)
    python benchmarks/e2e_shapes.py --shapes olmoe-1b-7b --layers 8 --variants coat bf16   (an 80 GB card, where BF16
                                                    does not fit the 16 layers: the speed ratio of 8)
    python benchmarks/e2e_shapes.py --variants coat coat-compiled --profile   (and each row's kernels per step)
    python benchmarks/e2e_shapes.py --smoke                             (CPU, tiny shapes: checks that it runs)
    python benchmarks/e2e_shapes.py --plot RESULT.json... [--plot-file PNG]   (bar charts of result files)
"""
import importlib.metadata
import inspect
import os
import sys
import traceback
import warnings

import torch
from transformers import Qwen2ForCausalLM

import coat
from coat.nn.vision import convert_vision_attention, vision_linears

from _common import RESULTS_DIR, compile_for_fixed_shapes, kernel_profile, parser, print_table, write_results
from _model_shapes import SHAPES, SMOKE_BATCH, SMOKE_SEQ, Shape, VisionLanguageShape
from e2e import GIB, Training, instantiate, make_optimizer, timed_steps, torchao_float8, torchao_missing, trial

# Eager rows first, so that a run cut short keeps them; coat-compiled next, the question the compiled rows answer.
VARIANTS = ("bf16", "bf16-batched", "liger", "coat", "coat-vision", "coat-layer0-bf16", "coat-unfused", "coat-lowmem",
            "coat-compiled", "bf16-compiled", "torchao-compiled", "liger-compiled")
# compiling on the CPU takes minutes
SMOKE_VARIANTS = ("bf16", "bf16-batched", "liger", "coat", "coat-vision", "coat-unfused", "coat-lowmem")
VARIANT_COLORS = {"bf16": "tab:blue", "bf16-batched": "tab:olive", "bf16-compiled": "tab:cyan",
                  "torchao-compiled": "tab:green",
                  "liger": "tab:gray", "liger-compiled": "silver", "coat": "tab:orange", "coat-compiled": "tab:red",
                  "coat-vision": "tab:pink", "coat-layer0-bf16": "gold", "coat-unfused": "tab:brown",
                  "coat-lowmem": "tab:purple"}
PROFILE_KERNELS = 40  # the kernels of --profile kept per row, most time first


def convert_has_fused_loss() -> bool:
    """Whether coat.convert has the fused_loss option (its fused LM head + cross-entropy)."""
    return "fused_loss" in inspect.signature(coat.convert).parameters


def liger_missing(device: torch.device) -> str | None:
    """Why the Liger-Kernel variants cannot run here, or None."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as error:
        return f"Liger-Kernel is not importable ({error}): pip install --no-build-isolation -e '.[bench]'"
    if device.type != "cuda":
        return "Liger-Kernel's Triton kernels need a CUDA GPU"
    return None


def shape_excludes(variant: str, shape: Shape) -> str | None:
    """Why the variant does not apply to the shape, or None."""
    vision_language = isinstance(shape, VisionLanguageShape)
    if variant == "coat-vision" and not vision_language:
        return "a text model has no vision side to convert"
    if variant == "bf16-batched" and not vision_language:
        return "a text model has no vision attention to batch"
    if variant.startswith("liger") and vision_language:
        return ("not wired for vision-language models (Liger-Kernel's Qwen2.5-VL patch replaces the model's whole "
                "forward, untried against this transformers release)")
    return None


def coat_options(variant: str, vision_language: bool = False) -> dict:
    """coat.convert's options of a coat variant (on a vision-language shape if ``vision_language``); fused_loss set
    explicitly wherever coat.convert has it."""
    options = {"saved_format": "fp4", "group_size": 128} if variant == "coat-lowmem" else {}
    if variant == "coat-vision" or (variant == "coat-lowmem" and vision_language):
        options["vision_linears"] = True
    if convert_has_fused_loss():
        options["fused_loss"] = variant != "coat-unfused"
    return options


def first_decoder_layer(model: torch.nn.Module) -> str:
    """The name of the language model's first decoder layer (a vision tower's layers are not it)."""
    return next(name for name, _ in model.named_modules() if name.endswith("layers.0") and "vision" not in name)


def loss_kind(variant: str) -> str:
    """Which code computes the row's loss."""
    if variant.startswith("liger"):
        return "liger fused"
    if variant.startswith("coat") and coat_options(variant).get("fused_loss"):
        return "coat fused"
    return "transformers"


def build(variant: str, shape: Shape, config, device: torch.device) -> tuple:
    """The model and its optimizer."""
    bf16_weights = variant == "coat-lowmem"  # built in bfloat16: no float32 copy of the model ever exists
    model = instantiate(shape.model_class, config, torch.bfloat16 if bf16_weights else torch.float32, device)
    if variant.startswith("coat"):
        options = coat_options(variant, isinstance(shape, VisionLanguageShape))
        if variant == "coat-layer0-bf16":  # the setting the VLM example's first-layer arm trains with
            options["skip_modules"] = [first_decoder_layer(model)]
        coat.convert(model, **options)
    elif variant == "bf16-batched":
        convert_vision_attention(model)
    elif variant.startswith("torchao"):
        # the language model's linears: those coat.convert converts by default (vision_linears=False)
        vision = vision_linears(model) if isinstance(shape, VisionLanguageShape) else []
        torchao_float8(model, keep_bf16=[name for name, _ in vision])
    elif variant.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen2

        apply = apply_liger_kernel_to_qwen2 if shape.model_class is Qwen2ForCausalLM else apply_liger_kernel_to_llama
        # model=: only this model's forward is patched; the other kernels would patch transformers' modules
        apply(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True,
              model=model)
    optimizer = make_optimizer(list(model.parameters()), device, coat_state=variant.startswith("coat"),
                               bf16_weights=bf16_weights, fp8_grads="e5m2" if bf16_weights else None)
    model.train()
    if variant.endswith("compiled"):
        model = compile_for_fixed_shapes(model)  # the whole model, its parameters shared
    return model, optimizer


class ShapeTraining(Training):
    """benchmarks/e2e.py's training step on one GPU, of a shape's model (at --smoke's tiny size with smoke) on
    the shape's inputs, that also notes what each forward leaves allocated and whether it returned logits."""

    def __init__(self, variant: str, shape: Shape, device: torch.device, smoke: bool = False,
                 layers: int | None = None):
        super().__init__(variant, shape.make_config(smoke, layers), device, mesh=None, rank=0)
        self.shape, self.smoke = shape, smoke
        self.forward_kept_bytes = self.logits_returned = None

    def tokens(self, batch: int, seq: int) -> dict:
        """The model's keyword arguments for a step (Shape.inputs), on the device."""
        inputs = self.shape.inputs(self.config, batch, seq, self.smoke, self.generator)
        return {name: tensor.to(self.device) for name, tensor in inputs.items()}

    def build(self) -> None:
        self.free()
        self.model, self.optimizer = build(self.variant, self.shape, self.config, self.device)

    def free(self) -> None:
        if self.variant.endswith("compiled"):
            torch._dynamo.reset()  # the compile caches refer to the model
        if self.model is not None:
            # The accounting step's MemTracker leaves the parameters referenced from uncollectable cycles (its module
            # tracker's multi-grad hooks through autograd nodes): their storage is released here, so the next row
            # starts from what this one found.
            for param in self.model.parameters():
                param.grad = None
                param.data = param.data.new_empty(0)
        super().free()

    def forward(self, inputs: dict):
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if cuda else 0
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            output = self.model(**inputs)
        if cuda:
            self.forward_kept_bytes = torch.cuda.memory_allocated(self.device) - before
        self.logits_returned = output.logits is not None
        return output


def tracked_step(training: ShapeTraining, batch: int, seq: int) -> dict:
    """One more step under MemTracker (an eager model): what the body (of a vision-language model, the vision side
    too) and what the LM head and loss keep for backward, what the vision side keeps, and the live tensors at the
    step's peak by kind, in GiB, and the phase the peak fell in."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    ids = training.tokens(batch, seq)
    tracker = MemTracker()
    tracker.track_external(training.model, training.optimizer)
    with tracker, warnings.catch_warnings():
        # the tracker looks for each parameter's .grad, which coat's FP8 gradients leave None
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        timed_steps(training, ids, 1)
    device = training.device  # with its index on a GPU, as the tracker's keys have it
    modules = tracker.memory_tracking

    def total(module, state: _ModState) -> int:  # tracked bytes on the device at the module's last such state
        return modules[module].snapshots[state][-1].get(device, {}).get("Total", 0)

    root, body = training.model, training.model.base_model  # base_model: the LlamaModel / Qwen2Model inside
    peak = tracker.get_tracker_snapshot("peak")[device]
    if peak["Total"] == total(root, _ModState.PEAK_FW):
        phase = "forward"
    elif _ModState.PEAK_BW in modules[root].snapshots and peak["Total"] == total(root, _ModState.PEAK_BW):
        phase = "backward"
    else:
        phase = "optimizer step"
    parts = {
        "body kept GiB": (total(body, _ModState.POST_FW) - total(root, _ModState.PRE_FW)) / GIB,
        "head+loss kept GiB": (total(root, _ModState.POST_FW) - total(body, _ModState.POST_FW)) / GIB,
        "tracked peak GiB": peak["Total"] / GIB,
        "peak activations GiB": peak[_MemRefType.ACT] / GIB,
        "peak temporaries GiB": (peak[_MemRefType.TEMP] + peak[_MemRefType.OTH]) / GIB,
        "peak in": phase,
    }
    if isinstance(training.shape, VisionLanguageShape):
        vision = body.visual  # Qwen2.5-VL's vision tower with its patch merger
        parts["vision kept GiB"] = (total(vision, _ModState.POST_FW) - total(vision, _ModState.PRE_FW)) / GIB
    return parts


def error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 2000 else text[:1000] + " ... " + text[-1000:]


def shape_label(shape_name: str, layers: int | None) -> str:
    """The rows' and result file's name of the shape, cut to ``layers`` decoder layers where given."""
    return shape_name if layers is None else f"{shape_name}-{layers}-layers"


def measure(variant: str, shape_name: str, layers: int | None, batch: int, seq: int, args,
            device: torch.device) -> dict:
    """One row: the variant's step at the shape (cut to ``layers`` decoder layers where given), on a fresh model."""
    shape = SHAPES[shape_name]
    training = ShapeTraining(variant, shape, device, args.smoke, layers)
    row = {"shape": shape_label(shape_name, layers), "base shape": shape_name, "variant": variant, "batch": batch,
           "seq": seq, "layers": training.config.get_text_config().num_hidden_layers,
           "shape layers": shape.layers(args.smoke), "loss": loss_kind(variant),
           "compiled": variant.endswith("compiled")}
    if isinstance(shape, VisionLanguageShape):  # of the seq tokens of each sample
        row["image tokens"] = shape.image_tokens(args.smoke)
    if device.type == "cuda":  # what the rows before left allocated: taken out of this row's peaks below
        row["allocated before GiB"] = torch.cuda.memory_allocated(device) / GIB
    result = error = None
    try:
        training.build()
        result = trial(training, batch, seq, args.warmup, args.steps)  # None: out of memory
        if result is not None:
            if device.type == "cuda":  # the leftovers stay reserved too; the row's build released the rest
                for key in ("peak GiB", "steady GiB", "reserved GiB"):
                    result[key] -= row["allocated before GiB"]
            state = training.state_bytes()  # after a step: its gradients still held
            result.update({f"{part} GiB": size / GIB for part, size in state.items()})
            result["params"] = sum(p.numel() for p in training.model.parameters())
            result["logits returned"] = training.logits_returned
            if training.forward_kept_bytes is not None:
                result["fwd kept GiB"] = training.forward_kept_bytes / GIB
    except torch.OutOfMemoryError:  # while building
        result = None
    except Exception as exc:  # noqa: BLE001 - a failing row (a compile failure, say) is a result, not the run's end
        traceback.print_exc()
        error = error_text(exc)
    if result is not None and args.profile and device.type == "cuda":
        ids = training.tokens(batch, seq)
        profile = kernel_profile(lambda: training.step(ids), steps=2)
        result["profile"] = {**profile, "kernels": profile["kernels"][:PROFILE_KERNELS]}
    if result is not None and not row["compiled"]:
        try:
            result.update(tracked_step(training, batch, seq))
        except torch.OutOfMemoryError:
            result["accounting"] = "OOM"
        except Exception as exc:  # noqa: BLE001 - the row's measurements stand without the accounting
            traceback.print_exc()
            result["accounting"] = error_text(exc)
    training.free()
    if error is not None:
        row.update({"peak GiB": "error", "error": error})
    else:
        row.update(result or {"peak GiB": "OOM"})
    print(f"{row['shape']} {variant}: {row}", flush=True)
    return row


MIN_FIT_DEPTHS = 3  # cut depths a line needs: two always lie on one, the third tests that it is a line


def _line(points: list[tuple[int, float]]) -> dict:
    """The least-squares line y = fixed + per_layer * layers through (layers, y) points, with its largest residual."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    fixed = mean_y - slope * mean_x
    return {"per layer": slope, "fixed": fixed,
            "largest residual": max(abs(y - fixed - slope * x) for x, y in points)}


def predicted_peak(rows: list[dict], variant: str, shape_name: str, layers: int) -> float | None:
    """The peak GiB of ``variant`` at ``layers`` decoder layers of ``shape_name`` on the line through its rows that
    ran at two or more fewer depths, or None where there are not two."""
    ran = [(r["layers"], r["peak GiB"]) for r in rows if r.get("base shape") == shape_name and r["variant"] == variant
           and r["layers"] < layers and isinstance(r.get("peak GiB"), float)]
    if len({x for x, _ in ran}) < 2:
        return None
    line = _line(ran)
    return line["fixed"] + line["per layer"] * layers


def depth_fits(rows: list[dict]) -> dict:
    """For each shape measured at several depths (--layers N N ...), each variant with rows at MIN_FIT_DEPTHS or
    more cut depths: its step ms and peak GiB as lines in the decoder layers (the vision tower, embeddings, head and
    loss are the same at every depth; each decoder layer adds the same work and memory), their values at the
    shape's full depth and, where the variant ran there too, the lines' error against what it measured. Where a
    variant ran out of memory at the full depth, coat's full-depth row against that variant's line ("coat against
    lines"): an estimate, of a line whose error on coat's own rows shows how far to trust it."""
    fits = {}
    for base in dict.fromkeys(r["base shape"] for r in rows if "base shape" in r):
        of_shape = [r for r in rows if r.get("base shape") == base]
        lines, full_rows = {}, {}
        for variant in dict.fromkeys(r["variant"] for r in of_shape):
            mine = [r for r in of_shape if r["variant"] == variant]
            full = mine[0]["shape layers"]
            full_rows[variant] = next((r for r in mine if r["layers"] == full), None)
            cut = [r for r in mine if r["layers"] < full and isinstance(r.get("peak GiB"), float)]
            if len(cut) < MIN_FIT_DEPTHS:
                continue
            fit = {"depths": [r["layers"] for r in cut], "full depth": full}
            for key in ("step ms", "peak GiB"):
                fit[key] = _line([(r["layers"], r[key]) for r in cut])
                fit[key]["at full depth"] = fit[key]["fixed"] + fit[key]["per layer"] * full
            fit["tokens/s at full depth"] = mine[0]["batch"] * mine[0]["seq"] / (fit["step ms"]["at full depth"] / 1e3)
            measured = full_rows[variant]
            if measured is not None and isinstance(measured.get("peak GiB"), float):
                fit["error at full depth"] = {key: fit[key]["at full depth"] / measured[key] - 1
                                              for key in ("step ms", "peak GiB")}
            elif measured is not None:
                fit["at full depth measured"] = measured.get("peak GiB")  # "OOM" or "error"
            lines[variant] = fit
        if not lines:
            continue
        coat_full = full_rows.get("coat")
        against = {}
        if coat_full is not None and isinstance(coat_full.get("peak GiB"), float):
            for variant, fit in lines.items():
                if variant != "coat" and "error at full depth" not in fit:  # no full-depth row of its own to compare
                    against[variant] = {"speed ratio": coat_full["tokens/s/GPU"] / fit["tokens/s at full depth"],
                                        "peak ratio": coat_full["peak GiB"] / fit["peak GiB"]["at full depth"]}
        fits[base] = {"lines": lines, "coat against lines": against}
    return fits


def summarize(rows: list[dict], args, missing: dict[str, str]) -> dict:
    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    per_shape = {}
    for shape_name in dict.fromkeys(r["shape"] for r in rows):
        by_variant = {r["variant"]: r for r in rows if r["shape"] == shape_name}
        peak = {v: r.get("peak GiB") for v, r in by_variant.items()}  # GiB, "OOM" or "error"; None on the CPU
        speed = {v: r.get("tokens/s/GPU") for v, r in by_variant.items()}
        gib = {v: p if isinstance(p, float) else None for v, p in peak.items()}
        per_shape[shape_name] = {
            "batch": next(iter(by_variant.values()))["batch"],
            "seq": next(iter(by_variant.values()))["seq"],
            "peak_gib": peak,
            "tokens_per_s": speed,
            "memory_ratio_bf16_over_variant": {v: ratio(gib.get("bf16"), g) for v, g in gib.items()},
            "speed_ratio_over_bf16": {v: ratio(s, speed.get("bf16")) for v, s in speed.items()},
            "speed_ratio_over_torchao": {v: ratio(s, speed.get("torchao-compiled")) for v, s in speed.items()},
            "speed_ratio_over_bf16_batched": {v: ratio(s, speed.get("bf16-batched")) for v, s in speed.items()},
            # coat's fused loss against transformers' loss on coat (coat-unfused)
            "fused_loss_gib_saved": (gib["coat-unfused"] - gib["coat"]
                                     if gib.get("coat") is not None and gib.get("coat-unfused") is not None else None),
            "fused_loss_speed_ratio": ratio(speed.get("coat"), speed.get("coat-unfused")),
            # a vision-language model's vision side in FP8 (coat-vision) against it in BF16 (coat)
            "vision_linears_gib_saved": (gib["coat"] - gib["coat-vision"]
                                         if gib.get("coat") is not None and gib.get("coat-vision") is not None
                                         else None),
            "vision_linears_speed_ratio": ratio(speed.get("coat-vision"), speed.get("coat")),
            "compiled_over_eager_speed": {v: ratio(speed.get(f"{v}-compiled"), speed.get(v))
                                          for v in ("bf16", "liger", "coat") if f"{v}-compiled" in by_variant},
        }
    return {
        "smoke": args.smoke,
        "shapes": list(per_shape),
        "variants": list(dict.fromkeys(r["variant"] for r in rows)),
        "warmup": args.warmup,
        "steps": args.steps,
        "compile": "whole model (torch.compile(model, dynamic=False))",
        "coat_convert_has_fused_loss": convert_has_fused_loss(),
        "versions": {package: _version(package) for package in ("transformers", "torchao", "liger-kernel", "triton")},
        "per_shape": per_shape,
        "depth_fits": depth_fits(rows),
        "device memory GiB": device_memory_gib(),
        "errors": {f"{r['shape']} {r['variant']}": r["error"] for r in rows if "error" in r},
        "notes": [f"{v} skipped: {why}" for v, why in missing.items()],
    }


def device_memory_gib() -> float | None:
    """The GPU's memory in GiB; None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def plot(result_paths: list[str], png_path: str) -> None:
    """Bars of the result files: peak GiB and tokens/s of each variant, one group per shape."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.load(open(path)) for path in result_paths]
    rows = [row for result in results for row in result["rows"]]
    shapes = list(dict.fromkeys(f"{r['shape']}\n{r['batch']} x {r['seq']}" for r in rows))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    width = 0.8 / len(variants)
    figure, axes = plt.subplots(1, 2, figsize=(3 + 0.45 * len(variants) * len(shapes) * 2, 5))
    for ax, key, unit in ((axes[0], "peak GiB", "peak GiB (lower is better)"),
                          (axes[1], "tokens/s/GPU", "tokens/s (higher is better)")):
        for i, variant in enumerate(variants):
            for position, shape in enumerate(shapes):
                row = next((r for r in rows if r["variant"] == variant
                            and f"{r['shape']}\n{r['batch']} x {r['seq']}" == shape), None)
                if row is None:
                    continue
                value = row.get(key)
                ok = isinstance(value, float)
                bar = ax.bar(position + (i - (len(variants) - 1) / 2) * width, value if ok else 0, width,
                             color=VARIANT_COLORS[variant], label=variant)
                label = f"{value:,.0f}" if ok and value >= 100 else f"{value:.1f}" if ok else row.get("peak GiB", "n/a")
                ax.bar_label(bar, labels=[label], fontsize=7, rotation=90, padding=2)
        ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
        ax.set_ylabel(unit)
        ax.margins(y=0.2)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # each variant once
    axes[0].legend(unique.values(), unique.keys(), fontsize=8)
    figure.suptitle(f"whole training steps, {results[0]['device']}, torch {results[0]['torch']}")
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)
    plt.close(figure)


def plot_depths(result_path: str, png_path: str) -> None:
    """Step ms and peak GiB against decoder layers, a shape's rows at several depths with the lines of depth_fits
    drawn out to the full depth (dashed), and the card's memory."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(result_path))
    fits = result["summary"].get("depth_fits", {})
    rows = [r for r in result["rows"] if "base shape" in r]
    bases = list(dict.fromkeys(r["base shape"] for r in rows))
    figure, axes = plt.subplots(len(bases), 2, figsize=(10, 4 * len(bases)), squeeze=False)
    for (ax_ms, ax_gib), base in zip(axes, bases):
        failed = []  # (layers, variant, "OOM" or "error")
        for variant in dict.fromkeys(r["variant"] for r in rows if r["base shape"] == base):
            mine = [r for r in rows if r["base shape"] == base and r["variant"] == variant]
            color = VARIANT_COLORS[variant]
            for ax, key in ((ax_ms, "step ms"), (ax_gib, "peak GiB")):
                ran = [r for r in mine if isinstance(r.get(key), float)]  # the CPU measures no peaks
                ax.plot([r["layers"] for r in ran], [r[key] for r in ran], "o", color=color, label=variant)
                if fit := fits.get(base, {}).get("lines", {}).get(variant):
                    line = fit[key]
                    xs = [min(fit["depths"]), fit["full depth"]]
                    ax.plot(xs, [line["fixed"] + line["per layer"] * x for x in xs], "--", color=color, linewidth=1)
            failed += [(r["layers"], variant, r["peak GiB"]) for r in mine if isinstance(r.get("peak GiB"), str)]
        for layers, variant, what in failed:  # at the top, once the points have set the axis
            ax_gib.annotate(f"{variant}: {what}", (layers, ax_gib.get_ylim()[1]), fontsize=7,
                            color=VARIANT_COLORS[variant], ha="center", va="top")
        if memory := result["summary"].get("device memory GiB"):
            ax_gib.axhline(memory, color="black", linewidth=0.8)
            ax_gib.annotate("the card's memory", (ax_gib.get_xlim()[0], memory), fontsize=7, va="bottom")
        for ax, unit in ((ax_ms, "step ms (lower is better)"), (ax_gib, "peak GiB (lower is better)")):
            ax.set_xlabel(f"{base}: decoder layers")
            ax.set_ylabel(unit)
            ax.legend(fontsize=8)
    figure.suptitle(f"rows at several depths and lines through them, {result['device']}, torch {result['torch']}")
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)
    plt.close(figure)


def main():
    p = parser(__doc__)
    p.set_defaults(warmup=2, repeat=3)
    p.add_argument("--steps", dest="repeat", type=int, help="timed steps per row (same as --repeat)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models of every shape on the CPU, 2 warm-up steps and 1 timed")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), metavar="NAME",
                   help=f"model shapes, of: {', '.join(SHAPES)} (default: llama3.2-1b; --smoke: all)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, metavar="NAME",
                   help=f"rows, of: {', '.join(VARIANTS)} (default: all; --smoke: {', '.join(SMOKE_VARIANTS)})")
    p.add_argument("--batch", type=int, help="micro-batch of every shape (default: the shape's)")
    p.add_argument("--seq", type=int, help="sequence length of every shape (default: the shape's)")
    p.add_argument("--layers", type=int, nargs="+", metavar="N",
                   help="decoder layers of every shape's (language) model, at most the shape's: where BF16 mixed "
                        "precision does not fit the GPU at the full depth, the rows at fewer layers give the ratios "
                        "of the layers kept, and rows at three or more depths give lines through them "
                        "(summary's depth_fits); a variant whose line through two or more fewer depths puts its "
                        "peak over the GPU's memory is not run at that depth (its row says so, with the prediction); "
                        "a cut row's shape is named SHAPE-N-layers, and so is the file of one depth (of several: "
                        "SHAPE-depths-N-N-...)")
    p.add_argument("--profile", action="store_true",
                   help="one more pair of steps per row under torch.profiler: its kernels, most time first, in the "
                        "row and printed (GPU only)")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="only draw these result files into --plot-file")
    p.add_argument("--plot-file", help="the PNG (default: the result file's name with .png)")
    args = p.parse_args()
    if args.plot:
        png = args.plot_file or os.path.join(RESULTS_DIR, "e2e-shapes.png")
        plot(args.plot, png)
        print(f"wrote {png}")
        return
    args.steps = args.repeat
    if args.warmup < 2:
        p.error("--warmup must be at least 2: the second step is the first with optimizer state and gradients")
    if args.steps < 1 or (args.batch is not None and args.batch < 1) or (args.seq is not None and args.seq < 2):
        p.error("--steps and --batch must be at least 1, --seq at least 2")
    if args.smoke:
        device = torch.device("cpu")
        args.warmup, args.steps = 2, 1
    elif not torch.cuda.is_available() or not coat.built_with_cuda():
        sys.exit("benchmarks/e2e_shapes.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    shapes = args.shapes or (list(SHAPES) if args.smoke else ["llama3.2-1b"])
    variants = args.variants or (SMOKE_VARIANTS if args.smoke else VARIANTS)

    missing = {}
    for variant in variants:
        if variant.startswith("torchao"):
            missing[variant] = torchao_missing()
        elif variant.startswith("liger"):
            missing[variant] = liger_missing(device)
        elif variant == "coat-unfused" and not convert_has_fused_loss():
            missing[variant] = "coat.convert has no fused_loss option: the coat rows use transformers' loss"
    missing = {v: why for v, why in missing.items() if why}
    for variant, why in missing.items():
        print(f"{variant}: skipped, {why}", flush=True)
    sizes = {}  # shape -> (batch, seq)
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        sizes[shape_name] = (SMOKE_BATCH if args.smoke else args.batch or shape.batch,
                             SMOKE_SEQ if args.smoke else args.seq or shape.seq)
        for layers in args.layers or ():
            if not 1 <= layers <= shape.layers(args.smoke):
                p.error(f"--layers {layers}: {shape_name} has {shape.layers(args.smoke)} decoder layers; give at "
                        "most that many, at least 1")
        least = shape.image_tokens(args.smoke) + 3  # the image between its start and end tokens, and some text
        if sizes[shape_name][1] < least:
            p.error(f"--seq {sizes[shape_name][1]} leaves {shape_name} no text beside its image: give at least {least}")
        for variant in variants:
            why = shape_excludes(variant, shape)
            if why and variant not in missing:
                missing[f"{variant} on {shape_name}"] = why
                print(f"{variant} on {shape_name}: skipped, {why}", flush=True)

    depths = sorted(set(args.layers)) if args.layers else [None]
    memory_gib = device_memory_gib()

    def cut(shape_name: str, layers: int | None) -> int | None:  # None: the shape's own depth
        return None if layers == SHAPES[shape_name].layers(args.smoke) else layers

    if args.smoke:
        name = "e2e-shapes-smoke"
    elif len(depths) > 1:
        name = "e2e-shapes-" + "+".join(f"{s}-depths-" + "-".join(map(str, depths)) for s in shapes)
    else:
        name = "e2e-shapes-" + "+".join(shape_label(s, cut(s, depths[0])) for s in shapes)
    rows = []
    for shape_name in shapes:
        batch, seq = sizes[shape_name]
        for layers in depths:
            for variant in variants:
                if variant in missing or f"{variant} on {shape_name}" in missing:
                    continue
                predicted = predicted_peak(rows, variant, shape_name, layers)  # None without peaks (the CPU)
                if None not in (predicted, memory_gib) and predicted > memory_gib:  # an OOM costs a build and a step
                    rows.append({"shape": shape_label(shape_name, cut(shape_name, layers)), "base shape": shape_name,
                                 "variant": variant, "batch": batch, "seq": seq, "layers": layers,
                                 "shape layers": SHAPES[shape_name].layers(args.smoke), "peak GiB": "not run",
                                 "predicted peak GiB": predicted})
                    print(f"{rows[-1]['shape']} {variant}: not run, its rows at fewer layers put its peak at "
                          f"{predicted:.1f} GiB, over the card's {memory_gib:.1f}", flush=True)
                else:
                    rows.append(measure(variant, shape_name, cut(shape_name, layers), batch, seq, args, device))
                # after every row, so that a run cut short keeps what it measured
                path = write_results(args.results_dir, name, rows, summarize(rows, args, missing))
                png = args.plot_file or path.removesuffix(".json") + ".png"
                plot([path], png)
                if len(depths) > 1:
                    plot_depths(path, path.removesuffix(".json") + "-lines.png")
    if not rows:
        sys.exit("no variant could run here: " + "; ".join(f"{v}: {why}" for v, why in missing.items()))

    columns = ["shape", "variant", "batch", "seq", "image tokens", "loss", "logits returned", "peak GiB",
               "reserved GiB", "step ms", "tokens/s/GPU", "weights GiB", "grads GiB", "optimizer GiB", "fwd kept GiB",
               "body kept GiB", "vision kept GiB", "head+loss kept GiB", "peak activations GiB",
               "peak temporaries GiB", "peak in"]
    print_table(rows, columns)
    for row in rows:
        if "profile" in row:
            print(f"\n{row['shape']} {row['variant']}: kernels per step (torch.profiler, 2 steps)")
            print_table(row["profile"]["kernels"][:20], ["kernel", "class", "calls", "us"])
            print({k: v for k, v in row["profile"].items() if k != "kernels"})
    summary = summarize(rows, args, missing)
    for base, fits in summary["depth_fits"].items():
        for variant, fit in fits["lines"].items():
            check = ", ".join(f"{key} {error:+.1%}" for key, error in fit.get("error at full depth", {}).items())
            print(f"{base} {variant}: lines through {fit['depths']} layers, at {fit['full depth']}: "
                  f"{fit['step ms']['at full depth']:.1f} ms, {fit['peak GiB']['at full depth']:.1f} GiB"
                  + (f" (against its measured row: {check})" if check else ""))
        for variant, ratios in fits["coat against lines"].items():
            print(f"{base}: coat at full depth against {variant}'s line: {ratios['speed ratio']:.2f}x its tokens/s, "
                  f"{ratios['peak ratio']:.2f}x its peak (an estimate)")
    for line in summary["notes"] + [f"{where}: {error}" for where, error in summary["errors"].items()]:
        print(line)
    print(f"wrote {path} and {png}")
    if summary["errors"]:
        sys.exit(f"{len(summary['errors'])} row(s) failed: see their errors above and in {path}")

if __name__ == "__main__":
    main()
