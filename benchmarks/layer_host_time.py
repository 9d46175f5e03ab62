"""Host time of one Llama decoder layer: how long the host takes to enqueue the forward and the backward
(time.perf_counter around each call, no profiler), beside the GPU time of the step (CUDA events around
both). An eager layer whose host time approaches its GPU time leaves the GPU idle: every step of
`layer.py` starts from an idle GPU, so the host's head start before the first GEMM is paid each step.
Variants: coat eager, torchao compiled (when installed), BF16 eager; settings (2048, 2048) and (4096, 2048),
batch 4. Medians of 20 steps after 10 warm-up steps.

    python benchmarks/layer_host_time.py            (a CUDA GPU)
    python benchmarks/layer_host_time.py --smoke    (a tiny layer on the CPU: checks that the script runs)
"""
import statistics
import sys
import time

import torch
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


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU, eager variants, one step")
    p.set_defaults(warmup=10, repeat=20)
    args = p.parse_args()
    if args.smoke:
        device, batch, settings, variants, args.warmup, args.repeat = "cpu", 2, [(64, 32)], ["coat eager", "BF16 eager"], 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/layer_host_time.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, batch, settings, variants = "cuda", 4, [(2048, 2048), (4096, 2048)], VARIANTS
    torch.manual_seed(0)
    rows = []
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
    print_table(rows, ["hidden", "seq", "batch", "layer", "host fwd ms", "host bwd ms", "step ms"])
    path = write_results(args.results_dir, "layer_host_time-smoke" if args.smoke else "layer_host_time", rows,
                         {"smoke": args.smoke})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
