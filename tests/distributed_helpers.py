"""What the multi-process tests share: scenarios run in WORLD_SIZE spawned processes (gloo on the CPU, NCCL on
two GPUs when the machine has them), each writing its results under out/<scenario name>/rank<r>.pt, and the
comparisons they make. A test module defines its scenarios, a module-level ``worker`` (spawn pickles it by name)
that calls :func:`run_scenarios`, and a fixture that calls :func:`spawn_and_load`."""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import coat
from coat.data import stdlib_tokens
from optim_helpers import text_batches

WORLD_SIZE = 2
TIMEOUT_S = 240  # a worker stuck in a collective fails the test instead of blocking CI
LR, WEIGHT_DECAY = 1e-2, 0.1

BACKENDS = [
    pytest.param("gloo", id="gloo-cpu"),
    pytest.param(
        "nccl",
        id="nccl-cuda",
        marks=pytest.mark.skipif(
            torch.cuda.device_count() < 2 or not coat.built_with_cuda(), reason="needs 2 CUDA devices"
        ),
    ),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def batches(steps: int) -> list[torch.Tensor]:
    return text_batches(stdlib_tokens(200_000), steps, batch=4, context=32, seed=1)


def fully_sharded(model, mesh, **options):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def assert_all_equal(compared: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    differing = [name for name, (a, b) in compared.items() if a.shape != b.shape or not torch.equal(bits(a), bits(b))]
    assert not differing, f"{len(differing)} of {len(compared)} tensors differ, e.g. {differing[:5]}"


def run_scenarios(rank: int, world_size: int, backend: str, out: str, scenarios) -> None:
    """A worker's body: joins the process group and runs every scenario in this one process (starting processes,
    with torch and transformers, costs more than the scenarios themselves)."""
    torch.set_num_threads(1)  # same CPU kernels, same sums, in the workers and in the references they compute
    if backend == "nccl":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    # A file in the test's own folder, not a TCP port: a free port picked here can be taken by another test
    # process before the store binds it (EADDRINUSE on CI).
    dist.init_process_group(
        backend,
        init_method=rendezvous_file(out).resolve().as_uri(),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        for scenario in scenarios:
            scenario_dir = Path(out) / scenario.__name__
            scenario_dir.mkdir(exist_ok=True)
            scenario(rank, world_size, device, scenario_dir)
    finally:
        dist.destroy_process_group()


def rendezvous_file(out) -> Path:
    return Path(out) / "rendezvous"


def spawn_and_load(worker, backend: str, out: Path, scenarios, weights_only: bool = True) -> dict[str, list]:
    """Runs ``worker(rank, WORLD_SIZE, backend, out)`` in WORLD_SIZE processes, failing the test after
    TIMEOUT_S, and returns {scenario name: [rank 0's results, rank 1's, ...]}."""
    rendezvous_file(out).unlink(missing_ok=True)  # a file left by an earlier group would join this one to it
    context = mp.start_processes(
        worker, args=(WORLD_SIZE, backend, str(out)), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                pytest.fail(f"the {backend} workers did not finish in {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return {
        scenario.__name__: [
            torch.load(out / scenario.__name__ / f"rank{rank}.pt", weights_only=weights_only) for rank in range(WORLD_SIZE)
        ]
        for scenario in scenarios
    }
