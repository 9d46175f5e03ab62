"""How far are coat's gradients of a small Qwen2.5-VL from float32's, part by part, against BF16's and against an
independent FP8 emulation? A CPU experiment behind the VLM example's "where is the X?" gap (benchmarks/NOTES.md):
does FP8 starve the vision tower, whose every gradient comes through the language model's FP8 layers?

The model is examples/train_vlm.py's (``--preset``, ``--seed``). ``--train-steps N`` first trains it N steps in BF16
(float32 weights, bf16 autocast, torch's AdamW at the preset's learning rate with its warm-up and weight decay 0.1
on every parameter, clipping at 1.0, ``--batch`` samples a step from the example's training stream;
``--checkpoint`` keeps the weights for the next measurement), so the gradients are measured where learning is under
way as well as at initialization. Then, at those weights, one batch the training never saw (step 1,000,000 of the
stream) goes forward and backward four times:

    float32      no autocast: the reference
    bf16         bf16 autocast, the BF16 run of the example
    coat         coat.convert(model) under bf16 autocast, the --coat run; ``--coat-gradient-format`` and
                 ``--coat-skip`` (fnmatch patterns of decoder layers to keep in BF16) are its options of that name
    emulated     bf16 autocast, every linear layer of the language model's decoder layers rounding as a per-tensor
                 FP8 recipe does, written here from the formulas: input and weight to E4M3 with the scale
                 amax / 448, the output gradient to E5M2 with amax / 57344, both backward GEMMs on the rounded
                 operands; ``--emulate-skip`` names linears (substrings: o_proj, mlp) to leave in BF16

For each group of parameters (the vision tower's patch embedding and blocks, the merger, the token embedding, each
decoder layer, the final norm, the LM head) it prints and writes ||g - g_float32|| / ||g_float32|| of each run.
From the float32 pass it also prints, for each decoder layer, its input's root mean square at the text and at the
image tokens and ||g_input - g_output|| / ||g_output||: how much of the gradient of what feeds the layer its own
branches make, rather than the residual stream passing through (its branch share).
The JSON has them (its rows, a group each; branch_shares, a layer each) with the training losses, the options (its
summary), the versions and the command.

    python benchmarks/vlm_gradient_probe.py --out runs/gradients-init.json
    python benchmarks/vlm_gradient_probe.py --train-steps 600 --checkpoint runs/600.pt --out runs/gradients-600.json
    python benchmarks/vlm_gradient_probe.py --train-steps 600 --checkpoint runs/600.pt --emulate-skip o_proj v_proj \
        --out runs/gradients-600-o-v-bf16.json      # the same weights, not trained again
    python benchmarks/vlm_gradient_probe.py --train-steps 600 --checkpoint runs/600.pt \
        --coat-skip model.language_model.layers.0 --out runs/gradients-600-coat-layer0-bf16.json
"""
from __future__ import annotations

import argparse
import collections
import copy
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import coat
from coat.nn.vision import convert_vision_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from shapes_vqa import ShapesVQA  # noqa: E402
from train_vlm import PRESETS, build_model  # noqa: E402

UNSEEN_STEP = 1_000_000  # the stream's batch the measurement takes: far past any training step
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu", help="train_vlm.py's model and pictures")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights and the data")
    parser.add_argument("--rope-theta", type=float,
                        help="the language model's rotary base (train_vlm.py's --rope-theta; the preset's by default)")
    parser.add_argument("--batch", type=int, default=32, help="samples a training step and in the measured batch")
    parser.add_argument("--train-steps", type=int, default=0, help="BF16 training steps before the measurement")
    parser.add_argument("--checkpoint", help="where the trained weights go, and where they are taken from if there")
    parser.add_argument("--emulate-skip", nargs="*", default=[],
                        help="substrings of decoder linears' names the FP8 emulation leaves in BF16")
    parser.add_argument("--coat-gradient-format", choices=["e5m2", "e4m3", "none"], default="e5m2",
                        help="coat.convert's gradient_format in the coat run (none: unquantized output gradients)")
    parser.add_argument("--coat-skip", nargs="*", default=[], metavar="PATTERN",
                        help="coat.convert's skip_modules in the coat run, e.g. model.language_model.layers.0")
    parser.add_argument("--out", required=True, help="JSON file of the results")
    args = parser.parse_args(argv)
    if args.rope_theta is None:
        args.rope_theta = PRESETS[args.preset].rope_theta
    return args


def fp8_round(tensor: torch.Tensor, dtype: torch.dtype, largest: float) -> torch.Tensor:
    """``tensor`` rounded to ``dtype`` with one scale, amax / largest, and back, in its own dtype."""
    scale = tensor.abs().amax().float().clamp(min=torch.finfo(torch.float32).tiny) / largest
    return ((tensor.float() / scale).to(dtype).float() * scale).to(tensor.dtype)


class EmulatedFP8Linear(torch.autograd.Function):
    """y = round_e4m3(x) @ round_e4m3(W)^T; backward with the output gradient rounded to E5M2."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x8, w8 = fp8_round(x, torch.float8_e4m3fn, E4M3_MAX), fp8_round(weight, torch.float8_e4m3fn, E4M3_MAX)
        ctx.save_for_backward(x8, w8)
        return x8 @ w8.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x8, w8 = ctx.saved_tensors
        g8 = fp8_round(grad, torch.float8_e5m2, E5M2_MAX)
        return g8 @ w8, g8.reshape(-1, g8.shape[-1]).t() @ x8.reshape(-1, x8.shape[-1])


def emulate_fp8(model: torch.nn.Module, skip: list[str]) -> int:
    """Puts the decoder layers' linears of ``model`` (but those naming a ``skip`` substring) through
    EmulatedFP8Linear in bf16; returns how many."""
    def forward(linear, x):
        weight = linear.weight.to(torch.bfloat16)
        y = EmulatedFP8Linear.apply(x.to(torch.bfloat16), weight)
        return y if linear.bias is None else y + linear.bias.to(torch.bfloat16)

    count = 0
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Linear) and ".language_model.layers." in f".{name}"
                and not any(part in name for part in skip)):
            module.forward = forward.__get__(module)
            count += 1
    return count


def parameter_group(name: str) -> str:
    if ".visual." in f".{name}":
        if ".merger." in name:
            return "merger"
        return f"vision block {name.split('blocks.')[1].split('.')[0]}" if "blocks." in name else "vision embedding"
    if ".layers." in name:
        return f"decoder layer {name.split('layers.')[1].split('.')[0]}"
    return {"embed_tokens": "token embedding", "norm": "final norm", "lm_head": "LM head"}[name.split(".")[-2]]


def gradients(model: torch.nn.Module, batch: dict, autocast: bool) -> dict[str, torch.Tensor]:
    """Each parameter group's gradient, flattened, in float64."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(**batch).loss.backward()
    groups = collections.defaultdict(list)
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            groups[parameter_group(name)].append(parameter.grad.double().flatten())
    return {group: torch.cat(parts) for group, parts in groups.items()}


def branch_shares(model: torch.nn.Module, batch: dict) -> list[dict]:
    """In float32, for each decoder layer: the root mean square of its input at the text and at the image tokens,
    and how much its own branches add to the gradient the residual stream passes through it,
    ||g_input - g_output|| / ||g_output||, at each kind of token. Where that is large, the gradient of what feeds
    the layer is mostly the layer's own backward, and so are its rounding errors."""
    layers = model.model.language_model.layers
    inputs, outputs, hooks = {}, {}, []

    def keep(store, index, tensor):
        tensor.retain_grad()
        store[index] = tensor

    for index, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda module, args, kwargs, i=index: keep(inputs, i, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(
            lambda module, args, output, i=index: keep(outputs, i, output[0] if isinstance(output, tuple) else output)))
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    for hook in hooks:
        hook.remove()
    image = batch["input_ids"] == model.config.image_token_id
    rows = []
    for index in range(len(layers)):
        hidden, added = inputs[index].detach(), inputs[index].grad - outputs[index].grad
        row = {"layer": index}
        for kind, mask in (("text", ~image), ("image", image)):
            row[f"{kind} input rms"] = hidden[mask].pow(2).mean().sqrt().item()
            passed = outputs[index].grad[mask].norm()
            # None where nothing passes: the last layer's image tokens, whose outputs no loss term reads
            row[f"{kind} branch share"] = (added[mask].norm() / passed).item() if passed > 0 else None
        rows.append(row)
    return rows


def train_bf16(model: torch.nn.Module, data: ShapesVQA, steps: int, batch: int, lr: float, warmup: int) -> list:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(**data.batch(data.samples(step, batch), "cpu")).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}: loss {sum(losses[-50:]) / 50:.4f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> dict:
    args = parse_arguments(argv)
    preset = PRESETS[args.preset]
    started = time.time()
    model = build_model(argparse.Namespace(preset=args.preset, seed=args.seed, attention="sdpa",
                                           rope_theta=args.rope_theta), torch.device("cpu"))
    convert_vision_attention(model)
    data = ShapesVQA(args.seed, preset.image, preset.patch, preset.max_objects, held_out=1)
    if args.checkpoint and Path(args.checkpoint).exists():
        saved = torch.load(args.checkpoint)
        if saved["options"] != [args.preset, args.seed, args.batch, args.train_steps, args.rope_theta]:
            raise SystemExit(f"{args.checkpoint} holds the weights of --preset, --seed, --batch, --train-steps, "
                             f"--rope-theta {saved['options']}: give those or another --checkpoint")
        model.load_state_dict(saved["model"])
        losses = saved["losses"]
    else:
        losses = train_bf16(model, data, args.train_steps, args.batch, preset.lr, preset.warmup)
        if args.checkpoint:
            torch.save(dict(model=model.state_dict(), losses=losses,
                            options=[args.preset, args.seed, args.batch, args.train_steps, args.rope_theta]),
                       args.checkpoint)
    batch = data.batch(data.samples(UNSEEN_STEP, args.batch), "cpu")

    reference = gradients(model, batch, autocast=False)
    shares = branch_shares(model, batch)
    runs = {"bf16": gradients(copy.deepcopy(model), batch, autocast=True),
            "coat": gradients(coat.convert(copy.deepcopy(model), skip_modules=args.coat_skip,
                                           gradient_format=None if args.coat_gradient_format == "none"
                                           else args.coat_gradient_format), batch, autocast=True)}
    emulated = copy.deepcopy(model)
    emulated_linears = emulate_fp8(emulated, args.emulate_skip)
    runs["emulated"] = gradients(emulated, batch, autocast=True)

    errors = {run: {group: ((grads[group] - reference[group]).norm() / reference[group].norm()).item()
                    for group in reference} for run, grads in runs.items()}
    print(f"relative gradient error against float32 after {args.train_steps} BF16 steps (coat: output gradients "
          f"{args.coat_gradient_format}, {args.coat_skip or 'no layer'} in BF16; FP8 emulation: {emulated_linears} "
          f"linears, {args.emulate_skip or 'none'} left in BF16):")
    print(f"{'group':18s}" + "".join(f"{run:>10s}" for run in runs) + "   coat / bf16")
    for group in reference:
        print(f"{group:18s}" + "".join(f"{errors[run][group]:10.4f}" for run in runs)
              + f"   {errors['coat'][group] / errors['bf16'][group]:.2f}")
    print("\nin float32, each decoder layer's input (root mean square) and its branches' gradient over the one passed "
          "through (||g_in - g_out|| / ||g_out||):")
    print(f"{'layer':>5s}{'text rms':>10s}{'image rms':>11s}{'text share':>12s}{'image share':>13s}")
    for row in shares:
        share = {kind: "-" if row[f"{kind} branch share"] is None else f"{row[f'{kind} branch share']:.3f}"
                 for kind in ("text", "image")}
        print(f"{row['layer']:5d}{row['text input rms']:10.4f}{row['image input rms']:11.4f}{share['text']:>12s}"
              f"{share['image']:>13s}")
    result = dict(device="cpu", torch=torch.__version__, transformers=transformers.__version__,
                  python=platform.python_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  command=" ".join(["benchmarks/vlm_gradient_probe.py", *(sys.argv[1:] if argv is None else argv)]),
                  summary=vars(args) | {"emulated_linears": emulated_linears, "seconds": time.time() - started},
                  training_losses=losses, rows=[{"group": group, **{run: errors[run][group] for run in runs}}
                                                for group in reference],
                  branch_shares=shares)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
