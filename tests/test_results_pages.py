"""benchmarks/results_pages.py: the results pages and the README table are what benchmarks/results/*.json give,
and each figure shown is the latest one by the date inside the files."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def pages(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import results_pages

    return results_pages


def _write(directory, name, date, rows, command="benchmarks/optimizer.py", **extra):
    meta = {"device": "GPU X", "torch": "2.13.0", "cuda": "13.0", "python": "3.11", "date": date,
            "command": command, "summary": extra.pop("summary", {}), "rows": rows, **extra}
    (directory / name).write_text(json.dumps(meta))


ROW = {"optimizer": "coat.optim.AdamW", "params": "float32", "rounding": "-", "grads": "float32"}


def test_the_committed_pages_and_readme_table_are_up_to_date():
    completed = subprocess.run([sys.executable, "benchmarks/results_pages.py", "--check"], cwd=ROOT,
                               capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_the_latest_figure_is_chosen_by_the_date_inside_the_file_not_its_name(pages, tmp_path):
    _write(tmp_path, "optimizer-z-old.json", "2026-01-01T00:00:00+00:00", [{**ROW, "GPU vs torch": 0.9}])
    _write(tmp_path, "optimizer-a-new.json", "2026-02-01T00:00:00+00:00", [{**ROW, "GPU vs torch": 0.5}])
    family = next(f for f in pages.FAMILIES if f.page == "optimizer")
    chosen = pages.latest_figures(pages.load_results(str(tmp_path)), family)
    result, row = chosen[("GPU X", pages.row_key(family, ROW), "GPU vs torch")]
    assert (result.path, row["GPU vs torch"]) == ("optimizer-a-new.json", 0.5)


def test_a_figure_missing_from_the_latest_file_comes_from_the_latest_file_that_has_it(pages, tmp_path):
    _write(tmp_path, "old.json", "2026-01-01T00:00:00+00:00", [{**ROW, "GPU vs torch": 0.9, "host ms": 2.0}])
    _write(tmp_path, "new.json", "2026-02-01T00:00:00+00:00", [{**ROW, "GPU vs torch": 0.5}])
    family = next(f for f in pages.FAMILIES if f.page == "optimizer")
    chosen = pages.latest_figures(pages.load_results(str(tmp_path)), family)
    assert chosen[("GPU X", pages.row_key(family, ROW), "host ms")][0].path == "old.json"
    text, _ = pages.family_page(pages.load_results(str(tmp_path)), family)
    assert "### `new.json`" in text and "### `old.json`" in text


def test_smoke_runs_and_the_baseline_arms_of_an_ab_are_left_out(pages, tmp_path):
    _write(tmp_path, "kept.json", "2026-01-01T00:00:00+00:00", [{**ROW, "GPU vs torch": 0.5}])
    _write(tmp_path, "smoke.json", "2026-03-01T00:00:00+00:00", [{**ROW, "GPU vs torch": 9.0}], summary={"smoke": True})
    _write(tmp_path, "old-tree.json", "2026-03-02T00:00:00+00:00", [{**ROW, "GPU vs torch": 8.0}],
           note="A/B baseline: the tree before the change")
    assert [r.path for r in pages.load_results(str(tmp_path))] == ["kept.json"]


def test_convergence_runs_are_compared_with_the_mean_of_the_bf16_runs_of_their_seed(pages, tmp_path):
    def run(name, coat, loss, seed):
        command = f"examples/train_llama.py --preset 100m --name {name}" + (" --coat" if coat else "") + (
            f" --seed {seed}" if seed else "")
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "device": "GPU X", "torch": "2.13.0", "date": "2026-01-01T00:00:00+00:00",
            "command": command, "coat": coat, "preset": "100m", "final_val_loss": loss}))

    run("100m-bf16", False, 1.0, 0)
    run("100m-bf16-rerun", False, 1.2, 0)
    run("100m-bf16-seed1", False, 2.0, 1)
    run("100m-coat", True, 1.1, 0)
    run("100m-coat-seed1", True, 1.9, 1)
    rows = {r.rows[0]["name"]: r.rows[0] for r in pages.load_results(str(tmp_path))}
    assert rows["100m-coat"]["vs BF16"] == "+0.00%" and rows["100m-coat-seed1"]["vs BF16"] == "-5.00%"
    assert "vs BF16" not in rows["100m-bf16"]


def test_a_diverged_run_is_shown_where_it_stopped_and_compared_with_nothing(pages, tmp_path):
    def run(name, coat, loss, **diverged):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "device": "GPU X", "torch": "2.13.0", "date": "2026-01-01T00:00:00+00:00",
            "command": f"examples/train_llama.py --preset 100m --name {name}" + " --coat" * coat, "coat": coat,
            "preset": "100m", "steps": diverged.get("diverged_at_step", 2000), "final_val_loss": loss, **diverged}))

    run("100m-bf16", False, 1.0)
    run("100m-bf16-rerun", False, 0.5, diverged_at_step=2000)  # stopped at its last step: the same setting
    run("100m-coat", True, 1.1)
    run("100m-coat-rerun", True, 0.9, diverged_at_step=2000)
    results = pages.load_results(str(tmp_path))
    rows = {r.rows[0]["name"]: r.rows[0] for r in results}
    assert rows["100m-coat"]["vs BF16"] == "+10.00%" and "vs BF16" not in rows["100m-coat-rerun"]
    family = next(f for f in pages.FAMILIES if f.page == "convergence")
    text, _ = pages.family_page(results, family)
    assert "| 100m | 0 | 100m-coat-rerun | 0.9 | 2000 |" in text and "| 100m | 0 | 100m-bf16-rerun | 0.5 | 2000 |" in text


def test_layer_results_of_other_families_stand_beside_llamas(pages, tmp_path):
    """A layer.py --family file (rows with "model") has the settings of Llama's rows: it neither replaces them on
    the page nor in the README's figures or the plot, which are Llama-2-7B's; its rows show with their model."""
    def rows(gpu_vs_bf16, **model):
        return [{**model, "hidden": 4096, "seq": 2048, "batch": 4, "layer": layer, "GPU vs BF16": gpu_vs_bf16,
                 "saved U": saved} for layer, saved in (("BF16 eager", 22.8), ("coat eager", 8.6))]

    _write(tmp_path, "layer.json", "2026-01-01T00:00:00+00:00", rows(1.5), command="benchmarks/layer.py")
    _write(tmp_path, "layer-phi3.json", "2026-02-01T00:00:00+00:00", rows(1.2, model="phi3"),
           command="benchmarks/layer.py --family phi3")
    results = pages.load_results(str(tmp_path))
    family = next(f for f in pages.FAMILIES if f.page == "layer")
    text, sources = pages.family_page(results, family)
    assert {r.path for r in sources} == {"layer.json", "layer-phi3.json"}
    assert "| model | hidden |" in text and "| phi3 | 4096 | 2048 | 4 | coat eager | 1.2 |" in text
    found = pages._latest(results, "layer", "GPU vs BF16", layer="coat eager", hidden=4096, **pages.LLAMA_LAYER)
    assert [(r.path, row["GPU vs BF16"]) for r, row in found] == [("layer.json", 1.5)]
    (spec,) = [spec for name, spec in pages._plot_specs(results).items() if name.startswith("layer-")]
    assert spec["bars"]["coat eager"] == {"4096x2048": [1.5, 8.6]}


def test_convergence_runs_of_another_family_are_compared_with_that_familys_bf16_runs(pages, tmp_path):
    def run(name, coat, loss, family=None):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "device": "GPU X", "torch": "2.13.0", "date": "2026-01-01T00:00:00+00:00",
            "command": f"examples/train_llama.py --preset 100m --name {name}", "coat": coat, "preset": "100m",
            "seed": 0, "final_val_loss": loss, **({} if family is None else {"family": family})}))

    run("100m-bf16", False, 1.0)
    run("100m-phi3-bf16", False, 2.0, "phi3")
    run("100m-phi3-coat", True, 2.2, "phi3")
    rows = {r.rows[0]["name"]: r.rows[0] for r in pages.load_results(str(tmp_path))}
    assert rows["100m-phi3-coat"]["vs BF16"] == "+10.00%"
    assert pages._configuration(rows["100m-phi3-coat"]) is None  # not one of the README's Llama runs


def test_a_readme_without_the_table_markers_is_refused(pages, tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    monkeypatch.setattr(pages, "README", str(readme))
    with pytest.raises(SystemExit, match="no results table markers"):
        pages._readme_with("table")


def test_vision_language_rows_compare_coat_with_the_baselines_of_its_own_run(pages, tmp_path):
    """The README's vision-language figures: the Qwen2.5-VL-3B's coat row against the BF16 (out of memory here; where
    it fits, its peak ratio too, and BF16 with coat's vision attention) and torchao rows of the same run, with
    coat-vision and coat-lowmem; Qwen3-VL-4B's coat and coat-vision; the 7B's lowest-memory settings. The models page
    shows the image tokens and the vision side's share."""
    def row(shape, variant, peak, speed=None, vision=None):
        return {"shape": shape, "variant": variant, "batch": 1, "seq": 4096, "image tokens": 1024, "peak GiB": peak,
                **({"tokens/s/GPU": speed} if speed else {}), **({"vision kept GiB": vision} if vision else {})}

    command = "benchmarks/e2e_shapes.py --shapes {}"
    _write(tmp_path, "vl-3b.json", "2026-01-01T00:00:00+00:00", [
        row("qwen2.5-vl-3b", "bf16", "OOM"), row("qwen2.5-vl-3b", "coat", 40.0, 12000.0, 9.0),
        row("qwen2.5-vl-3b", "coat-vision", 36.0, 13200.0, 4.5), row("qwen2.5-vl-3b", "coat-lowmem", 27.04, 11000.0),
        row("qwen2.5-vl-3b", "torchao-compiled", 70.0, 10000.0)], command=command.format("qwen2.5-vl-3b"))
    _write(tmp_path, "vl-7b.json", "2026-01-01T00:00:00+00:00", [
        row("qwen2.5-vl-7b", "coat-lowmem", 48.25, 8000.0), row("qwen2.5-vl-7b", "bf16", "OOM")],
        command=command.format("qwen2.5-vl-7b"))
    results = pages.load_results(str(tmp_path))
    (three, three_figure, three_found), (seven, seven_figure, _) = pages._vision_language_figures(results)
    assert three.startswith("Qwen2.5-VL-3B shape") and "batch 1 x 4096 (1,024 of them image tokens)" in three
    assert three_figure == ("40.0 GiB (BF16 OOM, torchao 70.0 GiB); tokens/s 1.20x torchao; vision side FP8: 36.0 GiB, "
                            "1.10x coat's tokens/s; lowest-memory settings: 27.0 GiB")
    assert [r.path for r, _ in three_found] == ["vl-3b.json"]
    assert seven.startswith("Qwen2.5-VL-7B shape") and seven_figure == "48.2 GiB, 8,000 tokens/s (BF16: OOM)"
    # A later run of coat and coat-vision alone gives the vision figure (against its own coat row); the baselines stay
    # those of the run that has them. Qwen3-VL-4B's coat and coat-vision get a row of their own.
    _write(tmp_path, "vl-3b-vision.json", "2026-02-01T00:00:00+00:00", [
        row("qwen2.5-vl-3b", "coat", 41.0, 10000.0, 9.0), row("qwen2.5-vl-3b", "coat-vision", 37.0, 8000.0, 5.0)],
        command=command.format("qwen2.5-vl-3b"))
    _write(tmp_path, "vl3-4b.json", "2026-02-01T00:00:00+00:00", [
        row("qwen3-vl-4b", "coat", 46.0, 13000.0, 5.0), row("qwen3-vl-4b", "coat-vision", 44.0, 11700.0, 2.5)],
        command=command.format("qwen3-vl-4b"))
    results = pages.load_results(str(tmp_path))
    (three, three_figure, three_found), (four, four_figure, _), _ = pages._vision_language_figures(results)
    assert three_figure == ("40.0 GiB (BF16 OOM, torchao 70.0 GiB); tokens/s 1.20x torchao; vision side FP8: 37.0 GiB, "
                            "0.80x coat's tokens/s; lowest-memory settings: 27.0 GiB")
    assert [r.path for r, _ in three_found] == ["vl-3b.json", "vl-3b-vision.json"]
    assert four.startswith("Qwen3-VL-4B shape") and four_figure == (
        "46.0 GiB, 13,000 tokens/s; vision side FP8: 44.0 GiB, 0.90x coat's tokens/s, the tower keeping 2.5 GiB "
        "instead of 5.0")
    text, _ = pages.family_page(results, next(f for f in pages.FAMILIES if f.page == "models"))
    assert "| shape | variant | batch | seq | image tokens | peak GiB | tokens/s/GPU | vision kept GiB |" in text
    # A later run where BF16 fits (a larger card): its peak ratio, and BF16 with coat's vision attention too.
    _write(tmp_path, "vl-3b-bigger.json", "2026-03-01T00:00:00+00:00", [
        row("qwen2.5-vl-3b", "bf16", 85.0, 6000.0), row("qwen2.5-vl-3b", "bf16-batched", 84.0, 9000.0),
        row("qwen2.5-vl-3b", "coat", 42.0, 12000.0, 9.0), row("qwen2.5-vl-3b", "coat-vision", 37.0, 11400.0, 5.0),
        row("qwen2.5-vl-3b", "torchao-compiled", 64.0, 7500.0)], command=command.format("qwen2.5-vl-3b"))
    three, three_figure, three_found = pages._vision_language_figures(pages.load_results(str(tmp_path)))[0]
    assert three_figure == ("42.0 GiB (BF16 85.0 GiB, torchao 64.0 GiB), 0.494x BF16's peak; tokens/s 2.00x BF16, "
                            "1.60x torchao, 1.33x BF16 with coat's vision attention; vision side FP8: 37.0 GiB, 0.95x "
                            "coat's tokens/s")
    assert [r.path for r, _ in three_found] == ["vl-3b-bigger.json"]
    # A later run with the baselines but without coat-vision: the vision figure from the latest run that has it.
    _write(tmp_path, "vl-3b-baselines.json", "2026-04-01T00:00:00+00:00", [
        row("qwen2.5-vl-3b", "bf16", 85.0, 6000.0), row("qwen2.5-vl-3b", "coat", 42.0, 9000.0, 9.0),
        row("qwen2.5-vl-3b", "coat-lowmem", 23.8, 6000.0), row("qwen2.5-vl-3b", "torchao-compiled", 64.0, 4500.0)],
        command=command.format("qwen2.5-vl-3b"))
    three, three_figure, three_found = pages._vision_language_figures(pages.load_results(str(tmp_path)))[0]
    assert three_figure == ("42.0 GiB (BF16 85.0 GiB, torchao 64.0 GiB), 0.494x BF16's peak; tokens/s 1.50x BF16, "
                            "2.00x torchao; vision side FP8: 37.0 GiB, 0.95x coat's tokens/s; lowest-memory settings: "
                            "23.8 GiB")
    assert "against BF16 and torchao float8" in three and "BF16 with coat's vision attention" not in three
    assert [r.path for r, _ in three_found] == ["vl-3b-baselines.json", "vl-3b-bigger.json"]
    assert pages._vision_language_figures(pages.load_results(str(tmp_path / "none"))) == []


def test_vlm_runs_are_compared_with_the_bf16_runs_of_their_own_script_preset_steps_and_seed(pages, tmp_path,
                                                                                            monkeypatch):
    """train_vlm's summaries: held-out loss and answer accuracy against the BF16 runs of the same preset, rotary
    base, steps, seed, learning rate and vision attention kernels, never against a train_llama run or one of another
    length."""
    def run(name, coat, loss, accuracy, steps=1000, seed=0, date="2026-01-02", position=False, **recorded):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "device": "GPU X", "torch": "2.13.0", "date": f"{date}T00:00:00+00:00",
            "command": f"examples/train_vlm.py --preset gpu --name {name} --seed {seed}", "coat": coat,
            "vision_linears": False, "bf16_weights": False, "fp8_grads": None, "fast_accum": False, "preset": "gpu",
            "batch": 64, "steps": steps, "parameters": 36_149_632, "final_val_loss": loss,
            "final_answer_accuracy": accuracy, "text_only_accuracy": {"all": 0.14}, "csv": f"{name}.csv",
            **recorded}))
        (tmp_path / f"{name}.csv").write_text(
            "step,val_loss,answer_accuracy,answer_accuracy_position\n500,0.5,0.1,0.05\n1000,0.4,0.2,0.3\n" if position
            else "step,val_loss,answer_accuracy\n500,0.5,0.1\n1000,0.4,0.2\n")

    run("bf16", False, 0.30, 0.20)
    run("bf16-short", False, 9.0, 0.0, steps=100, date="2026-01-01")
    run("coat", True, 0.27, 0.25)
    (tmp_path / "llama-bf16.json").write_text(json.dumps({
        "name": "llama-bf16", "device": "GPU X", "torch": "2.13.0", "date": "2026-01-01T00:00:00+00:00",
        "command": "examples/train_llama.py --preset gpu", "coat": False, "preset": "gpu", "batch": 64, "steps": 1000,
        "final_val_loss": 5.0}))
    results = pages.load_results(str(tmp_path))
    rows = {r.rows[0]["name"]: r.rows[0] for r in results}
    assert rows["coat"]["vs BF16"] == "-10.00%" and rows["coat"]["accuracy vs BF16"] == "+5.0 points"
    ((what, figure, found),) = pages._vlm_convergence_figures(results)
    # a summary without the rotary base is from before the example recorded it, when every preset took 1e4
    assert what.startswith("36M Qwen2.5-VL (`train_vlm.py --preset gpu`), rotary base 10000, batch 64, 1000 steps")
    # one seed: its own figure, no mean
    assert figure == "seed 0: -10.00%, +5.0 points (coat 25.0%, BF16 20.0%, the question alone 14.0%)"
    assert [r.path for r, _ in found] == ["coat.json"]
    monkeypatch.setattr(pages, "RESULTS", str(tmp_path))  # where the plot reads the runs' CSVs
    # The plot draws the setting measured last (not the older 100-step run), a colour per arm; no position panel
    # where the CSVs have no such column.
    spec = pages._plot_specs(results)["vlm-convergence-gpu.png"]
    assert spec["accuracy"]["coat"] == [(500, 10.0), (1000, 20.0)] and set(spec["curves"]) == {"bf16", "coat"}
    assert spec["styles"] == {"bf16": ["BF16", 0], "coat": ["coat", 0]} and "position" not in spec
    assert spec["title"] == ("examples/train_vlm.py --preset gpu: 1000 steps at learning rate 0.001, rotary base "
                             "10000, vision attention on cuDNN's kernel")
    # Runs of another length: each item says its steps; the learning rate is the recorded one, else the preset's then.
    run("bf16-long", False, 0.20, 0.40, steps=3000, lr=5e-4)
    run("coat-long", True, 0.22, 0.41, steps=3000, lr=5e-4)
    ((what, figure, _),) = pages._vlm_convergence_figures(pages.load_results(str(tmp_path)))
    assert what.startswith("36M Qwen2.5-VL (`train_vlm.py --preset gpu`), rotary base 10000, batch 64, 1000 steps at "
                           "learning rate 0.001 and 3000 steps at learning rate 0.0005; questions about pictures")
    assert figure.startswith("1000 steps, seed 0: -10.00%, +5.0 points")
    assert "; 3000 steps, seed 0: +10.00%, +1.0 points" in figure
    # The measure over seeds: the coat runs' mean loss against their BF16 runs' mean, accuracy in points.
    run("bf16-long-s2", False, 0.30, 0.30, steps=3000, lr=5e-4, seed=2)
    run("coat-long-s2", True, 0.24, 0.36, steps=3000, lr=5e-4, seed=2, position=True, date="2026-01-03")
    results = pages.load_results(str(tmp_path))
    ((_, figure, _),) = pages._vlm_convergence_figures(results)
    # (0.22 + 0.24) / (0.20 + 0.30) - 1; the 1000-step length has one seed, so no mean
    assert figure.startswith("3000 steps, mean of 2 seeds: -8.00%, +3.5 points; 1000 steps, seed 0: ")
    spec = pages._plot_specs(results)["vlm-convergence-gpu.png"]
    assert set(spec["curves"]) == {"bf16-long", "coat-long", "bf16-long-s2", "coat-long-s2"}
    assert spec["position"] == {"coat-long-s2": [(500, 5.0), (1000, 30.0)]}
    assert spec["styles"]["coat-long-s2"] == ["coat", 2]
    del spec["position"]  # drawn without the panel too
    pages.draw(spec, str(tmp_path / "plot.png"))
    # Unquantized output gradients (--gradient-format none): a row of their own, not among the FP8 defaults.
    run("coat-long-g", True, 0.21, 0.40, steps=3000, lr=5e-4, gradient_format="none")
    results = pages.load_results(str(tmp_path))
    defaults, unquantized = pages._vlm_convergence_figures(results)
    assert "coat-long-g.json" not in [r.path for r, _ in defaults[2]]
    assert "output gradients unquantized" in unquantized[0] and [r.path for r, _ in unquantized[2]] == ["coat-long-g.json"]
    assert unquantized[1].startswith("seed 0: +5.00%, +0.0 points")
    assert pages._plot_specs(results)["vlm-convergence-gpu.png"]["styles"]["coat-long-g"] == [
        "coat, output gradients unquantized", 0]
    # torch's AdamW in place of coat's (--torch-adamw): a row and a colour of its own too.
    run("coat-long-torch-adamw", True, 0.20, 0.40, steps=3000, lr=5e-4, torch_adamw=True)
    results = pages.load_results(str(tmp_path))
    defaults, unquantized, torch_adamw = pages._vlm_convergence_figures(results)
    assert "coat-long-torch-adamw.json" not in [r.path for r, _ in defaults[2] + unquantized[2]]
    assert "torch's AdamW" in torch_adamw[0] and torch_adamw[1].startswith("seed 0: +0.00%, +0.0 points")
    assert pages._plot_specs(results)["vlm-convergence-gpu.png"]["styles"]["coat-long-torch-adamw"] == [
        "coat, torch's AdamW", 0]
    # A setting the colours do not tell apart is drawn under its name, and kept out of the README's rows.
    run("coat-long-fp4", True, 0.21, 0.40, steps=3000, lr=5e-4, saved_format="fp4")
    run("coat-long-bf16-layers", True, 0.21, 0.40, steps=3000, lr=5e-4, bf16_modules=["model.layers.*"])
    results = pages.load_results(str(tmp_path))
    spec = pages._plot_specs(results)["vlm-convergence-gpu.png"]
    assert spec["styles"]["coat-long-fp4"] is None and spec["styles"]["coat-long-bf16-layers"] is None
    shown = [r.path for _, _, found in pages._vlm_convergence_figures(results) for r, _ in found]
    assert "coat-long-bf16-layers.json" not in shown and "coat-long-fp4.json" not in shown
    pages.draw(spec, str(tmp_path / "plot.png"))
    # The first decoder layer kept in BF16 (--bf16-modules model.language_model.layers.0): a row and a colour.
    run("coat-long-layer0", True, 0.19, 0.40, steps=3000, lr=5e-4, bf16_modules=["model.language_model.layers.0"])
    results = pages.load_results(str(tmp_path))
    first_layer = pages._vlm_convergence_figures(results)[-1]
    assert "the first decoder layer in BF16" in first_layer[0] and first_layer[1].startswith("seed 0: -5.00%")
    assert [r.path for r, _ in first_layer[2]] == ["coat-long-layer0.json"]
    assert pages._plot_specs(results)["vlm-convergence-gpu.png"]["styles"]["coat-long-layer0"] == [
        "coat, first decoder layer in BF16", 0]
    # Nor with a run of another learning rate, or whose vision attention could take other kernels (cuDNN's where the
    # other's could not, coat.nn.attention: runs from before the example kept it off, unless --sdpa-backends left it
    # out; or the math kernel alone, a BF16 run's perturbation, which is no baseline of the default kernels').
    run("coat-long-lr", True, 0.5, 0.1, steps=3000, lr=1e-4)
    run("bf16-long-kernels", False, 0.24, 0.39, steps=3000, lr=5e-4, seed=1, vision_attention_without_cudnn=True)
    run("bf16-long-math", False, 0.48, 0.2, steps=3000, lr=5e-4, seed=1, sdpa_backends=["math"],
        vision_attention_without_cudnn=True)
    run("coat-long-kernels", True, 0.18, 0.5, steps=3000, lr=5e-4, seed=1)
    run("coat-long-flash", True, 0.12, 0.5, steps=3000, lr=5e-4, seed=1, sdpa_backends=["flash", "efficient", "math"])
    rows = {r.rows[0]["name"]: r.rows[0] for r in pages.load_results(str(tmp_path))}
    assert "vs BF16" not in rows["coat-long-lr"] and "vs BF16" not in rows["coat-long-kernels"]
    assert rows["coat-long"]["vs BF16"] == "+10.00%" and rows["coat-long-flash"]["vs BF16"] == "-50.00%"
    # A seed run again with the same settings repeats its trajectory: it counts once, as its latest run.
    before = pages._vlm_convergence_figures(pages.load_results(str(tmp_path)))[0]
    run("coat-long-s2-again", True, 0.24, 0.36, steps=3000, lr=5e-4, seed=2, date="2026-01-04")
    after = pages._vlm_convergence_figures(pages.load_results(str(tmp_path)))[0]
    assert after[1] == before[1] and "3000 steps, mean of 3 seeds" in after[1]
    paths = [r.path for r, _ in after[2]]
    assert "coat-long-s2-again.json" in paths and "coat-long-s2.json" not in paths
    # Another rotary base (the gpu preset's since 2026-12-07): compared with its own BF16 runs only, a README row of
    # its own, the newest first, and the plot draws it as the setting measured last.
    run("bf16-theta", False, 0.25, 0.45, steps=3000, lr=5e-4, seed=2, rope_theta=100.0, date="2026-01-05")
    run("coat-theta", True, 0.20, 0.46, steps=3000, lr=5e-4, seed=2, rope_theta=100.0, date="2026-01-05")
    run("coat-theta-s3", True, 0.20, 0.46, steps=3000, lr=5e-4, seed=3, rope_theta=100.0, date="2026-01-05")
    results = pages.load_results(str(tmp_path))
    rows = {r.rows[0]["name"]: r.rows[0] for r in results}
    assert rows["coat-theta"]["vs BF16"] == "-20.00%" and "vs BF16" not in rows["coat-theta-s3"]
    assert rows["coat-long-s2-again"]["vs BF16"] == "-20.00%"  # 0.24 against 0.30, not against bf16-theta's 0.25
    newer, older = pages._vlm_convergence_figures(results)[:2]
    assert "rotary base 100, batch 64, 3000 steps" in newer[0] and newer[1] == (
        "seed 2: -20.00%, +1.0 points (coat 46.0%, BF16 45.0%, the question alone 14.0%)")
    assert [r.path for r, _ in newer[2]] == ["coat-theta.json"] and older[1] == after[1]
    spec = pages._plot_specs(results)["vlm-convergence-gpu.png"]
    assert set(spec["curves"]) == {"bf16-theta", "coat-theta", "coat-theta-s3"} and "rotary base 100," in spec["title"]



def test_moe_model_rows_take_bf16s_outcome_from_an_earlier_file_or_say_what_it_would_need(pages, tmp_path):
    """A later lowest-memory run without a BF16 row still shows BF16's outcome on that device (an earlier file's);
    a shape with no BF16 row anywhere says what mixed precision's state alone would take (16 bytes a parameter);
    where BF16 fits, coat's tokens/s are compared with its run at the same batch and sequence."""
    def row(shape, variant, peak, **more):
        return {"shape": shape, "variant": variant, "batch": 1, "seq": 4096, "peak GiB": peak, **more}

    lowmem = {"tokens/s/GPU": 17000.0, "state B/param": 5.09}
    _write(tmp_path, "olmoe.json", "2026-01-01T00:00:00+00:00", [
        row("olmoe-1b-7b", "coat-lowmem", 40.0, **lowmem), row("olmoe-1b-7b", "bf16", "OOM")],
        command="benchmarks/e2e_shapes.py")
    _write(tmp_path, "olmoe-lowmem.json", "2026-02-01T00:00:00+00:00", [row("olmoe-1b-7b", "coat-lowmem", 34.2, **lowmem)],
           command="benchmarks/e2e_shapes.py")
    _write(tmp_path, "qwen2-moe.json", "2026-02-01T00:00:00+00:00", [
        row("qwen2-moe-a2.7b", "coat-lowmem", 69.4, params=2**30, **lowmem)], command="benchmarks/e2e_shapes.py")
    results = pages.load_results(str(tmp_path))
    (olmoe, olmoe_figure, olmoe_found), (qwen, qwen_figure, _) = pages._moe_model_figures(results)
    assert olmoe.startswith("OLMoE-1B-7B shape") and olmoe_figure == "34.2 GiB, 17,000 tokens/s, 5.09 B/param (BF16: OOM)"
    assert [r.path for r, _ in olmoe_found] == ["olmoe-lowmem.json", "olmoe.json"]
    assert qwen.startswith("Qwen2-MoE-A2.7B shape")
    assert qwen_figure == "69.4 GiB, 17,000 tokens/s, 5.09 B/param (BF16 not run: its model state alone is 16 GiB)"
    # Where BF16 fits (a larger card), coat with float32 master weights is compared with it on the same run's shape.
    _write(tmp_path, "olmoe-h200.json", "2026-03-01T00:00:00+00:00", [
        row("olmoe-1b-7b", "coat-lowmem", 34.0, **lowmem), row("olmoe-1b-7b", "coat", 66.0, **{"tokens/s/GPU": 18000.0}),
        row("olmoe-1b-7b", "bf16", 110.0, **{"tokens/s/GPU": 12000.0}),
        {**row("olmoe-1b-7b", "bf16", 60.0, **{"tokens/s/GPU": 1.0}), "seq": 1024}], command="benchmarks/e2e_shapes.py")
    (_, figure, _), _ = pages._moe_model_figures(pages.load_results(str(tmp_path)))
    assert figure == ("34.0 GiB, 17,000 tokens/s, 5.09 B/param (BF16: 110.0 GiB); 66.0 GiB, 18,000 tokens/s, "
                      "1.50x BF16's")


def test_a_shape_cut_to_fewer_layers_compares_coat_with_bf16_only_where_bf16_did_not_fit_the_whole(pages, tmp_path):
    """Rows of e2e_shapes.py --layers (shape SHAPE-N-layers) never stand for the whole shape; where BF16 ran out of
    memory at the full depth, the README row adds coat against BF16 at the cut depth, naming it and the device."""
    def row(shape, variant, peak, speed, layers=None):
        cut = {"layers": layers, "shape layers": 16} if layers else {}
        return {"shape": shape, "variant": variant, "batch": 1, "seq": 4096, "peak GiB": peak,
                "tokens/s/GPU": speed, "state B/param": 10.09, **cut}

    _write(tmp_path, "olmoe.json", "2026-01-01T00:00:00+00:00", [
        row("olmoe-1b-7b", "coat-lowmem", 34.2, 17000.0), {"shape": "olmoe-1b-7b", "variant": "bf16", "batch": 1,
                                                           "seq": 4096, "peak GiB": "OOM"}],
        command="benchmarks/e2e_shapes.py")
    _write(tmp_path, "olmoe-8.json", "2026-02-01T00:00:00+00:00", [
        row("olmoe-1b-7b-8-layers", "coat", 40.0, 21000.0, 8), row("olmoe-1b-7b-8-layers", "bf16", 64.0, 15000.0, 8)],
        command="benchmarks/e2e_shapes.py --layers 8")
    (what, figure, found), = pages._moe_model_figures(pages.load_results(str(tmp_path)))
    assert figure == ("34.2 GiB, 17,000 tokens/s, 10.09 B/param (BF16: OOM); cut to 8 of its 16 decoder layers, "
                      "where BF16 fits the GPU X: coat 1.40x BF16's tokens/s, 0.62x its peak (40.0 GiB against 64.0 "
                      "GiB)")
    assert what.endswith("at fewer layers") and [r.path for r, _ in found] == ["olmoe.json", "olmoe.json", "olmoe-8.json",
                                                                               "olmoe-8.json"]
    # Where BF16 fits the whole shape, that comparison stands alone.
    _write(tmp_path, "olmoe-h200.json", "2026-03-01T00:00:00+00:00", [
        row("olmoe-1b-7b", "coat-lowmem", 34.0, 17000.0), row("olmoe-1b-7b", "coat", 66.0, 18000.0),
        row("olmoe-1b-7b", "bf16", 110.0, 12000.0)], command="benchmarks/e2e_shapes.py")
    (_, figure, _), = pages._moe_model_figures(pages.load_results(str(tmp_path)))
    assert figure.endswith("66.0 GiB, 18,000 tokens/s, 1.50x BF16's")


def test_the_routers_balance_is_the_mean_normalized_entropy_of_the_expert_shares(pages, tmp_path):
    def run(name, coat, shares, seed=0):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "device": "GPU X", "torch": "2.13.0", "date": "2026-01-01T00:00:00+00:00",
            "command": f"examples/train_llama.py --preset 100m --family qwen3_moe --seed {seed}", "coat": coat,
            "family": "qwen3_moe", "preset": "100m", "batch": 8, "steps": 2000, "final_val_loss": 1.0,
            "expert_token_shares": shares}))

    run("bf16", False, [[0.25] * 4, [1.0, 0.0, 0.0, 0.0]])  # layers: even (1), collapsed (0)
    run("coat", True, [[0.25] * 4, [0.25] * 4])
    run("bf16-other-seed", False, [[1.0, 0.0, 0.0, 0.0]] * 2, seed=1)
    results = pages.load_results(str(tmp_path))
    coat = [(r, r.rows[0]) for r in results if r.rows[0]["name"] == "coat"]
    assert pages._routing_balance(results, coat) == "coat 1.00; BF16 0.50"
