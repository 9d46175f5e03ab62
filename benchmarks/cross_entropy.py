"""The LM head + cross-entropy, forward and backward: transformers' unfused path against coat's fused
linear_cross_entropy (both strategies) and Liger-Kernel's fused linear cross-entropy when it is installed, in the
same run.

A step is loss = f(hidden, weight, labels) then loss.backward(), hidden [N, H] in bf16 and weight [V, H] in one of
two dtypes ("weight" column): bf16 (the weight gradient comes back in bf16 in every variant), or float32 under
torch.autocast(bfloat16), as a model with float32 master weights trains (the logits GEMM in bf16, the weight
gradient in float32: coat's float32 accumulator is then the gradient itself). Variants:
    transformers eager      logits = hidden @ weight.T (bf16), .float(), F.cross_entropy: transformers'
                            ForCausalLMLoss on its LlamaForCausalLM logits
    transformers compiled   the same under torch.compile (static shapes)
    coat forward            coat.nn.functional.linear_cross_entropy, strategy="forward" (gradients in the forward)
    coat recompute          strategy="recompute" (the backward recomputes each chunk's logits)
    liger                   liger_kernel's LigerFusedLinearCrossEntropyFunction, when importable (bf16 weight only)
"ms" is the GPU time of the step (CUDA events, median after warm-up); "peak GiB above inputs" is the step's peak
of allocated memory minus what was allocated before it (hidden, weight, labels), the gradients included.
"loss" is each variant's loss, "loss rel. diff" its relative difference from transformers eager's. "chunk logits
GiB" is the size of one chunk's bf16 logits at coat's default chunk size, against which the fused variants' working
memory (the peak less the gradients, which every variant returns) compares.

    python benchmarks/cross_entropy.py            (needs a CUDA GPU)
    python benchmarks/cross_entropy.py --smoke    (tiny shapes on the CPU, no torch.compile: checks that it runs)
"""
import importlib.util
import sys

import torch
import torch.nn.functional as F

import coat
from coat.nn.cross_entropy import default_chunk_size
from coat.nn.functional import linear_cross_entropy

from _common import compile_for_fixed_shapes, parser, print_table, time_ms, write_results

# (tokens, vocab, hidden): Llama-3's vocabulary at Llama-3.2-1B's hidden size (batch 8 x 2048) and Llama-3-8B's.
SHAPES = [(16384, 128256, 2048), (16384, 128256, 4096)]
SMOKE_SHAPES = [(64, 1000, 32)]
IGNORED_FRACTION = 0.1  # padding and masked prompt tokens
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "float32 + autocast": torch.float32}


def transformers_loss(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.T).float(), labels)


def coat_loss(strategy):
    return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, strategy=strategy)


def liger_loss():
    """Liger-Kernel's fused linear cross-entropy, or None where liger_kernel is not installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    def loss(hidden, weight, labels):
        result = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels)
        return result[0] if isinstance(result, tuple) else result

    return loss


def variants(device, smoke, weight_dtype):
    found = {"transformers eager": transformers_loss, "coat forward": coat_loss("forward"),
             "coat recompute": coat_loss("recompute")}
    if not smoke:
        found["transformers compiled"] = compile_for_fixed_shapes(transformers_loss)
        liger = liger_loss() if device == "cuda" and weight_dtype == torch.bfloat16 else None
        if liger is not None:
            found["liger"] = liger
    return found


def peak_bytes_above_inputs(step, device):
    """The step's peak of allocated memory above what was allocated before it (CUDA only; 0 on the CPU)."""
    if device != "cuda":
        step()
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(shape, weight_name, device, smoke, warmup, repeat):
    tokens, vocab, hidden_size = shape
    weight_dtype = WEIGHT_DTYPES[weight_name]
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device=device) * hidden_size**-0.5).to(weight_dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[torch.rand(tokens, device=device) < IGNORED_FRACTION] = -100
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=weight_dtype != torch.bfloat16)
    chunk_logits = default_chunk_size(tokens, vocab) * vocab * 2

    rows, reference_loss = [], None
    for name, loss_fn in variants(device, smoke, weight_dtype).items():
        def step(loss_fn=loss_fn):
            hidden.grad = weight.grad = None
            with autocast:
                loss = loss_fn(hidden, weight, labels)
            loss.backward()
            return loss

        loss = step().item()
        reference_loss = loss if reference_loss is None else reference_loss
        peak = peak_bytes_above_inputs(step, device)
        hidden.grad = weight.grad = None
        rows.append({"tokens,V,H": ",".join(map(str, shape)), "weight": weight_name, "variant": name,
                     "ms": time_ms(step, warmup, repeat, device), "peak GiB above inputs": peak / 2**30,
                     "chunk logits GiB": chunk_logits / 2**30, "loss": loss,
                     "loss rel. diff": abs(loss - reference_loss) / abs(reference_loss)})
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager only, one run each")
    args = p.parse_args()
    if args.smoke:
        device, shapes, args.warmup, args.repeat = "cpu", SMOKE_SHAPES, 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/cross_entropy.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, shapes = "cuda", SHAPES
    torch.manual_seed(0)
    rows = [row for shape in shapes for weight in WEIGHT_DTYPES
            for row in measure(shape, weight, device, args.smoke, args.warmup, args.repeat)]
    print_table(rows, ["tokens,V,H", "weight", "variant", "ms", "peak GiB above inputs", "chunk logits GiB", "loss",
                       "loss rel. diff"])
    summary = {"smoke": args.smoke, "ignored_fraction": IGNORED_FRACTION,
               "liger": importlib.util.find_spec("liger_kernel") is not None}
    path = write_results(args.results_dir, "cross_entropy-smoke" if args.smoke else "cross_entropy", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
