"""Every model family coat.convert supports, under FSDP2 (fully_shard per decoder layer, then the model) on two
gloo processes: plain, and with the projection weights all-gathered in FP8 (coat.distributed.fp8_all_gather,
whose scale groups follow each family's projections: Phi-3's fused qkv_proj and gate_up_proj are one group each).

Both ranks train on the same batches, so the averaged gradient is the single-process one bit for bit, and the
FP8 all-gather brings the codes and scale of the unsharded weight: a sharded run equals the single-process run
of the same converted model bit for bit, losses and every parameter shard after the steps. The optimizer is SGD
with momentum, which is elementwise, so that only the model is under test (tests/test_optim_distributed.py
covers coat.optim.AdamW's shards).
"""
from __future__ import annotations

import copy
import datetime
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import coat
from test_nn_llama import FAMILIES, tiny_model, token_batch

pytestmark = pytest.mark.transformers

WORLD_SIZE = 2
TIMEOUT_S = 240
STEPS = 3
FSDP_FAMILIES = [family for family in FAMILIES if family not in ("llama", "mistral", "qwen2")]  # those three:
# tests/test_optim_distributed.py (Llama) and the shared decoder layer


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def train(model, tokens: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in tokens:
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_family(family: str, rank: int, mesh, gather_in_fp8: bool) -> dict:
    reference = coat.convert(tiny_model(family).float())
    model = copy.deepcopy(reference)
    if gather_in_fp8:
        communication = coat.distributed.fp8_all_gather(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tokens = [token_batch("cpu")] * STEPS  # one batch, so that the loss falls step after step
    result = {"losses": train(model, tokens), "reference_losses": train(reference, tokens)}
    result["compared"] = {
        name: (local(param).detach().clone(), expected.detach().chunk(WORLD_SIZE, dim=0)[rank].clone())
        for (name, param), expected in zip(model.named_parameters(), reference.parameters())
    }
    if gather_in_fp8:
        result["codes_sent"] = communication.log.buffer_elements
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)  # the same CPU kernels, the same sums, in both ranks and in the reference
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        results = {(family, fp8): run_family(family, rank, mesh, fp8) for family in FSDP_FAMILIES
                   for fp8 in (False, True)}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp-families")
    context = mp.start_processes(worker, args=(free_port(), str(out)), nprocs=WORLD_SIZE, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                pytest.fail(f"the workers did not finish in {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("gather_in_fp8", [False, True], ids=["bf16-gather", "fp8-all-gather"])
@pytest.mark.parametrize("family", FSDP_FAMILIES)
def test_fsdp2_trains_each_family_as_one_process_does(results, family, gather_in_fp8):
    for rank_results in results:
        got = rank_results[family, gather_in_fp8]
        assert got["losses"] == got["reference_losses"]
        assert got["losses"][-1] < got["losses"][0]
        differing = [name for name, (a, b) in got["compared"].items() if not torch.equal(a, b)]
        assert not differing, differing
        if gather_in_fp8:  # every projection weight's shard went as one byte per element, twice a step
            shard_elements = sum(a.numel() for name, (a, _) in got["compared"].items() if "_proj." in name)
            assert got["codes_sent"] == 2 * STEPS * shard_elements
