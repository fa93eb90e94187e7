"""Bad inputs get one clear message before expensive work; crashes, preemption and corrupt checkpoints
lose nothing (the resumed run reproduces the uninterrupted one's metrics exactly on CPU)."""
import contextlib
import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

import checkpoint
import data
import parallel
import reliability
import train_dapo as T
from conftest import ROOT, make_model_dir, run_metrics, torchrun_trainer, trainer_argv
from tools import plot, prepare_data


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


def model_copy(td, tp, edit_config=None, edit_tokenizer_config=None):
    shutil.copytree(td / "model", tp / "m")
    for name, edit in (("config.json", edit_config), ("tokenizer_config.json", edit_tokenizer_config)):
        if edit:
            f = tp / "m" / name
            f.write_text(json.dumps(edit(json.loads(f.read_text()))))
    return {"model_path": str(tp / "m")}


def edit_weights(td, tp, edit):
    over = model_copy(td, tp)
    f = tp / "m" / "model.safetensors"
    sd = load_file(f)
    edit(sd)
    save_file(sd, f, metadata={"format": "pt"})
    return over


def case_wrong_shape(td, tp):
    return edit_weights(td, tp, lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"][:-1].clone()}))


def case_missing_tensor(td, tp):
    return edit_weights(td, tp, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))


def case_truncated_weights(td, tp):
    over = model_copy(td, tp)
    f = tp / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return over


def case_corrupt_tokenizer(td, tp):
    over = model_copy(td, tp)
    (tp / "m" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return over


def case_no_stop_token(td, tp):
    return model_copy(td, tp, edit_config=lambda c: {k: v for k, v in c.items() if k != "eos_token_id"},
                      edit_tokenizer_config=lambda c: {**c, "eos_token": "<|not_in_vocab|>"})


def case_template(source):
    return lambda td, tp: model_copy(td, tp, edit_tokenizer_config=lambda c: {**c, "chat_template": source})


def case_unknown_data_source(td, tp):
    rows = arith()
    rows[5]["data_source"] = "mystery_bench"
    return {"train_files": [write_rows(tp / "d.parquet", rows)]}


def case_dict_ground_truth(td, tp):
    rows = arith()
    for r in rows:  # one type per parquet column: every row a struct
        r["reward_model"] = {"style": "rule", "ground_truth": {"answer": r["reward_model"]["ground_truth"]}}
    return {"train_files": [write_rows(tp / "gt.parquet", rows)]}


def case_reward_syntax_error(td, tp):
    return {"reward_fn": reward_file(tp, "def score(data_source, solution_str, ground_truth, extra_info=None)\n"
                                         "    return 1.0\n")}


def case_reward_kills_worker(td, tp):
    return {"reward_fn": reward_file(tp, "import os\ndef score(data_source, solution_str, ground_truth, "
                                         "extra_info=None):\n    os._exit(7)\n"), "reward_num_workers": 1}


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
    ("agg mode", lambda td, tp: {"loss_agg_mode": "mean"}, "loss_agg_mode='mean' .*; choose one of token-mean"),
    ("token budget", lambda td, tp: {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 10},
     "ppo_max_token_len_per_gpu=10 x sp_size=1 must be >= max_prompt_length"),
    ("logger missing", lambda td, tp: {"logger": ["jsonl", "mlflow"]},
     "logger 'mlflow' is listed but mlflow is not installed"),
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
    ("resume path", lambda td, tp: {"resume": str(tp / "no_ckpt")}, "resume=.*no_ckpt.*path of a checkpoint"),
    # knobs out of range: each named with what is allowed
    ("grad clip zero", lambda td, tp: {"grad_clip": 0.0}, "grad_clip=0.0 must be > 0.*zero every update"),
    ("grad clip negative", lambda td, tp: {"grad_clip": -1.0}, "grad_clip=-1.0 must be > 0.*flip"),
    ("lr negative", lambda td, tp: {"lr": -1e-6}, "lr=-1e-06 must be >= 0"),
    ("betas", lambda td, tp: {"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\) must be two values in \[0, 1\)"),
    ("weight decay", lambda td, tp: {"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0"),
    ("seed", lambda td, tp: {"seed": -1}, "seed=-1 must be >= 0"),
    ("logprob chunk", lambda td, tp: {"logprob_chunk": 0}, "logprob_chunk=0 must be > 0"),
    ("val n", lambda td, tp: {"val_n": 0}, "val_n=0 must be > 0"),
    ("steps", lambda td, tp: {"total_training_steps": -2}, "total_training_steps=-2 must be >= 0"),
    ("reward timeout", lambda td, tp: {"reward_timeout": 0.0}, "reward_timeout=0.0 must be > 0"),
    ("reward workers", lambda td, tp: {"reward_num_workers": -1}, "reward_num_workers=-1 must be >= 0"),
    ("top_k", lambda td, tp: {"top_k": 0}, r"top_k=0 must be -1 \(off\) or > 0"),
    ("save freq", lambda td, tp: {"save_freq": -2}, "save_freq=-2 must be >= -1"),
    ("context length", lambda td, tp: {"max_response_length": 500},
     "= 564 exceeds the model's context, max_position_embeddings=512"),
    ("cuda missing", lambda td, tp: {"device": "cuda"}, "device='cuda'"),
    ("npu missing", lambda td, tp: {"device": "npu"}, "device='npu'"),
    # model directories
    ("wrong shape", case_wrong_shape, r"shape mismatch for 'model.norm.weight'.*\(31,\).*\(32,\)"),
    ("truncated weights", case_truncated_weights, "model.safetensors.*truncated or corrupt"),
    ("missing tensor", case_missing_tensor, "lacks 1 tensors.*model.layers.1.mlp.up_proj.weight"),
    ("kv heads", lambda td, tp: model_copy(td, tp, edit_config=lambda c: {**c, "num_key_value_heads": 3}),
     "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ("corrupt tokenizer", case_corrupt_tokenizer, "tokenizer.json"),
    ("no stop token", case_no_stop_token, "no stop token.*eos_token_id"),
    ("template syntax", case_template("{% for m in messages %}{{ m['content'] }"), "chat_template.*syntax error.*line 1"),
    ("template raises", case_template("{{ raise_exception('system messages only') }}"), "system messages only"),
    # data and reward
    ("unknown data source", case_unknown_data_source, "mystery_bench.*reward_fn"),
    ("ground truth type", case_dict_ground_truth, "gt.parquet.*row 0.*ground_truth"),
    ("reward import", case_reward_syntax_error, "my_reward.py.*line 2"),
    ("reward kills its worker", case_reward_kills_worker, "exit code 7"),
]


@pytest.mark.parametrize("name,make,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gives_one_clear_message(tiny_dir, tmp_path, capsys, monkeypatch, name, make, message):
    if name == "logger missing":  # the test extras install mlflow: hide it from the check
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == "mlflow" else real(mod, *a))
    over = make(tiny_dir, tmp_path)
    out = over.pop("out_dir", str(tmp_path / "run"))
    rc = T.main(trainer_argv(tiny_dir, out, **{"total_training_steps": 1, **over}))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ")
    if name != "reward raises":  # there, the user's own function's traceback follows the message, on purpose
        assert "Traceback" not in err
    import re
    assert re.search(message, err, re.S), err


def test_resume_from_a_different_model_shape(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1)) == 0
    bigger = make_model_dir(tmp_path / "bigger", hidden=48)
    rc = T.main(trainer_argv(tiny_dir, run, total_training_steps=2, model_path=str(bigger)))
    err = capsys.readouterr().err
    assert rc == 2 and "different model (hidden_size: checkpoint 32 vs model_path 48" in err
    assert (run / "checkpoints" / "step_1" / "COMPLETE").exists()  # nothing saved was lost


@pytest.mark.slow  # restarts timed-out reward workers
def test_hanging_reward_times_out_and_the_run_continues(tiny_dir, tmp_path):
    fn = reward_file(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                               "    if len(solution_str) % 5 == 0:\n        time.sleep(60)\n"  # a few
                               "    return float(len(solution_str) % 2)\n")
    assert T.main(trainer_argv(tiny_dir, tmp_path / "run", total_training_steps=1, reward_fn=fn,
                               reward_num_workers=2, reward_timeout=0.5, filter_groups_metric="score",
                               val_files=[])) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["reward/num_timeouts"] > 0


def test_repeated_non_finite_updates_stop_the_run(tiny_dir, tmp_path, capsys):
    rc = T.main(trainer_argv(tiny_dir, tmp_path / "run", total_training_steps=6, lr=1e30, max_consecutive_skips=2,
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
    cmd = [sys.executable, os.path.join(ROOT, "train_dapo.py"),
           *trainer_argv(tiny_dir, out, total_training_steps=steps, **over)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    p = launch(tiny_dir, out)
    assert p.wait(timeout=300) == 0, p.stdout.read()
    return run_metrics(out)


@pytest.mark.slow  # python train_dapo.py
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
    assert run_metrics(out) == uninterrupted


@pytest.mark.slow  # python train_dapo.py
@pytest.mark.parametrize("garble", ["dcp", "config.json", "trainer_state.pt"])
def test_corrupt_checkpoint_is_skipped_with_a_message(tiny_dir, tmp_path, uninterrupted, garble):
    out = tmp_path / "run"
    assert launch(tiny_dir, out, steps=2).wait(timeout=300) == 0
    newest = out / "checkpoints" / "step_2" / garble
    for f in (newest.iterdir() if newest.is_dir() else [newest]):  # garble a file of the newest checkpoint
        f.write_bytes(b"garbage")
    p = launch(tiny_dir, out)
    log = p.stdout.read()
    assert p.wait(timeout=300) == 0, log
    assert "step_2 is unusable" in log and "resumed from" in log and "step_1 at step 1" in log
    assert run_metrics(out) == uninterrupted


@pytest.mark.slow  # python train_dapo.py
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
    assert "stopped by signal" in log  # after a step, or while refilling the next (rewound to its start)
    p = launch(tiny_dir, out, save_freq=0)
    log = p.stdout.read()
    assert p.wait(timeout=300) == 0, log
    assert run_metrics(out) == uninterrupted


@pytest.mark.parametrize("stop_at", [2, 3])  # step 2 validates (test_freq=2); step 3 is the last one
def test_sigterm_during_an_update_then_resume_validates_that_step(tiny_dir, tmp_path, capsys, monkeypatch,
                                                                  stop_at):
    """A signal once a step is updating: the step finishes and is checkpointed, but the signal cuts its
    validation short; the resumed run validates it, so the metrics match the uninterrupted run's."""
    over = dict(total_training_steps=3, save_freq=0)
    reference = tmp_path / "reference"
    assert T.main(trainer_argv(tiny_dir, reference, **over)) == 0
    update, calls = T.update_policy, []

    def update_then_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == stop_at:  # the update runs to its end: the signal is seen after it
            os.kill(os.getpid(), signal.SIGTERM)
        return update(*args, **kwargs)
    monkeypatch.setattr(T, "update_policy", update_then_signal)
    out = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, out, **over)) == 0
    assert f"stopped by signal after step {stop_at}" in capsys.readouterr().out
    monkeypatch.setattr(T, "update_policy", update)
    assert T.main(trainer_argv(tiny_dir, out, **over)) == 0
    assert run_metrics(out) == run_metrics(reference)


@pytest.mark.slow  # python train_dapo.py
def test_keep_last_prunes_only_after_a_new_checkpoint(tiny_dir, tmp_path):
    out = tmp_path / "run"
    assert launch(tiny_dir, out, keep_last=1).wait(timeout=300) == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step_3"]


# -----------------------------------------------------------------------------
# resume is all or nothing; out_dir belongs to one run; signals, full disks and partial files


def test_unusable_trainer_state_and_no_older_checkpoint_stops_with_what_was_tried(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1)) == 0
    (run / "checkpoints" / "step_1" / "trainer_state.pt").write_bytes(b"not a pickle")
    before = (run / "metrics.jsonl").read_text()
    rc = T.main(trainer_argv(tiny_dir, run, total_training_steps=2))
    err = capsys.readouterr().err
    assert rc == 2 and "no usable checkpoint" in err and "step_1: trainer_state.pt" in err
    assert (run / "metrics.jsonl").read_text() == before  # nothing trained, nothing truncated


def test_explicit_resume_path_to_a_corrupt_checkpoint_is_one_line(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1)) == 0
    shard = next((run / "checkpoints" / "step_1" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    rc = T.main(trainer_argv(tiny_dir, tmp_path / "other", total_training_steps=2,
                             resume=str(run / "checkpoints" / "step_1")))
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"cannot resume from {run / 'checkpoints' / 'step_1'}: dcp/{shard.name} is truncated" in err


def test_offload_that_would_fill_the_host_stops_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(parallel, "host_memory_gib", lambda: 1e-6)
    loaded = []
    monkeypatch.setattr(T, "from_pretrained", lambda *a, **k: loaded.append(1))
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, param_offload=True)) == 2
    err = capsys.readouterr().err
    assert "GiB of host memory per GPU" in err and "shard them over more GPUs" in err, err
    assert not loaded and not (run / "metrics.jsonl").exists()


def test_resume_disable_refuses_an_earlier_runs_checkpoints(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1)) == 0
    before = (run / "metrics.jsonl").read_text()
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, resume="disable")) == 2
    assert "holds an earlier run's checkpoints" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == before


def test_optimizer_knobs_changed_at_resume_are_applied_and_announced(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, lr=1e-3, val_files=[])) == 0
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=2, lr=2e-3, weight_decay=0.0, val_files=[])) == 0
    out = capsys.readouterr().out
    assert "resume: lr=0.002 replaces the checkpoint's 0.001" in out
    assert "resume: weight_decay=0.0 replaces the checkpoint's 0.1" in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/lr"] for r in rows] == [1e-3, 2e-3]


def test_a_second_run_on_the_same_out_dir_is_refused(tiny_dir, tmp_path, capsys):
    import fcntl
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as held:  # another live run holds the lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1)) == 2
    assert "in use by pid 4242" in capsys.readouterr().err
    assert not (run / "metrics.jsonl").exists()
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, val_files=[])) == 0  # released: free again


def test_partial_last_metrics_line_is_skipped_on_resume_and_plot(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, val_files=[])) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "train/ac')  # a crash mid-write
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=2, val_files=[])) == 0
    assert "is not complete JSON" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "tr')
    if importlib.util.find_spec("matplotlib"):
        assert plot.main([str(run)]) == 0 and (run / "metrics.png").exists()


def test_full_disk_during_a_checkpoint_says_so_and_leaves_no_partial_directory(tiny_dir, tmp_path, capsys,
                                                                               monkeypatch):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, val_files=[])) == 0

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint.dcp, "save", no_space)
    rc = T.main(trainer_argv(tiny_dir, run, total_training_steps=2, val_files=[]))
    err = capsys.readouterr().err
    assert rc == 3 and "No space left on device" in err and "step_2.tmp" in err
    assert sorted(os.listdir(run / "checkpoints")) == ["step_1"]  # the older one stays, no partial one
    assert checkpoint.checkpoint_problem(str(run / "checkpoints" / "step_1")) is None


@pytest.mark.slow  # python train_dapo.py
def test_sigterm_while_dynamic_sampling_refills_forever_stops_promptly(tiny_dir, tmp_path):
    fn = reward_file(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                               "    return 0.0\n")  # no group ever varies
    out = tmp_path / "run"
    p = launch(tiny_dir, out, reward_fn=fn, filter_groups_metric="score", max_num_gen_batches=0, val_files=[],
               gen_batch_size=2)
    lines = []
    for line in p.stdout:  # progress is printed while refilling
        lines.append(line)
        if "dynamic sampling: gen batch 6" in line:
            break
    else:
        pytest.fail("".join(lines))
    p.send_signal(signal.SIGTERM)
    rest = p.communicate(timeout=60)[0]
    assert p.returncode == 0, rest
    assert "stopped by signal during step 1, which is dropped" in rest
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")  # no step was finished


# -----------------------------------------------------------------------------
# torchrun: a stop that fits in torchrun's 30 s, watchdogs on waits, one clear line when a rank fails

EXIT_AFTER_RUN = """
import atexit, sys
sys.path.insert(0, {root!r})
import parallel
atexit.register(print, "interpreter teardown ran")
if {with_group}:
    parallel.init_process_group("cpu")
print("run over", end="")  # unflushed: exit_process must flush it
parallel.shutdown()
parallel.exit_process(3)
"""


@pytest.mark.parametrize("with_group", [True, False])
def test_a_finished_cpu_run_leaves_with_its_code_and_output_but_without_interpreter_teardown(with_group):
    # gloo's threads can abort a finished process during teardown (SIGABRT), which torchrun reports as a failed
    # run; after a gloo-only group is destroyed the process skips teardown, and only then
    code = EXIT_AFTER_RUN.format(root=str(ROOT), with_group=with_group)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 3, p.stderr
    assert p.stdout == ("run over" if with_group else "run overinterpreter teardown ran\n")


def worker_pids(p) -> dict:
    """rank -> pid of the processes torchrun (the Popen p) started."""
    pids = {}
    tasks = os.listdir(f"/proc/{p.pid}/task")  # any thread of torchrun may have started a worker
    for pid in [pid for t in tasks for pid in open(f"/proc/{p.pid}/task/{t}/children").read().split()]:
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        pids[int(env["RANK"])] = int(pid)
    return pids


def wait_for_step(out, step, p, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and any(json.loads(x)["step"] >= step for x in path.read_text().splitlines()
                                 if x.endswith("}")):
            return
        time.sleep(0.05)
    pytest.fail(f"step {step} never finished: {p.stdout.read() if p.poll() is not None else 'timed out'}")


SLOW_WHEN_FLAGGED = """
import os
from reward import compute_score

def score(data_source, solution_str, ground_truth, extra_info=None):
    if os.path.exists({flag!r}):  # the test slows scoring down from some step on; the scores stay the same
        open({flag!r} + ".sleeping", "w").close()
        time.sleep(6.0)
    return compute_score(data_source, solution_str, ground_truth, extra_info)
"""


@pytest.mark.slow  # torchrun of train_dapo.py
def test_sigterm_to_torchrun_during_a_step_longer_than_30_s_leaves_a_checkpoint(tiny_dir, tmp_path):
    flag = tmp_path / "slow"
    over = dict(reward_fn=reward_file(tmp_path, SLOW_WHEN_FLAGGED.format(flag=str(flag))), reward_num_workers=1,
                total_training_steps=4, save_freq=0)
    reference = tmp_path / "reference"
    p = torchrun_trainer(tiny_dir, reference, 2, **over)
    assert p.wait(timeout=600) == 0, p.stdout.read()[-5000:]

    out = tmp_path / "run"
    p = torchrun_trainer(tiny_dir, out, 2, **over)
    wait_for_step(out, 1, p)
    flag.touch()  # from now on each response takes 6 s to score: a step takes minutes
    deadline = time.time() + 120
    while not (tmp_path / "slow.sleeping").exists() and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # torchrun forwards it and SIGKILLs its workers 30 s later
    log = p.communicate(timeout=120)[0]
    stopped_at = max(r["step"] for r in run_metrics(out))
    assert f"stopped by signal during step {stopped_at + 1}, which is dropped" in log, log[-5000:]
    assert (out / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").exists(), log[-5000:]
    print([line for line in log.splitlines() if "after the signal" in line])  # the time it took, for the record

    flag.unlink()
    p = torchrun_trainer(tiny_dir, out, 2, **over)
    log = p.communicate(timeout=600)[0]
    assert p.returncode == 0 and f"step_{stopped_at} at step {stopped_at}" in log, log[-5000:]
    assert run_metrics(out) == run_metrics(reference)  # the dropped step was redone as it would have run


@pytest.mark.slow  # torchrun of train_dapo.py
def test_a_stuck_generator_is_reported_and_stops_the_run_after_the_watchdog_limit(tiny_dir, tmp_path):
    out = tmp_path / "run"
    p = torchrun_trainer(tiny_dir, out, 2, rollout_gpus=1, total_training_steps=50, save_freq=0, val_files=[],
                         watchdog_log_s=1.0, watchdog_timeout_s=6.0)
    wait_for_step(out, 1, p)
    generator = worker_pids(p)[1]
    os.kill(generator, signal.SIGSTOP)
    try:
        log = p.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):  # torchrun SIGKILLs it 30 s after the trainer's exit
            os.kill(generator, signal.SIGKILL)
    # the trainer waits for its gen batch or in the weight broadcast before it, depending on the moment
    assert re.search(r"waiting for generator rank(\(s\))? 1( to take the weights)? since", log), log[-5000:]
    assert "error: waited" in log and "watchdog_timeout_s=6: that rank is stuck or gone" in log, log[-5000:]
    assert "train_dapo.py\", line" not in log  # one line, no traceback of ours


def reward_always_raises(tp):
    return {"reward_fn": reward_file(tp, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                         "    raise ValueError('broken')\n")}


def reward_never_varies(tp):
    return {"reward_fn": reward_file(tp, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                         "    return 0.0\n"),
            "filter_groups_metric": "score", "max_num_gen_batches": 2}


@pytest.mark.slow  # torchrun of train_dapo.py
@pytest.mark.parametrize("case,make,message", [
    ("reward fails everywhere", reward_always_raises, "scoring failed for all"),
    ("dynamic sampling starved", reward_never_varies, "dynamic sampling: after 2 gen batches"),
    ("out_dir in use", None, "in use by pid"),
])
def test_a_failing_rank_gives_one_error_line_and_the_others_one_short_line(tiny_dir, tmp_path, case, make, message):
    out = tmp_path / "run"
    lock = None
    if make is None:
        out.mkdir()
        lock = checkpoint.lock_out_dir(str(out))  # another run holds out_dir
    p = torchrun_trainer(tiny_dir, out, 2, total_training_steps=2, val_files=[], **(make(tmp_path) if make else {}))
    log = p.communicate(timeout=300)[0]
    if lock is not None:
        lock.close()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], log[-5000:]
    assert "stopped because rank" in log, log[-5000:]
    assert "Connection closed by peer" not in log and "train_dapo.py\", line" not in log, log[-5000:]


def test_resuming_past_the_last_step_says_there_is_nothing_to_train(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=2, val_files=[])) == 0
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, val_files=[])) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the checkpoint resumed is at step 2 and this run has 1 steps" in out
    assert "total_training_steps" in out and (run / "metrics.jsonl").read_text() == before


def test_readme_passes_overrides_to_torchrun_runs_after_a_double_dash():
    """torchrun's own parser takes an option after the script unless a -- ends its options."""
    for line in open(os.path.join(ROOT, "README.md")).read().splitlines():
        if line.lstrip().startswith("torchrun") and " --" in line.split("train_dapo.py", 1)[-1].split("#")[0]:
            script_args = line.split("train_dapo.py", 1)[1].split("#")[0].split()
            overrides = [a for a in script_args if a.startswith("--")]
            assert overrides[0] == "--", line


def test_watchdog_says_who_is_waited_for_then_stops_the_run():
    lines = []
    watchdog = reliability.Watchdog("generator rank 3", 0.05, 0.3, lines.append)
    with pytest.raises(reliability.WaitTimeout, match=r"waited 0 s for generator rank 3 .*watchdog_timeout_s=0.3: that rank"):
        while True:
            watchdog()
            time.sleep(0.01)
    assert len(lines) >= 3 and all(line.startswith("waiting for generator rank 3 since ") for line in lines)


def test_watchdog_ends_the_wait_at_a_stop_signal():
    stop = reliability.StopFlag(lambda msg: None)
    try:
        watchdog = reliability.Watchdog("generator rank 1", 60.0, 1800.0, lambda msg: None, stop)
        watchdog()  # no signal: keeps waiting
        stop.handler(signal.SIGTERM, None)
        with pytest.raises(reliability.StopRequested):
            watchdog()
    finally:
        stop.restore()


def test_a_half_written_checkpoint_of_a_killed_run_is_removed_after_the_next_one(tiny_dir, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_5.tmp" / "dcp").mkdir(parents=True)  # what a SIGKILL mid-write leaves
    (run / "checkpoints" / "step_5.tmp" / "dcp" / "__0_0.distcp").write_bytes(b"x" * 1000)
    assert T.main(trainer_argv(tiny_dir, run, total_training_steps=1, val_files=[])) == 0
    assert sorted(os.listdir(run / "checkpoints")) == ["step_1"]
