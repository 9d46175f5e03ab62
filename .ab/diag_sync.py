import sys, traceback, time
sys.path.insert(0, "tests")
import torch, coat
from optim_helpers import tiny_llama
from test_report import tokens, train_step
from torch.profiler import ProfilerActivity, profile
model = coat.convert(tiny_llama(seed=0)).cuda()
optimizer = coat.optim.AdamW(model.parameters(), lr=1e-3)
report = coat.report.QuantizationReport(model, optimizer)
batch = tokens().cuda()
with report.capture():
    train_step(model, optimizer, batch)
report.stats(); torch.cuda.synchronize()
API = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaFreeHost")
for name in ("plain", "capture"):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        torch.cuda._sleep(200_000_000)
        t = time.perf_counter()
        if name == "plain":
            train_step(model, optimizer, batch)
        else:
            with report.capture():
                train_step(model, optimizer, batch)
        host = time.perf_counter() - t
    print(name, f"host {host*1e3:.1f} ms")
    for e in prof.events():
        if e.name in API:
            print("  ", e.name, f"{e.cpu_time_total:.0f} us", " <- ".join(str(f) for f in e.stack[:8] if "torch/" not in str(f) or "report" in str(f))[:600])
    report.stats()
for name in ("plain", "capture"):
    torch.cuda.set_sync_debug_mode("error")
    try:
        if name == "plain":
            train_step(model, optimizer, batch)
        else:
            with report.capture():
                train_step(model, optimizer, batch)
        print(name, "no flagged sync")
    except Exception:
        print(name, "flagged sync:"); traceback.print_exc(limit=-8)
    torch.cuda.set_sync_debug_mode(0)
