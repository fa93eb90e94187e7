"""Bad inputs get one clear message before expensive work; crashes, preemption and corrupt checkpoints
lose nothing (the resumed run reproduces the uninterrupted one's metrics exactly on CPU)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data
import prepare_data
import train_dapo as T
from conftest import make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = dict(max_prompt_length=64, max_response_length=12, overlong_buffer_len=6, train_batch_size=2,
            gen_batch_size=3, n=4, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=2,
            filter_groups_metric="seq_reward", temperature=1.5, lr=1e-3, test_freq=2, save_freq=1,
            reward_num_workers=0, cpu_threads=1, val_max_samples=4, max_num_gen_batches=20, logger=["jsonl"])


def args(tiny_dir, out, **over):
    kv = {"model_path": str(tiny_dir / "model"), "train_files": [str(tiny_dir / "train.parquet")],
          "val_files": [str(tiny_dir / "val.parquet")], "out_dir": str(out), **TINY, **over}
    return [f"--{k}={v!r}" if not isinstance(v, str) else f"--{k}={v}" for k, v in kv.items()]


def write_rows(path, rows):
    data.write_parquet(rows, str(path))
    return str(path)


def arith(n=8):
    return prepare_data.make_arith_rows(n, "train", seed=0)


def reward_file(tmp_path, body):
    f = tmp_path / "my_reward.py"
    f.write_text("import math, time\n" + body)
    return f"{f}:score"


# each case: (name, function of (tiny_dir, tmp_path) -> overrides, expected message regex)
def case_bad_parquet(td, tp):
    (tp / "x.parquet").write_bytes(b"not a parquet file")
    return {"train_files": [str(tp / "x.parquet")]}


def case_empty_parquet(td, tp):
    pq.write_table(pq.read_table(td / "train.parquet").slice(0, 0), tp / "e.parquet")
    return {"train_files": [str(tp / "e.parquet")]}


def case_missing_column(td, tp):
    pq.write_table(pa.table({"data_source": ["arith"], "prompt": ["1+1="]}), tp / "m.parquet")
    return {"train_files": [str(tp / "m.parquet")]}


def case_non_list_prompt(td, tp):
    rows = arith()
    rows[3]["prompt"] = [{"role": "user"}]  # no content
    return {"train_files": [write_rows(tp / "p.parquet", rows)], "gen_batch_size": 2}


def case_no_ground_truth(td, tp):
    rows = arith()
    for r in rows:
        r["reward_model"] = {"style": "rule", "ground_truth": None}
    return {"train_files": [write_rows(tp / "g.parquet", rows)], "gen_batch_size": 2}


def case_model_no_weights(td, tp):
    shutil.copytree(td / "model", tp / "m")
    os.remove(tp / "m" / "model.safetensors")
    return {"model_path": str(tp / "m")}


def case_model_arch(td, tp):
    shutil.copytree(td / "model", tp / "m")
    cfg = json.loads((tp / "m" / "config.json").read_text())
    (tp / "m" / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    return {"model_path": str(tp / "m")}


def case_no_chat_template(td, tp):
    shutil.copytree(td / "model", tp / "m")
    tc = json.loads((tp / "m" / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (tp / "m" / "tokenizer_config.json").write_text(json.dumps(tc))
    return {"model_path": str(tp / "m")}


def case_out_dir_not_writable(td, tp):
    (tp / "afile").write_text("x")
    return {"out_dir": str(tp / "afile" / "run")}


BAD_INPUTS = [
    ("typo", lambda td, tp: {"lrr": 1e-3}, "unknown config key 'lrr'.*did you mean 'lr'"),
    ("wrong type", lambda td, tp: {"n": "four"}, "n='four'.*expected int"),
    ("bool as int", lambda td, tp: {"use_kl_loss": 1}, "use_kl_loss=1.*expected bool"),
    ("mini batch", lambda td, tp: {"ppo_mini_batch_size": 3}, "ppo_mini_batch_size=3 must divide"),
    ("micro batch", lambda td, tp: {"ppo_micro_batch_size_per_gpu": 3}, "ppo_micro_batch_size_per_gpu=3 must divide"),
    ("clip c", lambda td, tp: {"clip_ratio_c": 0.5}, "clip_ratio_c=0.5 must be > 1"),
    ("overlong buffer", lambda td, tp: {"overlong_buffer_len": 64}, "overlong_buffer_len=64 must be in"),
    ("agg mode", lambda td, tp: {"loss_agg_mode": "mean"}, "loss_agg_mode='mean'; choose one of"),
    ("token budget", lambda td, tp: {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 10},
     "ppo_max_token_len_per_gpu=10 must be >= max_prompt_length"),
    ("logger missing", lambda td, tp: {"logger": ["jsonl", "mlflow"]}, "logger 'mlflow' is listed but"),
    ("missing parquet", lambda td, tp: {"train_files": [str(tp / "nope.parquet")]}, "not found: .*nope.parquet"),
    ("unreadable parquet", case_bad_parquet, "x.parquet is not a readable parquet file"),
    ("empty parquet", case_empty_parquet, "e.parquet.*(no rows|0 rows|empty)"),
    ("missing column", case_missing_column, "missing column 'reward_model' in .*m.parquet"),
    ("malformed prompt", case_non_list_prompt, "p.parquet.*row 3"),
    ("no ground truth", case_no_ground_truth, "g.parquet.*row 0.*ground_truth"),
    ("overlong prompt", lambda td, tp: {"max_prompt_length": 8}, "row 0.*max_prompt_length=8.*"
                                                                   "filter_overlong_prompts"),
    ("model dir", lambda td, tp: {"model_path": str(tp)}, "has no config.json"),
    ("model weights", case_model_no_weights, "no model.safetensors"),
    ("architecture", case_model_arch, "unsupported architecture 'GPT2LMHeadModel'"),
    ("chat template", case_no_chat_template, "has no chat template"),
    ("reward file", lambda td, tp: {"reward_fn": str(tp / "none.py") + ":f"}, "none.py"),
    ("reward function", lambda td, tp: {"reward_fn": reward_file(tp, "def other(**kw):\n    return 1.0\n")},
     "score"),
    ("reward raises", lambda td, tp: {"reward_fn": reward_file(
        tp, "def score(data_source, solution_str, ground_truth, extra_info=None):\n    raise KeyError('oops')\n")},
     "raised KeyError"),
    ("reward NaN", lambda td, tp: {"reward_fn": reward_file(
        tp, "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return math.nan\n")},
     "score.*nan"),
    ("reward None", lambda td, tp: {"reward_fn": reward_file(
        tp, "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return None\n")},
     "score.*None"),
    ("reward type", lambda td, tp: {"reward_fn": reward_file(
        tp, "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 'good'\n")},
     "score.*'good'"),
    ("out dir", case_out_dir_not_writable, "out_dir=.*afile/run.* is not writable"),
    ("resume path", lambda td, tp: {"resume": str(tp / "no_ckpt")}, "cannot resume from .*no_ckpt"),
]


@pytest.mark.parametrize("name,make,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gives_one_clear_message(tiny_dir, tmp_path, capsys, name, make, message):
    over = make(tiny_dir, tmp_path)
    out = over.pop("out_dir", str(tmp_path / "run"))
    rc = T.main(args(tiny_dir, out, total_training_steps=1, **over))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ")
    if name != "reward raises":  # there, the user's own function's traceback follows the message, on purpose
        assert "Traceback" not in err
    import re
    assert re.search(message, err, re.S), err


def test_resume_from_a_different_model_shape(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(args(tiny_dir, run, total_training_steps=1)) == 0
    bigger = make_model_dir(tmp_path / "bigger", hidden=48)
    rc = T.main(args(tiny_dir, run, total_training_steps=2, model_path=str(bigger)))
    err = capsys.readouterr().err
    assert rc == 2 and "different model (hidden_size: checkpoint 32 vs model_path 48" in err
    assert (run / "checkpoints" / "step_1" / "COMPLETE").exists()  # nothing saved was lost


def test_hanging_reward_times_out_and_the_run_continues(tiny_dir, tmp_path):
    fn = reward_file(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                               "    if solution_str.count('1') % 3 == 0:\n        time.sleep(60)\n"
                               "    return float(len(solution_str) % 2)\n")
    assert T.main(args(tiny_dir, tmp_path / "run", total_training_steps=1, reward_fn=fn, reward_num_workers=2,
                       reward_timeout=0.5, filter_groups_metric="score", val_files=[])) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["reward/num_timeouts"] > 0


def test_repeated_non_finite_updates_stop_the_run(tiny_dir, tmp_path, capsys):
    rc = T.main(args(tiny_dir, tmp_path / "run", total_training_steps=6, lr=1e30, max_consecutive_skips=2,
                     val_files=[], filter_groups=False, gen_batch_size=2))
    err = capsys.readouterr().err
    assert rc == 3 and "2 steps in a row had a non-finite loss" in err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["actor/skipped_updates"] == 2  # both optimizer steps of the step were skipped


# -----------------------------------------------------------------------------
# crashes (kill -9 at chosen points), preemption, corrupt checkpoints: resumed == uninterrupted


def launch(tiny_dir, out, fault=None, steps=3, **over):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("NANODAPO_FAULT", None)
    if fault:
        env["NANODAPO_FAULT"] = fault
    cmd = [sys.executable, os.path.join(ROOT, "train_dapo.py"), *args(tiny_dir, out, total_training_steps=steps,
                                                                         **over)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    p = launch(tiny_dir, out)
    assert p.wait(timeout=300) == 0, p.stdout.read()
    return metrics(out)


@pytest.mark.parametrize("fault,last_complete", [
    ("gen:1", 1),  # killed while generating step 2
    ("update:2", 1),  # killed after step 2's update, before its checkpoint
    ("checkpoint:2", 1),  # killed in the middle of writing step 2's checkpoint
])
def test_kill_9_then_resume_reproduces_the_uninterrupted_run(tiny_dir, tmp_path, uninterrupted, fault,
                                                             last_complete):
    out = tmp_path / "run"
    p = launch(tiny_dir, out, fault=fault)
    assert p.wait(timeout=300) == -signal.SIGKILL
    ckpts = out / "checkpoints"
    # the half-written directory, if any, is never picked up:
    assert not (ckpts / "step_2" / "COMPLETE").exists() and (ckpts / f"step_{last_complete}" / "COMPLETE").exists()
    p = launch(tiny_dir, out)
    log = p.stdout.read()
    assert p.wait(timeout=300) == 0, log
    assert f"resumed from {ckpts / f'step_{last_complete}'}" in log
    assert metrics(out) == uninterrupted


def test_corrupt_checkpoint_is_skipped_with_a_message(tiny_dir, tmp_path, uninterrupted):
    out = tmp_path / "run"
    assert launch(tiny_dir, out, steps=2).wait(timeout=300) == 0
    for f in (out / "checkpoints" / "step_2" / "dcp").iterdir():  # garble the newest checkpoint's shards
        f.write_bytes(b"garbage")
    p = launch(tiny_dir, out)
    log = p.stdout.read()
    assert p.wait(timeout=300) == 0, log
    assert "step_2 is unreadable" in log and "resumed from" in log and "step_1 at step 1" in log
    assert metrics(out) == uninterrupted


def test_sigterm_checkpoints_and_exits_zero_then_resumes(tiny_dir, tmp_path, uninterrupted):
    out = tmp_path / "run"
    p = launch(tiny_dir, out, save_freq=0)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and
                                          '"step": 1' in (out / "metrics.jsonl").read_text()):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    log = p.stdout.read()
    assert p.wait(timeout=300) == 0, log
    assert "stopped by signal after step" in log
    p = launch(tiny_dir, out, save_freq=0)
    log = p.stdout.read()
    assert p.wait(timeout=300) == 0, log
    assert metrics(out) == uninterrupted


def test_keep_last_prunes_only_after_a_new_checkpoint(tiny_dir, tmp_path):
    out = tmp_path / "run"
    assert launch(tiny_dir, out, keep_last=1).wait(timeout=300) == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step_3"]
