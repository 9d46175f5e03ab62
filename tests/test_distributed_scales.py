"""When coat.distributed.fp8_all_gather agrees its FP8 scales (scales="per_group", "per_unit", "precomputed"),
under FSDP2 with two processes (gloo on CPU, NCCL on two GPUs): every mode trains bit for bit like FSDP2 without
FP8 gathers and like one process, runs the all-reduces it promises, and "precomputed" refuses, on every rank
and without hanging, to gather weights written since their scales were agreed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import coat
from coat.optim import AdamW
from distributed_helpers import (
    BACKENDS,
    LR,
    WEIGHT_DECAY,
    assert_all_equal,
    batches,
    fully_sharded,
    local,
    run_scenarios,
    spawn_and_load,
)
from optim_helpers import tiny_llama

pytestmark = pytest.mark.transformers

MODES = coat.distributed.SCALE_MODES
LAYERS, GROUPS_PER_LAYER = 2, 4  # q/k/v, o, gate/up, down
STEPS = 3
# Parameter dtype, FSDP2 mixed-precision policy's param_dtype, FP8 reduce-scatter alongside.
VARIANTS = {"float32": (torch.float32, None, False), "bf16-policy-fp8-reduce-scatter": (torch.float32, torch.bfloat16, True)}


class AllReduces:
    """Counts the calls of dist.all_reduce (every collective coat's scales run) while it is entered."""

    def __enter__(self):
        self.calls, self.original = 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.original


def train(model, opt, tokens) -> float:
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    return loss.item()


# --- workers (run in spawned processes) ---------------------------------------------------------------------


def modes_train_bit_for_bit(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    """Each mode against FSDP2 without FP8 gathers and (float32, no policy) one process: losses, gradients and
    parameters over a few SGD steps (elementwise, so sharding changes no bit), the all-reduces of each step and
    what the collectives sent."""
    data = batches(STEPS)
    mesh = init_device_mesh(device.type, (world_size,))
    results = {}
    for variant, (dtype, param_dtype, reduce_scatter_in_fp8) in VARIANTS.items():
        runs = {}
        for run in ("unsharded", "bf16 gather", *MODES):
            if run == "unsharded" and param_dtype is not None:
                continue  # one process has no mixed-precision policy to compare with
            model = coat.convert(tiny_llama(seed=0).to(device, dtype))
            gather = coat.distributed.fp8_all_gather(model, scales=run) if run in MODES else None
            reduce_scatter = None
            if run != "unsharded":
                fully_sharded(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
                if reduce_scatter_in_fp8:
                    reduce_scatter = coat.distributed.fp8_reduce_scatter(model)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            if run == "precomputed":
                coat.distributed.precompute_fp8_scales_after_step(opt, model)
            losses, tensors, all_reduces, sent = [], {}, [], []
            for step, tokens in enumerate(data):
                with AllReduces() as counted:
                    losses.append(train(model, opt, tokens.to(device)))
                all_reduces.append(counted.calls)
                for name, p in model.named_parameters():
                    grad = p.grad if run != "unsharded" else p.grad.chunk(world_size)[rank]
                    tensors[f"{name}/grad{step}"] = local(grad).cpu().clone()
                model.zero_grad(set_to_none=True)
                if gather is not None:
                    sent.append({
                        "all-gather codes": gather.log.sent[torch.uint8],
                        "all-reduce amaxes": gather.log.sent[torch.float32],
                        "all-gather elements": gather.log.buffer_elements,
                        "reduce-scatter bytes": reduce_scatter.log.bytes_sent if reduce_scatter else 0,
                        "reduce-scatter elements": reduce_scatter.log.buffer_elements if reduce_scatter else 0,
                    })
                    gather.log = coat.distributed.CommunicationLog()
                    if reduce_scatter:
                        reduce_scatter.log = coat.distributed.CommunicationLog()
            for name, p in model.named_parameters():
                tensors[name] = (local(p) if run != "unsharded" else p.chunk(world_size)[rank]).detach().cpu().clone()
            runs[run] = dict(losses=losses, tensors=tensors, all_reduces=all_reduces, sent=sent)
        results[variant] = runs
    torch.save({"variants": results}, out / f"rank{rank}.pt")


def stale_weights(model, opt, tokens, change) -> dict:
    """``change`` done to the weights of a model gathering with precomputed scales: the error of the forward
    after it, then whether a forward-backward-step after precompute_fp8_scales trains on, and its all-reduces.
    The first change is the optimizer step made before; later ones start from freshly precomputed scales."""
    change()
    try:
        model(input_ids=tokens, labels=tokens)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    coat.distributed.precompute_fp8_scales(model)
    model.zero_grad(set_to_none=True)
    with AllReduces() as counted:
        loss = train(model, opt, tokens)  # leaves its gradients, for the next change
    coat.distributed.precompute_fp8_scales(model)  # only the next change is then seen
    return {"error": error, "loss_after_precompute": loss, "all_reduces_after_precompute": counted.calls}


def precomputed_scales_refuse_stale_weights(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    tokens = batches(1)[0].to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    model = coat.convert(tiny_llama(seed=0).to(device))
    coat.distributed.fp8_all_gather(model, scales="precomputed")
    fully_sharded(model, mesh)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    with AllReduces() as counted:  # no precompute yet: the first gathers agree the scales, one per unit
        train(model, opt, tokens)
    first_step_all_reduces = counted.calls
    down_proj = model.model.layers[1].mlp.down_proj
    state = get_model_state_dict(model)
    cases = {
        "optimizer step without the hook": stale_weights(model, opt, tokens, lambda: None),
        "state dict load": stale_weights(model, opt, tokens, lambda: set_model_state_dict(model, state)),
        "in-place edit": stale_weights(model, opt, tokens, lambda: down_proj.weight.detach().mul_(0.5)),
        "local shard edit": stale_weights(model, opt, tokens, lambda: down_proj.weight.detach().to_local().add_(1.0)),
        "torch optimizer step": stale_weights(model, opt, tokens, torch.optim.SGD(model.parameters(), lr=LR).step),
    }
    # Rank 1 holds no row of the second weight (1 row over 2 ranks), and 16 of the first's 17 (padded).
    torch.manual_seed(0)
    stack = torch.nn.Sequential(coat.nn.Linear(16, 33), coat.nn.Linear(33, 1)).to(device)
    coat.distributed.fp8_all_gather(stack, scales="precomputed")
    for layer in stack:
        fully_shard(layer, mesh=mesh)
    fully_shard(stack, mesh=mesh)
    stack_opt = AdamW(stack.parameters(), lr=LR)
    coat.distributed.precompute_fp8_scales_after_step(stack_opt, stack)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(device)

    class Stack(torch.nn.Module):  # the call stale_weights makes, on the stack
        def forward(self, input_ids, labels):
            return stack(x)

    def stack_step():
        stack(x).square().sum().backward()
        stack_opt.step()
        stack.zero_grad(set_to_none=True)

    stack_step()
    stack_state = get_model_state_dict(stack)
    stack_cases = {}
    for name, change in (("empty shard: in-place edit", lambda: stack[1].weight.detach().mul_(2.0)),
                         ("empty shard: state dict load", lambda: set_model_state_dict(stack, stack_state))):
        change()
        try:
            stack(x)
            stack_cases[name] = ""
        except RuntimeError as exc:
            stack_cases[name] = str(exc)
        coat.distributed.precompute_fp8_scales(stack)
    with AllReduces() as counted:
        stack_step()  # with the hook: precomputed after the step
    stack_cases["all_reduces_with_hook"] = counted.calls
    refusals = {}
    per_unit = coat.convert(tiny_llama(seed=0).to(device))
    coat.distributed.fp8_all_gather(per_unit)
    fully_sharded(per_unit, mesh)
    for name, target in (("per_unit", per_unit), ("plain", fully_sharded(tiny_llama(seed=0).to(device), mesh))):
        try:
            coat.distributed.precompute_fp8_scales(target)
        except ValueError as exc:
            refusals[name] = str(exc)
    torch.save({"first_step_all_reduces": first_step_all_reduces, "cases": cases, "stack_cases": stack_cases,
                "refusals": refusals}, out / f"rank{rank}.pt")


SCENARIOS = (modes_train_bit_for_bit, precomputed_scales_refuse_stale_weights)


def worker(rank: int, world_size: int, backend: str, out: str) -> None:
    run_scenarios(rank, world_size, backend, out, SCENARIOS)


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, tmp_path_factory) -> dict[str, list[dict]]:
    """{scenario name: [rank 0's results, rank 1's]}, from one run of the workers per backend."""
    return spawn_and_load(worker, request.param, tmp_path_factory.mktemp(request.param), SCENARIOS)


# --- tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_scale_mode_trains_bit_for_bit_like_bf16_gathers_and_one_process(results, variant):
    for result in results["modes_train_bit_for_bit"]:
        runs = result["variants"][variant]
        references = [name for name in ("unsharded", "bf16 gather") if name in runs]
        for mode in MODES:
            for reference in [*references, "per_group"]:
                assert runs[mode]["losses"] == runs[reference]["losses"], (mode, reference)
                assert_all_equal({name: (runs[mode]["tensors"][name], t) for name, t in runs[reference]["tensors"].items()})
        assert runs["per_unit"]["losses"][-1] < runs["per_unit"]["losses"][0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_scale_mode_runs_the_all_reduces_it_promises(results, variant):
    # Per step each layer (one FSDP2 unit, 4 scale groups) is gathered twice: forward, and backward after
    # resharding. "precomputed": the first step's forward gathers agree the scales (nothing was precomputed),
    # the backward gathers reuse them, and the hook after every step agrees all 8 in one all-reduce.
    gathers = 2 * LAYERS
    expected = {
        "per_group": ([gathers * GROUPS_PER_LAYER] * STEPS, gathers * GROUPS_PER_LAYER),
        "per_unit": ([gathers] * STEPS, gathers * GROUPS_PER_LAYER),
        "precomputed": ([LAYERS + 1] + [1] * (STEPS - 1), LAYERS * GROUPS_PER_LAYER),
    }
    for result in results["modes_train_bit_for_bit"]:
        runs = result["variants"][variant]
        for mode, (all_reduces, amaxes_per_step) in expected.items():
            assert runs[mode]["all_reduces"] == all_reduces, mode
            for step, sent in enumerate(runs[mode]["sent"]):
                if mode != "precomputed" or step > 0:
                    assert sent["all-reduce amaxes"] == amaxes_per_step, mode
                # bytes per step against bf16 collectives: all-gather 2 bytes per element, reduce-scatter 4 (float32)
                gathered_bytes = sent["all-gather codes"] + 4 * sent["all-reduce amaxes"]
                assert sent["all-gather codes"] == sent["all-gather elements"] > 0
                assert gathered_bytes <= 0.52 * 2 * sent["all-gather elements"], mode
                if variant.endswith("fp8-reduce-scatter"):
                    assert 0 < sent["reduce-scatter bytes"] <= 0.27 * 4 * sent["reduce-scatter elements"], mode


def test_precomputed_scales_refuse_weights_written_since_on_every_rank(results):
    for result in results["precomputed_scales_refuse_stale_weights"]:
        assert result["first_step_all_reduces"] == LAYERS  # forward: one per unit; backward: none
        for case, got in result["cases"].items():
            assert "were written" in got["error"] and "precompute_fp8_scales(model)" in got["error"], case
            assert got["all_reduces_after_precompute"] == 0, case  # precompute_fp8_scales ran before
            assert torch.isfinite(torch.tensor(got["loss_after_precompute"])), case
        cases = result["stack_cases"]
        assert cases.pop("all_reduces_with_hook") == 1
        for case, error in cases.items():
            assert "were written" in error, case
        assert "scales='per_unit'" in result["refusals"]["per_unit"]
        assert "is all-gathered in FP8" in result["refusals"]["plain"]


def test_fp8_all_gather_refuses_unknown_scale_modes():
    model = coat.convert(tiny_llama(seed=0))
    with pytest.raises(ValueError, match=r"scales must be one of \('per_group', 'per_unit', 'precomputed'\)"):
        coat.distributed.fp8_all_gather(model, scales="per_step")
    assert not any(isinstance(p, coat.distributed.FP8AllGatherWeight) for p in model.parameters())
