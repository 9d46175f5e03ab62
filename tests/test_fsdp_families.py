"""Every model family coat.convert supports, under FSDP2 (fully_shard per decoder layer, then the model) on two
gloo processes: plain, and with the projection weights all-gathered in FP8 (coat.distributed.fp8_all_gather,
whose scale groups follow each family's projections: Phi-3's fused qkv_proj and gate_up_proj are one group each),
and vision-language models with their vision side in FP8 too, sharded per language layer and vision block: Qwen2.5-VL
(gated vision MLPs, coat.nn.SwiGLUMLP) and Qwen3-VL (non-gated ones, coat.nn.MLP).

Both ranks train on the same batches, so the averaged gradient is the single-process one bit for bit, and the
FP8 all-gather brings the codes and scale of the unsharded weight: a sharded run equals the single-process run
of the same converted model bit for bit, losses and every parameter shard after the steps. The optimizer is SGD
with momentum, which is elementwise, so that only the model is under test (tests/test_optim_distributed.py
covers coat.optim.AdamW's shards).
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import coat
from distributed_helpers import WORLD_SIZE, local, run_scenarios, spawn_and_load
from test_nn_llama import FAMILIES, tiny_model, token_batch

pytestmark = pytest.mark.transformers

STEPS = 3
VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl")  # each with vision_linears=True
FSDP_FAMILIES = [family for family in FAMILIES if family not in ("llama", "mistral", "qwen2")]  # those three:
# tests/test_optim_distributed.py (Llama) and the shared decoder layer


def train(model, batches: list[dict]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """FSDP2's shard of ``tensor`` on ``rank``: torch.chunk's along dim 0, empty past the chunks there are (Qwen2-MoE's
    shared_expert_gate weight [1, H] lives on rank 0 alone)."""
    chunks = tensor.chunk(WORLD_SIZE, dim=0)
    return chunks[rank] if rank < len(chunks) else tensor[:0]


def run_sharded(reference, units, batches: list[dict], rank: int, mesh, gather_in_fp8: bool) -> dict:
    """A copy of the converted ``reference`` under fully_shard (each of ``units(model)``, then the model) trained on
    ``batches`` beside the reference: both losses, each parameter's local shard with the reference's."""
    model = copy.deepcopy(reference)
    if gather_in_fp8:
        communication = coat.distributed.fp8_all_gather(model)
    for unit in units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    result = {"losses": train(model, batches), "reference_losses": train(reference, batches)}
    result["compared"] = {
        name: (local(param).detach().clone(), shard(expected.detach(), rank).clone())
        for (name, param), expected in zip(model.named_parameters(), reference.parameters())
    }
    if gather_in_fp8:
        result["codes_sent"] = communication.log.buffer_elements
    return result


def run_family(family: str, rank: int, mesh, gather_in_fp8: bool) -> dict:
    tokens = token_batch("cpu")  # one batch, so that the loss falls step after step
    return run_sharded(coat.convert(tiny_model(family).float()), lambda model: model.model.layers,
                       [dict(input_ids=tokens, labels=tokens)] * STEPS, rank, mesh, gather_in_fp8)


def run_vision_language_model(name: str, rank: int, mesh, gather_in_fp8: bool) -> dict:
    """A vision-language model with its vision side in FP8 too, fully_shard per language decoder layer and vision
    block, the image in every batch."""
    from test_nn_vlm import image_batch, tiny_vlm

    tokens, labels, images = image_batch(name)
    batch = dict(input_ids=tokens, labels=labels, **{**images, "pixel_values": images["pixel_values"].float()})
    return run_sharded(coat.convert(tiny_vlm(name).float(), vision_linears=True),
                       lambda model: [*model.model.language_model.layers, *model.model.visual.blocks],
                       [batch] * STEPS, rank, mesh, gather_in_fp8)


def families(rank: int, world_size: int, device: torch.device, out: Path) -> None:
    mesh = init_device_mesh(device.type, (world_size,))
    results = {(family, fp8): run_family(family, rank, mesh, fp8) for family in FSDP_FAMILIES for fp8 in (False, True)}
    results.update({(name, fp8): run_vision_language_model(name, rank, mesh, fp8)
                    for name in VISION_LANGUAGE for fp8 in (False, True)})
    torch.save(results, out / f"rank{rank}.pt")


def worker(rank: int, world_size: int, backend: str, out: str) -> None:
    run_scenarios(rank, world_size, backend, out, (families,))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Each rank's {(family, gathered in FP8): its results}; gloo only (no NCCL run of these yet)."""
    return spawn_and_load(worker, "gloo", tmp_path_factory.mktemp("fsdp-families"), (families,),
                          weights_only=False)["families"]


def assert_trains_as_one_process(got: dict, gathers_per_step) -> None:
    """Losses and parameter shards as the single process's; with the FP8 all-gather, each weight's shard went as one
    byte per element ``gathers_per_step(name)`` times a step (0: in 16 bits, as biases, norms and the 3-D expert
    weights)."""
    assert got["losses"] == got["reference_losses"]
    assert got["losses"][-1] < got["losses"][0]
    differing = [name for name, (a, b) in got["compared"].items() if not torch.equal(a, b)]
    assert not differing, differing
    if "codes_sent" in got:
        codes = sum(a.numel() * gathers_per_step(name) for name, (a, _) in got["compared"].items())
        assert codes and got["codes_sent"] == STEPS * codes


@pytest.mark.parametrize("gather_in_fp8", [False, True], ids=["bf16-gather", "fp8-all-gather"])
@pytest.mark.parametrize("family", FSDP_FAMILIES)
def test_fsdp2_trains_each_family_as_one_process_does(results, family, gather_in_fp8):
    """Every projection weight gathered in FP8 for forward and again for backward."""
    for rank_results in results:
        assert_trains_as_one_process(rank_results[family, gather_in_fp8],
                                     lambda name: 2 * name.endswith("_proj.weight"))


@pytest.mark.parametrize("gather_in_fp8", [False, True], ids=["bf16-gather", "fp8-all-gather"])
@pytest.mark.parametrize("name", VISION_LANGUAGE)
def test_fsdp2_trains_a_vision_language_model_as_one_process_does(results, name, gather_in_fp8):
    """Gathered in FP8 for forward and backward: the projections of the language model and of the vision blocks'
    MLPs (*_proj, Qwen3-VL's linear_fc1 and linear_fc2), the vision attention's qkv and proj; once a step: the
    mergers' linear layers (Qwen3-VL's deepstack mergers too), which sit in the root unit (FSDP2 keeps the root's
    parameters gathered from forward to backward); not the patch embedding (a convolution)."""
    vision_block = re.compile(r"model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])\.weight")
    merger = re.compile(r"model\.visual\.(merger\.mlp\.[02]|(merger|deepstack_merger_list\.\d+)\.linear_fc[12])"
                        r"\.weight")

    def gathers_per_step(name: str) -> int:
        if name.endswith("_proj.weight") or vision_block.fullmatch(name):
            return 2
        return 1 if merger.fullmatch(name) else 0

    for rank_results in results:
        got = rank_results[name, gather_in_fp8]
        assert any(name.startswith("model.visual.") for name in got["compared"])
        assert_trains_as_one_process(got, gathers_per_step)
