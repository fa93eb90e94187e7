"""
Runs the arms of an ablation side by side on one machine (one trainer process each, e.g. several small-model runs
sharing one GPU), each arm the same config with one knob changed, then plots them together.

    python bench/ablation.py configs/smollm2_135m_dapo.py --root out/ablation --deadline 540
    python bench/ablation.py configs/smollm2_135m_dapo.py --root out/ablation --deadline 540   # again: resumes
    python tools/plot.py out/ablation/base out/ablation/clip_symmetric --x=step

Every arm writes out_dir = ROOT/NAME. At the deadline (seconds) every arm still running gets SIGTERM: it finishes its
step, writes a checkpoint and exits, so the same command later resumes every arm where it stopped (resume="auto").
Arms that have reached total_training_steps are not started again. The arms' wall-clock figures are those of
processes sharing the machine: compare them with each other, not with a run that had the GPU to itself.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train_dapo as T  # noqa: E402
from tools import plot  # noqa: E402

# name -> the overrides of that arm (the baseline twice, with two seeds, for the run-to-run spread)
ARMS = {
    "base": [],
    "base_seed1": ["--seed=1"],
    "clip_symmetric": ["--clip_ratio_high=0.2"],
    "no_dynamic_sampling": ["--filter_groups=False"],
    "seq_mean_token_mean": ["--loss_agg_mode=seq-mean-token-mean"],
    "no_overlong_shaping": ["--overlong_buffer=False"],
}
# each figure: (file name, arms, what the horizontal axis counts)
FIGURES = [
    ("clip_higher.png", ["base", "base_seed1", "clip_symmetric"], "step"),
    ("dynamic_sampling_steps.png", ["base", "base_seed1", "no_dynamic_sampling"], "step"),
    ("dynamic_sampling_samples.png", ["base", "base_seed1", "no_dynamic_sampling"], "samples"),
    ("dynamic_sampling_time.png", ["base", "base_seed1", "no_dynamic_sampling"], "time"),
    ("loss_agg_mode.png", ["base", "base_seed1", "seq_mean_token_mean"], "step"),
    ("overlong_shaping.png", ["base", "base_seed1", "no_overlong_shaping"], "step"),
]


def steps_done(out_dir: str) -> int:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    return max((r["step"] for r in T.read_metrics(path) if "timing_s/step" in r), default=0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--root", default="out/ablation", help="every arm's out_dir is ROOT/NAME")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated names from ARMS")
    p.add_argument("--deadline", type=float, default=540, help="seconds before the arms still running get SIGTERM")
    p.add_argument("--stagger", type=float, default=5, help="seconds between arm starts (engine start-up memory)")
    p.add_argument("--extra", default="", help="overrides for every arm, e.g. '--gpu_memory_utilization=0.12'")
    args = p.parse_args()
    cfg, _ = T.parse_args(T.Config, [args.config])
    t0 = time.time()
    procs = {}
    for name in args.arms.split(","):
        out_dir = os.path.join(args.root, name)
        if steps_done(out_dir) >= cfg.total_training_steps:
            print(f"{name}: done ({steps_done(out_dir)} steps)")
            continue
        os.makedirs(out_dir, exist_ok=True)
        cmd = [sys.executable, "train_dapo.py", args.config, f"--out_dir={out_dir}", "--resume=auto",
               *ARMS[name], *args.extra.split()]
        log = open(os.path.join(out_dir, "train.log"), "a")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        print(f"{name}: started, {' '.join(cmd[2:])}")
        time.sleep(args.stagger)
    while any(pr.poll() is None for pr in procs.values()) and time.time() - t0 < args.deadline:
        time.sleep(2)
    for pr in procs.values():
        if pr.poll() is None:
            pr.send_signal(signal.SIGTERM)  # the trainer finishes its step and checkpoints
    for name, pr in procs.items():
        try:
            rc = pr.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pr.kill()
            rc = "killed"
        print(f"{name}: exit {rc}, {steps_done(os.path.join(args.root, name))} steps")
    summary = {}
    for name in args.arms.split(","):
        path = os.path.join(args.root, name, "metrics.jsonl")
        rows = T.read_metrics(path) if os.path.isfile(path) else []
        val = [(r["step"], r["val/acc"]) for r in rows if "val/acc" in r]
        summary[name] = {"steps": steps_done(os.path.join(args.root, name)), "val_acc": val}
    print(json.dumps(summary))
    for png, arms, x in FIGURES:
        dirs = [os.path.join(args.root, a) for a in arms if steps_done(os.path.join(args.root, a)) > 0]
        if len(dirs) > 1:
            print(f"wrote {plot.plot(dirs, x=x, png=os.path.join(args.root, png))}")


if __name__ == "__main__":
    main()
