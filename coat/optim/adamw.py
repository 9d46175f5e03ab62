"""coat.optim.AdamW: a drop-in for torch.optim.AdamW that keeps both Adam moments in FP8 (COAT, section 4).

The update, per element, in float32 inside one fused kernel (coat.ops.fp8_adamw_step, one call per parameter
group and device), with decoupled weight decay as in torch.optim.AdamW:

    m, v = dequantize(exp_avg), dequantize(exp_avg_sq)
    m    = beta1 * m + (1 - beta1) * g
    v    = beta2 * v + (1 - beta2) * g^2
    p    = p * (1 - lr * weight_decay)
    p    = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    exp_avg, exp_avg_sq = quantize(m), quantize(v)    fresh scale, k and C per group (dynamic range expansion)

State of a parameter p (``opt.state[p]``):

    step             0-d float32 CPU tensor, as torch keeps it: the bias corrections are computed on the host
                     from it, so step() never waits for the GPU
    exp_avg          FP8 codes of m: p's shape, dtype float8_e4m3fn or float8_e5m2 (m_format)
    exp_avg_meta     bfloat16 (scale, k, C) of each group of m: shape (*p.shape[:-1], ceil(p.shape[-1] / G), 3)
    exp_avg_sq       FP8 codes of v (v_format)
    exp_avg_sq_meta  bfloat16 (scale, k, C) of each group of v

A group is a run of G (group_size) elements along the last dimension; each row ends in a short group when G
does not divide it. That is 2 + 12 / G bytes per parameter (2.09 at G = 128) against torch's 8.

Parameters without master weights. A bfloat16 parameter is updated in float32 and stored back in bfloat16:
2 bytes instead of a float32 master copy's 4. ``param_rounding="nearest"`` (the default) loses every update
smaller than half a bfloat16 ulp of its parameter; ``"stochastic"`` rounds up with probability equal to the
fraction of an ulp the float32 result lies above the bfloat16 value below it, so the stored parameter equals
the update in expectation and small updates add up over steps (the random bits come from a seed per parameter
and step, derived from ``rounding_seed``, which the state dict keeps, so a resumed run draws the same bits).

FP8 gradients (``fp8_grads="e5m2"`` or ``"e4m3"``). After backward accumulates a parameter's gradient, a hook
quantizes it to FP8 with one per-tensor scale (``scale = amax / FP8_MAX``, coat.ops.quantize_tensors) and frees
the 2- or 4-byte gradient: 1 byte per parameter stays until ``zero_grad()``. Gradient accumulation over
micro-batches adds each new gradient to the dequantized stored one and quantizes the sum again (one FP8
rounding per micro-batch). ``param.grad`` is None after backward, so clip with :meth:`clip_grad_norm_` of this
optimizer (torch.nn.utils.clip_grad_norm_ sees no gradients there); :meth:`grad` returns a parameter's
dequantized gradient. Non-finite gradients follow the quantizers' rule (coat.ops): the per-tensor amax ignores
NaN, so a NaN element stays NaN and the rest of its tensor quantizes as if it were absent; as in
torch.optim.AdamW, only that element of the parameter turns NaN. An Inf element makes the scale Inf and the
whole FP8 gradient NaN (FP8 cannot hold the overflow, and clipping it would hide it), so the whole parameter
turns NaN. Either way :meth:`grad` shows the NaN and :meth:`clip_grad_norm_` returns NaN, which
``error_if_nonfinite`` reports. FP8 gradients need unsharded parameters (not FSDP2 DTensors).

Distributed parameters (DTensor, from FSDP2's fully_shard). The step runs on the local shards; ``exp_avg`` and
``exp_avg_sq`` are DTensors placed like the parameter. For a parameter with two or more dimensions the meta is a
DTensor placed like the parameter too: FSDP2 shards dim 0, which cuts between rows, so every rank holds whole
groups and the result is the same as on one process. A 1-D parameter (norm weight, bias) is a single row that
dim-0 sharding cuts anywhere: its groups are G-element runs from the start of each rank's shard, and its meta
is a plain tensor holding the groups of the local shard. Sharding the last dimension of a parameter with two
or more dimensions would split groups and is refused.

FSDP1 (use_orig_params=True) hands the optimizer 1-D views of each rank's flat shard (empty on ranks that hold
none of a parameter): their groups are G-element runs of that view, in the flattened order of the parameter.

Checkpoints. ``state_dict()`` returns the state above, except that the meta of a 1-D (or 0-d) parameter is
saved per element, shape (*p.shape, 3), placed like the parameter, so that any sharding can load it;
torch.distributed.checkpoint saves and reshards it like any DTensor. ``load_state_dict()`` re-forms the groups
of the loading layout: a group whose elements all carry the same saved meta keeps its codes and meta, so a
checkpoint loaded on the layout that saved it continues bit for bit; a group that mixes elements of different
saved groups (a shard boundary moved) is dequantized exactly, element by element, and quantized again, one
more FP8 rounding of those elements. Parameters with two or more dimensions keep their row-wise groups under
any dim-0 sharding, so their states load exactly on any number of ranks.

Copies. ``copy.deepcopy`` and ``pickle`` of the optimizer (together with its model, as for torch's optimizers)
give an optimizer that steps bit for bit as the original would, FP8 gradients pending from backward included.
The state dict round-trips through torch.save / torch.load and torch.distributed.checkpoint, and deep-copies;
plain ``pickle`` writes it but cannot load it back, as it cannot load any float8 tensor (torch 2.13): pickle
``torch.save``'s bytes instead.
"""
from __future__ import annotations

import math
import weakref
from collections import defaultdict
from copy import deepcopy
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from coat import ops

# Options that fix how the states are stored: a checkpoint must have been saved with the same ones.
_STORAGE_OPTIONS = ("group_size", "m_format", "v_format")
_COAT_OPTIONS = (*_STORAGE_OPTIONS, "expand", "param_rounding", "rounding_seed")
_PARAM_ROUNDINGS = ("nearest", "stochastic")
# FP8 gradients are dequantized to bfloat16 for the fused step in chunks of at most this many elements, so the
# step never holds more than 128 MiB of them at once (one larger tensor is its own chunk).
_DEQUANTIZED_GRAD_CHUNK = 1 << 26
# Parameters of a group whose kernel call is enqueued before the host prepares the next ones: the CUDA kernel's
# launch size (kTensorsPerLaunch in csrc/cuda/adamw_step.cu), so that the GPU runs one launch while the host builds
# the next call's tensor lists and the binding checks them, instead of waiting for all of the group's. The first
# call takes fewer, so that the GPU starts after a few parameters' preparation rather than 32 parameters'.
_PARAMS_PER_CALL = 32
_PARAMS_IN_FIRST_CALL = 2
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_MASK32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# parameter -> weak reference to the coat.optim.AdamW whose fp8_grads hook keeps its gradients
_FP8_GRAD_OWNERS = WeakIdKeyDictionary()  # by identity: tensors compare element-wise
# torch.optim.AdamW features coat does not implement, with the only value accepted for each.
_UNSUPPORTED_FEATURES = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "fused": None,
    "capturable": False,
    "differentiable": False,
}
_SUPPORTED_FEATURES_TEXT = ", ".join(f"{name}={value}" for name, value in _UNSUPPORTED_FEATURES.items())
# (codes key, meta key, format option, index of its flag in the expand pair)
_MOMENTS = (("exp_avg", "exp_avg_meta", "m_format", 0), ("exp_avg_sq", "exp_avg_sq_meta", "v_format", 1))
_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FORMAT_NAMES = {dtype: name for name, dtype in ops.FP8_DTYPES.items()}


class _FP8Bytes(NamedTuple):
    """An FP8 tensor as its bytes, in the form :meth:`AdamW.__getstate__` hands pickle and deepcopy."""

    data: torch.Tensor  # uint8 view
    dtype: torch.dtype

    @staticmethod
    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dtype in ops.FP8_MAX:
            return _FP8Bytes(value.view(torch.uint8), value.dtype)
        return value

    @staticmethod
    def unwrap(value: Any) -> Any:
        return value.data.view(value.dtype) if isinstance(value, _FP8Bytes) else value


class AdamW(torch.optim.Optimizer):
    """AdamW whose first and second moments are stored in FP8 with per-group dynamic range expansion.

    Takes the arguments of torch.optim.AdamW, and:

    Args:
        group_size: elements per quantization group along the last dimension: 16, 32, 64 or 128.
        m_format, v_format: FP8 format of the first and second moment: "e4m3" or "e5m2", or the dtypes
            torch.float8_e4m3fn / torch.float8_e5m2.
        expand: dynamic range expansion on (True) or off (False), or a (m, v) pair of bools.
        param_rounding: how the update of a bfloat16 parameter is rounded: "nearest" or "stochastic" (see the
            module docstring; float32 parameters are stored exactly either way).
        rounding_seed: the seed of stochastic rounding, an integer; None takes torch.initial_seed() (so
            torch.manual_seed fixes it, and nothing is drawn from the generator).
        fp8_grads: None (gradients stay in param.grad), or "e5m2" / "e4m3": each gradient is kept in FP8 with
            a per-tensor scale once backward has produced it (module docstring). Not per group.

    All of these but fp8_grads, like lr, betas, eps and weight_decay, can be set per parameter group.
    Parameters are float32 (master weights; gradients float32, bfloat16 or float16) or bfloat16 (no master
    copy: 2 bytes per parameter, each update rounded as param_rounding says). amsgrad, maximize, foreach,
    fused, capturable and differentiable are accepted only at their defaults (False or None), and raise
    otherwise.

    Beyond torch.optim.Optimizer: :meth:`torch_state_dict` and :meth:`load_torch_state_dict` convert to and
    from the state of torch.optim.AdamW, to switch optimizers in the middle of a run; under fp8_grads,
    :meth:`grad` and :meth:`clip_grad_norm_`.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        group_size: int = 128,
        m_format: str | torch.dtype = "e4m3",
        v_format: str | torch.dtype = "e4m3",
        expand: bool | tuple[bool, bool] = True,
        param_rounding: str = "nearest",
        rounding_seed: int | None = None,
        fp8_grads: str | torch.dtype | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            group_size=group_size,
            m_format=m_format,
            v_format=v_format,
            expand=expand,
            param_rounding=param_rounding,
            rounding_seed=_draw_seed() if rounding_seed is None else rounding_seed,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
        )
        _normalize_options(defaults)
        self._fp8_grad_dtype = None if fp8_grads is None else ops.fp8_dtype(fp8_grads)
        # param -> (FP8 codes of the gradient, as a rows x cols matrix; 0-d float32 scale)
        self._fp8_grads: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _normalize_options(group)
            for param in group["params"]:
                _check_param_dtype(param)
                if self._fp8_grad_dtype is not None:
                    _check_fp8_grad_param(param)
        except ValueError:
            self.param_groups.pop()
            raise
        if self._fp8_grad_dtype is not None:
            self._hook_fp8_grads(group["params"])

    def _hook_fp8_grads(self, params: Iterable[torch.Tensor]) -> None:
        """Makes backward hand this optimizer the gradients of ``params`` (fp8_grads). The hook holds the
        optimizer weakly: once it is gone, its hooks do nothing and another optimizer may keep the gradients."""
        hook = _fp8_grad_hook(weakref.ref(self))
        for param in params:
            if param.requires_grad:
                _FP8_GRAD_OWNERS[param] = weakref.ref(self)
                param.register_post_accumulate_grad_hook(hook)

    def __getstate__(self) -> dict[str, Any]:
        """torch's (defaults, state, param_groups) and the FP8 gradients with their format, so that
        copy.deepcopy and pickle give a working optimizer. FP8 tensors travel as their bytes: pickle cannot load
        a float8 tensor (torch 2.13 rebuilds the storage through the legacy torch.load, which has no float8)."""
        state = super().__getstate__()
        state["state"] = _map_state(self.state, _FP8Bytes.wrap)
        state["_fp8_grad_dtype"] = self._fp8_grad_dtype
        state["_fp8_grads"] = {param: tuple(map(_FP8Bytes.wrap, grad)) for param, grad in self._fp8_grads.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restores a copy made through :meth:`__getstate__`, hooking its parameters' gradients under
        fp8_grads; or, from load_state_dict, sets state and param_groups."""
        if "_fp8_grads" not in state:  # load_state_dict's update: state and param_groups only
            super().__setstate__(state)
            return
        state = dict(state)
        state["state"] = _map_state(state["state"], _FP8Bytes.unwrap)
        state["_fp8_grads"] = {param: tuple(map(_FP8Bytes.unwrap, grad)) for param, grad in state["_fp8_grads"].items()}
        super().__setstate__(state)
        if self._fp8_grad_dtype is not None:
            params = [param for group in self.param_groups for param in group["params"]]
            for param in params:  # a copy sharing the original's parameters would race it for their gradients
                _check_fp8_grad_param(param)
            self._hook_fp8_grads(params)

    @property
    def fp8_grads(self) -> torch.dtype | None:
        """The FP8 dtype gradients are kept in (the fp8_grads option), or None."""
        return self._fp8_grad_dtype

    @torch.no_grad()
    def _quantize_grad(self, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook of fp8_grads: param.grad (plus the stored FP8 gradient, when
        accumulating) goes to FP8 with a per-tensor scale, and param.grad is freed."""
        grad = param.grad
        if grad is None:
            return
        stored = self._fp8_grads.get(param)
        if stored is not None:
            grad = grad.float() + ops.dequantize(*stored, None, torch.float32).view(grad.shape)
        codes, scale, _ = ops.quantize_tensors([_as_rows(grad).contiguous()], self._fp8_grad_dtype, dim=0)
        self._fp8_grads[param] = (codes, scale)
        param.grad = None

    def grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the next step will use for ``param``: its FP8 gradient dequantized to float32 under
        fp8_grads, else ``param.grad``; None when it has none."""
        stored = self._fp8_grads.get(param)
        if stored is None:
            return param.grad
        return ops.dequantize(*stored, None, torch.float32).view(param.shape)

    def fp8_moments(self, param: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The FP8 moments of ``param`` as ``{"m": (codes, meta), "v": (codes, meta)}``, this process's shard
        for a DTensor parameter: codes as rows (a 0-d parameter is one row of one element) and meta
        (scale, k, C) per group; {} before the parameter's first step or for an empty shard."""
        state = self.state.get(param)
        if not state or _local(param).numel() == 0:
            return {}
        return {
            ("m", "v")[index]: (_as_rows(_local(state[codes_key])), _local(state[meta_key]))
            for codes_key, meta_key, _, index in _MOMENTS
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim.Optimizer.zero_grad, and drops the FP8 gradients of fp8_grads."""
        super().zero_grad(set_to_none)
        self._fp8_grads.clear()

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters, FP8 gradients included: returns
        the total norm of the gradients (as a float32 tensor) and scales them by ``max_norm / (norm + 1e-6)``
        when that is below 1. An FP8 gradient is scaled through its per-tensor scale, with no pass over its
        codes. Use it in place of torch.nn.utils.clip_grad_norm_ under fp8_grads."""
        params = [p for group in self.param_groups for p in group["params"]]
        fp8 = [self._fp8_grads[p] for p in params if p in self._fp8_grads]
        plain = [p.grad for p in params if p.grad is not None]
        if any(isinstance(g, DTensor) for g in plain):
            raise NotImplementedError(
                "coat.optim.AdamW.clip_grad_norm_ is for FP8 gradients of unsharded parameters; clip FSDP2's "
                "DTensor gradients with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)"
            )
        if not fp8 and not plain:
            return torch.tensor(0.0, device="cpu")
        norms = [
            torch.linalg.vector_norm(codes.to(torch.bfloat16), norm_type, dtype=torch.float32) * scale
            for codes, scale in fp8
        ]
        norms += [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in plain]
        device = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped; "
                "pass error_if_nonfinite=False to skip this check"
            )
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, scale in fp8:
            scale.mul_(coefficient.to(scale.device))
        if plain:
            torch._foreach_mul_(plain, coefficient)
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None or p in self._fp8_grads]
        if not params:
            return
        states = []
        for param in params:  # every parameter checked before any is updated
            _check_for_step(param, self._fp8_grads.get(param))
            state = self.state[param]
            if not state:
                _init_state(param, group, state)
            states.append(state)
        index_of = _param_indices(self.param_groups) if group["param_rounding"] == "stochastic" else {}
        bounds = [0, *range(_PARAMS_IN_FIRST_CALL, len(params), _PARAMS_PER_CALL), len(params)]
        for start, end in zip(bounds, bounds[1:]):
            self._step_params(group, params[start:end], states[start:end], index_of)
        # Raised after the kernel calls, which took step + 1, so that raising them does not delay the first one.
        torch._foreach_add_([state["step"] for state in states], 1.0)

    def _step_params(
        self, group: dict[str, Any], params: list[torch.Tensor], states: list[dict[str, Any]], index_of: dict[int, int]
    ) -> None:
        """The kernel calls of a slice of the group's checked parameters, for their step counts plus one."""
        # One kernel call per device and step count (and per chunk of dequantized FP8 gradients). A group's
        # parameters normally share one count; one added later, or one without a gradient on some steps, has its
        # own, hence its own bias corrections.
        batches: dict[tuple[torch.device, float], list[tuple[torch.Tensor, dict[str, Any]]]] = {}
        for param, state in zip(params, states):
            local_param = _local(param)
            if local_param.numel() == 0:  # an FSDP rank holding none of this parameter
                continue
            step = state["step"].item() + 1.0  # a CPU tensor: reading it does not synchronize the GPU
            batches.setdefault((local_param.device, step), []).append((param, state))

        beta1, beta2 = group["betas"]
        lr = _host_lr(group["lr"])
        expand_m, expand_v = group["expand"]
        stochastic = group["param_rounding"] == "stochastic"
        for (_, step), entries in batches.items():
            # float64 on the host from the step count, exactly as torch.optim.AdamW computes them.
            decay_factor, step_size, bias_correction2_sqrt = ops.adamw_scalars(
                lr, beta1, beta2, group["weight_decay"], step
            )
            for chunk in self._chunks(entries):
                tensors: list[list[torch.Tensor]] = [[] for _ in range(6)]
                for param, state in chunk:
                    for tensor_list, tensor in zip(tensors, (
                        _local(param),
                        self._step_grad(param),
                        _local(state["exp_avg"]),
                        _local(state["exp_avg_meta"]),
                        _local(state["exp_avg_sq"]),
                        _local(state["exp_avg_sq_meta"]),
                    )):
                        tensor_list.append(_as_rows(tensor))
                seeds = None
                if stochastic:
                    step_seed = _step_seed(group["rounding_seed"], step)
                    seeds = [_param_seed(step_seed, index_of[id(p)], p) for p, _ in chunk]
                ops.fp8_adamw_step(
                    *tensors,
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    decay_factor=decay_factor,
                    step_size=step_size,
                    bias_correction2_sqrt=bias_correction2_sqrt,
                    group_size=group["group_size"],
                    expand_exp_avg=expand_m,
                    expand_exp_avg_sq=expand_v,
                    rounding_seeds=seeds,
                )

    def _chunks(self, entries: list) -> Iterable[list]:
        """The entries of one kernel call, split so that the FP8 gradients dequantized for one call stay
        below _DEQUANTIZED_GRAD_CHUNK elements (without fp8_grads: all in one call)."""
        chunk, elements = [], 0
        for entry in entries:
            size = _local(entry[0]).numel() if entry[0] in self._fp8_grads else 0
            if chunk and elements + size > _DEQUANTIZED_GRAD_CHUNK:
                yield chunk
                chunk, elements = [], 0
            chunk.append(entry)
            elements += size
        if chunk:
            yield chunk

    def _step_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The gradient the kernel reads: param.grad, or the FP8 gradient dequantized to bfloat16 (the codes are
        exact in bfloat16; the product with the scale rounds once, far below the FP8 rounding)."""
        stored = self._fp8_grads.get(param)
        if stored is None:
            return _local(param.grad).contiguous()
        return ops.dequantize(*stored, None, torch.bfloat16).view(param.shape)

    def state_dict(self) -> dict[str, Any]:
        """The state, with the meta of 1-D and 0-d parameters saved per element (see the module docstring).
        Tensors are shared with the optimizer, as in torch: copy the result to keep a snapshot in memory."""
        state_dict = super().state_dict()
        params = _params_by_index(self.param_groups)
        for index, state in list(state_dict["state"].items()):
            param, group = params[index]
            if param.dim() <= 1 and state:
                state = dict(state)
                for _, meta_key, _, _ in _MOMENTS:
                    state[meta_key] = _per_element_meta(param, state[meta_key], group["group_size"])
                state_dict["state"][index] = state
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` of a coat.optim.AdamW (also through torch.distributed.checkpoint, on any
        number of ranks). Like torch, it restores lr, betas, eps, weight_decay and expand from the checkpoint;
        group_size, m_format and v_format must equal this optimizer's, since the states are stored in them.
        FP8 codes and bfloat16 meta keep their dtypes (torch.optim.Optimizer.load_state_dict would cast every
        state tensor to the parameter's dtype)."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result

        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        _check_group_counts(groups, saved_groups)
        for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
            _check_storage_options(index, group, saved_group)

        id_map = {}
        saved_group_of = {}
        for group, saved_group in zip(groups, saved_groups):
            for key, param in zip(saved_group["params"], group["params"]):
                id_map[key] = param
                saved_group_of[key] = saved_group
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key in id_map:
                param = id_map[key]
                # a parameter never stepped has an empty state, kept empty as in torch
                state[param] = _state_from_checkpoint(param, value, saved_group_of[key], key) if value else {}
            else:
                state[key] = value  # state not tied to a parameter is kept as is, as torch does

        param_groups = []
        for group, saved_group in zip(groups, saved_groups):
            saved_group["params"] = group["params"]
            for key in ("param_rounding", "rounding_seed"):  # checkpoints saved before these options existed
                saved_group.setdefault(key, group[key])
            if "param_names" in group and "param_names" not in saved_group:
                saved_group["param_names"] = group["param_names"]
            _normalize_options(saved_group)
            param_groups.append(saved_group)
        self.__setstate__({"state": state, "param_groups": param_groups})

        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def torch_state_dict(self) -> dict[str, Any]:
        """The state as torch.optim.AdamW holds it, for ``torch.optim.AdamW.load_state_dict``: float32
        ``exp_avg`` and ``exp_avg_sq`` (the dequantized moments, DTensors placed like their parameters for
        FSDP2), the same ``step``, and param groups without coat's options. Also the form to checkpoint with
        under FSDP1: ``FSDP.optim_state_dict(model, opt, optim_state_dict=opt.torch_state_dict())``."""
        state = {}
        param_groups = []
        index_of = _param_indices(self.param_groups)
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key not in ("params", *_COAT_OPTIONS)}
            packed["params"] = [index_of[id(p)] for p in group["params"]]
            param_groups.append(packed)
            for param in group["params"]:
                param_state = self.state.get(param)
                if param_state:
                    state[index_of[id(param)]] = {
                        "step": param_state["step"].clone(),
                        "exp_avg": _dequantized(param, param_state["exp_avg"], param_state["exp_avg_meta"], group),
                        "exp_avg_sq": _dequantized(
                            param, param_state["exp_avg_sq"], param_state["exp_avg_sq_meta"], group
                        ),
                    }
        return {"state": state, "param_groups": param_groups}

    def load_torch_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the state of a torch.optim.AdamW (its ``state_dict()``): quantizes exp_avg and exp_avg_sq
        with this optimizer's group_size, formats and expand (coat.ops.quantize_expanded), keeps 'step', and
        takes lr, betas, eps and weight_decay (and scheduler keys such as initial_lr) from it. Under FSDP1, pass
        ``FSDP.optim_state_dict_to_load(model, opt, full_torch_state_dict)``."""
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        _check_group_counts(groups, saved_groups)
        param_groups = []
        id_map = {}
        for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
            for feature in ("amsgrad", "maximize"):
                if saved_group.get(feature, False):
                    raise ValueError(
                        f"param group {index} of the torch state dict uses {feature}=True, which coat.optim.AdamW "
                        "does not implement"
                    )
            if not saved_group.get("decoupled_weight_decay", True) and saved_group.get("weight_decay", 0) != 0:
                raise ValueError(
                    f"param group {index} of the torch state dict comes from torch.optim.Adam with L2 weight decay "
                    "(decoupled_weight_decay=False); coat.optim.AdamW decays weights like torch.optim.AdamW"
                )
            new_group = {
                key: value
                for key, value in saved_group.items()
                if key not in ("params", "param_names", "decoupled_weight_decay", *_COAT_OPTIONS, *_UNSUPPORTED_FEATURES)
            }
            new_group.update({key: group[key] for key in (*_COAT_OPTIONS, *_UNSUPPORTED_FEATURES)})
            new_group["params"] = group["params"]
            if "param_names" in group:
                new_group["param_names"] = group["param_names"]
            _normalize_options(new_group)
            param_groups.append(new_group)
            for key, param in zip(saved_group["params"], group["params"]):
                id_map[key] = (param, new_group)

        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"the torch state dict has state for {key!r}, which is no parameter of its groups")
            param, group = id_map[key]
            missing = [name for name in ("step", "exp_avg", "exp_avg_sq") if name not in value]
            if missing:
                raise ValueError(f"the torch state of parameter {key!r} lacks {missing}")
            param_state = {"step": _host_step(value["step"])}
            for codes_key, meta_key, format_key, expand_index in _MOMENTS:
                codes, meta = _quantized(param, value[codes_key], group, format_key, expand_index, key)
                param_state[codes_key] = codes
                param_state[meta_key] = meta
            state[param] = param_state
        self.__setstate__({"state": state, "param_groups": param_groups})


def _map_state(state: dict[Any, Any], convert: Callable[[Any], Any]) -> defaultdict[Any, Any]:
    """optimizer.state with ``convert`` applied to each value of each parameter's state."""
    return defaultdict(dict, {
        key: {name: convert(value) for name, value in values.items()} if isinstance(values, dict) else values
        for key, values in state.items()
    })


def _normalize_options(group: dict[str, Any]) -> None:
    """Checks a param group's options and stores them in canonical form: formats as "e4m3"/"e5m2", expand as
    an (m, v) pair, betas as floats. Raises ValueError with what is supported."""
    for feature, supported in _UNSUPPORTED_FEATURES.items():
        if group.get(feature, supported) != supported:
            raise ValueError(
                f"coat.optim.AdamW does not support {feature}={group[feature]!r}. It runs one fused FP8 kernel per "
                f"parameter group and supports {_SUPPORTED_FEATURES_TEXT}."
            )
        group[feature] = supported
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.device.type != "cpu":
            raise ValueError(
                "a Tensor lr must be a 1-element CPU tensor: step() reads it on the host, and reading a GPU "
                "tensor there would synchronize"
            )
        lr = lr.item()
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"Invalid epsilon value: {group['eps']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = (float(beta) for beta in betas)
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    group["betas"] = (beta1, beta2)
    if group["group_size"] not in ops.GROUP_SIZES:
        raise ValueError(f"group_size must be one of {ops.GROUP_SIZES}, got {group['group_size']!r}")
    group["m_format"] = _format_name(group["m_format"])
    group["v_format"] = _format_name(group["v_format"])
    group["expand"] = _expand_pair(group["expand"])
    if group["param_rounding"] not in _PARAM_ROUNDINGS:
        raise ValueError(f"param_rounding must be one of {_PARAM_ROUNDINGS}, got {group['param_rounding']!r}")
    seed = group["rounding_seed"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"rounding_seed must be an integer, got {seed!r}")


def _draw_seed() -> int:
    """torch's default generator's seed: torch.manual_seed fixes it, and reading it draws nothing from the
    generator, so building the optimizer leaves the user's random stream as torch.optim.AdamW does."""
    return torch.initial_seed()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _step_seed(base: int, step: float) -> int:
    """The stochastic-rounding seed of one step, from which every parameter's is derived (_param_seed). One
    hash per step: hashing per parameter in Python kept the GPU waiting."""
    return _splitmix64(_splitmix64(base & _MASK64) ^ int(step)) >> 1


def _param_seed(step_seed: int, param_index: int, param: torch.Tensor) -> int:
    """The seed of parameter ``param_index`` of the optimizer at one step, in [0, 2**63). A DTensor shard's
    global offset is added to the seed's low word, where the kernel adds the element index (coat/adamw.h):
    every shard then draws the bits of its elements in the whole tensor, and a sharded run rounds exactly as
    an unsharded one."""
    seed = (step_seed + param_index * _GOLDEN) & _MASK63
    offset = _global_offset(param)
    return (seed & ~_MASK32) | ((seed + offset) & _MASK32)


def _global_offset(param: torch.Tensor) -> int:
    """The flat index, in the whole tensor, of the first element of this rank's shard (0 for a plain tensor).
    FSDP2 shards dim 0, so the shard is a run of whole rows."""
    if not isinstance(param, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return sum(offset * math.prod(param.shape[dim + 1 :]) for dim, offset in enumerate(offsets))


def _fp8_grad_hook(optimizer_ref: weakref.ref):
    def hook(param: torch.Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None:
            optimizer._quantize_grad(param)

    return hook


def _check_fp8_grad_param(param: torch.Tensor) -> None:
    owner = _FP8_GRAD_OWNERS.get(param)
    if owner is not None and owner() is not None:
        raise ValueError(
            f"the gradients of a parameter of shape {tuple(param.shape)} are already kept in FP8 by another "
            "coat.optim.AdamW, whose hook would take them first; delete that optimizer before building this one"
        )
    if isinstance(param, DTensor):
        raise ValueError(
            "fp8_grads needs unsharded parameters: FSDP2's DTensor gradients are reduce-scattered by FSDP after "
            "backward. Leave fp8_grads=None under FSDP2 (bfloat16 parameters already give 2-byte gradients)."
        )


def _format_name(format: str | torch.dtype) -> str:
    return _FORMAT_NAMES[ops.fp8_dtype(format)]


def _expand_pair(expand: Any) -> tuple[bool, bool]:
    if isinstance(expand, bool):
        return expand, expand
    if isinstance(expand, (tuple, list)) and len(expand) == 2 and all(isinstance(e, bool) for e in expand):
        return expand[0], expand[1]
    raise ValueError(f"expand must be a bool or a (m, v) pair of bools, got {expand!r}")


def _check_param_dtype(param: torch.Tensor) -> None:
    if param.is_complex():
        raise ValueError("coat.optim.AdamW does not support complex parameters (view them as real with torch.view_as_real)")
    if param.dtype not in _PARAM_DTYPES:
        raise ValueError(
            f"coat.optim.AdamW updates float32 parameters (master weights) and bfloat16 parameters, got a "
            f"{param.dtype} parameter of shape {tuple(param.shape)}: keep float32 weights (model.float()) and "
            "train under torch.autocast(dtype=torch.float16), or convert the model to bfloat16"
        )


def _check_for_step(param: torch.Tensor, fp8_grad: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Refuses what the kernel cannot update in place: the parameter's dtype may have changed since it was
    added, and gradients come from outside."""
    _check_param_dtype(param)
    grad = param.grad
    if fp8_grad is not None:
        if grad is not None:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} has both an FP8 gradient (fp8_grads) and a param.grad "
                "set after backward; assign gradients before backward runs, or call zero_grad() first"
            )
        if not _local(param).is_contiguous():
            raise RuntimeError(
                f"coat.optim.AdamW updates contiguous parameters in place; a parameter of shape "
                f"{tuple(param.shape)} is not contiguous"
            )
        return
    if grad.is_sparse:
        raise RuntimeError("coat.optim.AdamW does not support sparse gradients; use torch.optim.SparseAdam for those")
    if grad.dtype not in _GRAD_DTYPES:
        raise RuntimeError(f"coat.optim.AdamW takes float32, bfloat16 or float16 gradients, got {grad.dtype}")
    if grad.shape != param.shape:
        raise RuntimeError(f"gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(param.shape)}")
    if isinstance(param, DTensor):
        _check_placements(param)
        if not isinstance(grad, DTensor) or grad.placements != param.placements:
            raise RuntimeError(
                f"the gradient of a DTensor parameter placed as {param.placements} must be a DTensor placed the "
                f"same way, got {grad.placements if isinstance(grad, DTensor) else 'a plain tensor'}"
            )
    if not _local(param).is_contiguous():
        raise RuntimeError(
            f"coat.optim.AdamW updates contiguous parameters in place; a parameter of shape {tuple(param.shape)} "
            "is not contiguous"
        )


def _check_placements(param: DTensor) -> None:
    for placement in param.placements:
        if placement.is_replicate():
            continue
        dim = getattr(placement, "dim", None)  # Shard and FSDP2+TP's _StridedShard
        if dim is None:
            raise RuntimeError(f"coat.optim.AdamW supports Shard and Replicate placements of parameters, got {placement}")
        if param.dim() >= 2 and dim % param.dim() == param.dim() - 1:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} is sharded on its last dimension ({placement}), which "
                "splits quantization groups; shard it on another dimension (FSDP2 shards dim 0)"
            )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The kernel views tensors as rows x cols; a 0-d parameter is one row of one element."""
    return tensor.view(1) if tensor.dim() == 0 else tensor


def _meta_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return (1, 3)
    return (*shape[:-1], -(-shape[-1] // group_size), 3)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _like_param(local: torch.Tensor, param: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as a DTensor of global ``shape`` on the parameter's mesh and placements, or as is for a plain
    parameter."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_strides(tuple(shape)),
    )


def _meta_state(param: torch.Tensor, local_meta: torch.Tensor, group_size: int) -> torch.Tensor:
    """How the meta is held in memory: a plain tensor of the local shard's groups for a 1-D (or 0-d) parameter,
    whose groups sharding forms per shard, else placed like the parameter."""
    if param.dim() <= 1:
        return local_meta
    return _like_param(local_meta, param, _meta_shape(tuple(param.shape), group_size))


def _init_state(param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
    """Zero moments: FP8 zeros and the meta that coat.ops.quantize_expanded gives all-zero groups."""
    local = _local(param)
    group_size = group["group_size"]
    state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # read every step: never on a GPU
    for codes_key, meta_key, format_key, expand_index in _MOMENTS:
        fp8_dtype = ops.fp8_dtype(group[format_key])
        if local.numel() == 0:
            codes = torch.empty(local.shape, dtype=fp8_dtype, device=local.device)
            meta = torch.empty(_meta_shape(tuple(local.shape), group_size), dtype=torch.bfloat16, device=local.device)
        else:
            # Every row of zeros quantizes alike: quantize one and repeat it, so that the first step does not
            # hold a float32 copy of the parameter (its peak memory would include it).
            rows = _as_rows(local)
            zero_row = torch.zeros(rows.shape[-1], dtype=torch.float32, device=local.device)
            row_codes, row_meta = ops.quantize_expanded(zero_row, group_size, fp8_dtype, expand=group["expand"][expand_index])
            codes = row_codes.expand(rows.shape).contiguous().view(local.shape)
            meta = row_meta.expand(*rows.shape[:-1], *row_meta.shape).contiguous()
        state[codes_key] = _like_param(codes, param, tuple(param.shape))
        state[meta_key] = _meta_state(param, meta, group_size)


def _param_indices(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """id(param) -> its index in state dicts, numbered as torch.optim.Optimizer.state_dict numbers them."""
    index_of: dict[int, int] = {}
    start = 0
    for group in param_groups:
        for index, param in enumerate(group["params"], start):
            index_of.setdefault(id(param), index)
        start += len(group["params"])
    return index_of


def _params_by_index(param_groups: list[dict[str, Any]]) -> dict[int, tuple[torch.Tensor, dict[str, Any]]]:
    index_of = _param_indices(param_groups)
    return {index_of[id(p)]: (p, group) for group in param_groups for p in group["params"]}


def _per_element_meta(param: torch.Tensor, meta: torch.Tensor, group_size: int) -> torch.Tensor:
    """The (scale, k, C) of each element's group, shape (*param.shape, 3), placed like the parameter."""
    local_param = _local(param)
    per_element = meta.repeat_interleave(group_size, dim=0)[: local_param.numel()]
    return _like_param(per_element.reshape(*local_param.shape, 3), param, (*param.shape, 3))


def _check_group_counts(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has {len(groups)}"
        )
    for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved_group["params"]):
            raise ValueError(
                f"parameter group {index} of the loaded state dict has {len(saved_group['params'])} parameters, "
                f"this optimizer's has {len(group['params'])}"
            )


def _check_storage_options(index: int, group: dict[str, Any], saved_group: dict[str, Any]) -> None:
    missing = [key for key in _STORAGE_OPTIONS if key not in saved_group]
    if missing:
        raise ValueError(
            f"parameter group {index} of the loaded state dict has no {', '.join(missing)}: it is not the state of a "
            "coat.optim.AdamW. Load a torch.optim.AdamW state dict with load_torch_state_dict()."
        )
    saved = {
        "group_size": saved_group["group_size"],
        "m_format": _format_name(saved_group["m_format"]),
        "v_format": _format_name(saved_group["v_format"]),
    }
    current = {key: group[key] for key in _STORAGE_OPTIONS}
    if saved != current:
        raise ValueError(
            f"parameter group {index}: the loaded states are stored with {saved}, this optimizer uses {current}. "
            "Build coat.optim.AdamW with the checkpoint's options, or convert the state through "
            "torch_state_dict() and load_torch_state_dict(), which quantizes again."
        )


def _host_step(step: torch.Tensor | float) -> torch.Tensor:
    return torch.tensor(float(step), dtype=torch.float32, device="cpu")


def _host_lr(lr: float | torch.Tensor) -> float:
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        raise RuntimeError("coat.optim.AdamW: a Tensor lr must stay on the CPU; reading a GPU lr would synchronize")
    return float(lr)


def _checked_state_tensor(
    param: torch.Tensor, value: Any, dtype: torch.dtype, shape: tuple[int, ...], where: str
) -> torch.Tensor:
    """``value`` checked against what the optimizer expects, moved to the parameter's device."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(
            f"{where} has dtype {value.dtype}, expected {dtype}; a state dict of torch.optim.AdamW loads with "
            "load_torch_state_dict()"
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    device = _local(param).device
    if isinstance(param, DTensor):
        if not isinstance(value, DTensor) or value.placements != param.placements or value.device_mesh != param.device_mesh:
            raise ValueError(
                f"{where} must be a DTensor placed like its parameter ({param.placements}); load FSDP2 checkpoints "
                "with torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict)"
            )
        return value if value.to_local().device == device else _like_param(value.to_local().to(device), param, shape)
    if isinstance(value, DTensor):
        raise ValueError(f"{where} is a DTensor but its parameter is not")
    return value.to(device)


def _state_from_checkpoint(param: torch.Tensor, saved: dict[str, Any], group: dict[str, Any], key: Any) -> dict[str, Any]:
    where = f"the state of parameter {key!r}"
    missing = [name for name in ("step", "exp_avg", "exp_avg_meta", "exp_avg_sq", "exp_avg_sq_meta") if name not in saved]
    if missing:
        raise ValueError(f"{where} lacks {missing}; a torch.optim.AdamW state dict loads with load_torch_state_dict()")
    group_size = group["group_size"]
    expand = _expand_pair(group["expand"])
    state = {"step": _host_step(saved["step"])}
    for codes_key, meta_key, format_key, expand_index in _MOMENTS:
        fp8_dtype = ops.fp8_dtype(group[format_key])
        codes = _checked_state_tensor(param, saved[codes_key], fp8_dtype, tuple(param.shape), f"{where}['{codes_key}']")
        if param.dim() <= 1:
            meta_shape = (*param.shape, 3)
        else:
            meta_shape = _meta_shape(tuple(param.shape), group_size)
        meta = _checked_state_tensor(param, saved[meta_key], torch.bfloat16, meta_shape, f"{where}['{meta_key}']")
        if param.dim() <= 1:
            local_codes, meta = _regroup_vector(
                _local(codes), _local(meta), group_size, fp8_dtype, expand[expand_index]
            )
            codes = _like_param(local_codes, param, tuple(param.shape))
        state[codes_key] = codes
        state[meta_key] = meta
    return state


def _regroup_vector(
    codes: torch.Tensor, per_element_meta: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, expand: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and per-group meta of a 1-D (or 0-d) parameter's local shard from its per-element checkpoint form.

    A group of this layout whose elements all carry the same saved meta keeps it (exact). The others mix
    elements of different saved groups: every element is dequantized with its own meta (as a one-element
    group) and the groups are quantized again."""
    count = codes.numel()
    per_element_meta = per_element_meta.reshape(count, 3)
    ngroups = -(-count // group_size)
    if count == 0:
        return codes, per_element_meta.new_empty((0, 3))
    first_meta = per_element_meta[::group_size]
    # Compare bit patterns so that a NaN meta matches itself.
    bits = per_element_meta.view(torch.int16)
    same_as_first = (bits == first_meta.view(torch.int16).repeat_interleave(group_size, dim=0)[:count]).all(dim=1)
    padded = torch.ones(ngroups * group_size, dtype=torch.bool, device=codes.device)
    padded[:count] = same_as_first
    uniform = padded.view(ngroups, group_size).all(dim=1)
    if bool(uniform.all()):
        return codes, first_meta.contiguous()
    values = ops.dequantize_expanded(_as_rows(codes).reshape(count, 1), per_element_meta.reshape(count, 1, 3), group_size)
    new_codes, new_meta = ops.quantize_expanded(values.reshape(count), group_size, fp8_dtype, expand=expand)
    keep = uniform.repeat_interleave(group_size)[:count]
    merged_codes = torch.where(keep, _as_rows(codes).view(torch.uint8), new_codes.view(torch.uint8))
    merged_meta = torch.where(uniform[:, None], first_meta, new_meta)
    return merged_codes.view(fp8_dtype).view(codes.shape), merged_meta


def _dequantized(param: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    local_codes = _local(codes)
    if local_codes.numel() == 0:
        local = torch.zeros(local_codes.shape, dtype=torch.float32, device=local_codes.device)
    else:
        local = ops.dequantize_expanded(_as_rows(local_codes), _local(meta), group["group_size"]).view(local_codes.shape)
    return _like_param(local, param, tuple(param.shape))


def _quantized(
    param: torch.Tensor, moment: Any, group: dict[str, Any], format_key: str, expand_index: int, key: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"the torch state of parameter {key!r}"
    if not isinstance(moment, torch.Tensor) or moment.shape != param.shape:
        shape = tuple(moment.shape) if isinstance(moment, torch.Tensor) else type(moment).__name__
        raise ValueError(f"{where}: a moment must be a tensor of the parameter's shape {tuple(param.shape)}, got {shape}")
    if isinstance(moment, DTensor) != isinstance(param, DTensor):
        raise ValueError(f"{where}: a moment must be a DTensor exactly when its parameter is one")
    local_param = _local(param)
    local = _local(moment).to(device=local_param.device, dtype=torch.float32).contiguous()
    fp8_dtype = ops.fp8_dtype(group[format_key])
    group_size = group["group_size"]
    if local.numel() == 0:
        codes = torch.empty(local.shape, dtype=fp8_dtype, device=local.device)
        meta = torch.empty(_meta_shape(tuple(local.shape), group_size), dtype=torch.bfloat16, device=local.device)
    else:
        codes, meta = ops.quantize_expanded(_as_rows(local), group_size, fp8_dtype, expand=group["expand"][expand_index])
        codes = codes.view(local.shape)
    return _like_param(codes, param, tuple(param.shape)), _meta_state(param, meta, group_size)
