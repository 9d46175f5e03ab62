"""coat's fused RoPE (coat.ops.rotary_embedding) against transformers' apply_rotary_pos_emb, eager and under
torch.compile, and against a device copy, in the same run; and coat's per-head q/k RMSNorm fused with RoPE
(coat.ops.qk_norm_rope, Qwen3's and Gemma 3's q_norm / k_norm) against transformers' Qwen3RMSNorm then
apply_rotary_pos_emb, at Qwen3-8B's and Gemma-3-12B's heads.

Layout, as in a converted decoder layer: q and k are column slices of one [B*S, (Hq + 2 Hk) * D] q/k/v
projection output. coat reads them in place as [B, S, H, D]; transformers' formula gets the transposed
[B, H, S, D] views that the layer passes it. cos, sin: [B, S, D] in the activation dtype, as transformers'
rotary embedding returns them.

Bytes, the least RoPE must move (benchmarks/NOTES.md, "RoPE"): q and k read once and written once, cos and
sin read once,
    bytes = 2 * B*S*(Hq + Hk)*D * elt + 2 * B*S*D * table_elt        per pass (forward, or backward)
qk_norm_rope also writes the norms' inputs as E4M3 with a float32 scale per 16 and rstd per row,
    bytes += B*S*(Hq + Hk)*D * (1 + 4/16) + 4 * B*S*(Hq + Hk)
GB/s = bytes / time, and "vs copy" divides it by the GB/s of a device copy of q and k (read + write counted)
timed in the same run. Target: coat's forward and inverse >= 0.85 of copy at B=4, S=2048, Hq=Hk=32, D=128,
bf16. "fwd+bwd" times the forward and the gradients of q and k (torch.autograd.grad, 2x the bytes): for coat
through its autograd Function (coat.nn.functional.rotary_embedding), for transformers through autograd of
its formula.

    python benchmarks/rope.py            (needs a CUDA GPU)
    python benchmarks/rope.py --smoke    (tiny shapes on the CPU, no torch.compile: checks that the script runs)
"""
import sys

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import coat
from coat.nn import functional as coat_functional

from _common import compile_for_fixed_shapes, parser, print_table, time_ms, write_results

# (B, S, Hq, Hk, D): Llama-2-7B (the target), Llama-3-8B's grouped-query attention, a longer sequence, and
# the head size of the 100M preset.
SHAPES = [(4, 2048, 32, 32, 128), (4, 2048, 32, 8, 128), (1, 8192, 32, 32, 128), (16, 1024, 12, 12, 64)]
TARGET_SHAPE = SHAPES[0]
SMOKE_SHAPES = [(2, 8, 4, 2, 16)]
# qk_norm_rope (B, S, Hq, Hk, D): Qwen3-8B (benchmarks/layer.py's qwen3 layer) and Gemma-3-12B's head_dim 256.
QK_NORM_SHAPES = [(4, 2048, 32, 8, 128), (4, 2048, 16, 8, 256)]
SMOKE_QK_NORM_SHAPES = [(2, 8, 4, 2, 16)]
TARGET = 0.85


def rope_inputs(batch, seq, q_heads, k_heads, head_dim, dtype, device):
    """q and k as views of one q/k/v GEMM output that needs gradients; RoPE's tables; output gradients in
    coat's [B, S, H, D] and transformers' [B, H, S, D] layouts."""
    qkv = torch.randn(batch * seq, (q_heads + 2 * k_heads) * head_dim, device=device, dtype=dtype, requires_grad=True)
    q = qkv[:, : q_heads * head_dim].view(batch, seq, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(batch, seq, k_heads, head_dim)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1).expand(batch, seq, head_dim)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grads = tuple(torch.randn_like(t) for t in (q, k))
    grads_transposed = tuple(g.transpose(1, 2).contiguous() for g in grads)
    return q, k, cos, sin, grads, grads_transposed


def transformers_rope(q, k, cos, sin):
    return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def forward_backward(rope, q, k, cos, sin, grads):
    """The forward, then the gradients of q and k only (not of the GEMM output they are views of)."""
    return torch.autograd.grad(rope(q, k, cos, sin), (q, k), grads)


def measure(shape, dtype, device, compile_baseline, warmup, repeat):
    batch, seq, q_heads, k_heads, head_dim = shape
    q, k, cos, sin, grads, grads_transposed = rope_inputs(*shape, dtype, device)
    element = torch.finfo(dtype).bits // 8
    rope_bytes = 2 * batch * seq * (q_heads + k_heads) * head_dim * element + 2 * batch * seq * head_dim * element
    copy_source = torch.randn(batch * seq * (q_heads + k_heads) * head_dim, device=device, dtype=dtype)
    copy_target = torch.empty_like(copy_source)

    forward = {"transformers eager": transformers_rope, "coat": coat.ops.rotary_embedding}
    backward = {"transformers eager": (transformers_rope, grads_transposed), "coat": (coat_functional.rotary_embedding, grads)}
    if compile_baseline:
        compiled = compile_for_fixed_shapes(transformers_rope)
        forward["transformers compiled"] = compiled
        backward["transformers compiled"] = (compiled, grads_transposed)

    cases = {("copy of q and k", "-"): (lambda: copy_target.copy_(copy_source), 2 * copy_source.numel() * element)}
    for name, rope in forward.items():
        cases[(name, "forward")] = (lambda rope=rope: _no_grad(rope, q, k, cos, sin), rope_bytes)
    cases[("coat", "inverse (backward op)")] = (
        lambda: coat.ops.rotary_embedding(grads[0], grads[1], cos, sin, inverse=True), rope_bytes)
    for name, (rope, output_grads) in backward.items():
        cases[(name, "fwd+bwd")] = (lambda rope=rope, g=output_grads: forward_backward(rope, q, k, cos, sin, g), 2 * rope_bytes)

    timed = {key: (time_ms(fn, warmup, repeat, device), nbytes) for key, (fn, nbytes) in cases.items()}
    copy_ms, copy_bytes = timed[("copy of q and k", "-")]
    copy_gbs = copy_bytes / copy_ms / 1e6
    rows = []
    for (name, kind), (ms, nbytes) in timed.items():
        eager = timed.get(("transformers eager", kind))
        gbs = nbytes / ms / 1e6
        rows.append({"B,S,Hq,Hk,D": ",".join(map(str, shape)), "op": name, "pass": kind, "ms": ms, "GB/s": gbs,
                     "vs copy": gbs / copy_gbs, "speedup vs eager": eager[0] / ms if eager else ""})
    return rows


def measure_qk_norm(shape, dtype, device, compile_baseline, warmup, repeat):
    """The forward of the q/k norms and RoPE, q and k read in place from one q/k/v GEMM output."""
    batch, seq, q_heads, k_heads, head_dim = shape
    q, k, cos, sin, _, _ = rope_inputs(*shape, dtype, device)
    q_norm, k_norm = (Qwen3RMSNorm(head_dim).to(device=device, dtype=dtype) for _ in range(2))
    rows_of = batch * seq * (q_heads + k_heads)
    element = torch.finfo(dtype).bits // 8
    nbytes = (2 * rows_of * head_dim * element + 2 * batch * seq * head_dim * element
              + rows_of * head_dim * (1 + 4 / 16) + 4 * rows_of)

    def transformers_qk_norm_rope(q, k, cos, sin):
        return apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)

    def coat_qk_norm_rope(q, k, cos, sin):
        return coat.ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.variance_epsilon, cos, sin)

    forward = {"transformers q/k norm + RoPE eager": transformers_qk_norm_rope, "coat qk_norm_rope": coat_qk_norm_rope}
    if compile_baseline:
        forward["transformers q/k norm + RoPE compiled"] = compile_for_fixed_shapes(transformers_qk_norm_rope)
    timed = {name: time_ms(lambda fn=fn: _no_grad(fn, q, k, cos, sin), warmup, repeat, device)
             for name, fn in forward.items()}
    eager = timed["transformers q/k norm + RoPE eager"]
    return [{"B,S,Hq,Hk,D": ",".join(map(str, shape)), "op": name, "pass": "forward", "ms": ms,
             "GB/s": nbytes / ms / 1e6 if name.startswith("coat") else "", "vs copy": "", "speedup vs eager": eager / ms}
            for name, ms in timed.items()]


def _no_grad(rope, *args):
    with torch.no_grad():
        return rope(*args)


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager only, one run each")
    args = p.parse_args()
    if args.smoke:
        device, shapes, args.warmup, args.repeat = "cpu", SMOKE_SHAPES, 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/rope.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, shapes = "cuda", SHAPES
    torch.manual_seed(0)

    rows = [row for shape in shapes for row in measure(shape, torch.bfloat16, device, not args.smoke, args.warmup, args.repeat)]
    rows += [row for shape in (SMOKE_QK_NORM_SHAPES if args.smoke else QK_NORM_SHAPES)
             for row in measure_qk_norm(shape, torch.bfloat16, device, not args.smoke, args.warmup, args.repeat)]
    print_table(rows, ["B,S,Hq,Hk,D", "op", "pass", "ms", "GB/s", "vs copy", "speedup vs eager"])
    target = ",".join(map(str, shapes[0]))
    coat_rows = {row["pass"]: row["vs copy"] for row in rows if row["B,S,Hq,Hk,D"] == target and row["op"] == "coat"}
    summary = {"smoke": args.smoke, "target_fraction_of_copy": TARGET, "target_shape": target,
               "coat_forward_vs_copy": coat_rows["forward"], "coat_inverse_vs_copy": coat_rows["inverse (backward op)"]}
    path = write_results(args.results_dir, "rope-smoke" if args.smoke else "rope", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
