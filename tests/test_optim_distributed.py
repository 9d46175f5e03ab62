"""coat.optim.AdamW under FSDP2 (fully_shard: DTensor parameters), FSDP1 (use_orig_params=True) and
torch.distributed.checkpoint, with two processes: gloo on CPU, and NCCL on two GPUs when the machine has them.

Every rank trains on the same batches. The averaged gradient is then the single-process gradient bit for bit
(g/2 + g/2 = g), so any difference from a single-process run would come from the optimizer. The single-process
reference runs inside each worker, on the same device, with a coat.optim.AdamW that sees every parameter the
way the sharded optimizer's groups are formed: as is for parameters with >= 2 dims under FSDP2 (dim-0 shards
hold whole rows), as one row per shard for 1-D parameters under FSDP2, as each rank's flat 1-D piece under
FSDP1. The documented grouping rules then predict the sharded run exactly, and the tests check bit equality.
"""
from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils._pytree as pytree
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullOptimStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import coat
from coat import ops
from coat.optim import AdamW
from distributed_helpers import (
    BACKENDS,
    LR,
    WEIGHT_DECAY,
    WORLD_SIZE,
    assert_all_equal,
    batches,
    fully_sharded,
    local,
    run_scenarios,
    spawn_and_load,
)
from optim_helpers import one_thread, tiny_llama  # noqa: F401 (one_thread: an autouse fixture)
from test_nn_llama import tiny_model

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

STATE_KEYS = ("exp_avg", "exp_avg_meta", "exp_avg_sq", "exp_avg_sq_meta")


def train_step(model, opt, tokens, pieces=()):
    """One step; ``pieces`` are (view, parameter, flat range) the reference optimizer sees instead of the
    parameter, whose gradients are the matching slices of the parameter's."""
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    for view, param, (start, end) in pieces:
        view.grad = param.grad.view(-1)[start:end].view(view.shape)
    opt.step()
    model.zero_grad(set_to_none=True)  # the reference's own 1-D parameters are not in its optimizer
    return loss.item()


def fp8_gathered(model):
    """A tiny Llama converted to coat whose projection weights FSDP2 will all-gather in FP8."""
    coat.distributed.fp8_all_gather(coat.convert(model))
    return model


# --- workers (run in spawned processes) ---------------------------------------------------------------------


# bfloat16 weights without a master copy, rounded stochastically: each shard draws the random bits of its
# elements in the whole tensor, so the sharded run must equal the single-process one bit for bit too.
BF16_STOCHASTIC = dict(dtype=torch.bfloat16, param_rounding="stochastic", rounding_seed=11)


def fsdp2_matches_single_process(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    compare_fsdp2_with_single_process(rank, world_size, device, out)


def fsdp2_bf16_stochastic_matches_single_process(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    compare_fsdp2_with_single_process(rank, world_size, device, out, **BF16_STOCHASTIC)


def compare_fsdp2_with_single_process(rank, world_size, device, out, dtype=torch.float32, **options) -> None:
    data = batches(4)
    reference = tiny_llama(seed=0).to(device, dtype)
    model = fully_sharded(copy.deepcopy(reference), init_device_mesh(device.type, (world_size,)))
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options)
    # The reference sees a 1-D parameter as world_size rows, one per shard: its row-wise groups are then the
    # groups FSDP2's shards form locally.
    pieces, reference_params = [], []
    for param in reference.parameters():
        if param.dim() == 1:
            view = param.detach().view(world_size, -1)
            pieces.append((view, param, (0, param.numel())))
            reference_params.append(view)
        else:
            reference_params.append(param)
    reference_opt = AdamW(reference_params, lr=LR, weight_decay=WEIGHT_DECAY, **options)
    losses = [train_step(model, opt, tokens.to(device)) for tokens in data]
    reference_losses = [train_step(reference, reference_opt, tokens.to(device), pieces) for tokens in data]

    compared, layout_errors = {}, []
    views = {id(param): view for view, param, _ in pieces}
    for (name, param), reference_param in zip(model.named_parameters(), reference.parameters()):
        state = opt.state[param]
        if param.dim() == 1:
            expected = views[id(reference_param)][rank]
            expected_state = {key: reference_opt.state[views[id(reference_param)]][key][rank] for key in STATE_KEYS}
        else:
            expected = reference_param.detach().chunk(world_size, dim=0)[rank]
            reference_state = reference_opt.state[reference_param]
            expected_state = {key: reference_state[key].chunk(world_size, dim=0)[rank] for key in STATE_KEYS}
        compared[name] = (local(param).detach(), expected)
        for key in STATE_KEYS:
            compared[f"{name}/{key}"] = (local(state[key]), expected_state[key])
        # codes are DTensors placed like the parameter; so is the meta of a >= 2-D parameter, while a 1-D
        # parameter's meta is a plain tensor of its shard's groups
        for key in STATE_KEYS:
            should_be_dtensor = key in ("exp_avg", "exp_avg_sq") or param.dim() >= 2
            is_dtensor = isinstance(state[key], DTensor)
            if is_dtensor != should_be_dtensor or (is_dtensor and state[key].placements != param.placements):
                layout_errors.append(f"{name}/{key}")
    # Sharding a matrix's last dimension (tensor parallelism's RowwiseParallel) would split its groups.
    mesh = init_device_mesh(device.type, (world_size,))
    row_split = torch.nn.Parameter(distribute_tensor(torch.randn(4, 64, device=device), mesh, [Shard(1)]))
    row_split.grad = distribute_tensor(torch.randn(4, 64, device=device), mesh, [Shard(1)])
    try:
        AdamW([row_split]).step()
        refusal = ""
    except RuntimeError as error:
        refusal = str(error)
    try:
        AdamW([row_split]).clip_grad_norm_(1.0)
        clip_refusal = ""
    except NotImplementedError as error:
        clip_refusal = str(error)
    torch.save(
        {
            "losses": losses,
            "reference_losses": reference_losses,
            "compared": {k: (a.cpu(), b.cpu()) for k, (a, b) in compared.items()},
            "layout_errors": layout_errors,
            "last_dimension_refusal": refusal,
            "clip_refusal": clip_refusal,
        },
        out / f"rank{rank}.pt",
    )


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """This rank's shards of the parameters and of their optimizer states."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = local(param).detach().cpu().clone()
        for key in STATE_KEYS:
            out[f"{name}/{key}"] = local(opt.state[param][key]).cpu().clone()
    return out


def dcp_resume(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    resume_from_dcp(rank, world_size, device, out)


def dcp_resume_bf16_stochastic(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    resume_from_dcp(rank, world_size, device, out, **BF16_STOCHASTIC)


def dcp_resume_fp8_all_gather(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    resume_from_dcp(rank, world_size, device, out, prepare=fp8_gathered, **BF16_STOCHASTIC)


def dcp_resume_moe(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    """A converted Qwen2-MoE (3-D expert weights sharded by expert, a shared expert, its [1, H] gate on one rank)."""
    resume_from_dcp(rank, world_size, device, out, build=moe_model, **BF16_STOCHASTIC)


def moe_model(seed: int) -> torch.nn.Module:
    return coat.convert(tiny_model("qwen2_moe", seed=seed, vocab_size=256))


def resume_from_dcp(rank, world_size, device, out, dtype=torch.float32, prepare=lambda model: model, build=None,
                    **options) -> None:
    build = build or (lambda seed: tiny_llama(seed=seed))
    data = batches(6)
    mesh = init_device_mesh(device.type, (world_size,))
    model = fully_sharded(prepare(build(0).to(device, dtype)), mesh)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options)
    for tokens in data[:3]:
        train_step(model, opt, tokens.to(device))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=out / "checkpoint")
    saved = snapshot(model, opt)
    uninterrupted_losses = [train_step(model, opt, tokens.to(device)) for tokens in data[3:]]
    uninterrupted = snapshot(model, opt)

    # A new model (another initialisation) and optimizer, resumed from the checkpoint as FSDP2 users do.
    # another rounding seed too: the checkpoint's must win
    resumed_model = fully_sharded(prepare(build(123).to(device, dtype)), mesh)
    resumed_opt = AdamW(resumed_model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **{**options, "rounding_seed": 99})
    state = {"model": get_model_state_dict(resumed_model), "optim": get_optimizer_state_dict(resumed_model, resumed_opt)}
    dcp.load(state, checkpoint_id=out / "checkpoint")
    state_dict_types = sorted({type(local(t)).__name__ for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)})
    set_model_state_dict(resumed_model, state["model"])
    set_optimizer_state_dict(resumed_model, resumed_opt, state["optim"])
    resumed_losses = [train_step(resumed_model, resumed_opt, tokens.to(device)) for tokens in data[3:]]
    torch.save(
        {
            "saved": saved,
            "uninterrupted": uninterrupted,
            "resumed": snapshot(resumed_model, resumed_opt),
            "uninterrupted_losses": uninterrupted_losses,
            "resumed_losses": resumed_losses,
            "state_dict_types": state_dict_types,
        },
        out / f"rank{rank}.pt",
    )


def fsdp1_matches_single_process(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    data = batches(4)
    reference = tiny_llama(seed=0).to(device)
    model = FSDP(copy.deepcopy(reference), use_orig_params=True, device_id=device)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    # Which flat range of each parameter every rank holds, from FSDP1's own record: the reference optimizer
    # sees each parameter as those 1-D pieces, the tensors FSDP1 hands the optimizer on each rank.
    flat_param = model._handle.flat_param
    ranges = {
        fqn: (info.intra_param_start_idx, info.intra_param_end_idx + 1)
        for fqn, info in zip(flat_param._fqns, flat_param._shard_param_infos)
        if info.in_shard
    }
    all_ranges = [None] * world_size
    dist.all_gather_object(all_ranges, ranges)
    reference_params = dict(reference.named_parameters())
    pieces = {}
    for piece_rank, rank_ranges in enumerate(all_ranges):
        for fqn, (start, end) in rank_ranges.items():
            view = reference_params[fqn].detach().view(-1)[start:end]
            pieces[(piece_rank, fqn)] = (view, reference_params[fqn], (start, end))
    reference_opt = AdamW([view for view, _, _ in pieces.values()], lr=LR, weight_decay=WEIGHT_DECAY)
    losses = [train_step(model, opt, tokens.to(device)) for tokens in data]
    reference_losses = [train_step(reference, reference_opt, tokens.to(device), pieces.values()) for tokens in data]

    compared = {}
    for fqn, param in zip(flat_param._fqns, flat_param._params):
        if param.numel() == 0:
            assert fqn not in ranges and not opt.state.get(param)
            continue
        view = pieces[(rank, fqn)][0]
        compared[fqn] = (param.detach(), view)
        for key in STATE_KEYS:
            compared[f"{fqn}/{key}"] = (opt.state[param][key], reference_opt.state[view][key])

    # Checkpointing under FSDP1 goes through the torch form (FSDP1's optimizer state dict needs one dtype
    # per parameter's states): gather it, then hand it to a new model's optimizer. offload_to_cpu=False:
    # with CPU tensors FSDP1's offload is a no-op .cpu() that leaves every state of a parameter a view of one
    # reused gather buffer (torch.optim.AdamW's exp_avg comes back as its exp_avg_sq); the clone avoids it.
    config = FullOptimStateDictConfig(offload_to_cpu=False)
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config)
    full_state = FSDP.optim_state_dict(model, opt, optim_state_dict=opt.torch_state_dict())
    resumed_model = FSDP(tiny_llama(seed=123).to(device), use_orig_params=True, device_id=device)
    FSDP.set_state_dict_type(resumed_model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config)
    resumed_opt = AdamW(resumed_model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    resumed_opt.load_torch_state_dict(FSDP.optim_state_dict_to_load(resumed_model, resumed_opt, full_state))
    resumed_params = resumed_model._handle.flat_param._params
    for fqn, param, resumed_param in zip(flat_param._fqns, flat_param._params, resumed_params):
        if param.numel() == 0:
            continue
        state, resumed_state = opt.state[param], resumed_opt.state[resumed_param]
        # exactly the documented conversion: dequantized here, quantized again there
        for codes_key, meta_key in (("exp_avg", "exp_avg_meta"), ("exp_avg_sq", "exp_avg_sq_meta")):
            moment = ops.dequantize_expanded(state[codes_key], state[meta_key], 128)
            codes, meta = ops.quantize_expanded(moment, 128, "e4m3")
            compared[f"torch form/{fqn}/{codes_key}"] = (resumed_state[codes_key], codes)
            compared[f"torch form/{fqn}/{meta_key}"] = (resumed_state[meta_key], meta)
    torch.save(
        {
            "losses": losses,
            "reference_losses": reference_losses,
            "compared": {k: (a.cpu(), b.cpu()) for k, (a, b) in compared.items()},
        },
        out / f"rank{rank}.pt",
    )


def fsdp2_fp8_reduce_scatter(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    """FSDP2 with coat.distributed.fp8_reduce_scatter against one process: what each all-to-all sends, the
    reduced gradients against the exact ones, and the losses of a few steps."""
    data = batches(4)
    reference = tiny_llama(seed=0).to(device)
    model = fully_sharded(copy.deepcopy(reference), init_device_mesh(device.type, (world_size,)))
    comm = coat.distributed.fp8_reduce_scatter(model)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    reference_opt = AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    gradient_errors, losses, reference_losses = {}, [], []
    for step, tokens in enumerate(data):
        for net, net_opt, net_losses in ((model, opt, losses), (reference, reference_opt, reference_losses)):
            loss = net(input_ids=tokens.to(device), labels=tokens.to(device)).loss
            loss.backward()
            net_losses.append(loss.item())
        if step == 0:  # every rank trains on the same batch: the exact reduced gradient is the reference's
            for (name, param), exact in zip(model.named_parameters(), reference.parameters()):
                exact = exact.grad.chunk(world_size, dim=0)[rank] if exact.dim() >= 1 else exact.grad
                got = local(param.grad)
                gradient_errors[name] = ((got - exact).norm() / exact.norm().clamp_min(1e-30)).item()  # 0 / 0: 0
        for net, net_opt in ((model, opt), (reference, reference_opt)):
            net_opt.step()
            net.zero_grad(set_to_none=True)
    torch.save(
        {"sent": {str(dtype): count for dtype, count in comm.log.sent.items()},
         "tensors": {str(dtype): count for dtype, count in comm.log.tensors.items()},
         "buffer_elements": comm.log.buffer_elements,
         "gradient_errors": gradient_errors, "losses": losses, "reference_losses": reference_losses},
        out / f"rank{rank}.pt",
    )


# Parameter dtype, FSDP2 mixed-precision policy, optimizer options, FP8 reduce-scatter alongside.
FP8_ALL_GATHER_VARIANTS = {
    "float32": (torch.float32, None, {}, False),
    "float32-bf16-policy-fp8-reduce-scatter": (torch.float32, torch.bfloat16, {}, True),
    "bf16-stochastic": (torch.bfloat16, None, {"param_rounding": "stochastic", "rounding_seed": 11}, False),
}


def fsdp2_fp8_all_gather(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    """FSDP2 with coat.distributed.fp8_all_gather against FSDP2 without it, on a converted model: what each
    step sends, and the losses, gradients and parameters of a few steps, which must be the same bits (the
    layers read the same FP8 codes with the same scale). Then what fp8_all_gather refuses."""
    data = batches(3)
    mesh = init_device_mesh(device.type, (world_size,))
    results = {}
    for variant, (dtype, param_dtype, options, reduce_scatter_in_fp8) in FP8_ALL_GATHER_VARIANTS.items():
        runs = {}
        for gather_in_fp8 in (False, True):
            model = coat.convert(tiny_llama(seed=0).to(device, dtype))
            comm = coat.distributed.fp8_all_gather(model) if gather_in_fp8 else None
            fully_sharded(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
            if reduce_scatter_in_fp8:
                coat.distributed.fp8_reduce_scatter(model)
            weight_types = set()
            model.model.layers[0].register_forward_pre_hook(  # after FSDP2's hook, which gathers the weights
                lambda layer, _: weight_types.update({type(layer.self_attn.q_proj.weight).__name__,
                                                      type(layer.mlp.down_proj.weight).__name__})
            )
            opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options)
            losses, grads, sent_per_step = [], {}, []
            for step, tokens in enumerate(data):
                loss = model(input_ids=tokens.to(device), labels=tokens.to(device)).loss
                loss.backward()
                losses.append(loss.item())
                grads.update({f"{name}/grad{step}": local(p.grad).cpu().clone() for name, p in model.named_parameters()})
                opt.step()
                model.zero_grad(set_to_none=True)
                if comm is not None:
                    sent_per_step.append({str(dtype): (count, comm.log.tensors[dtype])
                                          for dtype, count in comm.log.sent.items()})
                    comm.log = coat.distributed.CommunicationLog()
            params = {name: local(p).detach().cpu().clone() for name, p in model.named_parameters()}
            runs[gather_in_fp8] = dict(losses=losses, tensors={**grads, **params}, weight_types=sorted(weight_types),
                                       sent_per_step=sent_per_step)
        results[variant] = {
            "losses": runs[True]["losses"],
            "reference_losses": runs[False]["losses"],
            "compared": {name: (runs[True]["tensors"][name], t) for name, t in runs[False]["tensors"].items()},
            "weight_types": runs[True]["weight_types"],
            "reference_weight_types": runs[False]["weight_types"],
            "sent_per_step": runs[True]["sent_per_step"],
            # what one rank's shards of the projection weights hold, and the bytes FSDP2 would gather them in
            "projection_shard_elements": sum(
                local(p).numel() for name, p in model.named_parameters() if "proj" in name
            ),
            "gathered_itemsize": (param_dtype or dtype).itemsize,
        }
    # Rows that do not split evenly: FSDP2 pads the last shards (33 rows: 17 + 16; 1 row: 1 + 0).
    uneven = {}
    for gather_in_fp8 in (False, True):
        torch.manual_seed(0)
        stack = torch.nn.Sequential(coat.nn.Linear(16, 33), coat.nn.Linear(33, 1)).to(device)
        if gather_in_fp8:
            coat.distributed.fp8_all_gather(stack)
        for layer in stack:
            fully_shard(layer, mesh=mesh)
        fully_shard(stack, mesh=mesh)
        loss = stack(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(device)).square().sum()
        loss.backward()
        uneven[gather_in_fp8] = {"loss": loss.detach().cpu(),
                                 **{name: local(p.grad).cpu() for name, p in stack.named_parameters()}}
    results["uneven"] = {"compared": {name: (uneven[True][name], t) for name, t in uneven[False].items()}}
    try:
        coat.distributed.fp8_all_gather(model)
        after_fully_shard = ""
    except ValueError as error:
        after_fully_shard = str(error)
    # A trained model dropped by its user is freed: its memory is not held until the process ends.
    model_ref = weakref.ref(model)
    del model, opt
    gc.collect()
    torch.save({"variants": results, "after_fully_shard": after_fully_shard, "model_freed": model_ref() is None},
               out / f"rank{rank}.pt")


SCENARIOS = (
    fsdp2_fp8_reduce_scatter,
    fsdp2_fp8_all_gather,
    dcp_resume_fp8_all_gather,
    fsdp2_matches_single_process,
    fsdp2_bf16_stochastic_matches_single_process,
    dcp_resume,
    dcp_resume_bf16_stochastic,
    dcp_resume_moe,
    fsdp1_matches_single_process,
)


def worker(rank: int, world_size: int, backend: str, out: str) -> None:
    run_scenarios(rank, world_size, backend, out, SCENARIOS)


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, tmp_path_factory) -> dict[str, list[dict]]:
    """{scenario name: [rank 0's results, rank 1's]}, from one run of the workers per backend, and under
    "checkpoint" the directory of the scenario dcp_resume's checkpoint."""
    out = tmp_path_factory.mktemp(request.param)
    loaded = spawn_and_load(worker, request.param, out, SCENARIOS)
    return {**loaded, "checkpoint": out / dcp_resume.__name__ / "checkpoint"}


# --- tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["fsdp2_matches_single_process", "fsdp2_bf16_stochastic_matches_single_process"])
def test_fsdp2_matches_single_process_bit_for_bit(results, scenario):
    for result in results[scenario]:
        assert result["layout_errors"] == []
        assert "sharded on its last dimension" in result["last_dimension_refusal"]
        assert "torch.nn.utils.clip_grad_norm_" in result["clip_refusal"]
        assert result["losses"] == result["reference_losses"]
        assert result["losses"][-1] < result["losses"][0]
        assert_all_equal(result["compared"])


def test_fp8_reduce_scatter_sends_fp8_and_tracks_the_exact_gradients(results):
    for result in results["fsdp2_fp8_reduce_scatter"]:
        # per reduce-scatter: one FP8 code per element of the gradient buffer, one float32 scale per 128 elements
        # of each rank's chunk (a chunk's last block may be short)
        codes, scales = result["sent"]["torch.uint8"], result["sent"]["torch.float32"]
        calls = result["tensors"]["torch.uint8"]
        assert result["sent"].keys() == {"torch.uint8", "torch.float32"}
        assert result["tensors"]["torch.float32"] == calls > 0
        assert codes == result["buffer_elements"]
        assert codes / 128 <= scales < codes / 128 + calls * WORLD_SIZE
        sent_bytes = codes + 4 * scales
        assert sent_bytes <= 1.04 * result["buffer_elements"]  # float32 reduce-scatter: 4 bytes per element
        # E4M3 blocks: each element within 2^-4 of its block's largest magnitude
        assert max(result["gradient_errors"].values()) < 2**-4
        assert result["losses"][0] == result["reference_losses"][0]
        assert all(abs(a - b) / b < 2e-2 for a, b in zip(result["losses"], result["reference_losses"]))
        assert result["losses"][-1] < result["losses"][0]


@pytest.mark.parametrize("scenario", ["dcp_resume_bf16_stochastic", "dcp_resume_moe"])
def test_dcp_checkpoint_resumes_bf16_stochastic_rounding_bit_for_bit(results, scenario):
    for result in results[scenario]:
        assert result["resumed_losses"] == result["uninterrupted_losses"]
        assert all(t.dtype == torch.bfloat16 for name, t in result["resumed"].items() if "/" not in name)
        assert_all_equal({name: (t, result["resumed"][name]) for name, t in result["uninterrupted"].items()})


def test_dcp_checkpoint_resumes_on_two_ranks_and_loads_on_one(results):
    ranks = results["dcp_resume"]
    # Same number of ranks: the resumed run continues bit for bit.
    for result in ranks:
        assert result["resumed_losses"] == result["uninterrupted_losses"]
        assert_all_equal({name: (t, result["resumed"][name]) for name, t in result["uninterrupted"].items()})

    # One rank, no process group, plain model: >= 2-D states load exactly; each 1-D state's two saved
    # groups (one per rank, 32 elements each) now form one group of 64, re-quantized from the exactly
    # dequantized elements.
    model = tiny_llama(seed=7)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=results["checkpoint"], no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    saved = {name: torch.cat([r["saved"][name] for r in ranks]) for name in ranks[0]["saved"]}
    compared = {}
    for name, param in model.named_parameters():
        compared[name] = (param.detach(), saved[name])
        assert opt.state[param]["step"].item() == 3
        for codes_key, meta_key in (("exp_avg", "exp_avg_meta"), ("exp_avg_sq", "exp_avg_sq_meta")):
            if param.dim() >= 2:
                codes, meta = saved[f"{name}/{codes_key}"], saved[f"{name}/{meta_key}"]
            else:
                shards = [(r["saved"][f"{name}/{codes_key}"], r["saved"][f"{name}/{meta_key}"]) for r in ranks]
                exact = torch.cat([ops.dequantize_expanded(codes, meta, 128) for codes, meta in shards])
                codes, meta = ops.quantize_expanded(exact, 128, "e4m3")
            compared[f"{name}/{codes_key}"] = (opt.state[param][codes_key], codes)
            compared[f"{name}/{meta_key}"] = (opt.state[param][meta_key], meta)
    assert_all_equal(compared)
    # It trains on from there, close to the two-rank run: only the 1-D states' extra rounding differs.
    one_rank_losses = [train_step(model, opt, tokens) for tokens in batches(6)[3:]]
    two_rank_losses = ranks[0]["uninterrupted_losses"]
    assert max(abs(a - b) / b for a, b in zip(one_rank_losses, two_rank_losses)) < 1e-3


def test_fsdp1_use_orig_params_matches_single_process_bit_for_bit(results):
    for result in results["fsdp1_matches_single_process"]:
        assert result["losses"] == result["reference_losses"]
        assert result["losses"][-1] < result["losses"][0]
        assert_all_equal(result["compared"])


def test_fp8_all_gather_sends_fp8_codes_and_trains_bit_for_bit(results):
    # Per step, one rank's shard of every projection weight is gathered twice (forward, and backward after
    # resharding) as uint8 codes; each gather of a layer all-reduces the amaxes of its 4 groups (q/k/v, o,
    # gate/up, down) at once (scales="per_unit"; test_distributed_scales covers the other modes).
    for result in results["fsdp2_fp8_all_gather"]:
        assert result["after_fully_shard"].startswith("coat.distributed.fp8_all_gather must run before fully_shard")
        assert result["model_freed"]
        assert_all_equal(result["variants"].pop("uneven")["compared"])
        for variant, got in result["variants"].items():
            assert got["weight_types"] == ["FP8Weight"], variant
            assert got["reference_weight_types"] == ["Parameter"], variant
            shard_elements = got["projection_shard_elements"]
            for sent in got["sent_per_step"]:
                (codes, code_tensors), (amaxes, amax_tensors) = sent["torch.uint8"], sent["torch.float32"]
                assert sent.keys() == {"torch.uint8", "torch.float32"}
                assert code_tensors == 2 * 7 * 2 and amaxes == 4 * amax_tensors == 4 * 2 * 2  # 2 gathers, 2 layers
                assert codes == 2 * shard_elements
                sent_bytes = codes + 4 * amaxes
                high_precision_bytes = 2 * shard_elements * got["gathered_itemsize"]
                assert sent_bytes / high_precision_bytes < 1.01 / got["gathered_itemsize"], variant
            assert got["losses"] == got["reference_losses"], variant
            assert got["losses"][-1] < got["losses"][0], variant
            assert_all_equal(got["compared"])


def test_dcp_checkpoint_resumes_fp8_all_gather_bit_for_bit_with_plain_state_dicts(results):
    for result in results["dcp_resume_fp8_all_gather"]:
        assert result["state_dict_types"] == ["Tensor"]  # the local shards of every DTensor, and the other tensors
        assert result["resumed_losses"] == result["uninterrupted_losses"]
        assert_all_equal({name: (t, result["resumed"][name]) for name, t in result["uninterrupted"].items()})


def test_fp8_all_gather_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="found no coat projections in LlamaForCausalLM"):
        coat.distributed.fp8_all_gather(tiny_llama(seed=0))
    for options, message in (({"gradient_format": None}, "gradient_format=None"),
                             ({"smooth_swiglu": True}, "smooth_swiglu")):
        model = coat.convert(tiny_llama(seed=0), **options)
        with pytest.raises(ValueError, match=message):
            coat.distributed.fp8_all_gather(model)
        assert not any(isinstance(p, coat.distributed.FP8AllGatherWeight) for p in model.parameters())
    model = fp8_gathered(tiny_llama(seed=0))
    with pytest.raises(ValueError, match="already installed on model.layers.0.self_attn.q_proj"):
        coat.distributed.fp8_all_gather(model)
    tied = torch.nn.Sequential(coat.nn.Linear(4, 4), coat.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="tied to another parameter"):
        coat.distributed.fp8_all_gather(tied)
    codes = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    weight = coat.nn.FP8Weight(codes, torch.tensor(1.0), torch.tensor(448.0), torch.bfloat16)
    with pytest.raises(NotImplementedError, match="all-gathered in FP8"):
        weight + 1


def test_fp8_all_gather_keeps_a_plain_model_working():
    """Before fully_shard (or without it) the wrapped weights behave as the parameters they wrap: same
    outputs, gradients, optimizer steps and state dict."""
    data = batches(2)
    reference, model = coat.convert(tiny_llama(seed=0)), fp8_gathered(tiny_llama(seed=0))
    opts = [AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY) for net in (reference, model)]
    losses = [[train_step(net, opt, tokens) for tokens in data] for net, opt in zip((reference, model), opts)]
    assert losses[0] == losses[1]
    state = model.state_dict()
    assert all(type(t) is torch.Tensor for t in state.values())
    assert_all_equal({name: (t, state[name]) for name, t in reference.state_dict().items()})


def test_fp8_all_gather_model_copies_with_its_own_scale_groups():
    """A deep copy's weights compute their shared scale from the copy's weights, not the original's."""
    model = fp8_gathered(tiny_llama(seed=0))
    copied = copy.deepcopy(model)
    for original_layer, layer in zip(model.model.layers, copied.model.layers):
        for parent, members in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            group = getattr(parent, members[0]).weight.group
            assert [module() for module in group.modules] == [getattr(parent, member) for member in members]
        assert layer.self_attn.q_proj.weight.group.comm is copied.model.layers[0].self_attn.q_proj.weight.group.comm
        assert layer.self_attn.q_proj.weight.group is not original_layer.self_attn.q_proj.weight.group


def test_fp8_reduce_scatter_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="needs a model sharded with fully_shard"):
        coat.distributed.fp8_reduce_scatter(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="block_size must be one of"):
        coat.distributed.FP8ReduceScatter(block_size=100)
    with pytest.raises(ValueError, match="unsupported FP8 format"):
        coat.distributed.FP8ReduceScatter(format="e3m4")

    class TwoRanks:
        def size(self):
            return 2

    comm = coat.distributed.FP8ReduceScatter()
    with pytest.raises(NotImplementedError, match="sums or averages"):
        comm(torch.empty(4), torch.zeros(8), TwoRanks(), dist.ReduceOp.MAX)
    assert comm.log.sent == {} and comm.log.bytes_sent == 0
