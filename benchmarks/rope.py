"""coat's fused RoPE (coat.ops.rotary_embedding) against transformers' apply_rotary_pos_emb, eager and under
torch.compile, and against a device copy, in the same run.

Layout, as in a converted decoder layer: q and k are column slices of one [B*S, (Hq + 2 Hk) * D] q/k/v
projection output. coat reads them in place as [B, S, H, D]; transformers' formula gets the transposed
[B, H, S, D] views that the layer passes it. cos, sin: [B, S, D] in the activation dtype, as transformers'
rotary embedding returns them.

Bytes, the least RoPE must move (benchmarks/NOTES.md, "RoPE"): q and k read once and written once, cos and
sin read once,
    bytes = 2 * B*S*(Hq + Hk)*D * elt + 2 * B*S*D * table_elt        per pass (forward, or backward)
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

import coat
from coat.nn import functional as coat_functional

from _common import compile_for_fixed_shapes, parser, print_table, time_ms, write_results

# (B, S, Hq, Hk, D): Llama-2-7B (the target), Llama-3-8B's grouped-query attention, a longer sequence, and
# the head size of the 100M preset.
SHAPES = [(4, 2048, 32, 32, 128), (4, 2048, 32, 8, 128), (1, 8192, 32, 32, 128), (16, 1024, 12, 12, 64)]
TARGET_SHAPE = SHAPES[0]
SMOKE_SHAPES = [(2, 8, 4, 2, 16)]
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
    print_table(rows, ["B,S,Hq,Hk,D", "op", "pass", "ms", "GB/s", "vs copy", "speedup vs eager"])
    target = ",".join(map(str, shapes[0]))
    coat_rows = {row["pass"]: row["vs copy"] for row in rows if row["B,S,Hq,Hk,D"] == target and row["op"] == "coat"}
    summary = {"smoke": args.smoke, "target_fraction_of_copy": TARGET, "target_shape": target,
               "coat_forward_vs_copy": coat_rows["forward"], "coat_inverse_vs_copy": coat_rows["inverse (backward op)"]}
    path = write_results(args.results_dir, "rope-smoke" if args.smoke else "rope", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
