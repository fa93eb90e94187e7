"""
Plot one run's metrics, or overlay several runs (an ablation): reward, accuracy, response length and entropy
from each run's metrics.jsonl, one line per run, labelled by the config values that differ between the runs.

    python tools/plot.py out/tiny                                   # -> out/tiny/metrics.png
    python tools/plot.py out/abl/base out/abl/no_clip --x=samples   # -> out/abl/ablation_samples.png

--x picks the horizontal axis: the training step, the responses generated so far (what dynamic sampling
costs) or the wall-clock seconds of the steps.
"""
import argparse
import json
import os
import sys

from train_dapo import read_metrics


class PlotError(ValueError):
    """A run directory or option this tool cannot use; the message says what to pass instead."""


PLOT_PANELS = [("train/score_mean", "reward (score)"), ("train/acc", "accuracy (train)"),
               ("val/acc", "accuracy (validation)"), ("response_length/mean", "response length"),
               ("actor/entropy", "entropy")]
PLOT_X = {"step": "training step", "samples": "responses generated", "time": "wall-clock (s)"}


def plot(out_dirs: list[str], x: str = "step", png: str | None = None) -> str:
    """A PNG of reward, accuracy, response length and entropy from the metrics.jsonl of one run or several (an
    ablation: one line per run, labelled by the config values that differ between them). x: what the
    horizontal axis counts (PLOT_X).
    -> the PNG's path (default: metrics.png in the run, or ablation_<x>.png beside the runs)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError("plotting needs matplotlib: pip install matplotlib "
                        "(or pip install -e '.[plot]')") from e
    if x not in PLOT_X:
        raise PlotError(f"--x={x!r}; choose one of {', '.join(PLOT_X)}")
    runs = []
    for out_dir in out_dirs:
        path = os.path.join(out_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            raise PlotError(f"no metrics.jsonl in {out_dir!r}; pass the out_dir of a run")
        runs.append((out_dir, read_metrics(path)))
    labels = run_labels(out_dirs)
    height = 3.5 if len(runs) == 1 else 3.5 + 0.3 * len(runs)  # room for the legend below
    fig, axes = plt.subplots(1, len(PLOT_PANELS), figsize=(4 * len(PLOT_PANELS), height))
    for ax, (key, title) in zip(axes, PLOT_PANELS):
        for (out_dir, rows), label in zip(runs, labels):
            xs = plot_x(rows, x, out_dir)
            pts = [(xs[r["step"]], r[key]) for r in rows if key in r and r["step"] in xs]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("val") else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel(PLOT_X[x])
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))  # 175,000 samples as 1.75e5
    if len(runs) == 1:
        axes[0].legend(fontsize=7)
        fig.tight_layout()
    else:  # one legend for all panels, below them: the labels can be long
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", fontsize=8)
        fig.tight_layout(rect=(0, 0.06 * len(runs), 1, 1))
    if png is None and len(runs) == 1:
        png = os.path.join(out_dirs[0], "metrics.png")
    elif png is None:
        png = os.path.join(os.path.commonpath([os.path.abspath(d) for d in out_dirs]), f"ablation_{x}.png")
    fig.savefig(png, dpi=100)
    return png


def run_labels(out_dirs: list[str]) -> list[str]:
    """A legend label per run: the config values (out_dir/config.json) that differ between the runs, else the
    run directory's name."""
    configs = []
    for out_dir in out_dirs:
        path = os.path.join(out_dir, "config.json")
        configs.append(json.load(open(path)) if os.path.isfile(path) else {})
    ignored = {"out_dir", "experiment_name"}
    keys = sorted({k for c in configs for k in c} - ignored)
    differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
    labels = []
    for out_dir, c in zip(out_dirs, configs):
        if differ:
            labels.append(", ".join(f"{k}={c.get(k)}" for k in differ))
        else:
            labels.append(os.path.basename(os.path.normpath(out_dir)))
    return labels


def plot_x(rows: list[dict], x: str, out_dir: str) -> dict:
    """step -> the horizontal coordinate: the step, the responses generated up to it (gen batches x
    gen_batch_size x n, from out_dir/config.json), or the wall-clock seconds of all steps up to it."""
    if x == "step":
        return {r["step"]: r["step"] for r in rows}
    per_step = {}
    if x == "samples":
        cfg = json.load(open(os.path.join(out_dir, "config.json")))
        for r in rows:
            if "sampling/num_gen_batches" in r:
                per_step[r["step"]] = r["sampling/num_gen_batches"] * cfg["gen_batch_size"] * cfg["n"]
    else:
        for r in rows:
            if "timing_s/step" in r:
                per_step[r["step"]] = r["timing_s/step"]
    coordinate, total = {0: 0.0}, 0.0
    for step in sorted(per_step):
        total += per_step[step]
        coordinate[step] = total
    return coordinate


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Plot the metrics of one nanodapo run or overlay several.")
    parser.add_argument("out_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--x", default="step", choices=list(PLOT_X), help="what the horizontal axis counts")
    parser.add_argument("--png", default=None, help="where to write the PNG")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {plot(args.out_dirs, x=args.x, png=args.png)}")
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
