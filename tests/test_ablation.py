"""Specification of bench/ablation.py, the lab: arms and seeds from --arms/--seeds (names, checks), the runs
side by side with a deadline (a stand-in trainer), and the report from metrics.jsonl files written here: budgets,
the table (expected values worked out by hand), the seed bands and the PNGs."""
import json
import os
import subprocess
import sys

import pytest

from bench import ablation as A

STAND_IN = """
import os, signal, sys, time, json
out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--out_dir=")][0]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
step = 0
while not stop:
    step += 1
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "timing_s/step": 0.05}) + "\\n")
    time.sleep(0.05)
"""

# arm -> seed -> rows; gen_batch_size 2 x n 4 = 8 responses a gen batch
RUNS = {
    "a": {0: [{"step": 0, "val/acc": 0.1},
              {"step": 1, "sampling/num_gen_batches": 1, "timing_s/step": 10, "actor/entropy": 1.0,
               "response_length/mean": 40, "actor/pg_clipfrac": 0.1, "rollout/logp_mismatch": 0.01},
              {"step": 2, "sampling/num_gen_batches": 2, "timing_s/step": 20, "actor/entropy": 0.8,
               "response_length/mean": 44, "actor/pg_clipfrac": 0.2, "rollout/logp_mismatch": 0.03, "val/acc": 0.3},
              {"step": 3, "sampling/num_gen_batches": 1, "timing_s/step": 10, "actor/entropy": 0.6,
               "response_length/mean": 50, "actor/pg_clipfrac": 0.3, "rollout/logp_mismatch": 0.05},
              {"step": 4, "sampling/num_gen_batches": 1, "timing_s/step": 10, "actor/entropy": 0.4,
               "response_length/mean": 60, "actor/pg_clipfrac": 0.4, "rollout/logp_mismatch": 0.07, "val/acc": 0.5}],
          1: [{"step": 0, "val/acc": 0.2},  # stopped after step 2: it sets the budgets
              {"step": 1, "sampling/num_gen_batches": 1, "timing_s/step": 12, "actor/entropy": 1.2,
               "response_length/mean": 42, "actor/pg_clipfrac": 0.3, "rollout/logp_mismatch": 0.03},
              {"step": 2, "sampling/num_gen_batches": 1, "timing_s/step": 14, "actor/entropy": 1.0,
               "response_length/mean": 46, "actor/pg_clipfrac": 0.1, "rollout/logp_mismatch": 0.01, "val/acc": 0.4}]},
    "b": {0: [{"step": 0, "val/acc": 0.1},  # no rollout/logp_mismatch logged
              {"step": 1, "sampling/num_gen_batches": 3, "timing_s/step": 30, "actor/entropy": 0.5,
               "response_length/mean": 30, "actor/pg_clipfrac": 0.0},
              {"step": 2, "sampling/num_gen_batches": 3, "timing_s/step": 30, "actor/entropy": 0.5,
               "response_length/mean": 30, "actor/pg_clipfrac": 0.0, "val/acc": 0.6},
              {"step": 3, "sampling/num_gen_batches": 1, "timing_s/step": 10, "actor/entropy": 9.0,
               "response_length/mean": 90, "actor/pg_clipfrac": 0.9},
              {"step": 4, "sampling/num_gen_batches": 1, "timing_s/step": 10, "actor/entropy": 9.0,
               "response_length/mean": 90, "actor/pg_clipfrac": 0.9, "val/acc": 0.7}],
          1: [{"step": 0, "val/acc": 0.0},
              {"step": 1, "sampling/num_gen_batches": 1, "timing_s/step": 10, "actor/entropy": 0.7,
               "response_length/mean": 34, "actor/pg_clipfrac": 0.2},
              {"step": 2, "sampling/num_gen_batches": 1, "timing_s/step": 20, "actor/entropy": 0.9,
               "response_length/mean": 38, "actor/pg_clipfrac": 0.4, "val/acc": 0.2},
              {"step": 3, "sampling/num_gen_batches": 1, "timing_s/step": 10},
              {"step": 4, "sampling/num_gen_batches": 1, "timing_s/step": 10, "val/acc": 0.4}]},
}


def write_runs(root, runs=RUNS):
    """The runs' out_dirs (config.json + metrics.jsonl) under root -> the lab's run entries."""
    entries = []
    for arm, seeds in runs.items():
        for seed, rows in seeds.items():
            out_dir = os.path.join(root, arm, f"seed{seed}")
            os.makedirs(out_dir)
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump({"gen_batch_size": 2, "n": 4, "seed": seed}, f)
            with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            entries.append({"arm": arm, "seed": seed, "out_dir": out_dir})
    return entries


def flat(points):
    return [v for p in points for v in p]


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "cfg.py"
    path.write_text("seed = 3\ntotal_training_steps = 2\n")
    return str(path)


def test_arms_one_per_value_grid_and_list():
    arms = A.expand_arms(["loss_agg_mode=token-mean,seq-mean-token-mean"])
    assert arms == {"loss_agg_mode-token-mean": [("loss_agg_mode", "token-mean")],
                    "loss_agg_mode-seq-mean-token-mean": [("loss_agg_mode", "seq-mean-token-mean")]}
    grid = A.expand_arms(["clip_ratio_high=0.2,0.28", "--filter_groups=True,False"])
    assert list(grid) == ["clip_ratio_high-0.2__filter_groups-True", "clip_ratio_high-0.2__filter_groups-False",
                          "clip_ratio_high-0.28__filter_groups-True", "clip_ratio_high-0.28__filter_groups-False"]
    listed = A.expand_arms(["clip_ratio_high=0.2", "filter_groups=False"], one_at_a_time=True)
    assert listed == {"base": [], "clip_ratio_high-0.2": [("clip_ratio_high", "0.2")],
                      "filter_groups-False": [("filter_groups", "False")]}
    # commas inside brackets and quotes stay in the value; other characters become _ in the name
    betas = A.expand_arms(["betas=(0.9, 0.99),(0.9,0.999)", "train_files=['a,b.parquet']"])
    assert list(betas.values())[0] == [("betas", "(0.9, 0.99)"), ("train_files", "['a,b.parquet']")]
    assert list(betas) == ["betas-_0.9__0.99___train_files-__a_b.parquet__",
                           "betas-_0.9_0.999___train_files-__a_b.parquet__"]
    assert all(os.sep not in name for name in betas)


def test_whole_arms_change_several_knobs_at_once(config_file):
    arms = A.expand_arms(["loss_mode=vanilla,cispo"], whole=["loss_mode=gspo loss_agg_mode=seq-mean-token-mean"])
    assert arms == {"loss_mode-gspo__loss_agg_mode-seq-mean-token-mean":
                    [("loss_mode", "gspo"), ("loss_agg_mode", "seq-mean-token-mean")],
                    "loss_mode-vanilla": [("loss_mode", "vanilla")], "loss_mode-cispo": [("loss_mode", "cispo")]}
    assert A.expand_arms([], whole=["--n=4"]) == {"n-4": [("n", "4")]}
    with pytest.raises(A.LabError, match="write 'K1=V1 K2=V2'"):
        A.expand_arms([], whole=["loss_mode"])
    with pytest.raises(A.LabError, match="a key is given twice"):
        A.expand_arms([], whole=["n=4 n=8"])
    with pytest.raises(A.LabError, match="'loss_mod' is not a config field"):
        A.expand_arms([], whole=["loss_mod=gspo"])
    # a loss mode without the aggregation it needs is refused before anything starts
    with pytest.raises(A.LabError, match="arm 'loss_mode-gspo': loss_mode='gspo' takes its paper's mean"):
        A.plan_runs(config_file, A.expand_arms([], whole=["loss_mode=gspo"]), 1, "out", [])


def test_bad_arms_give_clear_errors(config_file, capsys):
    with pytest.raises(A.LabError, match="'clip_ratio_hgh' is not a config field; did you mean 'clip_ratio_high'"):
        A.expand_arms(["clip_ratio_hgh=0.2,0.3"])
    with pytest.raises(A.LabError, match="the lab sets seed itself; use --seeds N"):
        A.expand_arms(["seed=1,2"])
    with pytest.raises(A.LabError, match="write KEY=V1,V2"):
        A.expand_arms(["clip_ratio_high"])
    with pytest.raises(A.LabError, match="an empty value"):
        A.expand_arms(["clip_ratio_high=0.2,"])
    with pytest.raises(A.LabError, match="clip_ratio_high given twice"):
        A.expand_arms(["clip_ratio_high=0.2", "clip_ratio_high=0.3"])
    with pytest.raises(A.LabError, match="same directory name 'val_files-a_b'"):
        A.expand_arms(["val_files=a/b,a_b"])
    with pytest.raises(A.LabError, match="no arms"):
        A.expand_arms([])
    with pytest.raises(A.LabError, match="arm 'clip_ratio_high-abc': clip_ratio_high='abc'"):  # a type
        A.plan_runs(config_file, A.expand_arms(["clip_ratio_high=abc"]), 1, "out", [])
    with pytest.raises(A.LabError, match="arm 'n-0': n=0"):  # a range
        A.plan_runs(config_file, A.expand_arms(["n=0"]), 1, "out", [])
    with pytest.raises(A.LabError, match="--extra --out_dir=x: the lab sets out_dir itself; use --root DIR"):
        A.plan_runs(config_file, A.expand_arms(["n=4"]), 1, "out", ["--out_dir=x"])
    with pytest.raises(A.LabError, match="at least one seed"):
        A.plan_runs(config_file, A.expand_arms(["n=4"]), 0, "out", [])
    assert A.main([config_file, "--arms", "lr_rate=1e-6", "--report_only"]) == 2
    assert "error: --arms: 'lr_rate' is not a config field" in capsys.readouterr().err


def test_runs_arm_by_seed(config_file):
    runs = A.plan_runs(config_file, A.expand_arms(["n=4,8"]), 2, "out/lab", ["--lr=1e-5"])
    assert [(r["arm"], r["seed"], r["out_dir"]) for r in runs] == [
        ("n-4", 3, "out/lab/n-4/seed3"), ("n-4", 4, "out/lab/n-4/seed4"),
        ("n-8", 3, "out/lab/n-8/seed3"), ("n-8", 4, "out/lab/n-8/seed4")]
    assert runs[1]["argv"] == [config_file, "--lr=1e-5", "--n=4", "--seed=4", "--out_dir=out/lab/n-4/seed4",
                               "--resume=auto"]
    assert (runs[3]["cfg"].n, runs[3]["cfg"].seed, runs[3]["cfg"].lr) == (8, 4, 1e-5)


def test_run_all_deadline_and_done(tmp_path, config_file):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    runs = A.plan_runs(config_file, A.expand_arms(["n=4,8"]), 1, str(tmp_path / "lab"), [])
    done = runs[1]["out_dir"]  # has reached total_training_steps=2: not started again
    os.makedirs(done)
    with open(os.path.join(done, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "timing_s/step": 1}\n{"step": 2, "timing_s/step": 1}\n')
    codes = A.run_all(runs, deadline=4.0, stagger=0, script=str(script))
    assert codes == {runs[0]["out_dir"]: 0, done: "done"}  # SIGTERM at the deadline, a clean exit
    assert A.steps_done(runs[0]["out_dir"]) > 0 and A.steps_done(done) == 2
    assert os.path.isfile(os.path.join(runs[0]["out_dir"], "train.log"))


def test_budgets_table_bands_and_plots(tmp_path):
    entries = write_runs(str(tmp_path))
    summary = A.report(entries, str(tmp_path), {"step": None, "samples": None, "time": None})
    # coordinates: a0 samples 0 8 24 32 40, time 0 10 30 40 50; a1 samples 0 8 16, time 0 12 26;
    # b0 samples 0 24 48 56 64, time 0 30 60 70 80; b1 samples 0 8 16 24 32, time 0 10 30 40 50
    assert summary["budgets"] == {"step": 2, "samples": 16, "time": 26}
    a, b = summary["arms"]["a"], summary["arms"]["b"]
    assert a["steps"] == [4, 2] and b["steps"] == [4, 4]
    expect = {("a", "step"): (0.35, 0.3, 0.4), ("a", "samples"): (0.25, 0.1, 0.4), ("a", "time"): (0.25, 0.1, 0.4),
              ("b", "step"): (0.4, 0.2, 0.6), ("b", "samples"): (0.15, 0.1, 0.2), ("b", "time"): (0.05, 0.0, 0.1)}
    for (arm, x), (mean, lo, hi) in expect.items():
        s = summary["arms"][arm][f"val/acc@{x}"]
        assert (s["mean"], s["min"], s["max"]) == pytest.approx((mean, lo, hi)), (arm, x)
    # over steps 1..2 only; per run (the timing's median: 15, 13 and 30, 15), then the mean over seeds
    stats = {key: (a[key] and a[key]["mean"], b[key] and b[key]["mean"]) for key, _, _ in A.STEP_STATS}
    assert stats == {"actor/entropy": pytest.approx((1.0, 0.65)), "response_length/mean": pytest.approx((43, 33)),
                     "actor/pg_clipfrac": pytest.approx((0.175, 0.15)),
                     "rollout/logp_mismatch": (pytest.approx(0.02), None), "timing_s/step": pytest.approx((14, 22.5))}
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0].startswith("| arm | seeds | steps | val/acc @ step 2 | val/acc @ 16 samples | val/acc @ 26 s |")
    assert table[2] == ("| a | 2 | 2-4 | 0.350 (0.300-0.400) | 0.250 (0.100-0.400) | 0.250 (0.100-0.400) "
                        "| 1 | 43 | 0.175 | 0.02 | 14 |")
    assert table[3] == ("| b | 2 | 4-4 | 0.400 (0.200-0.600) | 0.150 (0.100-0.200) | 0.050 (0.000-0.100) "
                        "| 0.65 | 33 | 0.15 | — | 22.5 |")
    assert json.load(open(tmp_path / "summary.json"))["budgets"]["samples"] == 16
    for x in A.AXES:
        png = tmp_path / f"val_acc_{x}.png"
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # the bands: validations every seed ran, at the seeds' mean coordinate
    arms = {arm: [A.load_run(e["out_dir"]) for e in entries if e["arm"] == arm] for arm in RUNS}
    assert flat(A.band(arms["a"], "step")) == pytest.approx([0, 0.15, 0.1, 0.2, 2, 0.35, 0.3, 0.4])
    assert flat(A.band(arms["a"], "samples")) == pytest.approx([0, 0.15, 0.1, 0.2, 20, 0.35, 0.3, 0.4])
    assert flat(A.band(arms["b"], "time")) == pytest.approx([0, 0.05, 0.0, 0.1, 45, 0.4, 0.2, 0.6,
                                                             65, 0.55, 0.4, 0.7])


def test_budgets_from_flags_and_report_errors(tmp_path):
    entries = write_runs(str(tmp_path))
    summary = A.report(entries, str(tmp_path), {"step": 4, "samples": 40, "time": 1000})
    # a run whose last validation is before the budget counts with that validation (a1: 0.4)
    assert summary["arms"]["a"]["val/acc@step"]["mean"] == pytest.approx(0.45)
    assert summary["arms"]["b"]["val/acc@samples"]["mean"] == pytest.approx((0.1 + 0.4) / 2)
    assert summary["arms"]["b"]["val/acc@time"]["mean"] == pytest.approx(0.55)
    with pytest.raises(A.LabError, match="no run under .* has a metrics.jsonl"):
        A.report([{"arm": "x", "seed": 0, "out_dir": str(tmp_path / "none")}], str(tmp_path), {})
    os.remove(os.path.join(entries[0]["out_dir"], "config.json"))
    with pytest.raises(A.LabError, match="no config.json"):
        A.report(entries, str(tmp_path), {})


def test_script_help_runs():
    out = subprocess.run([sys.executable, "bench/ablation.py", "--help"], capture_output=True, text=True,
                         cwd=A.ROOT)
    assert out.returncode == 0 and "--one_at_a_time" in out.stdout
