"""FP8 communication for FSDP2 (fully_shard): gradients reduce-scattered and weights all-gathered in FP8.

Gradients
---------
FSDP2 reduce-scatters the gradients of each sharded module once per backward, in the reduce dtype (bf16 or
float32). :func:`fp8_reduce_scatter` replaces that collective with AGoQ's (section 5): an FP8 sum on the wire
would overflow and lose precision, so nothing is summed in FP8.

    every rank:   its flat gradient buffer, world_size chunks (chunk j is what rank j keeps), each quantized to
                  FP8 in 1 x G blocks with one float32 scale per block   (coat.ops.quantize_group)
    all-to-all:   chunk j's codes and scales go to rank j                 (1 + 4/G bytes per element)
    every rank:   dequantizes the world_size chunks it received to float32 and sums them; with FSDP2's
                  ReduceOp.AVG the sum is divided by world_size; the result lands in the reduce dtype

Bytes sent per element of the buffer: 1 + 4/G (1.03 at G = 128) against 4 for a float32 reduce-scatter and 2
for bf16. Each rank's contribution is rounded once, to its block's FP8 grid (E4M3: 2^-4 of the block's
largest magnitude at most; E5M2: 2^-3); the sum itself is exact in float32 up to its own rounding. A block
holding NaN or Inf gives NaN for that block on every rank: a non-finite gradient is never silently dropped.

FSDP2's gradient divide factor (``set_gradient_divide_factor``, premultiplied sums) is not supported: the
reduce-scatter is then refused with a message. Every rank must install the same collective.

Weights
-------
FSDP2 all-gathers each parameter before its module runs (forward, and again in backward when it resharded
after forward), in the parameter dtype of its mixed-precision policy. A coat projection quantizes its weight
to FP8 as soon as it is gathered, so :func:`fp8_all_gather` quantizes the shards instead and gathers the codes
(FSDP2's fsdp_pre_all_gather / fsdp_post_all_gather extension, as torchao's float8 all-gather):

    every rank:   amax_local = max |W_j| over its shards of the group's weights      (coat.ops.tensor_amax)
    all-reduce:   amax = MAX over ranks of amax_local              (4 bytes per group; when: see Scales below)
    every rank:   codes = fp8(W_shard / scale), scale = max(amax / FP8_MAX, 2^-126)  (coat.ops.quantize_tensors)
    all-gather:   the codes, as uint8                                                (1 byte per element)
    every rank:   the layer reads the gathered codes and the scale (coat.nn.FP8Weight): forward as they are,
                  backward's dgrad GEMM their transpose (the same codes); nothing is quantized to a
                  new scale

A group is the weights that one per-tensor scale covers (:class:`coat.nn.functional.Projections`): q, k and v;
gate and up; o; down; a lone coat.nn.Linear. Quantization is elementwise once the scale is fixed and the max
is exact in any order, so the codes and the scale are those of the unsharded layer bit for bit: same losses,
same gradients. The weights are cast to the policy's parameter dtype first, as FSDP2 would gather them; the
amax is taken in the weights' own dtype and cast likewise (rounding is monotonic: the same bits).
Each rank reads its own shards of a group's weights, so the weights of a group must be sharded by one
fully_shard call (they are when decoder layers are the units).

Scales
------
Bytes sent per element of a weight: 1, against 2 for a bf16 all-gather and 4 for float32, plus 4 per group
for the amaxes. An all-reduce costs latency, not bandwidth (every one makes the ranks wait for each other),
so ``fp8_all_gather(model, scales=...)`` says how many there are:

    "per_unit"     (default) at each gather, the first weight of an FSDP2 unit (one fully_shard call) that
                   FSDP2 prepares agrees the amaxes of all the unit's groups in ONE all-reduce; the unit's other
                   weights, prepared in the same call before any is gathered, take theirs. Never stale.
    "per_group"    one all-reduce per group and gather (as coat did first), for comparison. Never stale.
    "precomputed"  :func:`precompute_fp8_scales` agrees every group's amax of the whole model in ONE
                   all-reduce, after each optimizer step (:func:`precompute_fp8_scales_after_step` registers
                   it); the gathers then run no collective. Before any precompute (the first step) the gathers
                   agree them as "per_unit" does, and keep them.

Staleness rule ("precomputed"): every write to a wrapped weight shard (an optimizer step, a state-dict load,
an in-place edit through the parameter, its DTensor or its local tensor) is counted per weight, on each rank;
a gather of a group written since its amax was agreed raises a RuntimeError that says to call
precompute_fp8_scales(model) (on every rank) - no weight is gathered with a stale scale, and no rank runs a
collective the others do not, so the error cannot deadlock. Ranks count the same writes when each holds rows
of every weight, or when the writes go through the DTensor parameter (load_state_dict, set_model_state_dict,
torch optimizers, in-place ops on the parameter). A rank holding no row of a weight (fewer rows than ranks)
does not see coat.optim.AdamW's step of it, which skips empty shards: after a step without precompute such a
rank gathers while the others raise, and waits in the all-gather until the process group's timeout (or until
torchrun stops it). An edit of one rank's local shard alone is seen by that rank alone, likewise.

The parameters keep their high-precision shards, gradients and optimizer states: FSDP2 reduce-scatters the
gradients as before (fp8_reduce_scatter works alongside), and state dicts hold plain tensors. Everything that
is not a coat projection weight (norms, embeddings, the LM head unless converted) is gathered as before.
"""
from __future__ import annotations

import collections
import copy
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from coat import ops
from coat.nn.config import FP8Config
from coat.nn.fp8_weight import FP8Weight
from coat.nn.modules import Linear, SwiGLUMLP


@dataclass
class CommunicationLog:
    """Running totals of what coat's collectives sent from this rank: elements by dtype, the tensors handed to
    collectives, and the elements of the high-precision buffers they stand for. :class:`FP8ReduceScatter`:
    all-to-alls of uint8 codes and float32 scales for gradient buffers. :class:`FP8AllGather`: all-gathers of
    uint8 codes for weight shards and all-reduces of float32 amaxes, one element per group. Totals, not a
    record per call, so that a log kept for a whole run stays a few numbers."""

    sent: collections.Counter = field(default_factory=collections.Counter)  # torch.dtype -> elements
    tensors: collections.Counter = field(default_factory=collections.Counter)  # torch.dtype -> tensors sent
    buffer_elements: int = 0

    def add(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self.sent[tensor.dtype] += tensor.numel()
            self.tensors[tensor.dtype] += 1

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank handed to collectives."""
        return sum(count * dtype.itemsize for dtype, count in self.sent.items())


class FP8ReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter as an all-to-all of block-scaled FP8 chunks, summed in float32 by the receiver
    (module docstring). Install it with :func:`fp8_reduce_scatter`."""

    def __init__(self, format: str | torch.dtype = "e4m3", block_size: int = 128) -> None:
        if block_size not in ops.GROUP_SIZES:
            raise ValueError(f"block_size must be one of {ops.GROUP_SIZES}, got {block_size!r}")
        self.fp8_dtype = ops.fp8_dtype(format)
        self.block_size = block_size
        self.log = CommunicationLog()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(
                f"coat's FP8 reduce-scatter sums or averages; FSDP2 asked for {op}. A gradient divide factor set with "
                "set_gradient_divide_factor makes FSDP2 ask for a premultiplied sum: leave it at its default."
            )
        world_size = group.size()
        codes, scales = self.quantize(input_tensor, world_size)
        received_codes = torch.empty_like(codes)
        received_scales = torch.empty_like(scales)
        # uint8: not every backend takes float8 dtypes
        dist.all_to_all_single(received_codes.view(torch.uint8), codes.view(torch.uint8), group=group)
        dist.all_to_all_single(received_scales, scales, group=group)
        self.log.add(codes.view(torch.uint8), scales)
        self.log.buffer_elements += input_tensor.numel()
        self.reduce(received_codes, received_scales, output_tensor, average=op == dist.ReduceOp.AVG)
        return None

    def quantize(self, input_tensor: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and block scales each rank sends: its flat buffer as world_size chunks, chunk j for rank j."""
        codes, scales, _ = ops.quantize_group(input_tensor.view(world_size, -1), self.block_size, self.fp8_dtype)
        return codes, scales

    def reduce(self, received_codes: torch.Tensor, received_scales: torch.Tensor, output_tensor: torch.Tensor,
               average: bool) -> None:
        """The received chunks dequantized to float32 and summed (divided by their number when ``average``)
        into ``output_tensor``."""
        received = ops.dequantize(received_codes, received_scales, self.block_size, torch.float32)
        # A float32 output takes the sum in place (viewed as the sum's shape, so that out= never resizes it); a
        # bf16 / fp16 one gets it rounded once.
        in_place = output_tensor.view(received.shape[1:]) if output_tensor.dtype == torch.float32 else None
        total = torch.sum(received, dim=0, out=in_place)
        if average:
            total /= received.shape[0]
        if in_place is None:
            output_tensor.copy_(total)


def fp8_reduce_scatter(model: torch.nn.Module, format: str | torch.dtype = "e4m3", block_size: int = 128) -> FP8ReduceScatter:
    """Makes every FSDP2 module in ``model`` (the modules ``fully_shard`` was applied to) reduce-scatter its
    gradients with one shared :class:`FP8ReduceScatter`, and returns it (its ``log`` counts what was sent).
    Call it after ``fully_shard``, on every rank."""
    comm = FP8ReduceScatter(format, block_size)
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not sharded:
        raise ValueError("fp8_reduce_scatter needs a model sharded with fully_shard (FSDP2); call it after fully_shard")
    for module in sharded:
        module.set_custom_reduce_scatter(comm)
    return comm


SCALE_MODES = ("per_group", "per_unit", "precomputed")


class FP8AllGather:
    """What :func:`fp8_all_gather` installed: its ``scales`` mode and its ``log``, which counts what its
    collectives sent (module docstring)."""

    def __init__(self, model: nn.Module, scales: str) -> None:
        if scales not in SCALE_MODES:
            raise ValueError(f"coat.distributed.fp8_all_gather: scales must be one of {SCALE_MODES}, got {scales!r}")
        self.scales = scales
        self.log = CommunicationLog()
        self._model = weakref.ref(model)  # where the FSDP2 units are looked up, at the first gather

    def __deepcopy__(self, memo) -> "FP8AllGather":
        """A copied model's: its units are those of the copy (or, when only a part was copied, each group alone)."""
        model = memo.get(id(self._model()))
        copied = FP8AllGather.__new__(FP8AllGather)
        copied.scales, copied.log = self.scales, CommunicationLog()
        copied._model = weakref.ref(model) if model is not None else lambda: None
        return copied

    def record(self, codes: torch.Tensor) -> None:
        self.log.add(codes)
        self.log.buffer_elements += codes.numel()

    def agree(self, groups: list["_ScaleGroup"], process_group, gathering: bool) -> None:
        """Every group's amax over its weights on every rank, in ONE all-reduce of the stacked local amaxes,
        held for the gather under way (``gathering``) and, under scales="precomputed", until a weight is written.
        The amaxes are those of the weights in their own dtype: rounding is monotonic, so the amax of the
        weights cast to the gathered dtype is this one cast (:meth:`FP8AllGatherWeight.fsdp_pre_all_gather`)."""
        amaxes = torch.stack([ops.tensor_amax(group.local_shards()) for group in groups])
        dist.all_reduce(amaxes, dist.ReduceOp.MAX, group=process_group)
        self.log.add(amaxes)
        for group, amax in zip(groups, amaxes):
            if gathering:
                group._amax, group._awaiting = amax, set(range(len(group.modules)))
            if self.scales == "precomputed":
                group._precomputed = amax, list(group.writes)

    def assign_units(self) -> None:
        """Each scale group's unit: the groups of the parameters that one fully_shard call gathers together."""
        model = self._model()
        if model is None:
            return
        units: dict[int, list[_ScaleGroup]] = {}

        def visit(module: nn.Module, unit: object) -> None:
            if isinstance(module, FSDPModule):
                unit = module._get_fsdp_state()  # shared by the modules of one fully_shard([...]) call
            weight = module._parameters.get("weight")
            local = weight._local_tensor if isinstance(weight, DTensor) else weight
            if isinstance(local, FP8AllGatherWeight):
                groups = units.setdefault(id(unit), [])
                if local.group not in groups:
                    groups.append(local.group)
                    local.group.unit = groups
            for child in module.children():
                visit(child, unit)

        visit(model, None)  # groups under no fully_shard module of the model are gathered by one above it


@dataclass(eq=False, repr=False)
class _ScaleGroup:
    """Projections whose weights share one FP8 scale, and where to find their shards.

    The weights hold their group, so the group holds its modules weakly: once FSDP2 has trained the model,
    C++ also holds the wrapped shards, the garbage collector no longer looks into their attributes, and a
    strong reference back to the modules kept the whole model alive after the user dropped it (at 7B on two
    GPUs, 12.6 GiB per rank for each model built in turn)."""

    names: list[str]
    modules: list[weakref.ref]  # to nn.Module
    fp8_dtype: torch.dtype
    comm: FP8AllGather
    # Writes to each member's shard on this rank (__torch_dispatch__), for the staleness check of precomputed scales.
    writes: list[int] = field(default_factory=list)

    unit: list["_ScaleGroup"] | None = None  # the groups FSDP2 gathers with this one (FP8AllGather.assign_units)
    # The agreed amax (in the weights' own dtype) and the members of the current gather that have not read it yet.
    _amax: torch.Tensor | None = None
    _awaiting: set[int] = field(default_factory=set)
    # scales="precomputed": the amax last agreed, and the writes it saw.
    _precomputed: tuple[torch.Tensor, list[int]] | None = None

    def __post_init__(self) -> None:
        self.writes = [0] * len(self.modules)

    def __deepcopy__(self, memo) -> "_ScaleGroup":
        """The group of a copied model: its weights point to the copied modules, not to the originals."""
        modules = [copy.deepcopy(module(), memo) for module in self.modules]
        return _ScaleGroup(list(self.names), [weakref.ref(module) for module in modules], self.fp8_dtype,
                           copy.deepcopy(self.comm, memo))

    def agreed_amax(self, member: int, process_group) -> torch.Tensor:
        """The group's amax over its weights on every rank. FSDP2 prepares every parameter of a unit for one
        all-gather before it gathers any (fsdp_post_all_gather ends the gather: :meth:`end_gather`), and nothing
        changes them in between: the first member asked agrees the amax (with the rest of its unit's groups
        unless scales="per_group"), its siblings in that gather take it. A member asked again agrees it afresh,
        except under scales="precomputed", which reuses the last agreed amax while no member was written since."""
        if member in self._awaiting:
            self._awaiting.discard(member)
            return self._amax
        if self.comm.scales == "precomputed" and self._precomputed is not None:
            amax, writes = self._precomputed
            if writes != self.writes:
                raise RuntimeError(
                    f"coat.distributed.fp8_all_gather: the weights of {', '.join(self.names)} were written (an "
                    "optimizer step, a state-dict load, an in-place edit) since their FP8 scale was agreed; with "
                    "scales='precomputed', call coat.distributed.precompute_fp8_scales(model) on every rank after "
                    "changing the weights (precompute_fp8_scales_after_step(optimizer, model) does it after each "
                    "step), or use scales='per_unit'"
                )
            return amax
        if self.comm.scales == "per_group":
            groups = [self]
        else:
            if self.unit is None:
                self.comm.assign_units()
            groups = self.unit or [self]
        self.comm.agree(groups, process_group, gathering=True)
        self._awaiting.discard(member)
        return self._amax

    def end_gather(self) -> None:
        """Called once a gather's codes arrived: the weights may change before the next gather."""
        for group in self.unit or [self]:
            group._amax, group._awaiting = None, set()

    def local_shards(self) -> list[torch.Tensor]:
        shards = []
        for name, module in zip(self.names, self.modules):
            weight = module().weight
            local = weight._local_tensor if isinstance(weight, DTensor) else weight
            if not isinstance(local, FP8AllGatherWeight):
                raise RuntimeError(
                    f"coat.distributed.fp8_all_gather: {', '.join(self.names)} share one FP8 scale, which every rank "
                    f"computes from its shards of all of them, but {name} is not sharded here; shard them with one "
                    "fully_shard call (e.g. one per decoder layer)"
                )
            shards.append(local._tensor)
        return shards


# What FSDP2 does to a parameter while it shards it (pad, narrow, view, copy, move) and copy.deepcopy must keep
# the all-gather extension; anything else (the optimizer's update, arithmetic) runs on the plain shard.
_OPS_KEEPING_THE_WRAPPER = {
    torch.ops.aten.detach.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class FP8AllGatherWeight(torch.Tensor):
    """A coat projection's weight (or its FSDP2 shard) that FSDP2 all-gathers as FP8 codes: a wrapper of the
    high-precision tensor, which every operation other than FSDP2's reads and writes unchanged."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, group: _ScaleGroup, member: int):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, group: _ScaleGroup, member: int):
        self._tensor = tensor
        self.group = group
        self.member = member  # its index in the group

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._tensor})"

    def __reduce_ex__(self, protocol):
        # torch.save and pickle store the plain tensor, as state dicts hold it: the extension is FSDP2's business
        return self._tensor.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        weight = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, FP8AllGatherWeight))
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            _count_writes(func, args, kwargs)
        args, kwargs = pytree.tree_map_only(FP8AllGatherWeight, lambda t: t._tensor, (args, kwargs))
        out = func(*args, **kwargs)
        if func not in _OPS_KEEPING_THE_WRAPPER:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: FP8AllGatherWeight(t, weight.group, weight.member), out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self.group, self.member)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, context, outer_size, outer_stride):
        return FP8AllGatherWeight(inner_tensors["_tensor"], *context)

    @torch.no_grad()
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self.dtype  # what FSDP2 would have gathered, and the layer quantized
        amax = self.group.agreed_amax(self.member, mesh.get_group())
        if dtype not in (self._tensor.dtype, torch.float32):  # the amax of the weights cast to dtype (agree)
            amax = amax.to(dtype).float()
        # Every rank sends as many rows as FSDP2's first shard holds; the last ranks' shards are padded.
        padded_rows = -(-outer_size[0] // mesh.size())
        codes, scale = quantize_shard(self._tensor.to(dtype), amax, self.group.fp8_dtype, padded_rows)
        self.group.comm.record(codes)
        return (codes,), (scale, amax, outer_size[0])

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,) = all_gather_outputs
        scale, amax, rows = metadata
        self.group.end_gather()
        if out is not None:  # FSDP2 gathered into the buffer of the previous gather: the scale may be new
            out.scale, out.amax = scale, amax
            return None
        weight = FP8Weight(codes[:rows].view(self.group.fp8_dtype), scale, amax, param_dtype)
        return weight, (codes,)


def quantize_shard(shard: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype,
                   padded_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rank all-gathers of its shard of a weight: the FP8 codes under the agreed ``amax``, as uint8
    (not every backend takes float8 dtypes), zero rows appended up to ``padded_rows``; and their scale."""
    codes, scale, _ = ops.quantize_tensors([shard], fp8_dtype, dim=0, amax=amax)
    return F.pad(codes.view(torch.uint8), (0, 0, 0, padded_rows - codes.shape[0])), scale


def _count_writes(func, args, kwargs) -> None:
    """Counts a write to each wrapped weight that ``func`` mutates (_ScaleGroup.writes), except FSDP2's copies
    of a shard into a new buffer of the same weight (when it pads a shard: on some ranks only), which change
    no value."""
    if func is torch.ops.aten.copy_.default and all(isinstance(t, FP8AllGatherWeight) for t in args[:2]):
        if (args[1].group, args[1].member) == (args[0].group, args[0].member):
            return
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, FP8AllGatherWeight):
                tensor.group.writes[tensor.member] += 1


def _plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight without the all-gather extension, sharing its data: what state dicts hold."""
    if isinstance(weight, DTensor) and isinstance(weight._local_tensor, FP8AllGatherWeight):
        return DTensor.from_local(weight._local_tensor._tensor, weight.device_mesh, weight.placements,
                                  run_check=False, shape=weight.shape, stride=weight.stride())
    return weight._tensor if isinstance(weight, FP8AllGatherWeight) else weight


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = _plain_weight(state_dict[key])


def _scale_groups(model: nn.Module) -> list[tuple[str, list[str], list[nn.Module], FP8Config]]:
    """(parent name, projection names, projection modules, config) per group of projections sharing a scale."""
    decoder = sys.modules.get("coat.nn.decoder")  # converted decoder layers exist only once coat.convert loaded it
    groups, grouped = [], set()
    for name, module in model.named_modules():
        if decoder is not None and isinstance(module, decoder.FP8DecoderLayerMixin):
            parent, config, member_sets = module.self_attn, module.fp8_config, module.attention_scale_groups
            name = f"{name}.self_attn"
        elif isinstance(module, SwiGLUMLP):
            parent, config, member_sets = module, module.config, (("gate_proj", "up_proj"), ("down_proj",))
        elif isinstance(module, Linear) and module not in grouped:
            parent, config, member_sets = module, module.config, ((),)
        else:
            continue
        for members in member_sets:
            modules = [getattr(parent, member) for member in members] or [parent]
            groups.append((name, [f"{name}.{m}" for m in members] or [name], modules, config))
            grouped.update(modules)
    return groups


def _check_supported(names: list[str], config: FP8Config) -> None:
    if config.gradient_format is None:
        raise ValueError(
            f"coat.distributed.fp8_all_gather: {names[0]} has gradient_format=None, whose backward multiplies by the "
            "high-precision weight, which an FP8 all-gather does not bring; use an FP8 gradient_format"
        )
    if config.smooth_swiglu:
        raise ValueError(
            f"coat.distributed.fp8_all_gather: {names[0]} uses smooth_swiglu, which folds a scale computed from the "
            "activations into the down projection's weight before quantizing it: its FP8 codes cannot be made "
            "before the forward"
        )


def fp8_all_gather(model: nn.Module, scales: str = "per_unit") -> FP8AllGather:
    """Makes FSDP2 all-gather the weights of the coat projections in ``model`` as FP8 codes plus one agreed
    scale per group (module docstring), and returns the :class:`FP8AllGather` whose ``log`` counts what was
    sent. ``scales`` says when the scales are agreed: "per_unit" (one all-reduce per FSDP2 unit and gather),
    "per_group" (one per group and gather) or "precomputed" (:func:`precompute_fp8_scales`). Order, on every
    rank: coat.convert, move the model to its device and dtype, fp8_all_gather, fully_shard, then build the
    optimizer."""
    comm = FP8AllGather(model, scales)
    if any(isinstance(module, FSDPModule) for module in model.modules()) or any(
        isinstance(param, DTensor) for param in model.parameters()
    ):
        raise ValueError(
            "coat.distributed.fp8_all_gather must run before fully_shard (FSDP2 sets up how it gathers each "
            "parameter when it shards it), and does not support DTensor (tensor-parallel) weights"
        )
    groups = _scale_groups(model)
    if not groups:
        raise ValueError(
            f"coat.distributed.fp8_all_gather found no coat projections in {type(model).__name__}: convert the model "
            "with coat.convert (or build it from coat.nn layers) first"
        )
    parameter_uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        parameter_uses[id(param)] = parameter_uses.get(id(param), 0) + 1
    for _, names, modules, config in groups:
        _check_supported(names, config)
        for name, module in zip(names, modules):
            if isinstance(module.weight, FP8AllGatherWeight):
                raise ValueError(f"coat.distributed.fp8_all_gather: already installed on {name}")
            if parameter_uses[id(module.weight)] > 1:
                raise ValueError(
                    f"coat.distributed.fp8_all_gather: {name}.weight is tied to another parameter, which would be "
                    "gathered in FP8 too; untie it or leave the module unconverted"
                )
    for _, names, modules, config in groups:
        group = _ScaleGroup(names, [weakref.ref(m) for m in modules], config.forward_dtype, comm)
        for member, module in enumerate(modules):
            weight = module.weight
            module.weight = nn.Parameter(FP8AllGatherWeight(weight.detach(), group, member),
                                         requires_grad=weight.requires_grad)
            module.register_state_dict_post_hook(_plain_weight_in_state_dict)
    return comm


def _gathered_scale_groups(model: nn.Module) -> list[_ScaleGroup]:
    """The scale groups of ``model``'s weights that FSDP2 all-gathers in FP8, in module order."""
    groups = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        local = weight._local_tensor if isinstance(weight, DTensor) else None
        if isinstance(local, FP8AllGatherWeight):
            groups.setdefault(local.group, weight.device_mesh)
    return list(groups.items())


@torch.no_grad()
def precompute_fp8_scales(model: nn.Module) -> None:
    """Agrees the FP8 scale of every group of ``model``'s weights gathered with
    ``fp8_all_gather(model, scales="precomputed")`` in ONE all-reduce, from the weights as they are now; the
    gathers then run no collective until a weight is written (module docstring). Call it on every rank after
    each optimizer step (:func:`precompute_fp8_scales_after_step` registers it) and after loading or editing
    the weights. The precedent is torchao's precompute_float8_dynamic_scale_for_fsdp."""
    groups = _gathered_scale_groups(model)
    if not groups:
        raise ValueError(
            f"coat.distributed.precompute_fp8_scales: no weight of {type(model).__name__} is all-gathered in FP8; "
            "call fp8_all_gather(model, scales='precomputed') before fully_shard, and this after it"
        )
    others = sorted({group.comm.scales for group, _ in groups} - {"precomputed"})
    meshes = {mesh for _, mesh in groups}
    if others:
        raise ValueError(
            f"coat.distributed.precompute_fp8_scales: the scales of {groups[0][0].names[0]} and others are agreed "
            f"at every gather (scales={others[0]!r}); install fp8_all_gather(model, scales='precomputed') instead"
        )
    if len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        raise NotImplementedError(
            "coat.distributed.precompute_fp8_scales: the weights must be sharded over one 1-D device mesh (FSDP2 "
            "without HSDP); use scales='per_unit'"
        )
    groups[0][0].comm.agree([group for group, _ in groups], next(iter(meshes)).get_group(), gathering=False)


def precompute_fp8_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Makes every ``optimizer.step()`` end with :func:`precompute_fp8_scales` on ``model``; returns the hook's
    handle (``handle.remove()`` undoes it)."""
    model_ref = weakref.ref(model)  # the optimizer outlives no model through its hook

    def precompute(optimizer, args, kwargs) -> None:
        if model_ref() is not None:
            precompute_fp8_scales(model_ref())

    return optimizer.register_step_post_hook(precompute)
