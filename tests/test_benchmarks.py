"""The GPU benchmarks' CPU smoke modes: the scripts run end to end and write their JSON."""
import inspect
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import coat

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def run_smoke(launcher: list[str], script: str, results_dir, *args: str) -> dict:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(
        [*launcher, os.path.join(BENCHMARKS, f"{script}.py"), "--smoke", "--results-dir", str(results_dir), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result_file,) = results_dir.glob("*.json")
    return json.loads(result_file.read_text())


def check_e2e(result: dict, world_size: int, fp8_comm: tuple[str, ...] = ("coat-fp8-comm",)) -> None:
    summary = result["summary"]
    assert summary["world_size"] == world_size
    # FP8 gradients need unsharded parameters, FP8 reduce-scatter FSDP2: each is skipped with a note elsewhere
    expected = ["bf16", "coat", "coat-fp8-grads"] if world_size == 1 else ["bf16", "coat", *fp8_comm]
    assert len(summary["notes"]) == 1 and "skipped" in summary["notes"][0]
    assert [row["variant"] for row in result["rows"]] == expected
    for row in result["rows"]:
        assert row["world size"] == world_size
        assert len(row["losses"]) == 2 and all(math.isfinite(loss) for loss in row["losses"])
    # weights + gradients + Adam state: float32 with torch's AdamW 16 bytes; coat 10.09, bf16 weights and FP8
    # gradients 5.09, plus the per-group meta of the tiny model's short rows
    state = summary["model_state_bytes_per_param"]
    assert state["bf16"] == pytest.approx(16.0, abs=0.01)
    assert 10.09 <= state["coat"] <= 10.2
    if world_size == 1:
        assert 5.09 <= state["coat-fp8-grads"] <= 5.2
    else:
        assert 6.09 <= state["coat-fp8-comm"] <= 6.2  # bf16 weights and gradients
        # What each rank handed to collectives per step, counted at torch.distributed's calls. BF16 gathers
        # bf16 weights and reduce-scatters float32 gradients; coat-fp8-comm gathers FP8 codes of the projection
        # weights (the embeddings, norms and LM head stay bf16) and sends FP8 gradient blocks with their scales.
        sent = {row["variant"]: row for row in result["rows"]}
        for row in sent.values():
            assert row["all-gather MB/step"] > 0 and row["reduce-scatter MB/step"] > 0
        assert sent["coat"]["all-gather MB/step"] == pytest.approx(sent["bf16"]["all-gather MB/step"])
        assert sent["coat-fp8-comm"]["all-gather MB/step"] < 0.9 * sent["bf16"]["all-gather MB/step"]
        assert sent["coat-fp8-comm"]["reduce-scatter MB/step"] < 0.3 * sent["bf16"]["reduce-scatter MB/step"]
        assert sent["coat-fp8-comm"]["all-reduce MB/step"] > 0 == sent["bf16"]["all-reduce MB/step"]
        ratios = result["summary"]["collective_bytes_over_bf16"]
        assert ratios["all-gather"]["bf16"] == 1.0 and ratios["all-gather"]["coat-fp8-comm"] < 0.9


@pytest.mark.parametrize("family", ["qwen3", "phi3", "olmo2", "gemma3"])
def test_layer_benchmark_other_families(tmp_path, family):
    """layer.py --family qwen3 (q/k norms), phi3 (fused qkv and gate_up weights), olmo2 (post-norms, full-width
    q/k norms) or gemma3 ((1 + w) norms, four of them, GeGLU): BF16's saved tensors beside coat's in every row."""
    result = run_smoke([sys.executable], "layer", tmp_path, "--family", family, "--variants", "coat eager")
    saved = {row["layer"]: row["tensors U"] for row in result["rows"]}
    assert set(saved) == {"BF16 eager", "coat eager"} and all(row["model"] == family for row in result["rows"])
    assert saved["coat eager"] * 1.8 <= saved["BF16 eager"]


@pytest.mark.parametrize("script", ["linear", "layer", "layer_host_time", "e2e", "rope", "report", "fp4", "cross_entropy",
                                    "fp8_collectives", "moe"])
def test_benchmark_smoke_mode(script, tmp_path):
    result = run_smoke([sys.executable], script, tmp_path)
    assert result["summary"]["smoke"] and result["rows"]
    assert {"device", "torch", "date", "command"} <= result.keys()
    if script == "layer":
        # The saved bytes do not depend on the device: at least 1.8x less than BF16 (the paper's figure) here too.
        saved = {row["layer"]: row["saved U"] for row in result["rows"]}
        assert all(row["tensors U"] == row["saved U"] for row in result["rows"])  # on the CPU one measure
        assert saved["coat eager"] * 1.8 <= saved["BF16 eager"]
        assert saved["coat fp4 G=128 eager"] < saved["coat fp4 eager"] < saved["coat fp6 eager"] < saved["coat eager"]
        assert saved["coat fast-accum eager"] == saved["coat eager"]
        assert set(saved) == {"BF16 eager", "coat eager", "coat fast-accum eager", "coat fp4 eager",
                              "coat fp4 G=128 eager", "coat fp6 eager"}
    if script == "e2e":
        check_e2e(result, world_size=1)


def test_report_benchmark_takes_the_batch(tmp_path):
    result = run_smoke([sys.executable], "report", tmp_path, "--batch", "3")
    assert {row["batch x seq"] for row in result["rows"]} == {"3x32"}
    completed = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "report.py"), "--smoke", "--batch", "0"],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    assert completed.returncode == 2 and "--batch must be a positive number of sequences" in completed.stderr


def test_report_benchmark_profiles_the_host(tmp_path):
    environment = {**os.environ, "PYTHONPATH": ROOT}
    completed = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "report.py"), "--smoke", "--host-profile", "2",
                                "--results-dir", str(tmp_path)], capture_output=True, text=True, env=environment,
                               timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "host time per step under cProfile, 2 steps each" in completed.stdout
    assert "quantization_sums_" in completed.stdout  # the native measuring op: a captured step's, not a plain one's


def test_gemm_algos_times_every_candidate_or_says_what_it_needs(tmp_path):
    """benchmarks/gemm_algos.py calls cuBLASLt: on an FP8 GPU it times each GEMM's candidates (the fastest is
    never slower than the first), elsewhere it exits saying what it needs."""
    completed = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "gemm_algos.py"), "--warmup", "1",
                                "--repeat", "2", "--results-dir", str(tmp_path)], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        assert completed.returncode == 0, completed.stderr[-3000:]
        (result_file,) = tmp_path.iterdir()
        rows = json.loads(result_file.read_text())["rows"]
        assert len(rows) == 22 and all(row["algos"] >= 1 and row["best us"] <= row["first us"] for row in rows)
    else:
        assert completed.returncode == 1
        assert "needs a CUDA GPU with FP8 tensor cores" in completed.stderr


def test_e2e_smoke_mode_fsdp2(tmp_path):
    """benchmarks/e2e.py under torchrun: FSDP2 on two CPU processes (gloo), meta-device build included."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = run_smoke(torchrun, "e2e", tmp_path, "--fp8-scales", "per_unit", "precomputed")
    assert result["rows"][0]["measured"] == "smoke"
    check_e2e(result, world_size=2, fp8_comm=("coat-fp8-comm", "coat-fp8-comm:precomputed"))
    # the same bytes but the amaxes: per step, one all-reduce after the optimizer step instead of one per gather
    rows = {row["variant"]: row for row in result["rows"]}
    precomputed, per_unit = rows["coat-fp8-comm:precomputed"], rows["coat-fp8-comm"]
    assert precomputed["all-gather MB/step"] == per_unit["all-gather MB/step"]
    assert 0 < precomputed["all-reduce MB/step"] < per_unit["all-reduce MB/step"]


def test_e2e_profile_mode_prints_where_the_step_goes(tmp_path):
    """--profile: step times and torch.profiler tables per variant, and no result file."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "e2e.py"), "--smoke", "--profile", "--variants", "bf16", "coat",
         "--results-dir", str(tmp_path)],
        capture_output=True, text=True, env=environment, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    for variant in ("bf16", "coat"):
        assert f"{variant}, 2 layers, batch 1: step ms" in completed.stderr + completed.stdout
    assert completed.stdout.count("Self CPU time total") == 2
    assert "_MLPResidualFunction" in completed.stdout  # coat's MLP block, which holds most of its forward
    assert list(tmp_path.iterdir()) == []


def test_e2e_largest_batch_search_recovers_from_out_of_memory(monkeypatch):
    """The GPU-only search, on the CPU with out-of-memory errors simulated above batch 5: doubling, then
    bisection, and the model rebuilt after each failure still trains."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e

    training = e2e.Training("bf16", e2e.llama_config("7b", 2, smoke=True), torch.device("cpu"), mesh=None, rank=0)
    training.build()
    step = training.step

    def step_out_of_memory_above_5(ids):
        if ids.shape[0] > 5:
            raise torch.OutOfMemoryError("simulated")
        return step(ids)

    training.step = step_out_of_memory_above_5
    tried = {}
    assert e2e.largest_batch(training, seq=8, warmup=2, steps=2, cap=64, tried=tried) == 5
    assert {batch: result is not None for batch, result in tried.items()} == {
        1: True, 2: True, 4: True, 8: False, 6: False, 5: True
    }
    # the batch found was measured in the search itself, timed steps included
    assert len(tried[5]["losses"]) == 2 and all(math.isfinite(loss) for loss in tried[5]["losses"])
    assert e2e.largest_batch(training, seq=8, warmup=2, steps=1, cap=3, tried={}) == 3


def test_e2e_largest_batch_search_skips_batches_extrapolated_over_the_memory_cap(monkeypatch):
    """Under torchrun a batch whose peak, extrapolated from the two largest that fit, exceeds 95% of the
    allocator cap is not run (one rank out of memory alone hangs the others); the rest run as before."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e

    run = []

    def trial(training, batch, seq, warmup, steps):  # 10 GiB + 5 GiB per sequence, out of memory over 70
        run.append(batch)
        return {"peak GiB": 10.0 + 5.0 * batch} if 10.0 + 5.0 * batch <= 70.0 else None

    monkeypatch.setattr(e2e, "trial", trial)
    training = e2e.Training("bf16", e2e.llama_config("7b", 2, smoke=True), torch.device("cpu"), mesh=None, rank=0)
    tried = {}
    assert e2e.CAP_MARGIN == 0.95
    assert e2e.largest_batch(training, seq=8, warmup=2, steps=2, cap=64, tried=tried, memory_cap_gib=75.0) == 12
    assert run == [1, 2, 4, 8, 12]  # 16 (predicted 90 GiB), 14 (80) and 13 (75) are over 71.25 GiB: not run
    assert {batch for batch, result in tried.items() if result is None} == {16, 14, 13}
    assert e2e.extrapolated_peak({1: {"peak GiB": 20.0}, 2: {"peak GiB": 22.0}, 4: None}, 8) == 34.0
    assert e2e.extrapolated_peak({1: {"peak GiB": 20.0}}, 8) is None
    run.clear()
    assert e2e.largest_batch(training, seq=8, warmup=2, steps=2, cap=64, tried={}) == 12
    assert run == [1, 2, 4, 8, 16, 12, 14, 13]  # without the cap every batch runs


def test_e2e_sequence_search_finds_the_longest_multiple_of_its_unit(monkeypatch):
    """The longest-sequence search at batch 1, with out-of-memory errors simulated above 5 x 1024 tokens."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e

    tried = []

    def fits(seq):
        tried.append(seq)
        return seq <= 5 * 1024

    assert e2e.largest_fitting(fits, cap=64 * 1024, unit=1024) == 5 * 1024
    assert tried == [1024, 2048, 4096, 8192, 6144, 5120]
    assert e2e.largest_fitting(lambda seq: True, cap=3 * 1024, unit=1024) == 3 * 1024
    assert e2e.largest_fitting(lambda seq: False, cap=8 * 1024, unit=1024) == 0


def test_e2e_plots_the_committed_gpu_results(tmp_path):
    results = sorted(str(p) for p in (pathlib.Path(ROOT) / "benchmarks" / "results").glob("e2e-*gpu-*.json"))
    assert results, "benchmarks/results holds no e2e result to plot"
    png = tmp_path / "e2e.png"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "e2e.py"), "--plot", *results, "--plot-file", str(png)],
        capture_output=True, text=True, env=environment, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


VISION_LANGUAGE_SHAPES = ["qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen3-vl-4b"]


def language_model_kept(row: dict) -> float:
    """GiB the embedding and decoder layers keep for backward: the body's, less a vision side's."""
    return row["body kept GiB"] - row.get("vision kept GiB", 0.0)


def test_e2e_shapes_smoke_mode(tmp_path):
    """benchmarks/e2e_shapes.py at tiny sizes of each shape on the CPU: every row trains, and its memory parts
    add up: model state from the tensors, and what the body and what the LM head and loss keep for backward. The
    vision-language shapes have the coat-vision row too, whose vision side keeps FP8 inputs where coat's keeps
    BF16 activations as bf16's does."""
    result = run_smoke([sys.executable], "e2e_shapes", tmp_path)
    summary = result["summary"]
    assert {"device", "torch", "date", "command"} <= result.keys()
    assert summary["smoke"] and summary["shapes"] == ["llama3.2-1b", "llama3.1-8b", "qwen2.5-7b", "olmoe-1b-7b",
                                                      "qwen2-moe-a2.7b", *VISION_LANGUAGE_SHAPES]
    assert set(summary["versions"]) == {"transformers", "torchao", "liger-kernel", "triton"}
    fused = "fused_loss" in inspect.signature(coat.convert).parameters
    assert summary["coat_convert_has_fused_loss"] == fused
    expected = ["bf16", "coat", "coat-unfused", "coat-lowmem"] if fused else ["bf16", "coat", "coat-lowmem"]
    assert any(note.startswith("liger skipped: ") for note in summary["notes"])  # no GPU for its Triton kernels
    text_shapes = [shape for shape in summary["shapes"] if shape not in VISION_LANGUAGE_SHAPES]
    assert [note for note in summary["notes"] if note.startswith("coat-vision on ")] == [
        f"coat-vision on {shape} skipped: a text model has no vision side to convert" for shape in text_shapes]
    assert [note for note in summary["notes"] if note.startswith("bf16-batched on ")] == [
        f"bf16-batched on {shape} skipped: a text model has no vision attention to batch" for shape in text_shapes]
    assert summary["errors"] == {}
    tokens, vocab = 2 * 32, 1024
    for shape in summary["shapes"]:
        rows = {row["variant"]: row for row in result["rows"] if row["shape"] == shape}
        vision_language = shape in VISION_LANGUAGE_SHAPES
        assert list(rows) == (["bf16", "bf16-batched", "coat", "coat-vision", *expected[2:]] if vision_language
                              else expected)
        for variant, row in rows.items():
            assert len(row["losses"]) == 1 and math.isfinite(row["losses"][0]) and "accounting" not in row
            assert row["peak in"] in ("forward", "backward", "optimizer step")
            assert row["body kept GiB"] > 0 and row["tracked peak GiB"] > 0
            assert row["loss"] == ("coat fused" if fused and variant in ("coat", "coat-vision", "coat-lowmem")
                                   else "transformers")
            # a 16 x 16-patch image, 16 tokens after the merger, in each sample of 32 tokens
            assert row.get("image tokens") == (16 if vision_language else None)
            assert ("vision kept GiB" in row) == vision_language
            if row["loss"] == "transformers":
                # transformers' loss: the bf16 logits it returns and the float32 log-softmax cross-entropy saves
                assert row["logits returned"]
                assert 6 * tokens * vocab <= row["head+loss kept GiB"] * 2**30 <= 12 * tokens * vocab
        bf16, coat_row, lowmem = rows["bf16"], rows["coat"], rows["coat-lowmem"]
        # coat-vision's step time against coat's (the peak ratio needs a GPU)
        assert (summary["per_shape"][shape]["vision_linears_speed_ratio"] is not None) == vision_language
        if vision_language:  # the vision side keeps what bf16's keeps with coat's attention, unless converted
            assert coat_row["vision kept GiB"] == pytest.approx(rows["bf16-batched"]["vision kept GiB"])
            assert rows["coat-vision"]["vision kept GiB"] * 1.3 <= coat_row["vision kept GiB"]
        # float32 weights, gradients and two Adam moments; coat's FP8 moments; bf16 weights with FP8 gradients
        assert bf16["state B/param"] == pytest.approx(16.0, abs=0.01)
        assert bf16["grads GiB"] == bf16["weights GiB"]
        assert bf16["optimizer GiB"] == pytest.approx(2 * bf16["weights GiB"], rel=1e-3)  # + the step counters
        assert 10.09 <= coat_row["state B/param"] <= 10.2
        assert 5.09 <= lowmem["state B/param"] <= 5.2
        assert lowmem["weights GiB"] == pytest.approx(bf16["weights GiB"] / 2)
        assert language_model_kept(coat_row) * 1.8 <= language_model_kept(bf16)  # activations saved in FP8
    assert (tmp_path / "e2e-shapes-smoke-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_shapes_rows_at_several_depths(tmp_path):
    """--layers N N ... runs every variant at each depth in one process, the shape's own depth among them, each
    row named by its depth (the CPU has no peaks, so no lines: depth_fits is empty)."""
    result = run_smoke([sys.executable], "e2e_shapes", tmp_path, "--shapes", "qwen2.5-vl-3b", "--layers", "2", "1",
                       "--variants", "bf16", "coat")
    rows = result["rows"]
    assert [(r["shape"], r["variant"], r["layers"]) for r in rows] == [
        ("qwen2.5-vl-3b-1-layers", "bf16", 1), ("qwen2.5-vl-3b-1-layers", "coat", 1),
        ("qwen2.5-vl-3b", "bf16", 2), ("qwen2.5-vl-3b", "coat", 2)]
    assert {r["base shape"] for r in rows} == {"qwen2.5-vl-3b"} and {r["shape layers"] for r in rows} == {2}
    assert all(math.isfinite(r["losses"][0]) for r in rows)
    assert result["summary"]["depth_fits"] == {} and result["summary"]["errors"] == {}


def depth_rows(variant: str, depths, step_ms, peak_gib, full: int = 36) -> list[dict]:
    """e2e_shapes rows of shape "s" at several depths; a step_ms of None: the row ran out of memory."""
    rows = []
    for layers, ms, peak in zip(depths, step_ms, peak_gib):
        row = {"shape": "s" if layers == full else f"s-{layers}-layers", "base shape": "s", "variant": variant,
               "layers": layers, "shape layers": full, "batch": 1, "seq": 4096}
        row.update({"peak GiB": "OOM"} if ms is None else
                   {"peak GiB": float(peak), "step ms": float(ms), "tokens/s/GPU": 4096 / (ms / 1e3)})
        rows.append(row)
    return rows


def test_e2e_shapes_depth_fits_against_numpy(monkeypatch):
    """Lines through the rows of each variant at the cut depths, against numpy's least squares in float64; their
    values at the full depth, their error where the variant ran there, and coat's full-depth row against the line
    of a variant that ran out of memory there."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    depths = [12, 18, 24, 30]
    bf16_ms, bf16_gib = [300.0, 391.0, 479.0, 572.0], [40.1, 56.8, 66.2, 76.0]
    coat_ms, coat_gib = [260.0, 310.0, 362.0, 409.0], [22.0, 28.1, 33.9, 40.2]
    rows = (depth_rows("bf16", depths + [36], bf16_ms + [None], bf16_gib + [None])
            + depth_rows("coat", depths + [36], coat_ms + [455.0], coat_gib + [46.0])
            + depth_rows("coat-vision", [18, 24, 36], [330.0, 380.0, 500.0], [26.0, 31.0, 42.0]))
    fits = e2e_shapes.depth_fits(rows)["s"]
    assert set(fits["lines"]) == {"bf16", "coat"}  # coat-vision: two cut depths, too few for a line
    for variant, ms, gib in (("bf16", bf16_ms, bf16_gib), ("coat", coat_ms, coat_gib)):
        fit = fits["lines"][variant]
        assert fit["depths"] == depths and fit["full depth"] == 36
        for key, ys in (("step ms", ms), ("peak GiB", gib)):
            slope, fixed = np.polyfit(np.array(depths, dtype=np.float64), np.array(ys, dtype=np.float64), 1)
            assert fit[key]["per layer"] == pytest.approx(slope, rel=1e-12)
            assert fit[key]["fixed"] == pytest.approx(fixed, rel=1e-12)
            assert fit[key]["at full depth"] == pytest.approx(fixed + 36 * slope, rel=1e-12)
            residuals = np.array(ys) - (fixed + slope * np.array(depths, dtype=np.float64))
            assert fit[key]["largest residual"] == pytest.approx(np.abs(residuals).max(), rel=1e-9)
        assert fit["tokens/s at full depth"] == pytest.approx(4096 / (fit["step ms"]["at full depth"] / 1e3))
    coat_fit, bf16_fit = fits["lines"]["coat"], fits["lines"]["bf16"]
    assert coat_fit["error at full depth"]["step ms"] == pytest.approx(coat_fit["step ms"]["at full depth"] / 455 - 1)
    assert coat_fit["error at full depth"]["peak GiB"] == pytest.approx(coat_fit["peak GiB"]["at full depth"] / 46 - 1)
    assert bf16_fit["at full depth measured"] == "OOM" and "error at full depth" not in bf16_fit
    assert fits["coat against lines"] == {"bf16": {
        "speed ratio": pytest.approx(bf16_fit["step ms"]["at full depth"] / 455),
        "peak ratio": pytest.approx(46 / bf16_fit["peak GiB"]["at full depth"])}}
    # without coat's full-depth row there is nothing to set against the lines
    assert e2e_shapes.depth_fits([r for r in rows if not (r["variant"] == "coat" and r["layers"] == 36)])[
        "s"]["coat against lines"] == {}


def test_e2e_shapes_predicts_a_deeper_peak_from_two_depths(monkeypatch):
    """A variant's peak at more layers on the line through its rows that ran at fewer (two at least), which decides
    whether the row would only run out of memory."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    rows = depth_rows("bf16", [12, 18, 24], [300, 391, None], [47.0, 56.0, None])
    assert e2e_shapes.predicted_peak(rows, "bf16", "s", 36) == pytest.approx(47.0 + 24 * 1.5)
    assert e2e_shapes.predicted_peak(rows, "bf16", "s", 18) is None  # one row below 18
    assert e2e_shapes.predicted_peak(rows, "coat", "s", 36) is None
    assert e2e_shapes.predicted_peak(rows, "bf16", "other", 36) is None


def test_e2e_shapes_does_not_run_a_depth_predicted_out_of_memory(monkeypatch, tmp_path):
    """A variant whose rows at two fewer depths put its peak over the GPU's memory gets a row that says it was not
    run, with the prediction, in the results file; the others run."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    def measure(variant, shape_name, layers, batch, seq, args, device):  # a peak of 30 or 10 GiB a layer
        depth = layers or 3
        row = depth_rows(variant, [depth], [100.0 * depth], [(30.0 if variant == "bf16" else 10.0) * depth], full=3)
        return row[0] | {"base shape": shape_name}

    shape = e2e_shapes.SHAPES["qwen2.5-vl-3b"]
    monkeypatch.setattr(type(shape), "layers", lambda self, smoke: 3)
    monkeypatch.setattr(e2e_shapes, "measure", measure)
    monkeypatch.setattr(e2e_shapes, "device_memory_gib", lambda: 80.0)
    monkeypatch.setattr(sys, "argv", ["e2e_shapes.py", "--smoke", "--shapes", "qwen2.5-vl-3b", "--layers", "1", "2",
                                      "3", "--variants", "coat", "bf16", "--results-dir", str(tmp_path)])
    e2e_shapes.main()
    rows = json.loads((tmp_path / "e2e-shapes-smoke-cpu.json").read_text())["rows"]
    assert [(r["variant"], r["layers"], r["peak GiB"]) for r in rows] == [
        ("coat", 1, 10.0), ("bf16", 1, 30.0), ("coat", 2, 20.0), ("bf16", 2, 60.0), ("coat", 3, 30.0),
        ("bf16", 3, "not run")]  # the last row too: the file is written after it
    assert rows[5]["predicted peak GiB"] == pytest.approx(90.0) and rows[5]["shape"] == "qwen2.5-vl-3b"


def test_e2e_shapes_plots_depths(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    rows = (depth_rows("bf16", [12, 18, 24, 36], [300, 391, 479, None], [40.1, 56.8, 66.2, None])
            + depth_rows("coat", [12, 18, 24, 36], [260, 310, 362, 455], [22.0, 28.1, 33.9, 46.0]))
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"device": "GPU", "torch": "2.13", "rows": rows, "summary": {
        "depth_fits": e2e_shapes.depth_fits(rows), "device memory GiB": 79.2}}))
    e2e_shapes.plot_depths(str(path), str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_shapes_passes_fused_loss_where_coat_convert_has_it(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    def convert_with_fused_loss(model, *, group_size=16, saved_format="e4m3", fused_loss=True):
        return model

    def convert_without(model, *, group_size=16, saved_format="e4m3"):
        return model

    monkeypatch.setattr(e2e_shapes.coat, "convert", convert_with_fused_loss)
    assert e2e_shapes.coat_options("coat") == {"fused_loss": True}
    assert e2e_shapes.coat_options("coat-unfused") == {"fused_loss": False}
    assert e2e_shapes.coat_options("coat-lowmem") == {"saved_format": "fp4", "group_size": 128, "fused_loss": True}
    assert e2e_shapes.coat_options("coat-lowmem", vision_language=True) == {
        "saved_format": "fp4", "group_size": 128, "vision_linears": True, "fused_loss": True}
    assert e2e_shapes.coat_options("coat-vision") == {"vision_linears": True, "fused_loss": True}
    assert [e2e_shapes.loss_kind(v) for v in ("coat-compiled", "coat-unfused", "bf16", "liger", "coat-vision")] == [
        "coat fused", "transformers", "transformers", "liger fused", "coat fused"]
    monkeypatch.setattr(e2e_shapes.coat, "convert", convert_without)
    assert e2e_shapes.coat_options("coat") == {} and e2e_shapes.loss_kind("coat") == "transformers"
    assert e2e_shapes.coat_options("coat-lowmem") == {"saved_format": "fp4", "group_size": 128}


def test_e2e_shapes_vision_language_samples_and_sizes(monkeypatch):
    """Each sample of the Qwen2.5-VL shapes: the image's 1,024 tokens between its start and end tokens, 3,072 text
    tokens with their labels, the image tokens' labels -100, an 896 x 896-pixel image in 64 x 64 patches; the models
    have the published sizes (counted on the meta device) and the 3B ties its embeddings."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    from _model_shapes import SHAPES
    from e2e import instantiate

    for name, billions in (("qwen2.5-vl-3b", 3.755), ("qwen2.5-vl-7b", 8.292)):
        shape = SHAPES[name]
        config = shape.make_config(smoke=False)
        inputs = shape.inputs(config, 2, 4096, False, torch.Generator().manual_seed(0))
        ids, labels = inputs["input_ids"], inputs["labels"]
        image = ids == config.image_token_id
        assert image.sum(1).tolist() == [shape.image_tokens(smoke=False)] * 2 == [1024] * 2
        assert torch.equal(image[:, 1:1025], torch.ones(2, 1024, dtype=torch.bool))
        assert (ids[:, 0] == config.vision_start_token_id).all() and (ids[:, 1025] == config.vision_end_token_id).all()
        assert torch.equal(labels == -100, image) and torch.equal(labels[~image], ids[~image])
        assert torch.equal(inputs["mm_token_type_ids"], image.int())
        assert inputs["image_grid_thw"].tolist() == [[1, 64, 64]] * 2
        assert inputs["pixel_values"].shape == (2 * 64 * 64, 3 * 2 * 14 * 14)
        model = instantiate(shape.model_class, config, torch.float32, "meta")
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=1e-3)
        tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
        assert tied == (name == "qwen2.5-vl-3b")


def test_e2e_shapes_layers_cuts_the_language_model_and_names_the_rows(monkeypatch, tmp_path):
    """--layers N builds the shape with N decoder layers (a vision-language model's tower untouched), names its rows
    and file SHAPE-N-layers so that they never stand for the whole shape, and refuses N outside 1 to the shape's."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    olmoe, vlm = e2e_shapes.SHAPES["olmoe-1b-7b"], e2e_shapes.SHAPES["qwen2.5-vl-3b"]
    assert (olmoe.layers(smoke=False), vlm.layers(smoke=False)) == (16, 36)
    assert olmoe.make_config(smoke=False, layers=8).num_hidden_layers == 8
    cut = vlm.make_config(smoke=False, layers=18)
    assert (cut.text_config.num_hidden_layers, cut.vision_config.depth) == (18, 32)
    assert vlm.make_config(smoke=False).text_config.num_hidden_layers == 36
    monkeypatch.setattr(sys, "argv", ["e2e_shapes.py", "--smoke", "--shapes", "olmoe-1b-7b", "--layers", "1",
                                      "--variants", "bf16", "--results-dir", str(tmp_path)])
    e2e_shapes.main()
    rows = json.loads((tmp_path / "e2e-shapes-smoke-cpu.json").read_text())["rows"]
    assert [(row["shape"], row["layers"], row["shape layers"]) for row in rows] == [("olmoe-1b-7b-1-layers", 1, 2)]
    for layers in ("3", "0"):  # the smoke shapes have 2 layers
        monkeypatch.setattr(sys, "argv", ["e2e_shapes.py", "--smoke", "--shapes", "olmoe-1b-7b", "--layers", layers])
        with pytest.raises(SystemExit):
            e2e_shapes.main()


def test_e2e_shapes_torchao_row_converts_the_linears_coat_converts(monkeypatch):
    """torchao's float8 linears replace the decoder layers' linears only: a vision-language model's vision tower
    and merger stay BF16 as in the coat row, and the LM head as in every row."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    kept = {}
    monkeypatch.setattr(e2e_shapes, "torchao_float8", lambda model, keep_bf16: kept.update(names=keep_bf16))
    monkeypatch.setattr(e2e_shapes, "compile_for_fixed_shapes", lambda model: model)
    for name in ("llama3.2-1b", "qwen2.5-vl-3b"):
        shape = e2e_shapes.SHAPES[name]
        model, _ = e2e_shapes.build("torchao-compiled", shape, shape.make_config(smoke=True), torch.device("cpu"))
        vision = [n for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n.startswith("model.visual.")]
        assert kept["names"] == vision
        assert ("model.visual.merger.mlp.0" in vision) == (name == "qwen2.5-vl-3b")


def test_e2e_shapes_first_layer_row_keeps_the_language_models_first_decoder_layer_bf16(monkeypatch):
    """coat-layer0-bf16 converts as the coat row does but for the language model's first decoder layer, which stays
    transformers' layer; a vision tower's first block is not taken for it."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    for name, first in (("llama3.2-1b", "model.layers.0"), ("qwen2.5-vl-3b", "model.language_model.layers.0")):
        shape = e2e_shapes.SHAPES[name]
        model, _ = e2e_shapes.build("coat-layer0-bf16", shape, shape.make_config(smoke=True), torch.device("cpu"))
        assert e2e_shapes.first_decoder_layer(model) == first
        layers = model.get_submodule(first.rsplit(".", 1)[0])
        assert type(layers[0]).__module__.startswith("transformers.")
        assert type(layers[1]).__module__.startswith("coat.") and isinstance(layers[1].mlp, coat.nn.SwiGLUMLP)


def test_e2e_shapes_records_out_of_memory_and_failures_as_rows(monkeypatch, tmp_path):
    """A row that runs out of memory is OOM, one that fails (a compile failure, say) records its error; the
    other rows are measured, everything is written, and the run exits with an error."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    build = e2e_shapes.build

    def failing_build(variant, shape, config, device):
        if variant == "coat":
            raise RuntimeError("simulated compile failure")
        return build(variant, shape, config, device)

    trial = e2e_shapes.trial

    def out_of_memory_trial(training, *args):
        return None if training.variant == "coat-lowmem" else trial(training, *args)

    monkeypatch.setattr(e2e_shapes, "build", failing_build)
    monkeypatch.setattr(e2e_shapes, "trial", out_of_memory_trial)
    monkeypatch.setattr(sys, "argv", ["e2e_shapes.py", "--smoke", "--shapes", "llama3.2-1b", "--variants", "bf16",
                                      "coat", "coat-lowmem", "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="1 row\\(s\\) failed"):
        e2e_shapes.main()
    result = json.loads((tmp_path / "e2e-shapes-smoke-cpu.json").read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert rows["coat"]["peak GiB"] == "error" and "simulated compile failure" in rows["coat"]["error"]
    assert rows["coat-lowmem"]["peak GiB"] == "OOM" and "error" not in rows["coat-lowmem"]
    assert math.isfinite(rows["bf16"]["losses"][0])
    assert result["summary"]["errors"] == {"llama3.2-1b coat": rows["coat"]["error"]}


def test_e2e_shapes_row_releases_the_parameters_its_accounting_step_keeps_referenced(monkeypatch):
    """torch's MemTracker leaves the model's parameters referenced from cycles gc cannot collect: without the
    release, a 7B row would leave its weights on the GPU for the next row (OLMoE's BF16 row after coat's)."""
    import gc
    import weakref

    monkeypatch.syspath_prepend(BENCHMARKS)
    import e2e_shapes

    training = e2e_shapes.ShapeTraining("bf16", e2e_shapes.SHAPES["olmoe-1b-7b"], torch.device("cpu"), smoke=True)
    training.build()
    e2e_shapes.trial(training, 1, 32, 1, 1)
    e2e_shapes.tracked_step(training, 1, 32)
    params = [weakref.ref(p) for p in training.model.parameters()]
    training.free()
    gc.collect()
    alive = [p() for p in params if p() is not None]
    assert alive, "MemTracker no longer keeps the parameters: the release in ShapeTraining.free can go"
    assert sum(p.untyped_storage().nbytes() for p in alive) == 0


@pytest.fixture
def mrope_probe(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import mrope_position_probe

    return mrope_position_probe


@pytest.mark.parametrize("swap_axes", [False, True])
def test_mrope_probe_positions_are_a_pictures(mrope_probe, swap_axes):
    """The probe's grid has the M-RoPE positions get_rope_index gives a picture of 4 x 4 merged tokens (8 x 8
    patches) after <vision_start>, the tokens after it too; --swap-axes exchanges the height and width streams."""
    model = mrope_probe.build_model(mrope_probe.parse_arguments(["--out", "unused"]))
    config = model.config
    grid = mrope_probe.CELLS
    input_ids = torch.tensor([[config.vision_start_token_id] + [config.image_token_id] * grid + [0, 0]])
    expected, _ = model.model.get_rope_index(input_ids, (input_ids == config.image_token_id).int(),
                                             torch.tensor([[1, 8, 8]]))
    expected = expected[:, 0]
    if swap_axes:
        expected[1:, 1:1 + grid] = expected[[2, 1], 1:1 + grid]
    assert torch.equal(mrope_probe.positions(swap_axes), expected)


def test_mrope_probe_content_noise_scales_the_grid_cells_embeddings_only(mrope_probe):
    """--content-noise draws its factors after the tokens (the token stream is the one without it) and multiplies
    the grid cells' input embeddings by them: factors of one give the model's own embedding of the tokens."""
    model = mrope_probe.build_model(mrope_probe.parse_arguments(["--out", "unused"]))
    ids, kind, answer, factors = mrope_probe.samples(torch.Generator().manual_seed(3), 8)
    noisy_ids, noisy_kind, noisy_answer, noisy_factors = mrope_probe.samples(torch.Generator().manual_seed(3), 8, 0.1)
    assert factors is None and noisy_factors.shape == (8, mrope_probe.CELLS, mrope_probe.HIDDEN)
    assert torch.equal(ids, noisy_ids) and torch.equal(kind, noisy_kind) and torch.equal(answer, noisy_answer)
    assert 0.09 < noisy_factors.std().item() < 0.11 and abs(noisy_factors.mean().item() - 1) < 0.01
    positions = mrope_probe.positions(False)
    with torch.no_grad():
        loss, logits = mrope_probe.answer_loss(model, ids, positions)
        ones_loss, ones_logits = mrope_probe.answer_loss(model, ids, positions, torch.ones_like(noisy_factors))
        noisy_loss, _ = mrope_probe.answer_loss(model, ids, positions, noisy_factors)
    assert torch.equal(loss, ones_loss) and torch.equal(logits, ones_logits) and not torch.equal(loss, noisy_loss)
    with pytest.raises(SystemExit):
        mrope_probe.parse_arguments(["--content-noise", "-0.1", "--out", "unused"])


def test_mrope_probe_runs_and_logs_each_kind_of_question(mrope_probe, tmp_path):
    """Both arms train and write the row and column accuracy of the held-out questions, which --plot draws; a
    coat-only option without --coat is refused."""
    logs = []
    for arm in ([], ["--coat", "--gradient-format", "none", "--swap-axes", "--content-noise", "0.1"]):
        out = tmp_path / f"probe-{len(logs)}.json"
        logs.append(str(out))
        result = mrope_probe.main([*arm, "--steps", "2", "--batch", "4", "--out", str(out)])
        assert json.loads(out.read_text()) == result
        (entry,) = result["rows"]
        assert entry["step"] == 2 and math.isfinite(entry["held_out_loss"])
        assert 0 <= entry["row_accuracy"] <= 1 and 0 <= entry["column_accuracy"] <= 1
        assert {"device", "torch", "transformers", "date", "command"} <= result.keys()
        assert result["summary"]["coat"] == bool(arm)
    mrope_probe.main(["--plot", str(tmp_path / "probe.png"), *logs])
    assert (tmp_path / "probe.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="add --coat"):
        mrope_probe.main(["--gradient-format", "none", "--out", str(tmp_path / "no.json")])
    with pytest.raises(SystemExit):  # neither a log to write nor logs to draw
        mrope_probe.main([])


@pytest.fixture
def gradient_probe(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import vlm_gradient_probe

    return vlm_gradient_probe


def float64_round(values: torch.Tensor, mantissa_bits: int, min_exponent: int, largest: float) -> torch.Tensor:
    """``values`` (float32) rounded to a float format with ``mantissa_bits`` and normals from 2**min_exponent
    (subnormals below, at their spacing), ties to even, after division by the float32 scale amax / ``largest``;
    the rounding in float64 arithmetic, the result scaled back."""
    scale = values.abs().amax() / largest  # float32, as the recipe keeps its scales
    scaled = (values / scale).double()
    exponent = torch.floor(torch.log2(scaled.abs().clamp(min=2.0**min_exponent)))
    step = 2.0 ** (exponent - mantissa_bits)
    return torch.round(scaled / step) * step * scale.double()  # torch.round: half to even


@pytest.mark.parametrize("dtype, mantissa_bits, min_exponent, largest",
                         [(torch.float8_e4m3fn, 3, -6, 448.0), (torch.float8_e5m2, 2, -14, 57344.0)])
def test_gradient_probe_rounds_as_the_formats_say(gradient_probe, dtype, mantissa_bits, min_exponent, largest):
    """fp8_round against the format written out in float64, bit for bit: normals and subnormals (values over eight
    decades), zeros and the largest value."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 2, 4096)
    values[:3] = torch.tensor([0.0, -0.0, 150.0])
    rounded = gradient_probe.fp8_round(values, dtype, largest)
    assert torch.equal(rounded.double(), float64_round(values, mantissa_bits, min_exponent, largest).float().double())
    assert (rounded == 0).sum() > 3  # some values fall below the smallest subnormal


def test_gradient_probe_emulation_multiplies_the_rounded_operands(gradient_probe):
    """EmulatedFP8Linear: the output is the product of input and weight rounded to E4M3, the input gradient the
    output gradient rounded to E5M2 times the rounded weight, the weight gradient its transpose times the rounded
    input (float64 products of the float64-rounded operands; float32 GEMM tolerance)."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 32, generator=generator) * torch.logspace(-3, 2, 32)).requires_grad_()
    weight = torch.randn(16, 32, generator=generator, requires_grad=True)
    grad = torch.randn(3, 5, 16, generator=generator) * 1e-3
    gradient_probe.EmulatedFP8Linear.apply(x, weight).backward(grad)
    y = gradient_probe.EmulatedFP8Linear.apply(x.detach(), weight.detach())
    x8 = float64_round(x.detach(), 3, -6, 448.0)
    w8 = float64_round(weight.detach(), 3, -6, 448.0)
    g8 = float64_round(grad, 2, -14, 57344.0)
    for got, expected in ((y, x8 @ w8.t()), (x.grad, g8 @ w8), (weight.grad, g8.reshape(-1, 16).t() @ x8.reshape(-1, 32))):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_gradient_probe_branch_shares_against_the_hidden_states_gradients(gradient_probe):
    """branch_shares against the same quantities from transformers' output_hidden_states (hidden_states[i] feeds
    layer i, hidden_states[i + 1] is its output but for the last, which is after the final norm) and
    torch.autograd.grad, at the tiny preset; the last layer's image share is None (nothing of the loss reads it)."""
    import argparse

    model = gradient_probe.build_model(argparse.Namespace(preset="tiny", seed=0, attention="sdpa", rope_theta=1e4),
                                       torch.device("cpu"))
    preset = gradient_probe.PRESETS["tiny"]
    data = gradient_probe.ShapesVQA(0, preset.image, preset.patch, preset.max_objects, held_out=1)
    batch = data.batch(data.samples(0, 4), "cpu")
    shares = gradient_probe.branch_shares(model, batch)
    outputs = model(**batch, output_hidden_states=True)
    hidden = outputs.hidden_states
    grads = torch.autograd.grad(outputs.loss, hidden[:-1])
    image = batch["input_ids"] == model.config.image_token_id
    assert len(shares) == preset.layers and image.any() and (~image).any()
    for i, row in enumerate(shares):
        for kind, mask in (("text", ~image), ("image", image)):
            assert row[f"{kind} input rms"] == pytest.approx(hidden[i][mask].pow(2).mean().sqrt().item(), rel=1e-5)
            if i + 1 < len(shares):
                added = grads[i][mask] - grads[i + 1][mask]
                assert row[f"{kind} branch share"] == pytest.approx(
                    (added.norm() / grads[i + 1][mask].norm()).item(), rel=1e-4)
    assert shares[-1]["image branch share"] is None and shares[-1]["text branch share"] > 0


def test_gradient_probe_measures_every_part_and_keeps_its_weights(gradient_probe, tmp_path):
    """At the tiny preset: every run has every parameter group, the emulation takes the decoder layers' 7 linears each
    (5 with o_proj and v_proj left out), FP8 is further from float32 than BF16, and a checkpoint gives the next run
    the same weights (the same errors) or, trained with other options, is refused; the coat run takes coat.convert's
    skip_modules and gradient_format."""
    common = ["--preset", "tiny", "--batch", "4", "--train-steps", "2", "--checkpoint", str(tmp_path / "w.pt")]
    result = gradient_probe.main([*common, "--out", str(tmp_path / "a.json")])
    assert json.loads((tmp_path / "a.json").read_text()) == result
    layers = gradient_probe.PRESETS["tiny"].layers
    assert result["summary"]["emulated_linears"] == 7 * layers and len(result["training_losses"]) == 2
    assert [row["layer"] for row in result["branch_shares"]] == list(range(layers))
    errors = {row["group"]: row for row in result["rows"]}
    groups = {"vision embedding", "merger", "token embedding", "final norm", "LM head",
              *(f"decoder layer {i}" for i in range(layers))}
    assert groups <= errors.keys() and len(errors) == len(result["rows"])
    for group in groups:
        assert errors[group]["bf16"] < errors[group]["coat"] and errors[group]["bf16"] < errors[group]["emulated"]
    again = gradient_probe.main([*common, "--emulate-skip", "o_proj", "v_proj", "--out", str(tmp_path / "b.json")])
    assert again["summary"]["emulated_linears"] == 5 * layers and again["training_losses"] == result["training_losses"]
    assert [row["coat"] for row in again["rows"]] == [row["coat"] for row in result["rows"]]
    kept = gradient_probe.main([*common, "--coat-skip", "model.language_model.layers.*",
                                "--out", str(tmp_path / "d.json")])
    unquantized = gradient_probe.main([*common, "--coat-gradient-format", "none", "--out", str(tmp_path / "e.json")])
    for default, bf16_layers, bf16_output_gradients in zip(result["rows"], kept["rows"], unquantized["rows"]):
        if default["group"].startswith("decoder layer"):  # every decoder layer in BF16: far nearer float32
            assert bf16_layers["coat"] < default["coat"] / 2, default["group"]
            assert bf16_output_gradients["coat"] != default["coat"], default["group"]
    with pytest.raises(SystemExit, match="another --checkpoint"):
        gradient_probe.main([*common[:-3], "3", "--checkpoint", str(tmp_path / "w.pt"), "--out", str(tmp_path / "c.json")])
