"""
The lab: runs the arms of an ablation side by side on one machine, every arm x seed its own trainer process (e.g.
several small-model runs sharing one GPU), then overlays their held-out accuracy and tabulates them.

    python bench/ablation.py configs/smollm2_135m_sums.py --arms loss_agg_mode=token-mean,seq-mean-token-mean \\
        --seeds 2 --root out/lab --deadline 540
    python bench/ablation.py ... (the same command again: resumes every run where it stopped)
    python bench/ablation.py configs/smollm2_135m_dapo.py --one_at_a_time --arms clip_ratio_high=0.2 \\
        --arms filter_groups=False --arms overlong_buffer=False --seeds 2     # README "Ablations": base + 3 arms

Arms. `--arms KEY=V1,V2,...` gives an arm per value; KEY is any Config field (train_dapo.Config), a value is
written as on the trainer's command line (`--KEY=V`; commas inside brackets or quotes do not split). Several
--arms flags make a grid, every combination of their values; with --one_at_a_time they make a list instead: a
"base" arm (the config as it is) and one arm per value, each changing that one knob from the base. An arm is named
by its overrides, KEY-VALUE joined by "__" (e.g. clip_ratio_high-0.2__loss_agg_mode-seq-mean-token-mean;
characters other than letters, digits and ._+- become _). Every key and value is checked (names, types, ranges)
before anything starts; --extra holds overrides for every arm. `--arm 'K1=V1 K2=V2'` adds one arm that changes
several knobs at once (a loss mode with the aggregation it needs: --arm 'loss_mode=gspo
loss_agg_mode=seq-mean-token-mean'), beside the --arms arms or alone.

Seeds. `--seeds N` runs each arm with seeds S..S+N-1, S the config's seed; every run writes out_dir =
ROOT/ARM/seedK. At the deadline (seconds) every run still going gets SIGTERM: it finishes its step, writes a
checkpoint and exits, so the same command later resumes each run where it stopped (resume="auto"); runs that
have reached total_training_steps are not started again. --report_only skips the runs and reports what is there.

Outputs, in ROOT:
- val_acc_step.png, val_acc_samples.png, val_acc_time.png: val/acc against training steps, generated responses
  (every gen batch of the step, dynamic sampling's refills included: sampling/num_gen_batches x gen_batch_size
  x n, summed) and seconds (timing_s/step, summed). Per arm, at each validation every seed ran: a line through
  the mean over seeds and a band from the lowest to the highest seed (on the samples and seconds axes a point
  sits at the seeds' mean coordinate). A dotted line marks the budget of the table.
- table.md (also printed), per arm: val/acc at a fixed step, sample and time budget (by default the largest
  each run reached: the smallest over runs of its last validation's coordinate; --step_budget etc. set them),
  each run's last validation within the budget, as mean (min-max) over seeds; over steps 1..step budget, the mean
  actor/entropy, response_length/mean, actor/pg_clipfrac and rollout/logp_mismatch, and the median
  timing_s/step, each the mean over seeds of the runs' own figures.
- summary.json: the same numbers, unrounded.
The runs share the machine: compare their seconds with each other, not with a run that had the GPU to itself.
"""
import argparse
import dataclasses
import difflib
import itertools
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train_dapo as T  # noqa: E402
from config import ConfigError, check_config  # noqa: E402
from verl_keys import split_top  # noqa: E402
from tools import plot  # noqa: E402

# keys the lab sets itself, and what to use instead
RESERVED = {"seed": "--seeds N", "out_dir": "--root DIR", "resume": "nothing (the lab resumes with resume=auto)"}
AXES = ("step", "samples", "time")
# table columns over the training steps: (metrics.jsonl key, column title, per-run statistic)
STEP_STATS = [("actor/entropy", "entropy", statistics.fmean),
              ("response_length/mean", "response length", statistics.fmean),
              ("actor/pg_clipfrac", "clip frac", statistics.fmean),
              ("rollout/logp_mismatch", "logp mismatch", statistics.fmean),
              ("timing_s/step", "s/step (median)", statistics.median)]


class LabError(ValueError):
    """A bad --arms spec, arm key or value, or run directory; the message says what to pass instead."""

# -----------------------------------------------------------------------------
# arms and seeds


def parse_arm_spec(spec: str) -> tuple[str, list[str]]:
    """"KEY=V1,V2" -> (KEY, [V1, V2]), the key checked against Config's fields."""
    key, eq, values = spec.partition("=")
    key = key.strip().removeprefix("--")
    if not eq or not key:
        raise LabError(f"--arms {spec!r}: write KEY=V1,V2,... "
                       f"(e.g. --arms loss_agg_mode=token-mean,seq-mean-token-mean)")
    check_key(key)
    values = split_top(values)
    if any(not v for v in values):
        raise LabError(f"--arms {spec!r}: an empty value; write KEY=V1,V2,... without empty items")
    if len(set(values)) < len(values):
        raise LabError(f"--arms {spec!r}: a value is listed twice")
    return key, values


def check_key(key: str):
    """A Config field the lab does not set itself, else LabError naming the nearest field."""
    if key in RESERVED:
        raise LabError(f"--arms {key}=...: the lab sets {key} itself; use {RESERVED[key]}")
    fields = [f.name for f in dataclasses.fields(T.Config)]
    if key not in fields:
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; arms vary fields of train_dapo.Config"
        raise LabError(f"--arms: {key!r} is not a config field{hint}")


def arm_name(overrides: list[tuple[str, str]]) -> str:
    """The arm's directory name: KEY-VALUE pairs joined by "__", "base" for none."""
    if not overrides:
        return "base"
    return "__".join(f"{k}-{re.sub(r'[^A-Za-z0-9._+-]', '_', v)}" for k, v in overrides)


def expand_arms(specs: list[str], one_at_a_time: bool = False,
                whole: list[str] = ()) -> dict[str, list[tuple[str, str]]]:
    """--arms specs -> {arm name: [(key, raw value), ...]}: every combination of the specs' values (a grid), or
    with one_at_a_time a "base" arm and one arm per value; then one arm per --arm (`whole`), as given."""
    if not specs and not whole:
        raise LabError("no arms: give --arms KEY=V1,V2,... (several for a grid, or with --one_at_a_time), "
                       "or --arm 'K1=V1 K2=V2' per arm")
    arms = {}
    for overrides in [parse_whole_arm(w) for w in whole]:
        arms[arm_name(overrides)] = overrides
    if not specs:
        return arms
    parsed = [parse_arm_spec(s) for s in specs]
    keys = [k for k, _ in parsed]
    if len(set(keys)) < len(keys):
        twice = ", ".join(sorted(k for k in set(keys) if keys.count(k) > 1))
        raise LabError(f"--arms: {twice} given twice; list all its values in one --arms KEY=V1,V2")
    if one_at_a_time:
        combos = [[]] + [[(k, v)] for k, vs in parsed for v in vs]
    else:
        combos = [list(zip(keys, vs)) for vs in itertools.product(*(vs for _, vs in parsed))]
    for overrides in combos:
        name = arm_name(overrides)
        if name in arms:
            raise LabError(f"arms {arms[name]} and {overrides} get the same directory name {name!r}; "
                           f"write the values so that they differ in letters, digits or ._+-")
        if len(name) > 200:
            raise LabError(f"arm name {name[:60]}... is longer than 200 characters; vary fewer keys at once")
        arms[name] = overrides
    return arms


def parse_whole_arm(spec: str) -> list[tuple[str, str]]:
    """--arm 'K1=V1 K2=V2' -> [(K1, V1), (K2, V2)]: one arm that changes several knobs at once (e.g. a loss mode
    with the aggregation it needs), its keys checked against Config's fields."""
    overrides = []
    for word in shlex.split(spec):
        key, eq, value = word.partition("=")
        key = key.strip().removeprefix("--")
        if not eq or not key or not value:
            raise LabError(f"--arm {spec!r}: write 'K1=V1 K2=V2' (e.g. --arm 'loss_mode=gspo "
                           "loss_agg_mode=seq-mean-token-mean')")
        check_key(key)
        overrides.append((key, value))
    if len({k for k, _ in overrides}) < len(overrides):
        raise LabError(f"--arm {spec!r}: a key is given twice")
    return overrides


def arm_config(config: str, overrides: list[tuple[str, str]], extra: list[str]):
    """The arm's Config (file, --extra, then the arm's overrides), checked knob by knob (no files)."""
    argv = [config, *extra, *(f"--{k}={v}" for k, v in overrides)]
    try:
        cfg, flags = T.parse_args(T.Config, argv)
        check_config(cfg, check_files=False)
    except ConfigError as e:
        raise LabError(f"arm {arm_name(overrides)!r}: {e}") from None
    if flags["dry_run"]:
        raise LabError("--dry_run is not an override; run train_dapo.py CONFIG --dry_run")
    return cfg


def plan_runs(config: str, arms: dict, seeds: int, root: str, extra: list[str]) -> list[dict]:
    """One entry per arm x seed: {arm, seed, out_dir, argv (the trainer's overrides), cfg}."""
    if seeds < 1:
        raise LabError(f"--seeds {seeds}: run each arm with at least one seed")
    for arg in extra:
        key = arg.removeprefix("--").partition("=")[0]
        if key in RESERVED:
            raise LabError(f"--extra {arg}: the lab sets {key} itself; use {RESERVED[key]}")
    runs = []
    for name, overrides in arms.items():
        base = arm_config(config, overrides, extra)
        for seed in range(base.seed, base.seed + seeds):
            out_dir = os.path.join(root, name, f"seed{seed}")
            argv = [config, *extra, *(f"--{k}={v}" for k, v in overrides), f"--seed={seed}",
                    f"--out_dir={out_dir}", "--resume=auto"]
            runs.append({"arm": name, "seed": seed, "out_dir": out_dir, "argv": argv,
                         "cfg": dataclasses.replace(base, seed=seed, out_dir=out_dir)})
    return runs

# -----------------------------------------------------------------------------
# running them side by side


def steps_done(out_dir: str) -> int:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    return max((r["step"] for r in T.read_metrics(path) if "timing_s/step" in r), default=0)


def run_all(runs: list[dict], deadline: float, stagger: float, script: str = "train_dapo.py") -> dict:
    """Start every run not yet done (script ARGV..., one process each, stagger seconds apart), SIGTERM those still
    going at the deadline, wait for their checkpoints. -> {out_dir: exit code, "done" or "killed"}."""
    t0, procs, codes = time.time(), {}, {}
    for r in runs:
        total = r["cfg"].total_training_steps
        if total > 0 and steps_done(r["out_dir"]) >= total:
            print(f"{r['out_dir']}: done ({steps_done(r['out_dir'])} steps)")
            codes[r["out_dir"]] = "done"
            continue
        if time.time() - t0 >= deadline:
            print(f"{r['out_dir']}: not started, the deadline has passed")
            continue
        os.makedirs(r["out_dir"], exist_ok=True)
        cmd = [sys.executable, script, *r["argv"]]
        with open(os.path.join(r["out_dir"], "train.log"), "a") as log:
            procs[r["out_dir"]] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        print(f"{r['out_dir']}: started, {shlex.join(cmd[1:])}")
        time.sleep(stagger)
    while any(p.poll() is None for p in procs.values()) and time.time() - t0 < deadline:
        time.sleep(1)
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # the trainer finishes its step and checkpoints
    for out_dir, p in procs.items():
        try:
            codes[out_dir] = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes[out_dir] = "killed"
        print(f"{out_dir}: exit {codes[out_dir]}, {steps_done(out_dir)} steps")
    return codes

# -----------------------------------------------------------------------------
# the report: budgets, the table, the overlays


def load_run(out_dir: str) -> dict:
    """A run's metrics and, per axis, step -> coordinate (tools/plot.py's: samples need out_dir/config.json)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    rows = T.read_metrics(path) if os.path.isfile(path) else []
    if rows and not os.path.isfile(os.path.join(out_dir, "config.json")):
        raise LabError(f"{out_dir} has metrics.jsonl but no config.json; pass the out_dir of a trainer run")
    coords = {x: plot.plot_x(rows, x, out_dir) for x in AXES} if rows else {x: {} for x in AXES}
    return {"out_dir": out_dir, "rows": rows, "coords": coords}


def val_points(run: dict, x: str) -> list[tuple[int, float, float]]:
    """(step, coordinate, val/acc) of each of the run's validations, in step order."""
    c = run["coords"][x]
    return sorted((r["step"], c[r["step"]], r["val/acc"]) for r in run["rows"]
                  if "val/acc" in r and r["step"] in c)


def budget(runs: list[dict], x: str) -> float | None:
    """The largest budget every run reached: the smallest over runs of its last validation's coordinate."""
    ends = [val_points(r, x)[-1][1] for r in runs if val_points(r, x)]
    return min(ends) if ends else None


def acc_within(run: dict, x: str, limit: float) -> float | None:
    """val/acc of the run's last validation at or before the budget."""
    within = [acc for _, c, acc in val_points(run, x) if c <= limit]
    return within[-1] if within else None


def step_stat(run: dict, key: str, fn, max_step: float) -> float | None:
    """fn over the key's values in the training steps 1..max_step (None where the run logged none)."""
    vals = [r[key] for r in run["rows"] if key in r and 1 <= r["step"] <= max_step]
    return fn(vals) if vals else None


def spread(values: list) -> dict | None:
    """mean, min and max of the values that exist; None if none does."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(arms: dict[str, list[dict]], budgets: dict[str, float | None]) -> dict:
    """Per arm: val/acc at each axis's budget and the step statistics (mean over seeds of each run's)."""
    budgets = dict(budgets)
    all_runs = [r for runs in arms.values() for r in runs]
    for x in AXES:
        if budgets.get(x) is None:
            budgets[x] = budget(all_runs, x)
    out = {"budgets": budgets, "arms": {}}
    for name, runs in arms.items():
        steps = [max((r["step"] for r in run["rows"] if "timing_s/step" in r), default=0) for run in runs]
        row = {"seeds": len(runs), "steps": steps}
        for x in AXES:
            row[f"val/acc@{x}"] = (spread([acc_within(run, x, budgets[x]) for run in runs])
                                   if budgets[x] is not None else None)
        max_step = budgets["step"] if budgets["step"] is not None else 0
        for key, _, fn in STEP_STATS:
            row[key] = spread([step_stat(run, key, fn, max_step) for run in runs])
        out["arms"][name] = row
    return out


def fmt(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}g}"


def table_markdown(summary: dict) -> str:
    """The summary as a markdown table: val/acc cells mean (min-max) over seeds, the rest means over seeds."""
    b = summary["budgets"]
    titles = {"step": f"val/acc @ step {fmt(b['step'])}", "samples": f"val/acc @ {fmt(b['samples'])} samples",
              "time": f"val/acc @ {fmt(b['time'])} s"}
    head = ["arm", "seeds", "steps"] + [titles[x] for x in AXES] + [t for _, t, _ in STEP_STATS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in summary["arms"].items():
        cells = [name, str(row["seeds"]), f"{min(row['steps'])}-{max(row['steps'])}"]
        for x in AXES:
            s = row[f"val/acc@{x}"]
            cells.append("—" if s is None else f"{s['mean']:.3f} ({s['min']:.3f}-{s['max']:.3f})")
        cells += [fmt(row[key]["mean"] if row[key] else None) for key, _, _ in STEP_STATS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def band(runs: list[dict], x: str) -> list[tuple[float, float, float, float]]:
    """(mean coordinate, mean, min, max val/acc over seeds) at each validation step every seed ran."""
    per_run = [{s: (c, a) for s, c, a in val_points(r, x)} for r in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    out = []
    for s in steps:
        cs, accs = zip(*(p[s] for p in per_run))
        out.append((statistics.fmean(cs), statistics.fmean(accs), min(accs), max(accs)))
    return out


def plot_overlays(arms: dict[str, list[dict]], budgets: dict, root: str) -> list[str]:
    """One PNG per axis: each arm's val/acc, the mean over seeds with a min-max band. -> the paths written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise LabError("plotting needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')") from e
    paths = []
    for x in AXES:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, runs in arms.items():
            pts = band([r for r in runs if r["rows"]], x)
            if not pts:
                continue
            xs, mean, lo, hi = zip(*pts)
            line, = ax.plot(xs, mean, marker="o", markersize=3, label=f"{name} ({len(runs)} seeds)")
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        if budgets.get(x) is not None:
            ax.axvline(budgets[x], color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(plot.PLOT_X[x])
        ax.set_ylabel("val/acc (mean over seeds, band min-max)")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(root, f"val_acc_{x}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def report(runs: list[dict], root: str, budgets: dict) -> dict:
    """Load every run, write table.md, summary.json and the overlays into root. -> the summary."""
    arms = {}
    for r in runs:
        arms.setdefault(r["arm"], []).append(load_run(r["out_dir"]))
    if not any(run["rows"] for runs_ in arms.values() for run in runs_):
        raise LabError(f"no run under {root} has a metrics.jsonl yet; run the lab without --report_only first")
    summary = summarize(arms, budgets)
    table = table_markdown(summary)
    with open(os.path.join(root, "table.md"), "w") as f:
        f.write(table)
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(table)
    for path in plot_overlays(arms, summary["budgets"], root):
        print(f"wrote {path}")
    return summary

# -----------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--arms", action="append", default=[], metavar="KEY=V1,V2",
                   help="an arm per value; several flags make a grid (or a list: --one_at_a_time)")
    p.add_argument("--arm", action="append", default=[], metavar="'K1=V1 K2=V2'",
                   help="one arm given whole: several knobs changed at once (beside the --arms arms)")
    p.add_argument("--one_at_a_time", action="store_true",
                   help="a base arm plus one arm per value, each changing one knob from the config")
    p.add_argument("--seeds", type=int, default=1, help="runs per arm, seeds S..S+N-1 (S: the config's seed)")
    p.add_argument("--root", default="out/ablation", help="every run's out_dir is ROOT/ARM/seedK")
    p.add_argument("--deadline", type=float, default=540, help="seconds before the runs still going get SIGTERM")
    p.add_argument("--stagger", type=float, default=5, help="seconds between run starts (engine start-up memory)")
    p.add_argument("--extra", default="", help="overrides for every arm, e.g. '--gpu_memory_utilization=0.12'")
    p.add_argument("--report_only", action="store_true", help="start nothing; report the runs under ROOT")
    for x, what in (("step", "training steps"), ("sample", "generated responses"), ("time", "seconds")):
        p.add_argument(f"--{x}_budget", type=float, default=None,
                       help=f"val/acc in the table at this many {what} (default: the largest every run reached)")
    args = p.parse_args(argv)
    try:
        arms = expand_arms(args.arms, args.one_at_a_time, args.arm)
        runs = plan_runs(args.config, arms, args.seeds, args.root, shlex.split(args.extra))
        print(f"{len(arms)} arms x {args.seeds} seeds: {', '.join(arms)}")
        if not args.report_only:
            run_all(runs, args.deadline, args.stagger)
        budgets = {"step": args.step_budget, "samples": args.sample_budget, "time": args.time_budget}
        report(runs, args.root, budgets)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
