"""One Llama decoder layer, forward + backward, at the settings of the paper's Table 7: hidden size 2048 and
4096, sequence length 2048 and 4096, batch 4 (intermediate size 11008 * hidden / 4096, heads of 128, SDPA
attention). Every run times, in one process on the same inputs:

    BF16 eager          transformers' LlamaDecoderLayer as it is (the baseline)
    BF16 compiled       the same under torch.compile
    torchao compiled    torchao float8 training (convert_to_float8_training, tensorwise scaling) under
                        torch.compile, the FP8 layer a user would pick instead; the row says so when
                        torchao is not installed (pip install --no-build-isolation -e ".[bench]")
    coat eager          the layer after coat.convert
    coat compiled       the same under torch.compile
    coat fast-accum eager   coat.convert(fast_accum=True): the forward GEMMs accumulate as torchao's do (the
                        tensor cores' fast FP8 accumulation), the backward GEMMs in fp32 as before
    coat fp4 eager      coat.convert(saved_format="fp4"): RMSNorm's and SiLU*mul's inputs kept as FP4 E2M1
                        in 1 x 16 blocks
    coat fp4 G=128 eager    the same in 1 x 128 blocks (AGoQ's block size: fewer scales, coarser blocks)
    coat fp6 eager      coat.convert(saved_format="fp6"): the same inputs kept as FP6 E2M3 in 1 x 16 blocks, the
                        middle step of the report's per-layer choice

Times are CUDA-event medians after warm-up (backward = total - forward), taken in rounds (--rounds, 5), the
variants in turn in each round, and the median over the rounds reported: an H200 at its power cap drifts by a
few percent over a run, which timing one variant after another would hand to whichever ran later. Each step
starts on an idle GPU, so they include the host's time to enqueue the step's first kernels. "GPU ms" is
forward + backward with the GPU kept busy while the host enqueues (_common.time_cuda_gpu_ms): the step's GPU
work alone, what a layer costs inside a model whose host runs ahead of the GPU (for every variant here the
host's time to enqueue a step is below the GPU's). "saved" is what the forward leaves allocated for backward:
the memory allocated across the forward minus its output, in MB and in units U = 2 bytes x tokens x hidden
(one BF16 copy of the layer's input); it includes the caching allocator's slack (a cached block up to 1 MB
larger than the request is handed out whole). "tensors U" is the bytes of the distinct storages autograd saves
(torch.autograd.graph.saved_tensors_hooks), parameters and the layer's inputs (RoPE's cos and sin, shared by a
model's layers) excluded, for the eager rows; on the CPU (--smoke) "saved" is that too.

Targets (H100/H200, issues 10 and 12): coat eager >= 1.8x BF16 eager and >= 1.1x torchao compiled, coat
compiled no slower than coat eager, saved activations <= 10.4 U (issue 10) and <= 9 U (issue 12); coat fp4
eager <= 6 U and no slower than coat eager.

    python benchmarks/layer.py                          (a CUDA GPU with FP8 tensor cores: H100/H200)
    python benchmarks/layer.py --settings 4096x2048 --profile   (adds a kernel table per layer variant)
    python benchmarks/layer.py --smoke                  (a tiny layer on the CPU: checks that the script runs)

--family qwen3 times a Qwen3 decoder layer instead (q/k norms over each head before RoPE, coat's fused
qk_norm_rope): intermediate 3 x hidden, heads of 128, a quarter as many key/value heads, so hidden 4096 is the
Qwen3-8B layer (32 heads, 8 key/value heads, intermediate 12288); default settings 4096x2048 and 4096x4096.
Its rows carry "model": "qwen3" and go to layer-qwen3-*.json.

--family phi3 times a Phi-3 decoder layer (one fused qkv_proj and one fused gate_up_proj weight): intermediate
3.5 x hidden, heads of 128, a quarter as many key/value heads, so hidden 5120 is the Phi-3-medium layer (40
heads, 10 key/value heads, intermediate 17920); default settings 5120x2048 and 5120x4096. Its rows carry
"model": "phi3" and go to layer-phi3-*.json.

--family olmo2 times an OLMo 2 decoder layer (no pre-norms; post-norms on the blocks' outputs; q/k norms over the
whole projections): Llama-2's sizes, so hidden 4096 is the OLMo-2-7B layer (32 heads, 32 key/value heads,
intermediate 11008); default settings 4096x2048 and 4096x4096.

--family gemma3 times a Gemma 3 decoder layer ((1 + w) norms, four of them, per-head q/k norms, GeGLU): heads of
256, half as many key/value heads, intermediate 4 x hidden, so hidden 3840 is the Gemma-3-12B layer (16 heads,
8 key/value heads, intermediate 15360); a global-attention layer (the sliding-window layers differ only in their
mask, which a layer timed alone does not get); default settings 3840x2048 and 3840x4096.

Their rows carry "model" and go to layer-FAMILY-*.json.

    python benchmarks/layer.py --family qwen3
    python benchmarks/layer.py --family phi3
    python benchmarks/layer.py --family olmo2
    python benchmarks/layer.py --family gemma3
"""
import copy
import statistics
import sys

import torch
from torch import nn
from transformers import Gemma3TextConfig, LlamaConfig, Olmo2Config, Phi3Config, Qwen3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer, Olmo2RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

import coat

from _common import (compile_for_fixed_shapes, kernel_profile, parser, print_table, time_cuda_gpu_ms, time_ms,
                     write_results)

BATCH = 4
SETTINGS = [(2048, 2048), (2048, 4096), (4096, 2048), (4096, 4096)]  # (hidden, sequence length)
SMOKE_BATCH, SMOKE_SETTINGS = 2, [(64, 32)]
SPEED_TARGET, PEER_TARGET, SAVED_TARGET_U, FP4_SAVED_TARGET_U = 1.8, 1.1, 9.0, 6.0
BASELINE, PEER = "BF16 eager", "torchao compiled"
# coat.convert's options of each coat variant
COAT_VARIANTS = {"coat eager": {}, "coat compiled": {}, "coat fast-accum eager": {"fast_accum": True},
                 "coat fp4 eager": {"saved_format": "fp4"},
                 "coat fp4 G=128 eager": {"saved_format": "fp4", "group_size": 128},
                 "coat fp6 eager": {"saved_format": "fp6"}}
VARIANTS = [BASELINE, "BF16 compiled", PEER, *COAT_VARIANTS]


def llama_config(hidden: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=11008 * hidden // 4096,
        num_attention_heads=max(hidden // 128, 1),
        num_key_value_heads=max(hidden // 128, 1),
        attn_implementation="sdpa",
    )


def qwen3_config(hidden: int) -> Qwen3Config:
    heads = max(hidden // 128, 1)
    return Qwen3Config(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=hidden // heads,
        attn_implementation="sdpa",
    )


def phi3_config(hidden: int) -> Phi3Config:
    heads = max(hidden // 128, 1)
    return Phi3Config(
        hidden_size=hidden,
        intermediate_size=7 * hidden // 2,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        attn_implementation="sdpa",
    )


def olmo2_config(hidden: int) -> Olmo2Config:
    heads = max(hidden // 128, 1)
    return Olmo2Config(hidden_size=hidden, intermediate_size=11008 * hidden // 4096, num_attention_heads=heads,
                       num_key_value_heads=heads, attn_implementation="sdpa")


def gemma3_config(hidden: int) -> Gemma3TextConfig:
    heads = max(hidden // 240, 1)
    return Gemma3TextConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=heads,
                            num_key_value_heads=max(heads // 2, 1), head_dim=256, query_pre_attn_scalar=256,
                            layer_types=["full_attention"], num_hidden_layers=1, attn_implementation="sdpa")


class Gemma3GlobalRotaryEmbedding(Gemma3RotaryEmbedding):
    """The RoPE tables of Gemma 3's global-attention layers, called as the other families' are."""

    def forward(self, x, position_ids):
        return super().forward(x, position_ids, "full_attention")


# --family: (config of a hidden size, decoder layer, rotary embedding, default settings)
FAMILIES = {"llama": (llama_config, LlamaDecoderLayer, LlamaRotaryEmbedding, SETTINGS),
            "qwen3": (qwen3_config, Qwen3DecoderLayer, Qwen3RotaryEmbedding, [(4096, 2048), (4096, 4096)]),
            "phi3": (phi3_config, Phi3DecoderLayer, Phi3RotaryEmbedding, [(5120, 2048), (5120, 4096)]),
            "olmo2": (olmo2_config, Olmo2DecoderLayer, Olmo2RotaryEmbedding, [(4096, 2048), (4096, 4096)]),
            "gemma3": (gemma3_config, Gemma3DecoderLayer, Gemma3GlobalRotaryEmbedding, [(3840, 2048), (3840, 4096)])}


def torchao_float8(layer: nn.Module) -> nn.Module | str:
    """The layer with torchao's float8 training linears (tensorwise scaling), or why it cannot be built."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        return f"torchao is not installed ({error.name}): pip install --no-build-isolation -e '.[bench]'"
    return convert_to_float8_training(layer)


def build_variant(stock: nn.Module, name: str):
    """The module to time for one variant, or a string saying why it is missing. Compiled variants are
    compiled for this setting's shapes alone (compile_for_fixed_shapes)."""
    if name == BASELINE:
        return stock
    if name == "BF16 compiled":
        return compile_for_fixed_shapes(copy.deepcopy(stock))
    if name == PEER:
        layer = torchao_float8(copy.deepcopy(stock))
        return layer if isinstance(layer, str) else compile_for_fixed_shapes(layer)
    converted = coat.convert(nn.ModuleList([copy.deepcopy(stock)]), **COAT_VARIANTS[name])[0]
    return compile_for_fixed_shapes(converted) if name == "coat compiled" else converted


def saved_by_hooks_mb(forward, excluded) -> float:
    """Distinct storages autograd saves during forward(), those whose data pointers are in ``excluded`` left out."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values()) / 2**20


def saved_by_allocator_mb(forward) -> float:
    """Memory the forward leaves allocated, its output excluded: what backward will consume."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    del out
    return saved / 2**20


def prepare(layer, hidden_states, position_embeddings, grad, device, compiled: bool) -> dict:
    """The layer's forward and forward + backward as callables, and what its forward saves for backward:
    "saved MB" (the allocator's measure on a GPU, the saved storages on the CPU; see the docstring) and
    "tensors MB" (the distinct storages autograd saves, on every device; None for a compiled layer, not
    measured there)."""
    parameters = list(layer.parameters())
    # Parameters, and the inputs that the forward made none of: RoPE's cos and sin, which a model computes once
    # for all its layers, like the allocator's measure, which counts what the forward allocates.
    not_activations = {t.untyped_storage().data_ptr() for t in (*parameters, hidden_states, *position_embeddings)}

    def forward():
        return layer(hidden_states, attention_mask=None, position_embeddings=position_embeddings)

    def forward_backward():
        hidden_states.grad = None
        for p in parameters:
            p.grad = None
        forward().backward(grad)

    forward_backward()  # compiled variants compile here, before anything is measured
    for p in parameters:
        p.grad = None
    tensors = None if compiled else saved_by_hooks_mb(forward, not_activations)
    saved = saved_by_allocator_mb(forward) if torch.device(device).type == "cuda" else tensors
    return {"forward": forward, "forward_backward": forward_backward, "saved MB": saved, "tensors MB": tensors}


def time_round(prepared: dict, warmup: int, repeat: int, device) -> dict:
    """One round of the layer's timings (medians of ``repeat`` after ``warmup``)."""
    total_ms = time_ms(prepared["forward_backward"], warmup, repeat, device)
    forward_ms = time_ms(prepared["forward"], warmup, repeat, device)
    timings = {"fwd ms": forward_ms, "bwd ms": total_ms - forward_ms, "total ms": total_ms}
    if torch.device(device).type == "cuda":
        timings["GPU ms"] = time_cuda_gpu_ms(prepared["forward_backward"], warmup, repeat)
    return timings


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU, eager variants, one run each")
    p.add_argument("--settings", nargs="+", metavar="HIDDENxSEQ", help="e.g. 4096x2048 (default: Table 7's four)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS, metavar="NAME",
                   help=f"layer variants to time, of: {', '.join(VARIANTS)}")
    p.add_argument("--profile", action="store_true", help="print each variant's kernels (torch.profiler, 5 steps)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of timing, the variants in turn in each (warm-up and repeat are per round); "
                        "each time is the median over the rounds")
    p.add_argument("--family", choices=FAMILIES, default="llama", help="the decoder layer's model family")
    p.set_defaults(warmup=3, repeat=10)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    variants = list(dict.fromkeys([BASELINE, *args.variants]))
    if args.smoke:
        device, batch, settings, args.warmup, args.repeat, args.rounds = "cpu", SMOKE_BATCH, SMOKE_SETTINGS, 1, 1, 1
        variants = [v for v in variants if "compiled" not in v]
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/layer.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, batch, settings = "cuda", BATCH, FAMILIES[args.family][3]
    if args.settings:
        settings = [tuple(int(v) for v in s.lower().split("x")) for s in args.settings]
    torch.manual_seed(0)

    rows, profiles = [], {}
    for hidden, length in settings:
        make_config, decoder_layer, rotary_embedding, _ = FAMILIES[args.family]
        config = make_config(hidden)
        stock = decoder_layer(config, layer_idx=0).to(device=device, dtype=torch.bfloat16)
        hidden_states = torch.randn(batch, length, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(length, device=device)[None]
        position_embeddings = rotary_embedding(config).to(device)(hidden_states, positions)
        grad = torch.randn_like(hidden_states)
        unit_mb = 2 * batch * length * hidden / 2**20
        results, prepared = {}, {}
        for name in variants:
            layer = build_variant(stock, name)
            if isinstance(layer, str):
                results[name] = {"missing": layer}
                print(f"{name}: {layer}")
                continue
            prepared[name] = prepare(layer, hidden_states, position_embeddings, grad, device, "compiled" in name)
        rounds = {name: [] for name in prepared}
        for _ in range(args.rounds):  # the variants in turn, so that a GPU whose clock drifts slows all alike
            for name, layer_calls in prepared.items():
                rounds[name].append(time_round(layer_calls, args.warmup, args.repeat, device))
        for name, layer_rounds in rounds.items():
            results[name] = {key: statistics.median(r[key] for r in layer_rounds) for key in layer_rounds[0]}
            results[name].update({key: prepared[name][key] for key in ("saved MB", "tensors MB")})
            if args.profile:
                profiles[f"{hidden}x{length} {name}"] = kernel_profile(prepared[name]["forward_backward"], steps=5)
        baseline, peer = results[BASELINE], results.get(PEER, {})
        for name, result in results.items():
            row = {"hidden": hidden, "seq": length, "batch": batch, "layer": name}
            if args.family != "llama":
                row["model"] = args.family
            if "missing" in result:
                rows.append({**row, "missing": result["missing"]})
                continue
            row.update(result)
            row["saved U"] = result["saved MB"] / unit_mb
            if result["tensors MB"] is not None:
                row["tensors U"] = result["tensors MB"] / unit_mb
            row["vs BF16 eager"] = baseline["total ms"] / result["total ms"]
            if "total ms" in peer:
                row["vs torchao"] = peer["total ms"] / result["total ms"]
            if "GPU ms" in result:
                row["GPU vs BF16"] = baseline["GPU ms"] / result["GPU ms"]
                if "GPU ms" in peer:
                    row["GPU vs torchao"] = peer["GPU ms"] / result["GPU ms"]
            rows.append(row)
        del stock, hidden_states, grad, prepared

    columns = ["hidden", "seq", "batch", "layer", "fwd ms", "bwd ms", "total ms", "vs BF16 eager", "vs torchao",
               "GPU ms", "GPU vs BF16", "GPU vs torchao", "saved MB", "saved U", "tensors U"]
    for name, profile in profiles.items():
        print(f"\n== kernels of {name}, per fwd+bwd step ==")
        print_table(profile["kernels"][:30], ["kernel", "class", "calls", "us"])
        print({k: v for k, v in profile.items() if k != "kernels"})
    print()
    print_table(rows, columns)
    coat_eager = [row for row in rows if row["layer"] == "coat eager" and "total ms" in row]
    coat_compiled = {(r["hidden"], r["seq"]): r for r in rows if r["layer"] == "coat compiled" and "total ms" in r}
    summary = {
        "smoke": args.smoke,
        "targets": {"vs_bf16_eager": SPEED_TARGET, "vs_torchao_compiled": PEER_TARGET, "saved_U": SAVED_TARGET_U,
                    "fp4_saved_U": FP4_SAVED_TARGET_U},
        "min_speedup": min(row["vs BF16 eager"] for row in coat_eager),
        "max_saved_U": max(row["saved U"] for row in coat_eager),
    }
    for low_bit_name, key in (("coat fp4 eager", "fp4"), ("coat fp4 G=128 eager", "fp4_g128"),
                              ("coat fp6 eager", "fp6")):
        low_bit = {(r["hidden"], r["seq"]): r for r in rows if r["layer"] == low_bit_name and "total ms" in r}
        if low_bit:
            summary[f"max_{key}_saved_U"] = max(row["saved U"] for row in low_bit.values())
            summary[f"max_{key}_tensors_U"] = max(row["tensors U"] for row in low_bit.values())
            for measure, name in (("total ms", "vs_coat_eager"), ("GPU ms", "gpu_vs_coat_eager")):
                if all(measure in row for row in coat_eager):
                    summary[f"min_{key}_{name}"] = min(
                        row[measure] / low_bit[(row["hidden"], row["seq"])][measure] for row in coat_eager
                    )
    if all("vs torchao" in row for row in coat_eager):
        summary["min_vs_torchao"] = min(row["vs torchao"] for row in coat_eager)
    if all("GPU vs BF16" in row for row in coat_eager):
        summary["min_gpu_speedup"] = min(row["GPU vs BF16"] for row in coat_eager)
    if all("GPU vs torchao" in row for row in coat_eager):
        summary["min_gpu_vs_torchao"] = min(row["GPU vs torchao"] for row in coat_eager)
    coat_fast = {(r["hidden"], r["seq"]): r for r in rows if r["layer"] == "coat fast-accum eager" and "total ms" in r}
    if coat_fast and all("GPU vs torchao" in row for row in coat_fast.values()):
        summary["min_fast_accum_vs_torchao"] = min(row["vs torchao"] for row in coat_fast.values())
        summary["min_fast_accum_gpu_vs_torchao"] = min(row["GPU vs torchao"] for row in coat_fast.values())
    if coat_compiled:
        summary["min_compiled_vs_eager"] = min(
            row["total ms"] / coat_compiled[(row["hidden"], row["seq"])]["total ms"] for row in coat_eager
        )
    print(summary)
    name = "layer" if args.family == "llama" else f"layer-{args.family}"
    path = write_results(args.results_dir, f"{name}-smoke" if args.smoke else name, rows,
                         {**summary, "profiles": profiles})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
