"""The MoE block of a decoder layer, forward + backward: h + experts(router(RMSNorm(h))), at Mixtral-8x7B's shape
(hidden 4096, 8 experts, top 2, intermediate 14336) and Qwen3-30B-A3B's (hidden 2048, 128 experts, top 8,
intermediate 768), 16k tokens: transformers' block with its grouped_mm experts in BF16, the same compiled, and
coat's converted layer (coat.nn.families.moe). GPU time (CUDA events, median after warm-up) and the bytes the
block saves for backward (parameters excluded), with ratios against BF16.

torchao's FP8 MoE training prototype (torchao.prototype.moe_training) swaps nn.Parameter expert weights for its
own tensor subclass inside torchtitan-style MoE modules; running it on transformers' experts is not done here (see
benchmarks/NOTES.md)."""
from __future__ import annotations

import copy
import sys

import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

import coat
from _common import compile_for_fixed_shapes, parser, print_table, time_ms, write_results

SHAPES = {
    "mixtral-8x7b": (MixtralConfig, MixtralDecoderLayer,
                     dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                          num_attention_heads=32, num_key_value_heads=8)),
    "qwen3-30b-a3b": (Qwen3MoeConfig, Qwen3MoeDecoderLayer,
                      dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, norm_topk_prob=True)),
}
TOKENS = (4, 4096)  # 16k tokens
SMOKE_SHAPES = {
    "mixtral-tiny": (MixtralConfig, MixtralDecoderLayer,
                     dict(hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                          num_attention_heads=4, num_key_value_heads=2)),
}
SMOKE_TOKENS = (2, 32)


def block_layer(config_class, layer_class, fields, device):
    config = config_class(**fields, num_hidden_layers=1)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    layer = layer_class(config, layer_idx=0).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, p.shape[-1] ** -0.5)
    return layer


def stock_block(layer):
    def block(h):
        return h + layer.mlp(layer.post_attention_layernorm(h))
    return block


def saved_bytes(fn, h, parameters) -> int:
    """Bytes of the distinct storages autograd saves in fn(h), parameters excluded."""
    storages = {}
    parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(h)
    return sum(storages.values())


def block_rows(name, shape, device, tokens, warmup, repeat):
    config_class, layer_class, fields = shape
    stock = block_layer(config_class, layer_class, fields, device)
    converted = copy.deepcopy(stock)
    coat.convert(torch.nn.ModuleList([converted]))  # finds the decoder layer inside
    variants = {
        "bf16 grouped_mm": stock_block(stock),
        "bf16 grouped_mm compiled": compile_for_fixed_shapes(stock_block(stock)) if device == "cuda" else None,
        "coat": converted._mlp_residual,
    }
    h = torch.randn(*tokens, fields["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(h)

    def step(fn, layer):
        h.grad = None
        for p in layer.parameters():
            p.grad = None
        fn(h).backward(grad)

    rows = []
    for variant, fn in variants.items():
        if fn is None:
            rows.append({"shape": name, "variant": variant, "missing": "torch.compile is timed on the GPU only"})
            continue
        layer = converted if variant == "coat" else stock
        ms = time_ms(lambda: step(fn, layer), warmup, repeat, device)
        rows.append({"shape": name, "tokens": h.shape[0] * h.shape[1], "variant": variant, "fwd+bwd ms": ms,
                     "saved MiB": saved_bytes(fn, h, list(layer.parameters())) / 2**20})
    base = rows[0]
    for row in rows:
        if "missing" not in row:
            row["vs bf16"] = base["fwd+bwd ms"] / row["fwd+bwd ms"]
            row["saved vs bf16"] = row["saved MiB"] / base["saved MiB"]
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, one run each")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = p.parse_args()
    if args.smoke:
        device, tokens, shapes, args.warmup, args.repeat = "cpu", SMOKE_TOKENS, SMOKE_SHAPES, 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/moe.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, tokens, shapes = "cuda", TOKENS, {name: SHAPES[name] for name in args.shapes}
    rows = []
    for name, shape in shapes.items():
        rows += block_rows(name, shape, device, tokens, args.warmup, args.repeat)
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, ["shape", "tokens", "variant", "fwd+bwd ms", "vs bf16", "saved MiB", "saved vs bf16", "missing"])
    coat_rows = {row["shape"]: row for row in rows if row["variant"] == "coat"}
    summary = {"smoke": args.smoke, **{f"{shape}_speedup": row["vs bf16"] for shape, row in coat_rows.items()},
               **{f"{shape}_saved_ratio": row["saved vs bf16"] for shape, row in coat_rows.items()}}
    path = write_results(args.results_dir, "moe-smoke" if args.smoke else "moe", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
