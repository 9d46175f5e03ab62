"""coat.optim.AdamW against torch.optim.AdamW(fused=True) on the tensors of a 1.1B-parameter Llama
(TinyLlama-1.1B's shapes: hidden 2048, intermediate 5632, 22 layers, 32 query and 4 key-value heads, vocab
32000), float32 parameters (master weights): optimizer step time and optimizer-state bytes per parameter.

Step time: CUDA events around ``opt.step()``, median of --repeat steps after --warmup, both optimizers in this
run on separate copies of the same parameters and gradients; coat with float32 and with bfloat16 gradients,
then with bfloat16 parameters (no master copy) rounded to nearest and stochastically, and with FP8 gradients
(fp8_grads="e5m2": the step dequantizes them in chunks before the fused kernel).
"host ms" is the time step() takes on the CPU (Python, launches) with the GPU not waited for: below the GPU
time, the host is not what limits the step. "GPU ms" is the step's GPU work alone (enqueued while the GPU is kept
busy, _common.time_cuda_gpu_ms), what the step costs inside a training step whose host runs ahead; "step ms"
starts on an idle GPU, so it also holds the host's time to the first launch. State bytes: every tensor in ``opt.state`` (codes, meta, step
counters) divided by the number of parameters.
Targets on H100/H200: coat's state bytes per parameter <= 2.1 (torch: 8); its step time <= 0.6x torch's fused
AdamW (float32 gradients for both), checked on both step ms and GPU ms.

    python benchmarks/optimizer.py            (needs a CUDA GPU and coat built with CUDA; ~35 GB of GPU memory)
"""
import sys
import time

import torch

import coat

from _common import parser, print_table, time_cuda_gpu_ms, time_cuda_ms, write_results

STATE_BYTES_TARGET = 2.1
STEP_TIME_TARGET = 0.6


def llama_shapes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> list[tuple]:
    kv = kv_heads * (hidden // heads)
    layer = [
        (hidden, hidden),  # q_proj
        (kv, hidden),  # k_proj
        (kv, hidden),  # v_proj
        (hidden, hidden),  # o_proj
        (intermediate, hidden),  # gate_proj
        (intermediate, hidden),  # up_proj
        (hidden, intermediate),  # down_proj
        (hidden,),  # input_layernorm
        (hidden,),  # post_attention_layernorm
    ]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values() if torch.is_tensor(t))


def host_ms(opt: torch.optim.Optimizer, repeat: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        opt.step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / repeat * 1e3


def main():
    p = parser(__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    if not torch.cuda.is_available() or not coat.built_with_cuda():
        sys.exit("benchmarks/optimizer.py needs a CUDA GPU and coat built with CUDA")

    shapes = llama_shapes(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab)
    generator = torch.Generator(device="cuda").manual_seed(0)
    values = [torch.randn(shape, device="cuda", generator=generator) * 0.02 for shape in shapes]
    grads = [torch.randn(shape, device="cuda", generator=generator) * 1e-3 for shape in shapes]
    count = sum(v.numel() for v in values)
    print(f"{len(shapes)} tensors, {count / 1e9:.3f}B float32 parameters")

    torch_params = [torch.nn.Parameter(v.clone()) for v in values]
    coat_params = [torch.nn.Parameter(v) for v in values]
    for param, grad in zip(torch_params, grads):
        param.grad = grad.clone()
    for param, grad in zip(coat_params, grads):
        param.grad = grad
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-4, weight_decay=0.1, fused=True)
    coat_opt = coat.optim.AdamW(coat_params, lr=1e-4, weight_decay=0.1)

    rows = []

    def measure(name, opt, grad_dtype, param_dtype=torch.float32, rounding="-"):
        ms = time_cuda_ms(opt.step, args.warmup, args.repeat)
        rows.append(
            {
                "optimizer": name,
                "params": str(param_dtype).replace("torch.", ""),
                "rounding": rounding,
                "grads": str(grad_dtype).replace("torch.", ""),
                "step ms": ms,
                "GPU ms": time_cuda_gpu_ms(opt.step, args.warmup, args.repeat),
                "host ms": host_ms(opt, args.repeat),
                "state B/param": state_bytes(opt) / count,
            }
        )

    measure("torch.optim.AdamW(fused=True)", torch_opt, torch.float32)
    measure("coat.optim.AdamW", coat_opt, torch.float32)
    del torch_opt, torch_params
    for param, grad in zip(coat_params, grads):
        param.grad_dtype = None  # torch keeps a gradient's dtype equal to its parameter's unless told otherwise
        param.grad = grad.bfloat16()
    del grads
    measure("coat.optim.AdamW", coat_opt, torch.bfloat16)
    bf16_grads = [p.grad for p in coat_params]
    del coat_opt, coat_params, values
    for rounding in ("nearest", "stochastic"):
        params = [torch.nn.Parameter(g.clone() * 20) for g in bf16_grads]
        for param, grad in zip(params, bf16_grads):
            param.grad = grad
        measure("coat.optim.AdamW", coat.optim.AdamW(params, lr=1e-4, weight_decay=0.1, param_rounding=rounding),
                torch.bfloat16, torch.bfloat16, rounding)
        del params
    params = [torch.nn.Parameter(g.clone() * 20) for g in bf16_grads]
    opt = coat.optim.AdamW(params, lr=1e-4, weight_decay=0.1, param_rounding="stochastic", fp8_grads="e5m2")
    torch.autograd.backward(params, grad_tensors=bf16_grads)  # the post-accumulate hooks quantize them
    del bf16_grads
    measure("coat.optim.AdamW", opt, torch.float8_e5m2, torch.bfloat16, "stochastic")

    torch_ms, torch_gpu_ms, torch_bytes = rows[0]["step ms"], rows[0]["GPU ms"], rows[0]["state B/param"]
    for row in rows:
        row["step vs torch"] = row["step ms"] / torch_ms
        row["GPU vs torch"] = row["GPU ms"] / torch_gpu_ms
    print_table(rows, ["optimizer", "params", "rounding", "grads", "step ms", "GPU ms", "host ms", "step vs torch",
                       "GPU vs torch", "state B/param"])
    coat_row = rows[1]
    meets_bytes = coat_row["state B/param"] <= STATE_BYTES_TARGET
    meets_time = coat_row["step vs torch"] <= STEP_TIME_TARGET
    meets_gpu_time = coat_row["GPU vs torch"] <= STEP_TIME_TARGET
    print(
        f"\nstate bytes per parameter: coat {coat_row['state B/param']:.3f} vs torch {torch_bytes:.3f}, "
        f"{torch_bytes / coat_row['state B/param']:.2f}x less; target <= {STATE_BYTES_TARGET}: "
        f"{'met' if meets_bytes else 'NOT MET'}"
    )
    print(
        f"step time: coat {coat_row['step vs torch']:.2f}x torch's fused AdamW (float32 gradients); target <= "
        f"{STEP_TIME_TARGET}x: {'met' if meets_time else 'NOT MET'}; GPU time: {coat_row['GPU vs torch']:.2f}x, "
        f"{'met' if meets_gpu_time else 'NOT MET'}"
    )
    summary = {
        "parameters": count,
        "tensors": len(shapes),
        "model": {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
        },
        "targets": {"state_bytes_per_param": STATE_BYTES_TARGET, "step_time_vs_torch_fused": STEP_TIME_TARGET},
        "coat_state_bytes_per_param": coat_row["state B/param"],
        "torch_state_bytes_per_param": torch_bytes,
        "coat_step_time_vs_torch_fused": coat_row["step vs torch"],
        "coat_gpu_time_vs_torch_fused": coat_row["GPU vs torch"],
        "meets_state_bytes_target": meets_bytes,
        "meets_step_time_target": meets_time,
        "meets_gpu_time_target": meets_gpu_time,
    }
    path = write_results(args.results_dir, "optimizer", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
