"""One Llama decoder layer, transformers' BF16 LlamaDecoderLayer against the same layer converted by
coat.convert, at the settings of the paper's Table 7: hidden size 2048 and 4096, sequence length 2048 and
4096, batch 4 (intermediate size 11008 * hidden / 4096, heads of 128, SDPA attention).

For each: forward, backward and total milliseconds (CUDA events, median after warm-up; backward = total -
forward) and the activation memory saved for backward, in MB, counted as the distinct storages autograd
saves (torch.autograd.graph.saved_tensors_hooks), parameters excluded. Targets on an H100: saved
activations at least 1.8x smaller and forward+backward at least 1.5x faster than BF16.

    python benchmarks/layer.py            (a CUDA GPU with FP8 tensor cores: H100/H200)
    python benchmarks/layer.py --smoke    (a tiny layer on the CPU: checks that the script runs)
"""
import copy
import sys

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import coat

from _common import parser, print_table, time_ms, write_results

BATCH = 4
SETTINGS = [(2048, 2048), (2048, 4096), (4096, 2048), (4096, 4096)]  # (hidden, sequence length)
SMOKE_BATCH, SMOKE_SETTINGS = 2, [(64, 32)]
MEMORY_TARGET, SPEED_TARGET = 1.8, 1.5


def llama_config(hidden: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=11008 * hidden // 4096,
        num_attention_heads=max(hidden // 128, 1),
        num_key_value_heads=max(hidden // 128, 1),
        attn_implementation="sdpa",
    )


def saved_activation_mb(run, parameters) -> float:
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values()) / 2**20


def measure(layer, hidden_states, position_embeddings, grad, warmup, repeat, device) -> dict:
    def forward():
        return layer(hidden_states, attention_mask=None, position_embeddings=position_embeddings)

    def forward_backward():
        hidden_states.grad = None
        for p in layer.parameters():
            p.grad = None
        forward().backward(grad)

    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    forward_ms = time_ms(forward, warmup, repeat, device)
    total_ms = time_ms(forward_backward, warmup, repeat, device)
    return {
        "fwd ms": forward_ms,
        "bwd ms": total_ms - forward_ms,
        "total ms": total_ms,
        "saved MB": saved_activation_mb(forward, parameters),
    }


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU, one run each")
    args = p.parse_args()
    if args.smoke:
        device, batch, settings, args.warmup, args.repeat = "cpu", SMOKE_BATCH, SMOKE_SETTINGS, 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/layer.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, batch, settings = "cuda", BATCH, SETTINGS
    torch.manual_seed(0)

    rows = []
    for hidden, length in settings:
        config = llama_config(hidden)
        stock = LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=torch.bfloat16)
        converted = coat.convert(nn.ModuleList([copy.deepcopy(stock)]))[0]
        hidden_states = torch.randn(batch, length, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(length, device=device)[None]
        position_embeddings = LlamaRotaryEmbedding(config).to(device)(hidden_states, positions)
        grad = torch.randn_like(hidden_states)
        results = {}
        for name, layer in (("BF16 (transformers)", stock), ("coat FP8", converted)):
            results[name] = measure(layer, hidden_states, position_embeddings, grad, args.warmup, args.repeat, device)
        baseline = results["BF16 (transformers)"]
        for name, result in results.items():
            speedup = baseline["total ms"] / result["total ms"]
            memory_ratio = baseline["saved MB"] / result["saved MB"]
            row = {"hidden": hidden, "seq": length, "batch": batch, "layer": name, **result}
            row["speedup"], row["memory ratio"] = speedup, memory_ratio
            if name != "BF16 (transformers)":
                row["meets 1.5x speed"] = "yes" if speedup >= SPEED_TARGET else "NO"
                row["meets 1.8x memory"] = "yes" if memory_ratio >= MEMORY_TARGET else "NO"
            rows.append(row)
        del stock, converted, hidden_states, grad

    columns = ["hidden", "seq", "batch", "layer", "fwd ms", "bwd ms", "total ms", "speedup", "saved MB",
               "memory ratio", "meets 1.5x speed", "meets 1.8x memory"]
    print_table(rows, columns)
    fp8_rows = [row for row in rows if row["layer"] == "coat FP8"]
    summary = {
        "smoke": args.smoke,
        "speed_target": SPEED_TARGET,
        "memory_target": MEMORY_TARGET,
        "min_speedup": min(row["speedup"] for row in fp8_rows),
        "min_memory_ratio": min(row["memory ratio"] for row in fp8_rows),
    }
    path = write_results(args.results_dir, "layer-smoke" if args.smoke else "layer", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
