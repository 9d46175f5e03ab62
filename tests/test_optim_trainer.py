"""coat with HuggingFace's Trainer, on CPU: coat.optim.AdamW passed in through ``optimizers=(opt, scheduler)`` or
built by the Trainer from ``optimizer_cls_and_kwargs``; the Trainer's checkpoints resume bit for bit; evaluate()
with compute_metrics on a coat.convert'ed model (the fused loss keeps the logits in eval mode)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import EvalPrediction, Trainer, TrainingArguments, get_linear_schedule_with_warmup

import coat
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


def dataset(windows: int = STEPS * 8, seed: int = 2) -> TextDataset:
    (batch,) = text_batches(stdlib_tokens(400_000), steps=1, batch=windows, context=64, seed=seed)
    return TextDataset(batch)


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


def token_accuracy(prediction: EvalPrediction) -> dict[str, float]:
    """Next-token accuracy over the labelled positions, from the argmax ids preprocess_logits_for_metrics made, or
    from the logits themselves without it."""
    predicted = prediction.predictions
    if predicted.ndim == 3:
        predicted = predicted.argmax(-1)
    predicted, labels = predicted[:, :-1], prediction.label_ids[:, 1:]  # position t predicts token t + 1
    labelled = labels != -100
    return {"accuracy": float(np.mean(predicted[labelled] == labels[labelled]))}


def evaluate(model, output_dir, preprocess: bool) -> dict[str, float]:
    trainer = Trainer(
        model=model,
        args=arguments(output_dir, per_device_eval_batch_size=16),
        eval_dataset=dataset(windows=64, seed=3),
        compute_metrics=token_accuracy,
        preprocess_logits_for_metrics=(lambda logits, labels: logits.argmax(-1)) if preprocess else None,
    )
    metrics = trainer.evaluate()
    return {name: metrics[f"eval_{name}"] for name in ("loss", "accuracy")}


@pytest.mark.parametrize("preprocess", [True, False], ids=["argmax-preprocessed", "logits"])
def test_trainer_evaluates_a_converted_model_as_the_stock_one(tmp_path, preprocess):
    """evaluate() with compute_metrics: the fused-loss model gives the metrics of the same converted model with
    transformers' head and loss bit for bit, and the stock model's within FP8's error. A briefly trained model,
    so that the accuracy measures something (0.31 against 1/256 at random)."""
    stock = tiny_llama(seed=0)
    Trainer(model=stock, args=arguments(tmp_path, learning_rate=3e-3), train_dataset=dataset()).train()
    metrics = evaluate(coat.convert(copy.deepcopy(stock)), tmp_path, preprocess)
    assert metrics == evaluate(coat.convert(copy.deepcopy(stock), fused_loss=False), tmp_path, preprocess)
    want = evaluate(stock, tmp_path, preprocess)
    assert want["accuracy"] > 0.25, want
    # FP8 moves the logits by 0.23% (relative norm; 0.065 at most), measured here: the mean loss by 2e-5
    # relative, below that error as the 4032 tokens average it. It flips the argmax at the 27 positions whose two
    # top logits are that close, each moving the accuracy by at most 1/4032 (here they cancelled: the same
    # accuracy), so 0.01 (40 flips all one way) holds it with room.
    assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-3)
    assert metrics["accuracy"] == pytest.approx(want["accuracy"], abs=0.01)
