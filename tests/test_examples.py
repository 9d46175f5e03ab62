"""The training examples on CPU: train_llama.py (BF16 and coat, its CSV, summary and plot), train_fsdp2.py on
two gloo processes (a resumed run continues the loss curve bit for bit, also from the last complete checkpoint
after a rank died while saving) and train_with_trainer.py (Trainer's checkpoint of a converted model resumes
exactly, skipping one cut short)."""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# Small enough for a 2-core CPU; every option the scripts share goes through this path.
QUICK = ["--steps", "6", "--batch", "4", "--seq", "64", "--log-every", "1", "--eval-every", "3", "--eval-batches", "1",
         "--data-bytes", "300000"]


# An x86 CPU without native bf16, on any x86 CPU: torch's vector code and oneDNN limited to AVX2.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run(arguments: list[str], cwd, expect_success: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env or {}),
                   "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run([sys.executable, *arguments], cwd=cwd, env=environment, capture_output=True, text=True,
                               timeout=600)
    if expect_success:
        assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    return completed


def torchrun(script: str, arguments: list[str], cwd, launcher: list[str] = (), **options) -> subprocess.CompletedProcess:
    """Two processes of an example script, started through ``launcher`` (a wrapper script's path) if given."""
    return run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *launcher,
                os.path.join(EXAMPLES, script), *arguments], cwd, **options)


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_train_llama_bf16_and_coat_logs_and_plot(tmp_path):
    script = os.path.join(EXAMPLES, "train_llama.py")
    run([script, *QUICK, "--out", "runs"], tmp_path)
    completed = run([script, *QUICK, "--out", "runs", "--coat", "--compare", "runs/tiny-bf16.csv"], tmp_path)
    assert "held-out loss" in completed.stdout
    # 6 steps of 4 x 64 tokens, and the text: 300,000 bytes less the held-out fiftieth
    assert "6 steps of 4 x 64 tokens on cpu: 1,536 tokens trained, drawn from 0.3M tokens of training text" \
        in completed.stdout.splitlines()[0]
    runs = tmp_path / "runs"
    bf16, fp8 = read_csv(runs / "tiny-bf16.csv"), read_csv(runs / "tiny-coat.csv")
    bf16_loss, fp8_loss = float(bf16[-1]["val_loss"]), float(fp8[-1]["val_loss"])
    assert (f"held-out loss: tiny-coat {fp8_loss:.4f} (step 6), tiny-bf16 {bf16_loss:.4f} (step 6): "
            f"tiny-coat {fp8_loss - bf16_loss:+.4f} ({(fp8_loss - bf16_loss) / bf16_loss:+.2%})") in completed.stdout
    assert [row["step"] for row in fp8] == [str(step) for step in range(1, 7)]
    for rows in (bf16, fp8):
        assert all(math.isfinite(float(row["train_loss"])) and float(row["tokens_per_s"]) > 0 for row in rows)
        assert [row["step"] for row in rows if row["val_loss"]] == ["3", "6"]
        assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    # Same initial weights and data: the first losses differ only by FP8 rounding.
    assert float(fp8[0]["train_loss"]) == pytest.approx(float(bf16[0]["train_loss"]), rel=0.01)
    summary = json.loads((runs / "tiny-coat.json").read_text())
    assert summary["coat"] and summary["steps"] == 6 and summary["final_val_loss"] == float(fp8[-1]["val_loss"])
    # bf16 autocast where this CPU computes bf16 natively, float32 with a note where it does not
    assert (summary["compute_dtype"], summary["compute_note"] is None) in (("bfloat16", True), ("float32", False))
    assert {"device", "torch", "date", "command"} <= summary.keys()
    assert (runs / "tiny-coat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def training_common(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import training_common

    return training_common


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 emulate an AVX2-only CPU on x86 only")
def test_train_llama_computes_in_float32_on_a_cpu_without_native_bf16(tmp_path, training_common):
    """The main job on an AVX2-only CPU, where torch's bf16 is many times slower than float32: both runs compute
    in float32 (coat outside its FP8 layers) and say so in their output, summary and plot legend."""
    script = os.path.join(EXAMPLES, "train_llama.py")
    baseline = run([script, *QUICK, "--out", "runs"], tmp_path, env=AVX2_ONLY)
    fp8 = run([script, *QUICK, "--out", "runs", "--coat", "--compare", "runs/tiny-bf16.csv"], tmp_path, env=AVX2_ONLY)
    assert "tiny-bf16: 0.9M parameters, baseline with float32 compute" in baseline.stdout
    assert "tiny-bf16: baseline computes in float32 on this CPU: no native bf16 (a bf16 matrix product took" \
        in baseline.stdout
    assert "tiny-coat: coat computes in float32 outside its FP8 layers on this CPU: no native bf16" in fp8.stdout
    for name, note in (("tiny-bf16", "baseline computes in float32 on this CPU: no native bf16"),
                       ("tiny-coat", "coat computes in float32 outside its FP8 layers on this CPU: no native bf16")):
        summary = json.loads((tmp_path / "runs" / f"{name}.json").read_text())
        assert summary["compute_dtype"] == "float32" and summary["compute_note"] == note
        assert summary["bf16_matmul_time_ratio"] > 3
        assert training_common.compute_note(str(tmp_path / "runs" / f"{name}.csv")) == note  # the legend's
    # forced: bf16 autocast even here, and no note
    run([script, *QUICK, "--out", "forced", "--compute-dtype", "bfloat16", "--steps", "1"], tmp_path, env=AVX2_ONLY)
    summary = json.loads((tmp_path / "forced" / "tiny-bf16.json").read_text())
    assert summary["compute_dtype"] == "bfloat16" and summary["compute_note"] is None
    assert training_common.compute_note(str(tmp_path / "forced" / "tiny-bf16.csv")) is None


def test_compare_prints_both_held_out_losses_and_the_difference(training_common, tmp_path, capsys):
    def write_log(name: str, val_losses: list) -> str:
        path = str(tmp_path / f"{name}.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, training_common.CSV_COLUMNS)
            writer.writeheader()
            writer.writerows({"step": step, "train_loss": 3.0, "val_loss": val} for step, val in enumerate(val_losses, 1))
        return path

    this = write_log("tiny-coat", [2.6, 2.5, None])
    training_common.print_comparison([write_log("tiny-bf16", [2.2, None, 2.0]), write_log("cut-short", [None])], this)
    assert capsys.readouterr().out.splitlines() == [
        "held-out loss: tiny-coat 2.5000 (step 2), tiny-bf16 2.0000 (step 3): tiny-coat +0.5000 (+25.00%)",
        "held-out loss: no comparison of tiny-coat with cut-short: cut-short has no held-out loss in its log",
    ]


def test_a_run_whose_loss_is_no_longer_finite_stops_with_its_log_and_summary(training_common, tmp_path):
    args = argparse.Namespace(out=str(tmp_path), name="diverging", steps=30)
    log = training_common.TrainingLog(args, first_step=0, tokens_per_step=8, device=torch.device("cpu"),
                                      setup={"coat": True, "preset": "tiny", "lr": 1e-3})
    log.record(10, 2.5, 1e-3)
    with pytest.raises(SystemExit, match="diverging: the training loss is nan over the steps up to 20.*Lower --lr.*"
                                         "--find-nonfinite names"):
        log.record(20, float("nan"), 1e-3)
    assert [row["train_loss"] for row in read_csv(tmp_path / "diverging.csv")] == ["2.5", "nan"]
    with open(tmp_path / "diverging.json") as f:
        summary = json.load(f)
    assert summary["diverged_at_step"] == 20 and summary["steps"] == 20
    assert (summary["coat"], summary["preset"], summary["lr"]) == (True, "tiny", 1e-3)  # the run's setup, as at the end


def test_accuracies_per_kind_of_question_go_to_the_log_and_the_plot(training_common, tmp_path, monkeypatch):
    """Each evaluation's accuracy over all questions and per kind, a kind it did not ask left empty; the plot gets a
    row of per-kind panels, drawn from the logs' columns."""
    args = argparse.Namespace(out=str(tmp_path), name="vqa", steps=20)
    log = training_common.TrainingLog(args, first_step=0, tokens_per_step=8, device=torch.device("cpu"), setup={},
                                      accuracy_kinds=("colour", "position"))
    log.record(10, 2.5, 1e-3, lambda: (2.4, {"all": 0.5, "colour": 0.75}))
    log.record(20, 2.0, 1e-3, lambda: (1.9, {"all": 0.6, "colour": 0.8, "position": 0.25}))
    rows = read_csv(tmp_path / "vqa.csv")
    assert [(r["answer_accuracy"], r["answer_accuracy_colour"], r["answer_accuracy_position"]) for r in rows] == [
        ("0.5", "0.75", ""), ("0.6", "0.8", "0.25")]
    assert log.finish()["final_answer_accuracy"] == 0.6
    drawn = []
    import matplotlib.axes  # a test dependency, as for every plot

    original = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda ax, title, *a, **k: drawn.append(title) or original(ax, title, *a, **k))
    training_common.plot_runs([str(tmp_path / "vqa.csv")], str(tmp_path / "vqa.png"))
    assert drawn[-2:] == ["accuracy: colour questions", "accuracy: position questions"]
    assert (tmp_path / "vqa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("ratio, expected", [(0.2, "bfloat16"), (2.9, "bfloat16"), (3.1, "float32"), (80.0, "float32")])
@pytest.mark.parametrize("use_coat", [False, True], ids=["baseline", "coat"])
def test_train_llama_chooses_float32_where_bf16_matmuls_are_slow(training_common, monkeypatch, ratio, expected,
                                                                  use_coat):
    """auto on a CPU (train_llama.py's and train_vlm.py's): bf16 autocast unless a bf16 matrix product takes more
    than 3 times a float32 one."""
    monkeypatch.setattr(training_common, "bf16_matmul_time_ratio", lambda: ratio)
    args = argparse.Namespace(compute_dtype="auto", bf16_weights=False, coat=use_coat)
    dtype, measured, note = training_common.choose_compute_dtype(args, torch.device("cpu"))
    assert dtype == getattr(torch, expected) and measured == ratio
    what = "coat computes in float32 outside its FP8 layers" if use_coat else "baseline computes in float32"
    assert note == (None if expected == "bfloat16" else f"{what} on this CPU: no native bf16")


@pytest.mark.parametrize("compute_dtype, bf16_weights, device, expected", [
    ("auto", False, "cuda", "bfloat16"),   # GPUs: bf16 autocast, as before
    ("auto", True, "cpu", "bfloat16"),     # bf16 weights compute in bf16
    ("bfloat16", False, "cpu", "bfloat16"),
    ("float32", False, "cpu", "float32"),
])
def test_train_llama_compute_dtype_without_measuring(training_common, monkeypatch, compute_dtype, bf16_weights, device,
                                                      expected):
    def not_measured():
        raise AssertionError("the CPU's bf16 speed is measured only for auto on a CPU with float32 weights")

    monkeypatch.setattr(training_common, "bf16_matmul_time_ratio", not_measured)
    args = argparse.Namespace(compute_dtype=compute_dtype, bf16_weights=bf16_weights, coat=True)
    assert training_common.choose_compute_dtype(args, torch.device(device)) == (getattr(torch, expected), None, None)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "olmo2", "gemma3"])
@pytest.mark.parametrize("preset", ["tiny", "100m"])
def test_families_build_the_preset_sizes(training_common, family, preset):
    """--family builds the preset in another family's config: the same hidden size, layers, heads and head size,
    every decoder layer of it converted by coat.convert; Llama's build is unchanged."""
    import coat

    def build(family):
        args = argparse.Namespace(family=family, preset=preset, model=None, seed=0, seq=64, attention="sdpa")
        return training_common.build_model(args, "meta")[0]

    llama, model = build("llama"), build(family)
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert type(model).__name__ == training_common.FAMILIES[family].model
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size"):
        assert getattr(model.config, field) == getattr(llama.config, field), field
    assert model.model.layers[0].self_attn.head_dim == llama.model.layers[0].self_attn.head_dim
    assert sum(p.numel() for p in model.parameters()) >= sum(p.numel() for p in llama.parameters())
    coat.convert(model)
    assert all(hasattr(layer, "fp8_config") for layer in model.model.layers)


def test_train_llama_quantization_report(tmp_path):
    completed = run([os.path.join(EXAMPLES, "train_llama.py"), *QUICK, "--coat", "--report-every", "3", "--out", "runs"],
                    tmp_path)
    assert completed.stdout.count("quantization report, step") == 2 and "max rel_error" in completed.stdout
    rows = read_csv(tmp_path / "runs" / "tiny-coat-report.csv")
    assert {row["step"] for row in rows} == {"3", "6"}
    assert {"model.layers.0", "lm_head"} <= {row["layer"] for row in rows}
    assert all(0 < float(row["rel_error"]) < 0.1 for row in rows if row["rel_error"])
    assert (tmp_path / "runs" / "tiny-coat-report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_llama_chooses_saved_formats_from_the_first_steps(tmp_path):
    """--saved-format auto: steps 1 and 2, captured from FP4 on, decide each layer (4, 6 or 8 bits); the later
    reports show the choice. In AGoQ's 1 x 128 blocks (--group-size 128)."""
    completed = run([os.path.join(EXAMPLES, "train_llama.py"), *QUICK, "--coat", "--saved-format", "auto",
                     "--group-size", "128", "--report-every", "3", "--out", "runs"], tmp_path)
    assert "saved formats after step 1's report: FP4 in" in completed.stdout
    assert "saved formats after step 2's report: FP4 in" in completed.stdout
    assert "saved formats after step 3's report" not in completed.stdout
    summary = json.loads((tmp_path / "runs" / "tiny-coat-auto-saved-g128.json").read_text())
    chosen = summary["saved_formats_chosen"]
    assert summary["group_size"] == 128 and chosen and set(chosen.values()) <= {"fp4", "fp6", "e4m3"}
    rows = read_csv(tmp_path / "runs" / "tiny-coat-auto-saved-g128-report.csv")
    kept = {(row["layer"], row["format"]) for row in rows if row["tensor"] in ("attn_norm_input", "gate_output")}
    assert kept == set(chosen.items())


def test_train_llama_from_a_local_model_directory(tmp_path):
    from optim_helpers import tiny_llama

    tiny_llama(seed=0).save_pretrained(tmp_path / "model")  # no tokenizer in it: byte tokens
    completed = run([os.path.join(EXAMPLES, "train_llama.py"), *QUICK, "--model", "model", "--coat", "--out", "runs"],
                    tmp_path)
    assert "model-coat: 0.1M parameters" in completed.stdout
    assert len(read_csv(tmp_path / "runs" / "model-coat.csv")) == 6


@pytest.mark.parametrize("error, arguments", [
    ("--eval-every (4) must be a multiple of --log-every (3)", ["--eval-every", "4", "--log-every", "3"]),
    ("--compare: no CSV log at missing.csv", ["--compare", "missing.csv"]),
    ("--report-every needs --coat", ["--report-every", "5"]),
    *[("--saved-format, --group-size, --fast-accum, --gradient-format, --bf16-modules and --unfused-loss are options "
       "of coat.convert: add --coat", option)
      for option in (["--saved-format", "fp4"], ["--group-size", "128"], ["--fast-accum"], ["--unfused-loss"],
                     ["--gradient-format", "none"], ["--bf16-modules", "model.layers.0"])],
    ("argument --group-size: invalid choice: 12", ["--coat", "--group-size", "12"]),
    ("--uniform-fp4 extends coat's FP4-kept activations to every saved activation: add --coat --saved-format fp4",
     ["--coat", "--uniform-fp4"]),
    ("--bf16-weights keeps no float32 weights to compute in float32: drop --compute-dtype float32",
     ["--coat", "--bf16-weights", "--compute-dtype", "float32"]),
])
def test_train_llama_explains_bad_options(tmp_path, monkeypatch, capsys, error, arguments):
    # In this process: each check runs before anything is built, so a subprocess would only add its start-up.
    monkeypatch.syspath_prepend(EXAMPLES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train_llama.py", *arguments])
    import train_llama

    with pytest.raises(SystemExit) as stopped:
        train_llama.main()
    assert stopped.value.code not in (0, None) and error in capsys.readouterr().err + str(stopped.value.code)


def test_train_fsdp2_needs_torchrun(tmp_path):
    completed = run([os.path.join(EXAMPLES, "train_fsdp2.py")], tmp_path, expect_success=False)
    assert completed.returncode != 0 and "run this script with torchrun" in completed.stderr


def fsdp2_devices() -> list:
    """gloo on CPU everywhere; NCCL where two GPUs are visible, with eager attention (FlashAttention's backward
    accumulates with atomics, so two SDPA runs are not bit-identical)."""
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    gpu = pytest.mark.skipif(not two_gpus, reason="needs two CUDA GPUs")
    return [pytest.param(["--device", "cpu"], id="cpu"), pytest.param(["--device", "cuda", "--attention", "eager"], marks=gpu, id="cuda")]


@pytest.mark.parametrize("device", fsdp2_devices())
@pytest.mark.parametrize("variant, name", [
    ([], "tiny-bf16"),
    (["--coat"], "tiny-coat"),
    (["--coat", "--bf16-weights", "--fp8-reduce-scatter", "--fp8-all-gather"],
     "tiny-coat-bf16w-fp8-reduce-scatter-fp8-all-gather"),
], ids=["bf16", "coat", "coat-low-memory-fp8-communication"])
def test_train_fsdp2_resume_continues_the_loss_curve_exactly(tmp_path, variant, name, device):
    arguments = [*QUICK, *variant, *device]
    torchrun("train_fsdp2.py", [*arguments, "--out", "straight"], tmp_path)
    torchrun("train_fsdp2.py", [*arguments, "--out", "resumed", "--checkpoint-dir", "ckpt", "--stop-after", "3"],
             tmp_path)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_3"]
    completed = torchrun("train_fsdp2.py", [*arguments, "--out", "resumed", "--checkpoint-dir", "ckpt", "--resume"],
                         tmp_path)
    assert "steps 3..6 of 6" in completed.stdout
    straight, resumed = read_csv(tmp_path / "straight" / f"{name}.csv"), read_csv(tmp_path / "resumed" / f"{name}.csv")
    columns = ["step", "tokens", "train_loss", "val_loss", "lr"]
    assert [[row[c] for c in columns] for row in resumed] == [[row[c] for c in columns] for row in straight]
    assert len(straight) == 6


def test_train_fsdp2_resumes_from_the_last_complete_checkpoint_after_a_rank_dies_while_saving(tmp_path):
    # Rank 1 exits in the middle of the save of step 6 (tests/crash_during_save.py): that checkpoint stays a
    # .partial directory, which --resume skips for step_3, and the resumed run ends where an uninterrupted one does.
    arguments = [*QUICK, "--coat", "--device", "cpu"]
    torchrun("train_fsdp2.py", [*arguments, "--out", "straight"], tmp_path)
    crashed = torchrun("train_fsdp2.py", [*arguments, "--out", "resumed", "--checkpoint-dir", "ckpt", "--save-every", "3"],
                       tmp_path, launcher=[os.path.join(ROOT, "tests", "crash_during_save.py")], expect_success=False,
                       env={"COAT_TEST_CRASH_SAVE": "6"})
    assert crashed.returncode != 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_3", "step_6.partial"]
    completed = torchrun("train_fsdp2.py", [*arguments, "--out", "resumed", "--checkpoint-dir", "ckpt", "--resume"],
                         tmp_path)
    assert f"--resume: skipping {os.path.join('ckpt', 'step_6.partial')}, a save that did not finish" in completed.stdout
    assert "steps 3..6 of 6" in completed.stdout
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_3", "step_6"]
    straight, resumed = read_csv(tmp_path / "straight" / "tiny-coat.csv"), read_csv(tmp_path / "resumed" / "tiny-coat.csv")
    columns = ["step", "tokens", "train_loss", "val_loss", "lr"]
    assert [[row[c] for c in columns] for row in resumed] == [[row[c] for c in columns] for row in straight]


def test_trainer_example_resumes_its_checkpoint_exactly(tmp_path):
    script = os.path.join(EXAMPLES, "train_with_trainer.py")
    arguments = [script, "--steps", "20", "--save-steps", "10", "--batch", "8", "--output-dir", "out"]
    completed = run(arguments, tmp_path)
    assert "coat + Trainer: 20 steps" in completed.stdout
    final_state = tmp_path / "out" / "checkpoint-20" / "trainer_state.json"
    straight = json.loads(final_state.read_text())["log_history"]
    final_state.unlink()  # a save of step 20 cut short before its last file: --resume takes checkpoint-10
    completed = run([*arguments, "--resume"], tmp_path)
    assert f"--resume: skipping {os.path.join('out', 'checkpoint-20')}, a save that did not finish" in completed.stdout
    resumed = json.loads(final_state.read_text())["log_history"]
    losses = [(entry["step"], entry["loss"]) for entry in straight if "loss" in entry]
    assert losses[-1][1] < losses[0][1]
    assert [(entry["step"], entry["loss"]) for entry in resumed if "loss" in entry] == losses


# train_vlm.py: a few steps, a small held-out set evaluated twice.
QUICK_VLM = ["--steps", "4", "--batch", "4", "--log-every", "1", "--eval-every", "2", "--held-out", "4", "--out", "runs"]


def test_train_vlm_bf16_and_coat_with_vision_linears_log_loss_and_accuracy(tmp_path, shapes_vqa):
    """A BF16 run, then coat with the vision side in FP8 too (the plain --coat run differs only in not converting
    the vision side, which tests/test_nn_vlm.py checks)."""
    script = os.path.join(EXAMPLES, "train_vlm.py")
    bf16 = run([script, *QUICK_VLM], tmp_path)
    assert ("tiny-vlm-bf16: 1.1M parameters (0.2M of them the vision encoder's), baseline with" in bf16.stdout
            and "4 steps of 4 samples on cpu: 48 x 48 pictures of one shape, 9 image tokens" in bf16.stdout)
    assert "tiny-vlm-bf16: the question alone answers" in bf16.stdout
    vision = run([script, *QUICK_VLM, "--coat", "--vision-linears", "--compare", "runs/tiny-vlm-bf16.csv"], tmp_path)
    assert "baseline" not in vision.stdout and "coat FP8 with FP8 vision linears" in vision.stdout
    runs = tmp_path / "runs"
    logs = {name: read_csv(runs / f"{name}.csv") for name in ("tiny-vlm-bf16", "tiny-vlm-coat-vision")}
    for name, rows in logs.items():
        assert [row["step"] for row in rows] == ["1", "2", "3", "4"]
        assert [row["step"] for row in rows if row["answer_accuracy"]] == ["2", "4"]
        assert all(0 <= float(row["answer_accuracy"]) <= 1 and math.isfinite(float(row["val_loss"]))
                   for row in rows if row["answer_accuracy"])
        # each kind's accuracy where evaluated (empty for a kind the 4 held-out questions do not ask)
        scored = (*shapes_vqa.KINDS, *shapes_vqa.POSITION_AXES)
        kinds = [f"answer_accuracy_{kind}" for kind in scored]
        assert list(rows[0])[-len(kinds):] == kinds and not any(rows[0][k] for k in kinds)
        assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
        summary = json.loads((runs / f"{name}.json").read_text())
        assert summary["final_answer_accuracy"] == float(rows[-1]["answer_accuracy"])
        assert summary["final_val_loss"] == float(rows[-1]["val_loss"])
        # accuracy per kind of question asked among the held-out samples, and over all of them
        by_kind, blind = summary["answer_accuracy_by_kind"], summary["text_only_accuracy"]
        assert by_kind["all"] == summary["final_answer_accuracy"] and set(by_kind) <= {"all", *scored}
        assert {kind: float(rows[-1][f"answer_accuracy_{kind}"]) for kind in by_kind if kind != "all"} == \
            {kind: value for kind, value in by_kind.items() if kind != "all"}
        assert not any(rows[-1][f"answer_accuracy_{kind}"] for kind in scored if kind not in by_kind)
        assert set(blind) == set(by_kind) and 0 <= blind["all"] <= 1
        assert summary["coat"] == (name != "tiny-vlm-bf16") and summary["vision_linears"] == name.endswith("vision")
        assert summary["rope_theta"] == 1e4  # the tiny preset's
        assert (runs / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Same initial weights and data: the first losses differ only by FP8 rounding.
    first = [float(rows[0]["train_loss"]) for rows in logs.values()]
    assert first[1] == pytest.approx(first[0], rel=0.01)
    accuracies = [float(rows[-1]["answer_accuracy"]) for rows in logs.values()]
    assert (f"answer accuracy: tiny-vlm-coat-vision {accuracies[1]:.1%}, tiny-vlm-bf16 {accuracies[0]:.1%}: "
            f"tiny-vlm-coat-vision {100 * (accuracies[1] - accuracies[0]):+.1f} points") in vision.stdout
    assert "held-out loss: tiny-vlm-coat-vision" in vision.stdout


def test_gradient_format_none_trains_with_unquantized_output_gradients(tmp_path, training_common):
    """--gradient-format none is coat.convert(gradient_format=None), the COAT paper's unquantized backward; the
    run's name and summary say so."""
    assert training_common.convert_gradient_format(argparse.Namespace(gradient_format="none")) is None
    assert training_common.convert_gradient_format(argparse.Namespace(gradient_format="e4m3")) == "e4m3"
    run([os.path.join(EXAMPLES, "train_vlm.py"), *QUICK_VLM, "--coat", "--gradient-format", "none"], tmp_path)
    summary = json.loads((tmp_path / "runs" / "tiny-vlm-coat-none-grad-output.json").read_text())
    assert summary["gradient_format"] == "none" and summary["coat"] and summary["final_val_loss"] > 0


def test_torch_adamw_keeps_coats_layers_and_takes_torchs_optimizer(training_common):
    """--torch-adamw: the FP8 layers with torch.optim.AdamW, to tell the optimizer's share of a difference from
    BF16; its name says so, and it refuses coat.optim.AdamW's options and a run without --coat."""
    import coat

    model = torch.nn.Linear(4, 4)
    args = argparse.Namespace(coat=True, torch_adamw=True, lr=1e-3, weight_decay=0.1, param_rounding="stochastic",
                              fp8_grads=None)
    optimizer = training_common.build_optimizer(args, model)
    assert type(optimizer) is torch.optim.AdamW and optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert isinstance(training_common.build_optimizer(argparse.Namespace(**{**vars(args), "torch_adamw": False}),
                                                      model), coat.optim.AdamW)
    parser = argparse.ArgumentParser()
    training_common.add_coat_arguments(parser)
    training_common.add_run_arguments(parser)

    def resolve(*arguments):
        args = argparse.Namespace(**vars(parser.parse_args(arguments)), preset="tiny", model=None, family="llama")
        return training_common.resolve(args)

    for arguments, error in ((["--torch-adamw"], "--torch-adamw replaces coat.optim.AdamW in a coat run: add --coat"),
                             (["--coat", "--torch-adamw", "--bf16-weights"], "drop --torch-adamw")):
        with pytest.raises(SystemExit, match=error):
            resolve(*arguments)
    assert resolve("--coat", "--torch-adamw").name == "tiny-coat-torch-adamw"


def test_bf16_modules_keep_the_named_decoder_layers_as_they_are(tmp_path):
    """--bf16-modules is coat.convert(skip_modules=...): the layers named stay BF16; the run's name and summary say
    which, and a pattern coat.convert would skip nothing with stops the run with its error."""
    run([os.path.join(EXAMPLES, "train_vlm.py"), *QUICK_VLM, "--coat", "--bf16-modules",
         "model.language_model.layers.*"], tmp_path)
    summary = json.loads((tmp_path / "runs" / "tiny-vlm-coat-bf16-model-language-model-layers-all.json").read_text())
    assert summary["bf16_modules"] == ["model.language_model.layers.*"] and summary["final_val_loss"] > 0
    failed = run([os.path.join(EXAMPLES, "train_vlm.py"), *QUICK_VLM, "--coat", "--bf16-modules", "model.layers.0"],
                 tmp_path, expect_success=False)
    assert "skip_modules pattern 'model.layers.0' matches no module" in failed.stderr


def test_train_vlm_explains_bad_options(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(EXAMPLES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train_vlm.py", "--vision-linears"])
    import train_vlm

    with pytest.raises(SystemExit) as stopped:
        train_vlm.main()
    assert stopped.value.code not in (0, None)
    assert "--vision-linears is an option of coat.convert: add --coat" in capsys.readouterr().err + str(stopped.value.code)
    monkeypatch.setattr(sys, "argv", ["train_vlm.py", "--rope-theta", "1"])
    with pytest.raises(SystemExit, match="--rope-theta is a rotary base, more than 1, got 1.0"):
        train_vlm.main()


def test_train_vlm_rope_theta_is_the_presets_unless_given(train_vlm, monkeypatch):
    """--rope-theta sets the language model's rotary base, each preset's by default; one column of a picture turns
    M-RoPE's width frequencies by at most theta ** (-5 / 8) radians (the presets' comment)."""
    monkeypatch.setattr(sys, "argv", ["train_vlm.py", "--preset", "gpu"])
    assert train_vlm.parse_arguments().rope_theta == train_vlm.PRESETS["gpu"].rope_theta == 100.0
    monkeypatch.setattr(sys, "argv", ["train_vlm.py", "--rope-theta", "500"])
    assert train_vlm.parse_arguments().rope_theta == 500.0
    model = train_vlm.build_model(argparse.Namespace(preset="tiny", seed=0, attention="sdpa", rope_theta=500.0),
                                  torch.device("cpu"))
    inv_freq = model.model.language_model.rotary_emb.inv_freq
    temporal, height, _ = train_vlm.mrope_section(2 * len(inv_freq))
    assert inv_freq[temporal + height].item() == pytest.approx(500.0 ** (-5 / 8), rel=1e-6)


@pytest.fixture
def shapes_vqa(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import shapes_vqa

    return shapes_vqa


@pytest.fixture
def train_vlm(shapes_vqa):
    import train_vlm

    return train_vlm


def test_shapes_vqa_position_ids_are_the_models(train_vlm, shapes_vqa):
    """The M-RoPE positions a batch brings are those the model's get_rope_index computes from the batch, for the
    tiny and the gpu preset's pictures (its spatial merge is the gpu model's), and the tiny model's loss is the same
    bit for bit with them as without."""
    model = train_vlm.build_model(argparse.Namespace(preset="tiny", seed=0, attention="sdpa", rope_theta=1e4), torch.device("cpu"))
    for preset in ("tiny", "gpu"):
        p = train_vlm.PRESETS[preset]
        dataset = shapes_vqa.ShapesVQA(seed=0, image_size=p.image, patch=p.patch, max_objects=p.max_objects, held_out=8)
        inputs = dataset.batch(dataset.held_out, "cpu")
        expected, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 inputs["image_grid_thw"])
        assert torch.equal(inputs["position_ids"], expected)
        if preset == "tiny":  # the pictures this model takes
            without = {name: value for name, value in inputs.items() if name != "position_ids"}
            with torch.no_grad():
                assert torch.equal(model(**inputs).loss, model(**without).loss)


def test_train_vlm_training_batches_are_the_steps_in_order(train_vlm, shapes_vqa):
    """The workers' batches are those of steps 0, 1, 2... in order, as drawn in the training process."""
    dataset = shapes_vqa.ShapesVQA(seed=1, image_size=48, patch=8, max_objects=3, held_out=1)
    batches = list(train_vlm.training_batches(dataset, 4, 5, torch.device("cpu")))
    assert len(batches) == 5
    for step, inputs in enumerate(batches):
        expected = dataset.batch(dataset.samples(step, 4), "cpu")
        assert inputs.keys() == expected.keys()
        assert all(torch.equal(inputs[name], expected[name]) for name in expected)


def test_shapes_vqa_is_deterministic_and_its_answers_are_in_the_picture(shapes_vqa):
    """The same samples from the same seed and step, others from another; each answer is what the picture shows:
    the colour drawn in the shape asked about, the cell its centre lies in, the number of colours in
    the picture; the question names something the picture holds once."""
    data = shapes_vqa
    dataset = data.ShapesVQA(seed=3, image_size=48, patch=8, max_objects=3, held_out=4)
    samples = dataset.samples(5, 64)
    assert samples == data.ShapesVQA(3, 48, 8, 3, 4).samples(5, 64)
    assert samples != dataset.samples(6, 64) and samples != data.ShapesVQA(4, 48, 8, 3, 4).samples(5, 64)
    images = data.render(samples, 48)
    assert {s.kind for s in samples} == set(data.KINDS) and {len(s.objects) for s in samples} == {1, 2, 3}
    for sample, image in zip(samples, images):
        def at(shape):  # the pixel at the centre; a ring's, three quarters of the way out
            x, y = shape.centre
            return image[:, int(y), int(x + 0.75 * shape.radius * (shape.shape == "ring"))]

        for shape in sample.objects:
            assert torch.equal(at(shape), torch.tensor(shape.rgb))
            colour = torch.tensor(data.COLOURS[shape.colour])
            assert (at(shape) - colour).abs().max() <= data.COLOUR_JITTER + 1e-6
            column, row = (int(c // (48 / data.GRID)) for c in shape.centre)
            assert data.GRID * row + column == shape.cell
        pixels = image.reshape(3, -1).T
        colours = {tuple(p.tolist()) for p in pixels if not torch.all(p == sample.background)}
        assert len(colours) == len(sample.objects)
        words = sample.question.rstrip("?").split()
        named = [s for s in sample.objects if s.shape in words or s.colour in words]
        if sample.kind == "count":
            assert sample.answer == data.COUNTS[len(sample.objects) - 1] and not named
        else:
            assert len(named) == 1
            asked = named[0]
            assert sample.answer == {"colour": asked.colour, "shape": asked.shape,
                                     "position": data.POSITIONS[asked.cell]}[sample.kind]


def test_shapes_vqa_held_out_set_is_none_of_the_training_samples(shapes_vqa):
    data = shapes_vqa
    dataset = data.ShapesVQA(seed=0, image_size=48, patch=8, max_objects=3, held_out=64)
    training = [s for step in range(100) for s in dataset.samples(step, 32)]
    assert not set(dataset.held_out) & set(training)
    held_out = data.render(dataset.held_out, 48).flatten(1)
    for step in range(0, 100, 10):
        images = data.render(dataset.samples(step, 32), 48).flatten(1)
        assert torch.cdist(held_out, images).min() > 0


def test_shapes_vqa_questions_alone_answer_at_chance(shapes_vqa):
    """The best answers to the question alone (its most frequent answer in training) are right about as often as a
    uniform guess among the answers the picture allows: 1 in 6 colours or shapes, 9 cells, 3 counts."""
    data = shapes_vqa
    dataset = data.ShapesVQA(seed=0, image_size=48, patch=8, max_objects=3, held_out=2000)
    training = [s for step in range(100) for s in dataset.samples(step, 100)]
    accuracy = data.text_only_accuracy(training, dataset.held_out)
    chance = {"colour": 1 / 6, "shape": 1 / 6, "position": 1 / 9, "count": 1 / 3, "position_row": 1 / 3,
              "position_column": 1 / 3}
    assert all(accuracy[kind] <= chance[kind] + 0.06 for kind in chance), accuracy


def test_shapes_vqa_scores_a_position_answers_row_and_column_apart(shapes_vqa):
    """A position answer's row and column count apart (POSITIONS is the 3 x 3 grid row by row); an answer that is no
    position scores neither; other kinds of question have no axes. The accuracies divide them by the position
    questions asked."""
    data = shapes_vqa

    def sample(kind, answer):
        return data.Sample(objects=(), background=0.0, kind=kind, question="?", answer=answer)

    where = sample("position", "top left")
    cases = {"top left": (1, 1, 1), "top": (0, 1, 0), "top right": (0, 1, 0), "left": (0, 0, 1), "centre": (0, 0, 0),
             "bottom left": (0, 0, 1)}
    for answer, (right, row, column) in cases.items():
        assert data.score(where, answer) == {"position": right, "position_row": row, "position_column": column}, answer
    assert data.score(where, "square") == data.score(where, None) == {"position": 0}
    assert data.score(sample("position", "centre"), "right") == {"position": 0, "position_row": 1, "position_column": 0}
    assert data.score(sample("colour", "red"), "red") == {"colour": 1}
    samples = [where, where, sample("colour", "red")]
    right = data.score(where, "top") + data.score(where, "bottom left") + data.score(samples[2], "red")
    assert data.accuracy_by_kind(samples, right) == {"all": 1 / 3, "colour": 1.0, "position": 0.0,
                                                    "position_row": 0.5, "position_column": 0.5}
    assert "position_row" not in data.accuracy_by_kind(samples[2:], data.score(samples[2], "red"))


def test_shapes_vqa_pixel_values_are_the_image_processors(shapes_vqa):
    """patchify lays the pictures out as transformers' Qwen2-VL image processor does (the vision encoder's 2D
    positions and the 2 x 2 merge read that order)."""
    from transformers import Qwen2VLImageProcessor

    data = shapes_vqa
    dataset = data.ShapesVQA(seed=0, image_size=48, patch=8, max_objects=3, held_out=3)
    images = data.render(dataset.held_out, 48)
    processed = Qwen2VLImageProcessor()(images=list(images), do_resize=False, do_rescale=False,
                                        image_mean=list(data.PIXEL_MEAN), image_std=list(data.PIXEL_STD), patch_size=8,
                                        merge_size=2, temporal_patch_size=2, return_tensors="pt")
    inputs = dataset.batch(dataset.held_out, "cpu")
    torch.testing.assert_close(inputs["pixel_values"], processed["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(inputs["image_grid_thw"], processed["image_grid_thw"])
    assert (inputs["input_ids"] == data.IMAGE).sum(dim=1).tolist() == [dataset.image_tokens] * 3 == [9] * 3
    # labels on the answer bytes and the end token only
    for row, sample in enumerate(dataset.held_out):
        labelled = inputs["labels"][row][inputs["labels"][row] != -100].tolist()
        assert labelled == list(sample.answer.encode()) + [data.END]


class NaNGradient(torch.autograd.Function):
    """The identity whose backward returns NaN: an op that turns finite gradients into non-finite ones."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Output:
    def __init__(self, loss):
        self.loss = loss


class TwoLayers(torch.nn.Module):
    """A model with the training examples' call convention (model(input_ids=..., labels=...).loss) whose second
    layer is the one named ``culprit``, which breaks the gradients in backward or the values in forward."""

    def __init__(self, breaks: str | None):
        super().__init__()
        self.first, self.culprit = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.breaks = breaks
        self.culprit.register_forward_hook(self.break_it)

    def break_it(self, module, inputs, output):
        if self.breaks == "backward":
            return NaNGradient.apply(output)
        if self.breaks == "forward":
            return output * float("inf")
        return output

    def forward(self, input_ids, labels):
        return Output(((self.culprit(self.first(input_ids)) - labels) ** 2).mean())


@pytest.mark.parametrize("breaks", ["forward", "backward"])
def test_find_nonfinite_stops_before_the_optimizer_step_and_names_the_module_and_function(training_common, breaks):
    torch.manual_seed(0)
    model = TwoLayers(breaks)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batch = {"input_ids": torch.randn(3, 4), "labels": torch.randn(3, 4)}
    with pytest.raises(training_common.NonFiniteStep) as failure:
        training_common.training_step(model, optimizer, scheduler, batch, 1.0, contextlib.nullcontext, True)
    assert math.isnan(failure.value.grad_norm)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the step was not taken

    finding = training_common.locate_nonfinite(model, batch, contextlib.nullcontext)
    assert finding[breaks] == {"module": "culprit", "type": "Linear"}
    assert finding["forward" if breaks == "backward" else "backward"] is None
    assert finding["nonfinite_grads"] == ["first.weight", "first.bias", "culprit.weight", "culprit.bias"]
    if breaks == "backward":  # anomaly mode looks for NaN: an Inf forward makes NaN only in the loss's backward
        assert finding["anomaly"] == "Function 'NaNGradientBackward' returned nan values in its 0th output."
        assert "test_examples.py" in finding["created_at"] and "break_it" in finding["created_at"]
    assert f"the {breaks} of culprit (Linear) made" in training_common.describe_nonfinite(finding)
    assert all(p.grad is None for p in model.parameters())


def test_find_nonfinite_lets_finite_steps_through(training_common):
    torch.manual_seed(0)
    model = TwoLayers(None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batch = {"input_ids": torch.randn(3, 4), "labels": torch.randn(3, 4)}
    before = [p.detach().clone() for p in model.parameters()]
    loss = training_common.training_step(model, optimizer, scheduler, batch, 0.0, contextlib.nullcontext, True)
    assert math.isfinite(loss.item()) and not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    finding = training_common.locate_nonfinite(model, batch, contextlib.nullcontext)
    assert finding["forward"] is finding["backward"] is finding["anomaly"] is None
    assert finding["nonfinite_grads"] == [] and finding["largest_grad"]["abs"] > 0
    assert "replayed, no module made a non-finite value" in training_common.describe_nonfinite(finding)
    # finite gradients whose norm overflows float32 (as at a learning rate far too high)
    finding["largest_grad"], finding["replay_grad_norm"] = {"parameter": "culprit.weight", "abs": 3e20}, math.inf
    assert training_common.describe_nonfinite(finding).startswith(
        "replayed, the loss and every gradient are finite, the largest 3e+20 (of culprit.weight), but the gradient "
        "norm is not")


def test_train_llama_find_nonfinite_names_what_made_a_diverging_run_non_finite(tmp_path):
    # a learning rate of 1e4 without clipping: weights of ~1e4 after the first step, non-finite values in the second
    completed = run([os.path.join(EXAMPLES, "train_llama.py"), *QUICK, "--lr", "1e4", "--clip", "0",
                     "--find-nonfinite", "--out", str(tmp_path), "--name", "diverging"], tmp_path, expect_success=False)
    assert completed.returncode != 0
    assert "The step's optimizer step was not taken" in completed.stderr, completed.stderr[-3000:]
    with open(tmp_path / "diverging.json") as f:
        summary = json.load(f)
    found = summary["nonfinite"]
    assert summary["diverged_at_step"] >= 1 and not math.isfinite(found["grad_norm"]) and summary["lr"] == 1e4
    assert found["forward"] or found["backward"]
    assert found["anomaly"] is None or found["anomaly"].startswith("Function '")


@pytest.fixture
def sdpa_switches():
    """torch's SDPA backend switches, restored after the test (choose_sdpa_backends sets them for the process)."""
    switches = {name: getattr(torch.backends.cuda, name.removeprefix("enable_") + "_enabled")
                for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp", "enable_math_sdp")}
    saved = {name: read() for name, read in switches.items()}
    yield switches
    for name, enabled in saved.items():
        getattr(torch.backends.cuda, name)(enabled)


def test_sdpa_backends_leave_only_the_named_kernels_and_explain_a_cpu_without_them(training_common, sdpa_switches):
    training_common.choose_sdpa_backends(["flash", "efficient", "math"], torch.device("cpu"))
    assert {name: read() for name, read in sdpa_switches.items()} == {
        "enable_flash_sdp": True, "enable_mem_efficient_sdp": True, "enable_cudnn_sdp": False, "enable_math_sdp": True}
    q = torch.randn(1, 2, 8, 16)
    torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q),
                               torch.softmax(q @ q.transpose(-1, -2) / 4, -1) @ q)
    with pytest.raises(SystemExit, match="on a CPU, scaled_dot_product_attention has only the flash and math kernels"):
        training_common.choose_sdpa_backends(["cudnn", "efficient"], torch.device("cpu"))
