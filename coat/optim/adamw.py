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

from collections import defaultdict
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from coat import ops
from coat.optim import checkpoint, rounding
from coat.optim.fp8_grads import check_fp8_grad_param, hook_fp8_grads
from coat.optim.options import check_for_step, check_param_dtype, host_lr, normalize_options
from coat.optim.sharding import local_shard
from coat.optim.state import MOMENTS, as_rows, init_state, param_indices

# FP8 gradients are dequantized to bfloat16 for the fused step in chunks of at most this many elements, so the
# step never holds more than 128 MiB of them at once (one larger tensor is its own chunk).
_DEQUANTIZED_GRAD_CHUNK = 1 << 26
# Parameters of a group whose kernel call is enqueued before the host prepares the next ones: the CUDA kernel's
# launch size (kTensorsPerLaunch in csrc/cuda/adamw_step.cu), so that the GPU runs one launch while the host builds
# the next call's tensor lists and the binding checks them, instead of waiting for all of the group's. The first
# call takes fewer, so that the GPU starts after a few parameters' preparation rather than 32 parameters'.
_PARAMS_PER_CALL = 32
_PARAMS_IN_FIRST_CALL = 2


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
            rounding_seed=rounding.draw_seed() if rounding_seed is None else rounding_seed,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
        )
        normalize_options(defaults)
        self._fp8_grad_dtype = None if fp8_grads is None else ops.fp8_dtype(fp8_grads)
        # param -> (FP8 codes of the gradient, as a rows x cols matrix; 0-d float32 scale)
        self._fp8_grads: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            normalize_options(group)
            for param in group["params"]:
                check_param_dtype(param)
                if self._fp8_grad_dtype is not None:
                    check_fp8_grad_param(param)
        except ValueError:
            self.param_groups.pop()
            raise
        if self._fp8_grad_dtype is not None:
            hook_fp8_grads(self, group["params"])

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
                check_fp8_grad_param(param)
            hook_fp8_grads(self, params)

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
        codes, scale, _ = ops.quantize_tensors([as_rows(grad).contiguous()], self._fp8_grad_dtype, dim=0)
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
        if not state or local_shard(param).numel() == 0:
            return {}
        return {
            ("m", "v")[index]: (as_rows(local_shard(state[codes_key])), local_shard(state[meta_key]))
            for codes_key, meta_key, _, index in MOMENTS
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
            check_for_step(param, self._fp8_grads.get(param))
            state = self.state[param]
            if not state:
                init_state(param, group, state)
            states.append(state)
        index_of = param_indices(self.param_groups) if group["param_rounding"] == "stochastic" else {}
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
            local_param = local_shard(param)
            if local_param.numel() == 0:  # an FSDP rank holding none of this parameter
                continue
            step = state["step"].item() + 1.0  # a CPU tensor: reading it does not synchronize the GPU
            batches.setdefault((local_param.device, step), []).append((param, state))

        beta1, beta2 = group["betas"]
        lr = host_lr(group["lr"])
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
                        local_shard(param),
                        self._step_grad(param),
                        local_shard(state["exp_avg"]),
                        local_shard(state["exp_avg_meta"]),
                        local_shard(state["exp_avg_sq"]),
                        local_shard(state["exp_avg_sq_meta"]),
                    )):
                        tensor_list.append(as_rows(tensor))
                seeds = None
                if stochastic:
                    step_seed = rounding.step_seed(group["rounding_seed"], step)
                    seeds = [rounding.param_seed(step_seed, index_of[id(p)], p) for p, _ in chunk]
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
            size = local_shard(entry[0]).numel() if entry[0] in self._fp8_grads else 0
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
            return local_shard(param.grad).contiguous()
        return ops.dequantize(*stored, None, torch.bfloat16).view(param.shape)

    def state_dict(self) -> dict[str, Any]:
        """The state, with the meta of 1-D and 0-d parameters saved per element (see the module docstring).
        Tensors are shared with the optimizer, as in torch: copy the result to keep a snapshot in memory."""
        return checkpoint.with_per_element_meta(super().state_dict(), self.param_groups)

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

        self.__setstate__(checkpoint.loaded_state(self.param_groups, state_dict))

        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def torch_state_dict(self) -> dict[str, Any]:
        """The state as torch.optim.AdamW holds it, for ``torch.optim.AdamW.load_state_dict``: float32
        ``exp_avg`` and ``exp_avg_sq`` (the dequantized moments, DTensors placed like their parameters for
        FSDP2), the same ``step``, and param groups without coat's options. Also the form to checkpoint with
        under FSDP1: ``FSDP.optim_state_dict(model, opt, optim_state_dict=opt.torch_state_dict())``."""
        return checkpoint.torch_state_dict(self.param_groups, self.state)

    def load_torch_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the state of a torch.optim.AdamW (its ``state_dict()``): quantizes exp_avg and exp_avg_sq
        with this optimizer's group_size, formats and expand (coat.ops.quantize_expanded), keeps 'step', and
        takes lr, betas, eps and weight_decay (and scheduler keys such as initial_lr) from it. Under FSDP1, pass
        ``FSDP.optim_state_dict_to_load(model, opt, full_torch_state_dict)``."""
        self.__setstate__(checkpoint.loaded_torch_state(self.param_groups, state_dict))


def _map_state(state: dict[Any, Any], convert: Callable[[Any], Any]) -> defaultdict[Any, Any]:
    """optimizer.state with ``convert`` applied to each value of each parameter's state."""
    return defaultdict(dict, {
        key: {name: convert(value) for name, value in values.items()} if isinstance(values, dict) else values
        for key, values in state.items()
    })

