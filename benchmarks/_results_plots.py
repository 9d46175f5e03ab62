"""The results pages' plots (benchmarks/results_pages.py builds their specs from the result files): drawn with
matplotlib, each PNG carrying a digest of its data and of this drawing code, so that a page is redrawn only when
either changed."""
from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import math
import statistics

DIGEST_KEY = "coat-data-sha256"
# train_vlm's arms (results_pages._arm names them); runs of no arm take the other colours, one each
ARM_COLOURS = {"BF16": "black", "coat": "tab:orange", "coat, vision side in FP8": "tab:green",
               "coat, output gradients unquantized": "tab:blue",
               "coat, vision side in FP8, output gradients unquantized": "tab:purple", "coat, torch's AdamW": "tab:red",
               "coat, first decoder layer in BF16": "tab:cyan"}
OTHER_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:gray")


def digest(spec: dict) -> str:
    """Of the data a plot draws and of the code that draws it: either changing makes the PNG stale."""
    code = inspect.getsource(draw) + repr((ARM_COLOURS, OTHER_COLOURS))  # with the styles it reads
    return hashlib.sha256((json.dumps(spec, sort_keys=True) + code).encode()).hexdigest()


def draw(spec: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if spec["kind"] == "convergence":  # held-out loss, and answer accuracy where the runs measure it
        panels = [("curves", spec["ylabel"], "log"), ("accuracy", "held-out answer accuracy (%)", "linear"),
                  ("position", '"where is the X?" answered (%)', "linear")]
        panels = [panel for panel in panels if panel[0] in spec]
        styles = spec.get("styles", {})
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        # Runs whose settings have no arm: colours no arm takes, the same run the same colour in every panel
        unnamed = [name for name in spec["curves"] if not styles.get(name)]
        colours = dict(zip(unnamed, itertools.cycle(OTHER_COLOURS)))
        for ax, (key, ylabel, yscale) in zip(axes[0], panels):
            by_arm: dict[str, list] = {}
            for name, points in spec[key].items():
                if styles.get(name):  # an arm's seeds: faint, under the arm's mean
                    arm, seed = styles[name]
                    by_arm.setdefault(arm, []).append((seed, dict(points)))
                    ax.plot([s for s, _ in points], [v for _, v in points], color=ARM_COLOURS[arm], alpha=0.3,
                            linewidth=0.8)
                else:
                    ax.plot([s for s, _ in points], [v for _, v in points], marker="." if key != "curves" else None,
                            color=colours.get(name), label=name)
            for arm, runs in sorted(by_arm.items()):  # the mean over seeds at the steps every seed evaluated
                steps = sorted(set.intersection(*(set(values) for _, values in runs)))
                # the label of the first panel's legend; a later panel may have fewer of the seeds logged
                label = f"{arm}, mean over its seeds" if len(runs) > 1 else f"{arm}, seed {runs[0][0]}"
                ax.plot(steps, [statistics.mean(values[s] for _, values in runs) for s in steps],
                        color=ARM_COLOURS[arm], linewidth=2.2, label=label)
            ax.set(xlabel="step", ylabel=ylabel, yscale=yscale)
            if not styles:
                ax.legend(fontsize=7)
        fig.suptitle(spec["title"] + ("; faint: each seed, bold: the mean over an arm's seeds" if styles else ""))
        if styles:  # one legend for the panels, below them
            handles, labels = axes[0][0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
            fig.tight_layout(rect=(0, 0.05 + 0.035 * math.ceil(len(labels) / 3), 1, 1))
        else:
            fig.tight_layout()
    else:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        variants = list(spec["bars"])
        groups = sorted({g for v in variants for g in spec["bars"][v]}, key=lambda g: (not g[0].isdigit(), g))
        width = 0.8 / len(variants)
        labels = (("GPU-time speed-up over BF16 eager", "saved activations (U)") if spec["kind"] == "layer"
                  else ("peak memory (GiB)", "tokens/s per GPU"))
        for i, variant in enumerate(variants):
            for j, ax in enumerate(axes):
                xs = [g_i + i * width for g_i, g in enumerate(groups) if g in spec["bars"][variant]]
                present = [g for g in groups if g in spec["bars"][variant]]
                drawn = ax.bar(xs, [spec["bars"][variant][g][j] for g in present], width,
                               label=variant if j == 0 else None)
                if spec["kind"] == "e2e":  # the batch each bar ran at
                    ax.bar_label(drawn, [str(spec["bars"][variant][g][2]) for g in present], fontsize=7)
        for ax, label in zip(axes, labels):
            ax.set_xticks([g_i + 0.4 - width / 2 for g_i in range(len(groups))], groups)
            ax.set_ylabel(label)
        fig.legend(loc="lower center", ncol=len(variants), fontsize=8)
        fig.suptitle(spec["device"] + (": bars labelled with their batch" if spec["kind"] == "e2e" else ""))
        fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, metadata={"Software": None, DIGEST_KEY: digest(spec)})
    plt.close(fig)


def png_digest(path: str) -> str | None:
    from PIL import Image
    try:
        with Image.open(path) as image:
            return image.info.get(DIGEST_KEY)
    except FileNotFoundError:
        return None
