"""coat.optim.AdamW with HuggingFace's Trainer, on CPU: passed in through ``optimizers=(opt, scheduler)`` or
built by the Trainer from ``optimizer_cls_and_kwargs``; the Trainer's checkpoints resume bit for bit."""
from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

from coat.data import stdlib_tokens
from coat.optim import AdamW
from optim_helpers import one_thread, text_batches, tiny_llama  # noqa: F401 (one_thread: an autouse fixture)

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

STEPS = 30


class TextDataset(torch.utils.data.Dataset):
    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


def dataset() -> TextDataset:
    (windows,) = text_batches(stdlib_tokens(400_000), steps=1, batch=STEPS * 8, context=64, seed=2)
    return TextDataset(windows)


def arguments(output_dir, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=8,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**{**options, **overrides})


def coat_trainer(output_dir, **overrides) -> tuple[Trainer, AdamW]:
    model = tiny_llama(seed=0)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(opt, num_warmup_steps=5, num_training_steps=STEPS)
    trainer = Trainer(
        model=model, args=arguments(output_dir, **overrides), train_dataset=dataset(), optimizers=(opt, scheduler)
    )
    return trainer, opt


def assert_fp8_state(opt: torch.optim.Optimizer, params) -> None:
    for param in params:
        state = opt.state[param]
        assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg_sq"].dtype == torch.float8_e4m3fn
        assert state["exp_avg_meta"].dtype == torch.bfloat16


def test_trainer_with_coat_optimizer_and_scheduler(tmp_path):
    trainer, opt = coat_trainer(tmp_path)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS // 5
    assert losses[-1] < 0.75 * losses[0], losses
    assert trainer.optimizer.optimizer is opt  # accelerate wraps it, and steps it
    assert_fp8_state(opt, trainer.model.parameters())
    assert opt.state[next(trainer.model.parameters())]["step"].item() == STEPS
    assert opt.param_groups[0]["lr"] == 0.0  # the linear schedule ran to its end


def test_trainer_checkpoint_resumes_bit_for_bit(tmp_path):
    uninterrupted, _ = coat_trainer(tmp_path / "run", save_strategy="steps", save_steps=STEPS // 2)
    uninterrupted.train()
    resumed, opt = coat_trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{STEPS // 2}"))
    assert_fp8_state(opt, resumed.model.parameters())
    for (name, a), b in zip(uninterrupted.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_trainer_builds_coat_optimizer_from_class_and_kwargs(tmp_path):
    model = tiny_llama(seed=0)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path, max_steps=5, learning_rate=3e-3, weight_decay=0.1),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=(AdamW, {"group_size": 64, "v_format": "e5m2"}),
    )
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, AdamW)
    # the Trainer's two groups: weight decay for matrices, none for norms and biases
    assert sorted(group["weight_decay"] for group in opt.param_groups) == [0.0, 0.1]
    assert all(group["group_size"] == 64 and group["v_format"] == "e5m2" for group in opt.param_groups)
    assert opt.state[model.lm_head.weight]["exp_avg_sq"].dtype == torch.float8_e5m2
