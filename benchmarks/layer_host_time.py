"""Host time of one Llama decoder layer: how long the host takes to enqueue the forward and the backward
(time.perf_counter around each call, no profiler), beside the GPU time of the step (CUDA events around
both). An eager layer whose host time approaches its GPU time leaves the GPU idle: every step of
`layer.py` starts from an idle GPU, so the host's head start before the first GEMM is paid each step.
Variants: coat eager, torchao compiled (when installed), BF16 eager; settings (2048, 2048) and (4096, 2048),
batch 4. Medians of 20 steps after 10 warm-up steps.

--breakdown adds, per variant and setting, the host time of each operator the dispatcher sees (aten and coat
ops, summed over one forward or one backward, medians over the timed steps), and counts the synchronizations
torch.cuda.set_sync_debug_mode reports: an operator whose host time grows with the layer's size waits for
the GPU. The timing wrapper adds its own few microseconds per call; the plain host times come from steps
without it.

    python benchmarks/layer_host_time.py            (a CUDA GPU)
    python benchmarks/layer_host_time.py --breakdown
    python benchmarks/layer_host_time.py --smoke    (a tiny layer on the CPU: checks that the script runs)
"""
import collections
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import coat
from _common import parser, print_table, write_results
from layer import build_variant, llama_config

VARIANTS = ["coat eager", "torchao compiled", "BF16 eager"]


def host_times(layer, x, position_embeddings, grad, warmup: int, repeat: int, device: str) -> dict:
    cuda = device == "cuda"
    forward_ms, backward_ms, step_ms = [], [], []
    for i in range(warmup + repeat):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = layer(x, attention_mask=None, position_embeddings=position_embeddings)
        out = out[0] if isinstance(out, tuple) else out
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        if cuda:
            end.record()
            end.synchronize()
        if i >= warmup:
            forward_ms.append((t1 - t0) * 1e3)
            backward_ms.append((t2 - t1) * 1e3)
            step_ms.append(start.elapsed_time(end) if cuda else (t2 - t0) * 1e3)
    return {"host fwd ms": statistics.median(forward_ms), "host bwd ms": statistics.median(backward_ms),
            "step ms": statistics.median(step_ms)}


class OperatorHostTime(TorchDispatchMode):
    """Host seconds spent in each operator (by overload packet name) while active, and its calls."""

    def __init__(self):
        super().__init__()
        self.seconds = collections.Counter()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.seconds[name] += time.perf_counter() - start
        self.calls[name] += 1
        return out


def operator_breakdown(layer, x, position_embeddings, grad, warmup: int, repeat: int, device: str, top: int) -> dict:
    """Per phase (forward, backward): the operators with the most host time, median ms per step and calls per
    step; and the synchronizations set_sync_debug_mode warned about in one step."""
    per_step = {"forward": [], "backward": []}
    for i in range(warmup + repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        with OperatorHostTime() as forward_ops:
            out = layer(x, attention_mask=None, position_embeddings=position_embeddings)
            out = out[0] if isinstance(out, tuple) else out
        with OperatorHostTime() as backward_ops:
            out.backward(grad)
        if i >= warmup:
            per_step["forward"].append(forward_ops)
            per_step["backward"].append(backward_ops)
    result = {}
    for phase, steps in per_step.items():
        names = set().union(*(step.seconds for step in steps))
        ms = {name: statistics.median(step.seconds[name] * 1e3 for step in steps) for name in names}
        ranked = sorted(names, key=ms.get, reverse=True)[:top]
        result[phase] = [{"op": name, "host ms": round(ms[name], 4), "calls": steps[-1].calls[name]} for name in ranked]
        result[phase + " total ms"] = round(statistics.median(sum(step.seconds.values()) * 1e3 for step in steps), 4)
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = layer(x, attention_mask=None, position_embeddings=position_embeddings)
                (out[0] if isinstance(out, tuple) else out).backward(grad)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        result["synchronizations"] = sorted({str(w.message).splitlines()[0] for w in caught})
    return result


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU, eager variants, one step")
    p.add_argument("--breakdown", action="store_true", help="also the host time of each operator, and synchronizations")
    p.add_argument("--top", type=int, default=12, help="operators listed per phase with --breakdown")
    p.set_defaults(warmup=10, repeat=20)
    args = p.parse_args()
    if args.smoke:
        device, batch, settings, variants, args.warmup, args.repeat = "cpu", 2, [(64, 32)], ["coat eager", "BF16 eager"], 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/layer_host_time.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, batch, settings, variants = "cuda", 4, [(2048, 2048), (4096, 2048)], VARIANTS
    torch.manual_seed(0)
    rows, breakdowns = [], []
    for hidden, length in settings:
        config = llama_config(hidden)
        stock = LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(batch, length, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        position_embeddings = LlamaRotaryEmbedding(config).to(device)(x, torch.arange(length, device=device)[None])
        grad = torch.randn_like(x)
        for name in variants:
            layer = build_variant(stock, name)
            row = {"hidden": hidden, "seq": length, "batch": batch, "layer": name}
            if isinstance(layer, str):
                rows.append({**row, "missing": layer})
                continue
            rows.append({**row, **host_times(layer, x, position_embeddings, grad, args.warmup, args.repeat, device)})
            if args.breakdown:
                breakdowns.append({**row, **operator_breakdown(layer, x, position_embeddings, grad, args.warmup,
                                                               args.repeat, device, args.top)})
    for breakdown in breakdowns:
        for phase in ("forward", "backward"):
            print(f"\n{breakdown['layer']} ({breakdown['hidden']}, {breakdown['seq']}), {phase}: "
                  f"{breakdown[phase + ' total ms']} ms of host time in operators")
            print_table(breakdown[phase], ["op", "host ms", "calls"])
        for message in breakdown.get("synchronizations", []):
            print(f"  synchronizes: {message}")
    print()
    print_table(rows, ["hidden", "seq", "batch", "layer", "host fwd ms", "host bwd ms", "step ms"])
    path = write_results(args.results_dir, "layer_host_time-smoke" if args.smoke else "layer_host_time", rows,
                         {"smoke": args.smoke, "operator breakdown": breakdowns})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
