"""The MoE block of a decoder layer, forward + backward: h + experts(router(RMSNorm(h))), at Mixtral-8x7B's shape
(hidden 4096, 8 experts, top 2, intermediate 14336) and Qwen3-30B-A3B's (hidden 2048, 128 experts, top 8,
intermediate 768), 16k tokens: transformers' block with its grouped_mm experts in BF16, the same compiled, and
coat's converted layer (coat.nn.families.moe), eager and compiled (torch.compile fuses the routing glue around
coat's ops). GPU time (CUDA events, median after warm-up) and the bytes the
block saves for backward (parameters excluded), with ratios against BF16.

torchao's FP8 MoE training prototype (torchao 0.18, torchao.prototype.moe_training) cannot run on transformers'
experts as they are: its FP8 grouped GEMM needs every expert's token group padded to a multiple of 16 rows, its
padding option asserts "not yet supported", and transformers' grouped_mm experts pass unpadded groups (its
parameter swap also intercepts torch._grouped_mm only, while transformers calls torch.nn.functional.grouped_mm
where torch has it, so the swapped experts would silently stay BF16). The "torchao fp8 rowwise" row is therefore
transformers' block with its experts computed by torchao's differentiable FP8 row-wise grouped GEMM
(_to_fp8_rowwise_then_scaled_grouped_mm) on rows grouped and padded to 16 by coat's routing (what torchtitan's
token-group padding does), SiLU*mul and the weighting in BF16: torchao's recipe at its best on this block."""
from __future__ import annotations

import copy
import sys

import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

import coat
from coat.nn import experts as coat_experts
from _common import compile_for_fixed_shapes, kernel_profile, parser, print_table, time_ms, write_results

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


def torchao_missing() -> str | None:
    try:
        import torchao.prototype.moe_training  # noqa: F401
    except ImportError as error:
        return f"torchao is not installed ({error.name}): pip install --no-build-isolation -e '.[bench]'"
    return None


def torchao_block(layer):
    """The block with torchao's FP8 row-wise grouped GEMM for the experts (see the module docstring)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_grouped_mm

    mlp, experts = layer.mlp, layer.mlp.experts

    def block(h):
        normed = layer.post_attention_layernorm(h)
        flat = normed.reshape(-1, normed.shape[-1])
        _, weights, index = mlp.gate(flat)
        routing = coat_experts.route(index, experts.gate_up_proj.shape[0])
        rows = coat_experts.permute_rows(flat, routing)
        gate_up = fp8_grouped_mm(rows, experts.gate_up_proj.transpose(-2, -1), routing.offsets,
                                 pad_token_groups_for_grouped_mm=False)
        gate, up = gate_up.chunk(2, dim=-1)
        out = fp8_grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1), routing.offsets,
                             pad_token_groups_for_grouped_mm=False)
        return h + coat_experts.combine(out, routing, weights, h.dtype).view(h.shape)
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


def block_rows(name, shape, device, tokens, warmup, repeat, profile=False):
    config_class, layer_class, fields = shape
    stock = block_layer(config_class, layer_class, fields, device)
    converted = copy.deepcopy(stock)
    coat.convert(torch.nn.ModuleList([converted]))  # finds the decoder layer inside
    variants = {
        "bf16 grouped_mm": stock_block(stock),
        "bf16 grouped_mm compiled": compile_for_fixed_shapes(stock_block(stock)) if device == "cuda" else None,
        "torchao fp8 rowwise": torchao_block(stock) if device == "cuda" and torchao_missing() is None else None,
        "coat": converted._mlp_residual,
        "coat compiled": compile_for_fixed_shapes(converted._mlp_residual) if device == "cuda" else None,
    }
    missing = {"bf16 grouped_mm compiled": "torch.compile is timed on the GPU only",
               "coat compiled": "torch.compile is timed on the GPU only",
               "torchao fp8 rowwise": "torchao's FP8 grouped GEMM runs on CUDA GPUs only" if device != "cuda"
               else torchao_missing()}
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
            rows.append({"shape": name, "variant": variant, "missing": missing[variant]})
            continue
        layer = converted if variant.startswith("coat") else stock
        try:
            ms = time_ms(lambda: step(fn, layer), warmup, repeat, device)
        except Exception as error:  # a compile failure is a finding to record, not the end of the run
            rows.append({"shape": name, "variant": variant, "missing": f"{type(error).__name__}: {error}"[:300]})
            continue
        rows.append({"shape": name, "tokens": h.shape[0] * h.shape[1], "variant": variant, "fwd+bwd ms": ms,
                     "saved MiB": saved_bytes(fn, h, list(layer.parameters())) / 2**20})
        if profile:
            rows[-1]["profile"] = kernel_profile(lambda: step(fn, layer), steps=3)
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
    p.add_argument("--profile", action="store_true", help="print each row's kernels per step (torch.profiler, GPU)")
    args = p.parse_args()
    if args.smoke:
        device, tokens, shapes, args.warmup, args.repeat = "cpu", SMOKE_TOKENS, SMOKE_SHAPES, 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/moe.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, tokens, shapes = "cuda", TOKENS, {name: SHAPES[name] for name in args.shapes}
    rows = []
    for name, shape in shapes.items():
        rows += block_rows(name, shape, device, tokens, args.warmup, args.repeat, args.profile and device == "cuda")
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, ["shape", "tokens", "variant", "fwd+bwd ms", "vs bf16", "saved MiB", "saved vs bf16", "missing"])
    for row in rows:
        if "profile" in row:
            print(f"\n{row['shape']} {row['variant']}: kernels per step (torch.profiler, 3 steps)")
            print_table(row["profile"]["kernels"][:25], ["kernel", "class", "calls", "us"])
            print({k: v for k, v in row["profile"].items() if k != "kernels"})
    coat_rows = {row["shape"]: row for row in rows if row["variant"] == "coat"}
    torchao_ms = {row["shape"]: row["fwd+bwd ms"] for row in rows if row["variant"] == "torchao fp8 rowwise"
                  and "missing" not in row}
    summary = {"smoke": args.smoke, **{f"{shape}_speedup": row["vs bf16"] for shape, row in coat_rows.items()},
               **{f"{shape}_vs_torchao": torchao_ms[shape] / row["fwd+bwd ms"] for shape, row in coat_rows.items()
                  if shape in torchao_ms},
               **{f"{shape}_saved_ratio": row["saved vs bf16"] for shape, row in coat_rows.items()}}
    path = write_results(args.results_dir, "moe-smoke" if args.smoke else "moe", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
