"""Quantize real training tensors to FP8 with coat and print the error per format and group size.

The tensors are real: a small character-level transformer is trained for a few seconds on the Python
standard library's own sources (text that ships with every Python), and its weights, the activations
entering its MLP, the gradients and AdamW's two moments are quantized with coat's group quantizer
(G = 16, 32, 64, 128) and its per-tensor "group scaling" quantizer, in E4M3 and E5M2.
Pass --tensor FILE.pt to quantize a tensor of your own instead.

    python examples/quantize_demo.py [--device cuda] [--steps 60] [--tensor my_tensor.pt]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
from tqdm import tqdm

import coat
from coat import ops
from coat.data import stdlib_tokens

GROUP_SIZES = (16, 32, 64, 128)
FORMATS = ("e4m3", "e5m2")


class TinyCharModel(nn.Module):
    def __init__(self, width: int = 128, layers: int = 2, context: int = 128):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(hidden, mask=mask, is_causal=True))


def train_and_capture(steps: int, device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    data = stdlib_tokens(2_000_000)
    model = TinyCharModel().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mlp = model.blocks.layers[-1].linear1
    captured = {}
    mlp.register_forward_hook(lambda _m, inputs, _o: captured.__setitem__("activation (MLP input)", inputs[0].detach()))
    context, batch = 128, 32
    progress = tqdm(range(steps), desc="training on stdlib sources", unit="step")
    for _ in progress:
        starts = torch.randint(0, data.numel() - context - 1, (batch,))
        window = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).to(device)
        logits = model(window[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        captured["gradient (MLP weight)"] = mlp.weight.grad.detach().clone()
        opt.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")
    state = opt.state[mlp.weight]
    captured["weight (MLP)"] = mlp.weight.detach()
    captured["AdamW exp_avg"] = state["exp_avg"]
    captured["AdamW exp_avg_sq"] = state["exp_avg_sq"]
    return {name: t.float().reshape(-1, t.shape[-1]) for name, t in captured.items()}


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(x_hat - x) / torch.linalg.vector_norm(x).clamp_min(1e-30)).item()


def report(name: str, x: torch.Tensor) -> None:
    print(f"\n{name}: shape {tuple(x.shape)}, |x| max {x.abs().max().item():.3g}, "
          f"rms {x.pow(2).mean().sqrt().item():.3g}")
    print(f"  {'quantizer':<22}" + "".join(f"{fmt + ' rel.err':>16}{'SQNR dB':>10}" for fmt in FORMATS))
    quantizers = [(f"per-group 1x{g}", g) for g in GROUP_SIZES] + [("per-tensor (grp scal.)", None)]
    for label, group_size in quantizers:
        cells = ""
        for fmt in FORMATS:
            if group_size is None:
                q, scale, _ = ops.quantize_tensor(x, fmt)
            else:
                q, scale, _ = ops.quantize_group(x, group_size, fmt)
            err = relative_error(x, ops.dequantize(q, scale, group_size, torch.float32))
            cells += f"{err:>16.4%}{-20 * math.log10(max(err, 1e-30)):>10.1f}"
        print(f"  {label:<22}{cells}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() and coat.built_with_cuda() else "cpu")
    parser.add_argument("--steps", type=int, default=60, help="training steps before capturing tensors")
    parser.add_argument("--tensor", help="a .pt file holding one tensor to quantize instead")
    args = parser.parse_args()
    if args.tensor:
        x = torch.load(args.tensor, map_location=args.device)
        tensors = {args.tensor: x.float().reshape(-1, x.shape[-1])}
    else:
        tensors = train_and_capture(args.steps, args.device)
    print(f"\ncoat {coat.__version__} on {args.device}: relative error ||x' - x|| / ||x|| of dequantize(quantize(x))")
    for name, x in tensors.items():
        report(name, x)


if __name__ == "__main__":
    main()
