"""End-to-end training of a Llama-2-7B-shaped model (random weights, sequence 2048, every parameter trained),
BF16 mixed precision against coat and the peers a user would pick instead, all in this run, one after the
other:

    bf16              float32 master weights; forward and backward under torch.autocast(bfloat16) on one GPU,
                      or FSDP2's MixedPrecisionPolicy (bfloat16 parameters, float32 gradient reduction) under
                      torchrun; torch.optim.AdamW(fused=True)
    bf16-compiled     the same with every decoder layer under torch.compile
    torchao-compiled  torchao float8 training (convert_to_float8_training, tensorwise scaling; the LM head
                      stays BF16, as in coat) with every decoder layer under torch.compile, the same optimizer
                      as bf16 (skipped, with a note, when torchao is not installed:
                      pip install --no-build-isolation -e ".[bench]")
    coat              the same model after coat.convert (FP8 decoder layers, activations saved in FP8), the same
                      master weights and autocast / policy, coat.optim.AdamW (FP8 moments)
    coat-compiled     coat with every decoder layer under torch.compile
    coat-bf16w        coat with bfloat16 weights and gradients and no float32 master copy (coat.optim.AdamW
                      rounds each update stochastically): 6.09 bytes of model state per parameter
    coat-bf16w-fp4    coat-bf16w with the inputs of RMSNorm and SiLU*mul saved as FP4 (coat.convert's
                      saved_format="fp4"): the lowest-memory activations
    coat-fp8-grads    coat-bf16w with gradients kept in FP8 (E5M2, per-tensor scale) after backward: 5.09 bytes
                      (one process only: FP8 gradients need unsharded parameters)
    coat-fp8-comm     under torchrun only: coat-bf16w whose gradients FSDP2 reduce-scatters as block-scaled FP8
                      (coat.distributed.fp8_reduce_scatter) and whose projection weights it all-gathers in FP8
                      (coat.distributed.fp8_all_gather) with its default scales="per_unit"; --fp8-scales MODE...
                      runs it once per mode, named coat-fp8-comm:MODE for the others ("per_group",
                      "precomputed": then coat.distributed.precompute_fp8_scales_after_step too)

A step is zero_grad, forward with the loss over the batch's own tokens, backward, optimizer step; no gradient
checkpointing. Under torchrun every decoder layer and the root are fully_shard'ed (FSDP2), and each rank trains
on its own micro-batch. For each variant:

  - peak GPU memory (torch.cuda.max_memory_allocated, and reserved) at the equal micro-batches of
    --memory-batches, each on a fresh model, over --warmup steps (the first allocates the optimizer state)
    and --steps timed ones; "steady GiB" leaves the first step out; the maximum over ranks under torchrun;
  - the largest micro-batch that trains: doubling from 1, then bisection, each trial --warmup and --steps
    full steps, up to --max-batch; a batch that runs out of memory on any rank does not fit (under torchrun the allocator
    may use --memory-cap = 95% of each GPU, so that every rank runs out at the same allocation, and a batch
    whose peak, extrapolated linearly from the two largest that fit, exceeds 95% of that cap is not run: one
    rank running out alone would leave the others waiting in a collective);
  - tokens/s per GPU at that batch: batch * seq / median step time (CUDA events) of --steps steps after
    --warmup steps; the slowest rank's under torchrun;
  - under torchrun, "all-gather MB/step" and "reduce-scatter MB/step": the bytes this rank handed to
    torch.distributed's collectives per timed step (their input tensors, counted at the call): FSDP2's own
    all-gathers and reduce-scatters for every variant, and for coat-fp8-comm the all-gathers of FP8 codes and
    the all-to-alls of coat's FP8 reduce-scatter (its amax all-reduces go under "all-reduce MB/step");
  - with --max-seq N: the longest sequence (a multiple of --seq-unit, up to N) that trains at batch 1, by the
    same doubling and bisection, and tokens/s there.

--shape 13b trains a Llama-2-13B shape (hidden 5120, 40 layers) instead; "state B/param" is the bytes of
weights, gradients and optimizer state per parameter after a step, counted from the tensors.

Every step of a measurement trains on the same random micro-batch: the data do not change the time, and the
falling loss (the model memorises the batch) shows that training works.

Targets (coat against bf16): peak memory at least 1.6x lower at equal batch (paper: 1.54x); tokens/s at least
1.3x at equal batch 1 and 1.8x at each one's largest batch (paper: 1.45x on 4 GPUs). Weights, gradients and
Adam states take 16 bytes per
parameter in BF16 (108 GB at 7B) and 10.09 in coat (the same float32 weights and gradients, 2.09 bytes of FP8
Adam state), so at small batches the memory ratio tends to 1.59. A BF16 run that fits no batch (7B on one
80 GB GPU, as in the paper's Table 8) is reported as OOM, and the ratios it would take part in are null.

    python benchmarks/e2e.py [--variants bf16 coat ...]       (one GPU)
    python benchmarks/e2e.py --shape 13b --variants coat-fp8-grads --memory-batches 1
    python benchmarks/e2e.py --variants bf16 coat --max-seq 65536     (+ the longest sequence at batch 1)
    torchrun --nproc_per_node 2 benchmarks/e2e.py              (FSDP2, two GPUs)
    torchrun --nproc_per_node 2 benchmarks/e2e.py --profile --layers 8 --variants coat-bf16w coat-fp8-comm
                                                               (where the step time goes: torch.profiler tables)
    torchrun --nproc_per_node 2 benchmarks/e2e.py --variants bf16 coat-bf16w coat-fp8-comm \
        --fp8-scales per_group per_unit precomputed            (the FP8 all-gather's three scale modes)
    python benchmarks/e2e.py --smoke                           (CPU: checks that the script runs)
    python benchmarks/e2e.py --plot RESULT.json... [--plot-file PNG]   (bar charts of result files)
"""
import collections
import datetime
import gc
import inspect
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import coat

from _common import RESULTS_DIR, parser, print_table, write_results

VARIANTS = ("bf16", "bf16-compiled", "torchao-compiled", "coat", "coat-compiled", "coat-bf16w", "coat-bf16w-fp4",
            "coat-fp8-grads", "coat-fp8-comm")
# compiling on the CPU takes minutes; the smoke run checks the script
SMOKE_VARIANTS = ("bf16", "coat", "coat-fp8-grads", "coat-fp8-comm")
VARIANT_COLORS = {"bf16": "tab:blue", "bf16-compiled": "tab:cyan", "torchao-compiled": "tab:green",
                  "coat": "tab:orange", "coat-compiled": "tab:red", "coat-bf16w": "tab:purple", "coat-bf16w-fp4": "tab:olive",
                  "coat-fp8-grads": "tab:brown", "coat-fp8-comm": "tab:pink"}
BF16_WEIGHT_VARIANTS = ("coat-bf16w", "coat-bf16w-fp4", "coat-fp8-grads", "coat-fp8-comm")
FP8_COMM = "coat-fp8-comm"
FP8_SCALES_DEFAULT = inspect.signature(coat.distributed.fp8_all_gather).parameters["scales"].default
SHAPES = {  # Llama-2 shapes: hidden, intermediate, heads, layers
    "7b": (4096, 11008, 32, 32),
    "13b": (5120, 13824, 40, 40),
}
MEMORY_TARGET, SPEED_TARGET, EQUAL_BATCH_SPEED_TARGET = 1.6, 1.8, 1.3
LR = 1e-5
SMOKE_BATCH, SMOKE_SEQ, SMOKE_LAYERS = 2, 32, 2
GIB = 2**30
CAP_MARGIN = 0.95  # under torchrun, the fraction of the allocator cap a batch's extrapolated peak may reach


def llama_config(shape_name: str, layers: int, smoke: bool) -> LlamaConfig:
    if smoke:
        shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    else:
        hidden, intermediate, heads, _ = SHAPES[shape_name]
        shape = dict(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads)
    return LlamaConfig(
        **shape,
        num_key_value_heads=shape["num_attention_heads"],
        num_hidden_layers=layers,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
        use_cache=False,  # training: no KV cache
    )


@torch.no_grad()
def initialise(model: LlamaForCausalLM, config: LlamaConfig) -> None:
    """LlamaForCausalLM's own init (normal matrices, unit RMSNorm weights) on this rank's shards, and the
    rotary frequencies, which to_empty left uninitialised."""
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if param.dim() == 1:
            local.fill_(1.0)
        else:
            local.normal_(0.0, config.initializer_range)
    rotary = model.model.rotary_emb
    for name, buffer in type(rotary)(config).named_buffers():
        rotary.get_buffer(name).copy_(buffer)


def torchao_missing() -> str | None:
    """Why the torchao variant cannot run here, or None."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        return f"torchao is not installed ({error.name}): pip install --no-build-isolation -e '.[bench]'"
    return None


def instantiate(model_class, config, dtype: torch.dtype, device: torch.device | str):
    """model_class(config) with its parameters in dtype, made on device (on "meta" they get no memory)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config)
    finally:
        torch.set_default_dtype(default_dtype)


def torchao_float8(model: torch.nn.Module, keep_bf16: list[str] = ()) -> None:
    """torchao's float8 training linears (tensorwise scaling) in place of the model's, the LM head left BF16
    as coat leaves it, and the linears named in keep_bf16."""
    from torchao.float8 import convert_to_float8_training

    kept = {"lm_head", *keep_bf16}
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name not in kept)


def make_optimizer(params: list, device: torch.device, *, coat_state: bool, bf16_weights: bool = False,
                   fp8_grads: str | None = None) -> torch.optim.Optimizer:
    """torch.optim.AdamW (fused on a GPU), or coat.optim.AdamW (FP8 moments); for bfloat16 weights without a
    float32 master copy, coat's with each update rounded stochastically and the gradients optionally in FP8."""
    if bf16_weights:
        return coat.optim.AdamW(params, lr=LR, param_rounding="stochastic", fp8_grads=fp8_grads)
    if coat_state:
        return coat.optim.AdamW(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, fused=device.type == "cuda")


def fp8_comm_variants(scale_modes: list[str]) -> list[str]:
    """coat-fp8-comm once per scale mode of its FP8 all-gather: the default mode keeps the plain name."""
    return [FP8_COMM if mode == FP8_SCALES_DEFAULT else f"{FP8_COMM}:{mode}" for mode in scale_modes]


def build(variant: str, config: LlamaConfig, device: torch.device, mesh) -> tuple:
    """The model and its optimizer. Under FSDP2 the model is built on the meta device and sharded before it
    gets memory, so that the whole model never sits on one GPU."""
    variant, _, scales = variant.partition(":")  # coat-fp8-comm:MODE (fp8_comm_variants)
    # The bf16-weight variants are built in bfloat16, so that no float32 copy of the model ever exists.
    dtype = torch.bfloat16 if variant in BF16_WEIGHT_VARIANTS else torch.float32
    model = instantiate(LlamaForCausalLM, config, dtype, "meta" if mesh is not None else device)
    if variant.startswith("coat"):
        # before fully_shard, which then shards the converted modules' parameters
        coat.convert(model, saved_format="fp4" if variant.endswith("-fp4") else "e4m3")
    if variant.startswith("torchao"):
        torchao_float8(model)
    if variant.endswith("compiled"):
        # Each build compiles afresh. Only the batch dimension changes within a build (the largest-batch search),
        # so torch.compile's automatic dynamic shapes cost little here, unlike across layer.py's settings.
        torch._dynamo.reset()
        for layer in model.model.layers:
            layer.compile()
    if mesh is not None:
        if variant == FP8_COMM:
            coat.distributed.fp8_all_gather(model, **({"scales": scales} if scales else {}))  # before fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device=device)
        initialise(model, config)
        if variant == FP8_COMM:
            coat.distributed.fp8_reduce_scatter(model)
    optimizer = make_optimizer(list(model.parameters()), device, coat_state=variant.startswith("coat"),
                               bf16_weights=variant in BF16_WEIGHT_VARIANTS,
                               fp8_grads="e5m2" if variant == "coat-fp8-grads" else None)
    if scales == "precomputed":  # inside the timed step: the hook's all-reduce is part of its cost
        coat.distributed.precompute_fp8_scales_after_step(optimizer, model)
    return model.train(), optimizer


class CollectiveBytes:
    """Counts the bytes this rank hands to torch.distributed's collectives while it is entered: the input
    tensor of each outermost call, by kind. Every collective FSDP2 and coat issue goes through these
    functions of torch.distributed (looked up at call time), whichever of them a torch version uses."""

    KINDS = {"all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather",
             "reduce_scatter_tensor": "reduce-scatter", "reduce_scatter_single": "reduce-scatter",
             "all_to_all_single": "reduce-scatter",  # coat's FP8 reduce-scatter is an all-to-all
             "all_reduce": "all-reduce"}
    INPUTS = ("input_tensor", "input", "tensor")

    def __init__(self):
        self.bytes = collections.Counter()
        self._depth = 0
        self._originals = {}

    def _counting(self, name: str, function):
        signature = inspect.signature(function)

        def counted(*args, **kwargs):
            if self._depth == 0:
                arguments = signature.bind(*args, **kwargs).arguments
                tensor = next(arguments[key] for key in self.INPUTS if key in arguments)
                self.bytes[self.KINDS[name]] += tensor.numel() * tensor.element_size()
            self._depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self):
        for name in self.KINDS:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._counting(name, self._originals[name]))
        return self

    def __exit__(self, *exc):
        for name, function in self._originals.items():
            setattr(dist, name, function)
        self._originals.clear()


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, of this rank's shard for a DTensor."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


class Training:
    """One variant's model and optimizer on this rank, and its training step."""

    def __init__(self, variant: str, config: LlamaConfig, device: torch.device, mesh, rank: int):
        self.variant, self.config, self.device, self.mesh = variant, config, device, mesh
        self.autocast = mesh is None  # under FSDP2 the MixedPrecisionPolicy casts instead
        self.generator = torch.Generator().manual_seed(rank)  # each rank its own micro-batches
        self.model = self.optimizer = None

    def tokens(self, batch: int, seq: int) -> torch.Tensor:
        return torch.randint(self.config.vocab_size, (batch, seq), generator=self.generator).to(self.device)

    def forward(self, ids: torch.Tensor):
        """The model's output, its loss over the batch's own tokens included."""
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            return self.model(input_ids=ids, labels=ids)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward(ids).loss
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's shards of the weights, the gradients (param.grad or coat's FP8 gradients) and the
        optimizer state, counted from the tensors."""
        params = list(self.model.parameters())
        fp8_grads = getattr(self.optimizer, "_fp8_grads", {})
        return {
            "weights": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None)
                     + sum(_local_bytes(codes) + _local_bytes(scale) for codes, scale in fp8_grads.values()),
            "optimizer": sum(_local_bytes(t) for state in self.optimizer.state.values() for t in state.values()
                             if isinstance(t, torch.Tensor)),
        }

    def state_bytes_per_param(self) -> float:
        """Bytes of weights, gradients and optimizer state per parameter, of this rank's shards."""
        params = list(self.model.parameters())
        return sum(self.state_bytes().values()) / max(sum(_local_bytes(p) // p.element_size() for p in params), 1)

    def free(self) -> None:
        self.model = self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def build(self) -> None:
        """A fresh model and optimizer, in place of the current ones."""
        self.free()
        self.model, self.optimizer = build(self.variant, self.config, self.device, self.mesh)


def all_ranks(values: list[float], op, device: torch.device) -> list[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def timed_steps(training: Training, ids: torch.Tensor, count: int) -> tuple[list[float], list[torch.Tensor]]:
    """Milliseconds and losses of `count` steps: CUDA events on a GPU, time.perf_counter on the CPU."""
    times, losses = [], []
    for _ in range(count):
        if training.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(training.step(ids))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            losses.append(training.step(ids))
            times.append((time.perf_counter() - start) * 1e3)
    return times, losses


def peak_gib(cuda: bool) -> list[float]:
    """Peak allocated and reserved GiB since the last call."""
    if not cuda:
        return [0.0, 0.0]
    peak = [torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB]
    torch.cuda.reset_peak_memory_stats()
    return peak


def trial(training: Training, batch: int, seq: int, warmup: int, steps: int) -> dict | None:
    """warmup + steps training steps at `batch`: peak memory over all of them and over all but the first,
    median ms of the last `steps` and their losses; None when any rank ran out of memory."""
    cuda = training.device.type == "cuda"
    ids = training.tokens(batch, seq)
    peak_gib(cuda)
    times, losses = [], []
    try:
        first_steps = min(warmup, 1)
        timed_steps(training, ids, first_steps)
        first = peak_gib(cuda)
        timed_steps(training, ids, warmup - first_steps)
        with CollectiveBytes() as sent:
            times, losses = timed_steps(training, ids, steps)
        ok = 1.0
    except torch.OutOfMemoryError:
        ok = 0.0
    # Out of the except clause: the error's traceback, which held the failed step's tensors, is released.
    del ids
    (ok,) = all_ranks([ok], dist.ReduceOp.MIN, training.device)
    if not ok:
        training.build()  # a step cut short can leave FSDP2's or the optimizer's state half-updated
        return None
    steady = peak_gib(cuda)
    median_ms = statistics.median(times) if times else 0.0
    measured = [max(first[0], steady[0]), steady[0], max(first[1], steady[1]), median_ms]
    peak, steady_peak, reserved, median_ms = all_ranks(measured, dist.ReduceOp.MAX, training.device)
    result = {"peak GiB": peak, "steady GiB": steady_peak, "reserved GiB": reserved} if cuda else {}
    if times:
        result.update({"step ms": median_ms, "tokens/s/GPU": batch * seq / median_ms * 1e3})
        result["state B/param"] = training.state_bytes_per_param()  # after a step: gradients still held
        result["losses"] = [loss.item() for loss in losses]
        if training.mesh is not None:  # what this rank handed to collectives per timed step
            for kind in ("all-gather", "reduce-scatter", "all-reduce"):
                result[f"{kind} MB/step"] = sent.bytes[kind] / len(times) / 2**20
    return result


def largest_fitting(fits, cap: int, unit: int = 1) -> int:
    """The largest multiple of `unit` <= cap (a multiple of unit) for which fits(value) holds: doubling from
    `unit` until one fails, then bisection; 0 when even `unit` does not fit."""
    good, bad = 0, None
    while bad is None and good < cap:
        value = min(2 * good, cap) if good else unit
        if fits(value):
            good = value
        else:
            bad = value
    while bad is not None and bad - good > unit:
        middle = (good + bad) // (2 * unit) * unit
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def extrapolated_peak(tried: dict[int, dict | None], batch: int) -> float | None:
    """The peak GiB at `batch`, extrapolated linearly from the two largest batches in `tried` that fit and
    are below it (activations grow linearly with the batch); None without two such batches."""
    fitting = sorted((b, result["peak GiB"]) for b, result in tried.items() if result and b < batch)
    if len(fitting) < 2:
        return None
    (b0, p0), (b1, p1) = fitting[-2:]
    return p1 + (p1 - p0) / (b1 - b0) * (batch - b1)


def largest_batch(training: Training, seq: int, warmup: int, steps: int, cap: int, tried: dict[int, dict | None],
                  memory_cap_gib: float | None = None) -> int:
    """The largest batch <= cap that trains at `seq`. Each batch tried runs the full trial (warm-up and timed
    steps), whose result lands in `tried` (None: out of memory), so the batch found is the one measured:
    a search of warm-up steps alone let batches pass that ran out of memory in the longer timed trial.
    With memory_cap_gib (under torchrun), a batch whose extrapolated peak exceeds CAP_MARGIN of it is not
    run and counts as out of memory: near the cap one rank can run out alone and leave the others waiting in
    a collective until NCCL's timeout ends the whole run (it did on 2 H200s, and on 4 H100s at a batch
    extrapolated to 96% of the cap: the allocator reserves up to ~10% more than the peak it allocates)."""

    def fits(batch: int) -> bool:
        if batch not in tried:
            predicted = extrapolated_peak(tried, batch) if memory_cap_gib else None
            if predicted is not None and predicted > CAP_MARGIN * memory_cap_gib:
                tried[batch] = None
                log(f"{training.variant}: batch {batch} not run, its extrapolated peak {predicted:.1f} GiB exceeds "
                    f"{CAP_MARGIN:.0%} of the allocator cap {memory_cap_gib:.1f}")
            else:
                tried[batch] = trial(training, batch, seq, warmup, steps)
                log(f"{training.variant}: batch {batch} {'fits' if tried[batch] else 'OOM'}")
        return tried[batch] is not None

    return largest_fitting(fits, cap)


def longest_sequence(training: Training, warmup: int, steps: int, cap: int, unit: int) -> tuple[int, dict | None]:
    """The longest sequence, a multiple of `unit` <= cap, that trains at batch 1, and its trial's result."""
    tried = {}

    def fits(seq: int) -> bool:
        tried[seq] = trial(training, 1, seq, warmup, steps)
        log(f"{training.variant}: batch 1 x seq {seq} {'fits' if tried[seq] else 'OOM'}")
        return tried[seq] is not None

    seq = largest_fitting(fits, cap, unit)
    return seq, tried.get(seq)


def profile_steps(variant: str, args, config: LlamaConfig, device: torch.device, mesh, rank: int) -> None:
    """--profile: where one variant's step time goes at the first --memory-batches batch. Times --steps steps
    after --warmup, then prints rank 0's torch.profiler tables of two more steps (CPU and CUDA activity, by
    CUDA time and by CPU time). NCCL kernels count the time they wait for the other ranks."""
    from torch.profiler import ProfilerActivity, profile

    training = Training(variant, config, device, mesh, rank)
    training.build()
    ids = training.tokens(args.memory_batches[0], args.seq)
    timed_steps(training, ids, args.warmup)
    times, _ = timed_steps(training, ids, args.steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_steps(training, ids, 2)
    if rank == 0:
        log(f"{variant}, {args.layers} layers, batch {args.memory_batches[0]}: step ms {sorted(times)}")
        for key in (("cuda_time_total",) if device.type == "cuda" else ()) + ("cpu_time_total",):
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
    training.free()


def measure(variant: str, args, config: LlamaConfig, device: torch.device, mesh, rank: int, world: int) -> list[dict]:
    training = Training(variant, config, device, mesh, rank)
    base = {"variant": variant, "world size": world}

    def row(measured: str, batch: int, result: dict | None) -> dict:
        out = {**base, "measured": measured, "batch": batch, **(result or {"peak GiB": "OOM"})}
        log(f"{variant}, {measured} {batch}: {result or 'OOM'}")
        return out

    if args.smoke:
        training.build()
        rows = [row("smoke", SMOKE_BATCH, trial(training, SMOKE_BATCH, args.seq, 0, 2))]
    else:
        rows, tried = [], {}
        for batch in args.memory_batches:
            training.build()  # fresh: every peak includes the first step, which allocates the optimizer state
            tried[batch] = trial(training, batch, args.seq, args.warmup, args.steps)
            rows.append(row("equal batch", batch, tried[batch]))
        if training.model is None:
            training.build()
        memory_cap_gib = None
        if mesh is not None and device.type == "cuda":
            memory_cap_gib = args.memory_cap * torch.cuda.get_device_properties(device).total_memory / GIB
        batch = largest_batch(training, args.seq, args.warmup, args.steps, args.max_batch, tried, memory_cap_gib)
        if batch:
            rows.append(row("largest batch", batch, tried[batch]))
        if args.max_seq:
            if training.model is None:
                training.build()
            seq, result = longest_sequence(training, args.warmup, args.steps, args.max_seq, args.seq_unit)
            if seq:
                rows.append({**row(f"longest seq {seq}", 1, result), "seq": seq})
    training.free()
    return rows


def summarize(rows: list[dict], args, world: int, missing: dict[str, str]) -> dict:
    variants = list(dict.fromkeys(r["variant"] for r in rows))

    def equal_batch(variant, batch, key):
        found = [r.get(key) for r in rows if r["variant"] == variant and r["measured"] == "equal batch"
                 and r["batch"] == batch and r["peak GiB"] != "OOM"]
        return found[0] if found else None

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    largest = {v: next((r for r in rows if r["variant"] == v and r["measured"] == "largest batch"), None)
               for v in variants}
    longest = {v: next((r for r in rows if r["variant"] == v and "seq" in r), None) for v in variants}
    batches = [] if args.smoke else args.memory_batches
    speed = {v: r.get("tokens/s/GPU") if r else None for v, r in largest.items()}
    by_batch = {  # variant -> equal batch -> value; null where the variant does not fit the batch
        key: {v: {str(b): equal_batch(v, b, key) for b in batches} for v in variants}
        for key in ("peak GiB", "steady GiB", "tokens/s/GPU")
    }
    memory_ratios = {str(b): ratio(equal_batch("bf16", b, "peak GiB"), equal_batch("coat", b, "peak GiB")) for b in batches}
    steady_ratios = {str(b): ratio(equal_batch("bf16", b, "steady GiB"), equal_batch("coat", b, "steady GiB"))
                     for b in batches}
    speed_ratios_equal = {  # tokens/s over bf16's at each equal batch
        v: {str(b): ratio(equal_batch(v, b, "tokens/s/GPU"), equal_batch("bf16", b, "tokens/s/GPU")) for b in batches}
        for v in variants
    }
    speed_ratios = {v: ratio(speed[v], speed.get("bf16")) for v in variants}
    measured_memory = [r for r in memory_ratios.values() if r is not None]
    notes = [f"{v} skipped: {why}" for v, why in missing.items()]
    notes += [f"bf16 does not fit batch {b}: no ratio there" for b in batches if equal_batch("bf16", b, "peak GiB") is None]
    if not args.smoke and speed.get("bf16") is None:
        notes.append("bf16 fits no batch: no speed ratio")
    coat_speed = speed_ratios.get("coat")
    coat_equal = speed_ratios_equal.get("coat", {}).get("1")
    state_bytes = {v: next((r["state B/param"] for r in rows if r["variant"] == v and "state B/param" in r), None)
                   for v in variants}
    # collective bytes per step depend on the parameters, not on the batch: each variant's first measured row
    sent = {kind: {v: next((r[f"{kind} MB/step"] for r in rows if r["variant"] == v and f"{kind} MB/step" in r), None)
                   for v in variants} for kind in ("all-gather", "reduce-scatter")}
    return {
        "smoke": args.smoke,
        "shape": args.shape,
        "layers": args.layers,
        "seq": args.seq,
        "world_size": world,
        "variants": variants,
        "peak_gib_at_equal_batch": by_batch["peak GiB"],
        "model_state_bytes_per_param": state_bytes,
        "tokens_per_s_per_gpu_at_equal_batch": by_batch["tokens/s/GPU"],
        "memory_ratio_bf16_over_coat": memory_ratios,  # by equal batch; null where either does not fit
        "steady_memory_ratio_bf16_over_coat": steady_ratios,  # the same without the first step
        "speed_ratio_over_bf16_at_equal_batch": speed_ratios_equal,
        "max_batch": {v: r["batch"] if r else 0 for v, r in largest.items()},
        "tokens_per_s_per_gpu_at_max_batch": speed,
        "speed_ratio_over_bf16_at_max_batch": speed_ratios,
        "speed_ratio_coat_over_bf16": coat_speed,
        "collective_mb_per_step": sent if world > 1 else None,
        "collective_bytes_over_bf16": ({kind: {v: ratio(mb, by_variant.get("bf16")) for v, mb in by_variant.items()}
                                       for kind, by_variant in sent.items()} if world > 1 else None),
        # batch 1, the longest sequence that trains (--max-seq; 0 where none does, absent when not searched)
        "longest_seq_at_batch_1": {v: r["seq"] if r else 0 for v, r in longest.items()} if args.max_seq else None,
        "tokens_per_s_at_longest_seq": ({v: r.get("tokens/s/GPU") if r else None for v, r in longest.items()}
                                        if args.max_seq else None),
        "targets": {"memory_bf16_over_coat": MEMORY_TARGET, "speed_coat_over_bf16_at_max_batch": SPEED_TARGET,
                    "speed_coat_over_bf16_at_batch_1": EQUAL_BATCH_SPEED_TARGET},
        "memory_target_met": min(measured_memory) >= MEMORY_TARGET if measured_memory else None,
        "speed_target_met": coat_speed >= SPEED_TARGET if coat_speed is not None else None,
        "equal_batch_speed_target_met": coat_equal >= EQUAL_BATCH_SPEED_TARGET if coat_equal is not None else None,
        "notes": notes,
    }


def plot(result_paths: list[str], png_path: str) -> None:
    """Bars of the result files: peak memory at each equal batch, and tokens/s per GPU at each variant's
    largest batch, BF16 beside coat, one group per setup (shape and GPUs; files of one setup share a group)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.load(open(path)) for path in result_paths]
    setups: dict[str, list[dict]] = {}  # "7B, FSDP2, 2 GPUs" -> the rows of every file of that setup
    for result in results:
        world = result["summary"]["world_size"]
        setup = result["summary"].get("shape", "7b").upper() + (", 1 GPU" if world == 1 else f", FSDP2, {world} GPUs")
        setups.setdefault(setup, []).extend(result["rows"])
    labelled = set()

    def legend_label(variant: str) -> str | None:
        """The variant's name on its first bar, so that the legend lists every variant once."""
        if variant in labelled:
            return None
        labelled.add(variant)
        return variant

    variants = list(dict.fromkeys(r["variant"] for rows in setups.values() for r in rows))
    memory_groups = [(setup, batch) for setup, rows in setups.items()
                     for batch in sorted({r["batch"] for r in rows if r["measured"] == "equal batch"})]
    group_width = 0.5 + 0.35 * len(variants)  # inches per group of bars
    figure, (memory_ax, speed_ax) = plt.subplots(
        1, 2, figsize=(2 + group_width * (len(memory_groups) + len(setups)), 4.8),
        gridspec_kw={"width_ratios": [max(len(memory_groups), 1), max(len(setups), 1)]})
    width = 0.8 / len(variants)
    offsets = {v: (i - (len(variants) - 1) / 2) * width for i, v in enumerate(variants)}
    for position, (setup, batch) in enumerate(memory_groups):
        for variant, offset in offsets.items():
            row = next((r for r in setups[setup] if r["variant"] == variant and r["measured"] == "equal batch"
                        and r["batch"] == batch), None)
            if row is None:
                continue
            fits = row["peak GiB"] != "OOM"
            bar = memory_ax.bar(position + offset, row["peak GiB"] if fits else 0, width,
                                color=VARIANT_COLORS[variant.partition(":")[0]], label=legend_label(variant))
            memory_ax.bar_label(bar, labels=[f"{row['peak GiB']:.1f}" if fits else "OOM"], fontsize=7)
    for position, (setup, rows) in enumerate(setups.items()):
        for variant, offset in offsets.items():
            if not any(r["variant"] == variant for r in rows):
                continue
            row = next((r for r in rows if r["variant"] == variant and r["measured"] == "largest batch"
                        and "tokens/s/GPU" in r), None)  # a largest batch that ran out of memory when timed: OOM
            bar = speed_ax.bar(position + offset, row["tokens/s/GPU"] if row else 0, width,
                               color=VARIANT_COLORS[variant.partition(":")[0]])
            speed_ax.bar_label(bar, labels=[f"{row['tokens/s/GPU']:,.0f}\nbatch {row['batch']}" if row else "OOM"],
                               fontsize=7)
    memory_ax.set_xticks(range(len(memory_groups)), [f"{setup}\nbatch {batch}".replace(", FSDP2", "\nFSDP2")
                                                     for setup, batch in memory_groups], fontsize=8)
    memory_ax.set_ylabel("peak GiB per GPU")
    memory_ax.set_title("peak memory at equal micro-batch (lower is better)")
    speed_ax.set_xticks(range(len(setups)), [setup.replace(", FSDP2", "\nFSDP2") for setup in setups], fontsize=8)
    speed_ax.set_ylabel("tokens/s per GPU")
    speed_ax.set_title("tokens/s at each one's largest micro-batch")
    memory_ax.legend(fontsize=8)  # one legend: the colours are the same in both charts, and it would cover labels
    for ax in (memory_ax, speed_ax):
        ax.margins(y=0.15)
    device = results[0]["device"]
    figure.suptitle(f"Llama-2 shapes, sequence {results[0]['summary']['seq']}, {device}, torch {results[0]['torch']}")
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)
    plt.close(figure)


def log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def main():
    p = parser(__doc__)
    p.set_defaults(warmup=2, repeat=5)
    p.add_argument("--steps", dest="repeat", type=int, help="timed steps per measurement (same as --repeat)")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU, two steps of each variant")
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b", help="Llama-2 model shape")
    p.add_argument("--layers", type=int, help="decoder layers (default: the shape's, 32 for 7b, 40 for 13b)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--memory-batches", default="1,2", help="comma-separated micro-batches for equal-batch memory")
    p.add_argument("--max-batch", type=int, default=64, help="the largest micro-batch the search tries")
    p.add_argument("--max-seq", type=int, default=0,
                   help="also search the longest sequence that trains at batch 1, up to this length (0: no search)")
    p.add_argument("--seq-unit", type=int, default=1024, help="the sequence search's step (--max-seq a multiple)")
    p.add_argument("--memory-cap", type=float, default=0.95,
                   help="under torchrun: the fraction of each GPU's memory the allocator may use, on every rank")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, metavar="NAME",
                   help=f"what to train, of: {', '.join(VARIANTS)} (default: all; --smoke: {', '.join(SMOKE_VARIANTS)})")
    p.add_argument("--fp8-scales", nargs="+", choices=coat.distributed.SCALE_MODES, default=[FP8_SCALES_DEFAULT],
                   metavar="MODE", help="coat-fp8-comm once per scale mode of its FP8 all-gather "
                   f"({', '.join(coat.distributed.SCALE_MODES)}; default {FP8_SCALES_DEFAULT})")
    p.add_argument("--profile", action="store_true",
                   help="instead of measuring: time and torch.profiler tables of two steps of each variant at the "
                        "first --memory-batches batch (try --layers 8)")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="only draw these result files into --plot-file")
    p.add_argument("--plot-file", default=os.path.join(RESULTS_DIR, "e2e.png"))
    args = p.parse_args()
    if args.plot:
        plot(args.plot, args.plot_file)
        print(f"wrote {args.plot_file}")
        return
    args.steps, args.memory_batches = args.repeat, [int(b) for b in args.memory_batches.split(",")]
    if args.max_seq % args.seq_unit:
        p.error("--max-seq must be a multiple of --seq-unit")
    if args.warmup < 2:
        p.error("--warmup must be at least 2: the second step is the first with optimizer state and gradients")
    if args.layers is None:
        args.layers = SHAPES[args.shape][3]
    if args.smoke:
        args.layers, args.seq = SMOKE_LAYERS, SMOKE_SEQ
        device = torch.device("cpu")
    elif not torch.cuda.is_available() or not coat.built_with_cuda():
        sys.exit("benchmarks/e2e.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    mesh = None
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # A rank stuck in a collective (one rank out of memory, the other not) fails after 90 s, not 10 min.
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=90))
        if device.type == "cuda":
            # Ranks differ in memory PyTorch does not allocate (NCCL, CUDA context), so near the limit one rank
            # could run out of memory in a step the other finishes, and wait forever in the next collective.
            # Under the same allocator cap on every rank, the same allocation fails everywhere.
            torch.cuda.set_per_process_memory_fraction(args.memory_cap, device)
        mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(rank)
    config = llama_config(args.shape, args.layers, args.smoke)

    variants = args.variants or (SMOKE_VARIANTS if args.smoke else VARIANTS)
    variants = [name for v in variants for name in (fp8_comm_variants(args.fp8_scales) if v == FP8_COMM else [v])]
    name = "e2e-1gpu" if world == 1 else f"e2e-fsdp2-{world}gpu"
    if args.shape != "7b":
        name = name.replace("e2e-", f"e2e-{args.shape}-")
    if args.smoke:
        name = "e2e-smoke" if world == 1 else "e2e-fsdp2-smoke"
    missing = {}
    rows = []
    for variant in variants:
        if variant.startswith("torchao") and torchao_missing():
            missing[variant] = torchao_missing()
        elif variant == "coat-fp8-grads" and mesh is not None:
            missing[variant] = "FP8 gradients need unsharded parameters (one process)"
        elif variant.startswith(FP8_COMM) and mesh is None:
            missing[variant] = "FP8 reduce-scatter needs FSDP2 (torchrun)"
        if variant in missing:
            log(f"{variant}: skipped, {missing[variant]}")
            continue
        if args.profile:
            profile_steps(variant, args, config, device, mesh, rank)
            continue
        rows += measure(variant, args, config, device, mesh, rank, world)  # frees its model before the next
        if rank == 0:  # after every variant, so that a run cut short keeps what it measured
            write_results(args.results_dir, name, rows, summarize(rows, args, world, missing))

    if rank == 0 and not args.profile:
        columns = ["variant", "world size", "measured", "batch", "peak GiB", "steady GiB", "reserved GiB", "step ms",
                   "tokens/s/GPU", "state B/param", "all-gather MB/step", "reduce-scatter MB/step",
                   "all-reduce MB/step"]
        print_table(rows, columns)
        summary = summarize(rows, args, world, missing)
        print({k: v for k, v in summary.items() if k not in ("smoke", "layers", "seq")})
        print(f"wrote {write_results(args.results_dir, name, rows, summary)}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
