"""Train a HuggingFace Llama with transformers' Trainer and coat: convert the model, hand Trainer the optimizer.

    model = coat.convert(LlamaForCausalLM(config))                       # or from_pretrained(path)
    optimizer = coat.optim.AdamW(model.parameters(), lr=..., weight_decay=...)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, steps)
    Trainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=..., optimizers=(optimizer, scheduler))

or let Trainer build the optimizer (it then applies its own weight-decay groups):

    Trainer(model=model, args=..., train_dataset=..., optimizer_cls_and_kwargs=(coat.optim.AdamW, {"lr": 3e-4}))

``bf16=True`` is Trainer's autocast, the same bf16 compute as train_llama.py; keep the model in float32 (the
master weights). Trainer's checkpoints (``save_steps``) hold the FP8 optimizer state and resume it exactly
(``--resume`` takes the newest checkpoint Trainer finished writing; ``resume_from_checkpoint=True`` would take
the newest by name, even one cut short). The text is the standard library's sources, as bytes.

    python examples/train_with_trainer.py [--steps 200] [--output-dir runs/trainer] [--resume]
"""
from __future__ import annotations

import argparse
import json
import os
import re

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    get_cosine_schedule_with_warmup,
)
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import coat
from coat.data import stdlib_tokens
from training_common import PRESETS, TextData


class TextWindows(torch.utils.data.Dataset):
    """Trainer's view of the text: item i is training window i (the same window every epoch)."""

    def __init__(self, data: TextData, count: int, seq_batch: int = 64):
        self.windows = torch.cat([data.train_batch(i, seq_batch) for i in range(-(-count // seq_batch))])[:count]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


def newest_complete_checkpoint(output_dir: str) -> str:
    """The newest checkpoint-N directory whose save finished: Trainer writes trainer_state.json last, so one
    without a readable trainer_state.json was cut short, and is skipped with a message."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted(int(m.group(1)) for name in names if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)))
    for step in reversed(steps):
        path = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        try:
            with open(os.path.join(path, TRAINER_STATE_NAME)) as state:
                json.load(state)
            return path
        except (OSError, ValueError):
            print(f"--resume: skipping {path}, a save that did not finish (no readable {TRAINER_STATE_NAME})")
    raise SystemExit(f"--resume: no complete {PREFIX_CHECKPOINT_DIR}-N in {output_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--output-dir", default="runs/trainer")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    args = parser.parse_args()

    preset = PRESETS["tiny"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
        num_hidden_layers=preset.layers, num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
        max_position_embeddings=preset.seq, tie_word_embeddings=False,
    ))
    coat.convert(model)
    optimizer = coat.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=args.steps // 10, num_training_steps=args.steps)

    dataset = TextWindows(TextData(stdlib_tokens(4_000_000), preset.seq, seed=0), args.steps * args.batch)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        bf16=True,
        max_grad_norm=1.0,
        logging_steps=10,
        save_steps=args.save_steps,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, optimizers=(optimizer, scheduler))
    trainer.train(resume_from_checkpoint=newest_complete_checkpoint(args.output_dir) if args.resume else None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"coat + Trainer: {trainer.state.global_step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
