"""Which tensors stay allocated on the GPU after a benchmarks/e2e_shapes.py row is freed (its "allocated before GiB").

    python3 tools/e2e_leak_probe.py      (from the repository root, on a GPU; ~1 min on an H200)
"""
import gc, sys, types
import torch
sys.path.insert(0, "benchmarks")
sys.argv = ["x"]
import e2e_shapes as es

dev = torch.device("cuda", 0)

class A: smoke = False; warmup = 2; steps = 1

def live_cuda_tensors():
    out = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                out.append(o)
        except Exception:
            pass
    return out

def describe(t, depth=0, seen=None):
    seen = seen or set()
    for r in gc.get_referrers(t):
        if id(r) in seen or isinstance(r, types.FrameType) or r is globals():
            continue
        seen.add(id(r))
        s = str(r)[:160].replace("\n", " ")
        print("   " * (depth + 1), type(r).__name__, s)
        if depth < 3 and not isinstance(r, types.ModuleType):
            describe(r, depth + 1, seen)

for variant, track in [("bf16", False), ("bf16", True), ("coat", True)]:
    shape = es.SHAPES["llama3.2-1b"]
    before = torch.cuda.memory_allocated()
    tr = es.ShapeTraining(variant, shape, shape.make_config(False), dev)
    tr.build()
    es.trial(tr, 2, 2048, 2, 1)
    if track:
        es.tracked_step(tr, 2, 2048)
    tr.free(); gc.collect(); torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    print(f"== {variant} tracked={track}: allocated {before/2**30:.3f} -> {after/2**30:.3f} GiB", flush=True)
    ts = live_cuda_tensors()
    big = sorted(ts, key=lambda t: -t.untyped_storage().nbytes())[:3]
    print("   live cuda tensors:", len(ts), "bytes", sum(t.untyped_storage().nbytes() for t in ts) / 2**30)
    for t in big:
        print("  tensor", tuple(t.shape), t.dtype, t.untyped_storage().nbytes() / 2**20, "MiB")
        describe(t)
    if after - before > 2**28 and not ts:
        print("   no python-visible tensor holds it")
        print(torch.cuda.memory_summary(abbreviated=True)[:3000])
