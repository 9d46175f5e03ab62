"""Which tensors stay allocated on the GPU after a benchmarks/e2e_shapes.py row is freed (its "allocated before GiB").

Builds, steps (trial) and frees the rows below at the Llama-3.2-1B shape, batch 2 x 2048, with and without the
MemTracker accounting step (tracked_step), then prints what stays allocated, the largest CUDA tensors gc still sees
and, three levels deep, what refers to them. It found MemTracker's step keeping a fused-AdamW model alive
(benchmarks/results/e2e-shapes-memtracker-leak-NVIDIA_H200.log).

    python3 tools/e2e_leak_probe.py      (from the repository root, on a GPU; ~1 min on an H200)
"""
import gc
import sys
import types

import torch

sys.path.insert(0, "benchmarks")
import e2e_shapes  # noqa: E402

ROWS = [("bf16", False), ("bf16", True), ("coat", True)]  # (variant, with the MemTracker step)
BATCH, SEQ = 2, 2048


def live_cuda_tensors() -> list[torch.Tensor]:
    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                tensors.append(obj)
        except Exception:  # noqa: BLE001 - some objects gc tracks fail isinstance (lazy modules)
            pass
    return tensors


def print_referrers(obj, depth: int = 0, seen: set | None = None) -> None:
    seen = set() if seen is None else seen
    for referrer in gc.get_referrers(obj):
        if id(referrer) in seen or isinstance(referrer, types.FrameType) or referrer is globals():
            continue
        seen.add(id(referrer))
        print("   " * (depth + 1), type(referrer).__name__, str(referrer)[:160].replace("\n", " "))
        if depth < 3 and not isinstance(referrer, types.ModuleType):
            print_referrers(referrer, depth + 1, seen)


def main() -> None:
    device = torch.device("cuda", 0)
    shape = e2e_shapes.SHAPES["llama3.2-1b"]
    for variant, tracked in ROWS:
        before = torch.cuda.memory_allocated()
        training = e2e_shapes.ShapeTraining(variant, shape, device)
        training.build()
        e2e_shapes.trial(training, BATCH, SEQ, warmup=2, steps=1)
        if tracked:
            e2e_shapes.tracked_step(training, BATCH, SEQ)
        training.free()
        gc.collect()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        print(f"== {variant} tracked={tracked}: allocated {before / 2**30:.3f} -> {after / 2**30:.3f} GiB", flush=True)
        tensors = live_cuda_tensors()
        print("   live cuda tensors:", len(tensors), "GiB", sum(t.untyped_storage().nbytes() for t in tensors) / 2**30)
        for tensor in sorted(tensors, key=lambda t: -t.untyped_storage().nbytes())[:3]:
            print("  tensor", tuple(tensor.shape), tensor.dtype, tensor.untyped_storage().nbytes() / 2**20, "MiB")
            print_referrers(tensor)
        if after - before > 2**28 and not tensors:
            print("   no python-visible tensor holds it")
            print(torch.cuda.memory_summary(abbreviated=True)[:3000])


if __name__ == "__main__":
    main()
