"""Asynchronous rollout (rollout_gpus > 0) on CPU with gloo, with the built-in engine and with vLLM generators
(tests/helpers/fake_vllm.py; one engine of two ranks in the 1 + 2 layout): the last torchrun ranks generate, the others
train. Runs are deterministic, a kill -9 then resume reproduces the uninterrupted run, no token is older than
max_staleness versions, and every prompt drawn is trained on once, in order, across resumes. Partial rollout
(max_staleness=2: gen batches are in flight when weights change) through the whole loop."""
import math
import os
import signal
import time

import pytest
import torch

import config
import train_dapo as T
from conftest import run_metrics, torchrun_trainer, trainer_argv

STEPS = 4  # save_freq=2: a checkpoint every other step, rounds asked ahead on the steps between


def torchrun(tiny_dir, out, nproc, rollout_gpus, fault=None, steps=STEPS, **over):
    over = {"total_training_steps": steps, "save_freq": 2, "rollout_gpus": rollout_gpus, **over}
    return torchrun_trainer(tiny_dir, out, nproc, fault=fault, **over)


def finish(p):
    log = p.stdout.read()
    assert p.wait(timeout=600) == 0, log[-5000:]
    return log


def check_rounds(rows, max_staleness=1):
    """Staleness (from the trajectories' versions) within the bound and reached; every round trained on follows the
    last one in the sampler's order (consumed prompts grow by the rounds' prompts: none skipped, none twice)."""
    train = [r for r in rows if "rollout/staleness_max" in r]
    assert all(r["rollout/staleness_max"] <= max_staleness for r in train)
    assert any(r["rollout/staleness_max"] == max_staleness for r in train)  # generation overlapped an update
    consumed = 0
    for r in train:
        consumed += r["sampling/num_gen_batches"] * 3  # gen_batch_size
        assert r["sampler/consumed_prompts"] == consumed, r["step"]


VLLM = {"fake_vllm": True, "rollout_engine": "vllm", "filter_groups": False}  # one gen batch a step: faster
LAYOUTS = {"1_trainer_1_generator": (2, 1, {}), "2_trainers_1_generator": (3, 1, {}),
           "1_trainer_2_generators": (3, 2, {}),
           "vllm_1_trainer_1_generator": (2, 1, VLLM), "vllm_2_trainers_1_generator": (3, 1, VLLM),
           "vllm_1_trainer_2_generators_one_engine": (3, 2, {**VLLM, "gen_tp": 2})}


@pytest.fixture(scope="module", params=list(LAYOUTS.values()), ids=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory, layout):
    out = tmp_path_factory.mktemp("async_ref") / "run"
    nproc, rollout_gpus, over = layout
    finish(torchrun(tiny_dir, out, nproc, rollout_gpus, **over))
    return run_metrics(out)


@pytest.mark.slow  # torchrun of train_dapo.py
def test_async_run_is_deterministic_and_stays_within_the_staleness_bound(tiny_dir, tmp_path, layout, uninterrupted):
    assert [r["step"] for r in uninterrupted] == list(range(STEPS + 1))
    check_rounds(uninterrupted)
    assert all(r["rollout/partial_frac"] == 0 for r in uninterrupted if r["step"])  # max_staleness=1: none in flight
    nproc, rollout_gpus, over = layout
    finish(torchrun(tiny_dir, tmp_path / "again", nproc, rollout_gpus, **over))
    assert run_metrics(tmp_path / "again") == uninterrupted


@pytest.mark.slow  # torchrun of train_dapo.py
def test_kill_9_then_resume_reproduces_the_uninterrupted_async_run(tiny_dir, tmp_path, layout, uninterrupted):
    out = tmp_path / "run"
    nproc, rollout_gpus, over = layout
    p = torchrun(tiny_dir, out, nproc, rollout_gpus, fault="update:3", **over)  # killed after step 3's update
    p.stdout.read()
    assert p.wait(timeout=600) != 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2"]
    log = finish(torchrun(tiny_dir, out, nproc, rollout_gpus, **over))
    assert "resumed from" in log and "step_2 at step 2" in log
    assert run_metrics(out) == uninterrupted


@pytest.mark.slow  # torchrun of train_dapo.py
@pytest.mark.parametrize("engine", [{}, VLLM], ids=["builtin", "vllm"])
def test_sigterm_checkpoints_on_all_ranks_and_the_resume_skips_no_prompt(tiny_dir, tmp_path, engine):
    out = tmp_path / "run"
    p = torchrun(tiny_dir, out, 2, 1, steps=6, save_freq=0, **engine)  # a round is out while steps 1-5 train
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and
                                          '"step": 1' in (out / "metrics.jsonl").read_text()):
        time.sleep(0.05)
    workers = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
    for pid in workers:  # as a cluster scheduler does: every process of the job
        os.kill(int(pid), signal.SIGTERM)
    assert "stopped by signal" in finish(p)
    stopped_at = max(r["step"] for r in run_metrics(out))
    assert stopped_at < 6 and (out / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").exists()
    finish(torchrun(tiny_dir, out, 2, 1, steps=6, save_freq=0, **engine))
    rows = run_metrics(out)
    assert [r["step"] for r in rows] == list(range(7))
    check_rounds(rows)  # the round in flight at the stop was drawn again after the resume, not lost


@pytest.mark.slow  # torchrun of train_dapo.py
def test_partial_rollout_keeps_the_per_token_bound_and_a_kill_9_loses_no_prompt(tiny_dir, tmp_path, monkeypatch):
    # each engine step of the stand-in takes 50 ms, so the weights that validation and the gen batches asked ahead
    # bring come while a gen batch is still generating
    monkeypatch.setenv("FAKE_VLLM_STEP_S", "0.05")
    over = {**VLLM, "gen_tp": 2, "max_staleness": 2, "steps": 8, "save_freq": 4}
    out = tmp_path / "run"
    p = torchrun(tiny_dir, out, 3, 2, fault="update:6", **over)  # killed after step 6's update
    p.stdout.read()
    assert p.wait(timeout=600) != 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step_4"]
    finish(torchrun(tiny_dir, out, 3, 2, **over))
    rows = run_metrics(out)
    assert [r["step"] for r in rows] == list(range(9))
    check_rounds(rows, max_staleness=2)  # per token; the prompts follow each other across the kill
    assert any(r["rollout/partial_frac"] > 0 for r in rows if r["step"])  # responses that changed versions


def test_rollout_gpus_must_leave_trainer_ranks(tiny_dir, tmp_path, capsys):
    assert T.main(trainer_argv(tiny_dir, tmp_path / "run", rollout_gpus=1)) == 2  # one process: no rank left to train
    assert "rollout_gpus=1 must be < the world size 1" in capsys.readouterr().err


@pytest.mark.parametrize("world,over,msg", [
    (2, {"rollout_gpus": 2}, "rollout_gpus=2 must be < the world size 2"),
    (4, {"rollout_gpus": 1, "tp_size": 2}, "must divide the world size 3"),  # the mesh is the trainer ranks'
    (4, {"rollout_gpus": 3, "rollout_engine": "vllm", "gen_tp": 2}, "gen_tp=2 must divide rollout_gpus=3"),
    (3, {"rollout_gpus": 2, "rollout_engine": "torch", "gen_tp": 2}, "gen_tp=2 needs rollout_engine='vllm'"),
    (3, {"rollout_gpus": 1, "rollout_engine": "vllm", "router_replay": True}, "router_replay=True is not supported"),
    (3, {"rollout_gpus": 1, "max_staleness": 0}, "max_staleness=0 must be > 0"),
    (3, {"rollout_gpus": 1, "rollout_rs_threshold": 0.5}, "rollout_rs_threshold=0.5 must be -1"),
])
def test_async_config_errors(world, over, msg):
    cfg = T.Config(train_batch_size=4, gen_batch_size=4, n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                   **over)
    with pytest.raises(T.ConfigError, match=msg):
        config.check_config(cfg, world_size=world, check_files=False)


@pytest.mark.parametrize("save_freq,total,step,expected", [
    (2, 10, 1, 1), (2, 10, 2, 0),  # none out when step 2's checkpoint is written
    (0, 10, 9, 1), (0, 10, 10, 0),  # save_freq 0: a checkpoint at the end only
    (5, 12, 3, 2), (5, 12, 4, 1), (5, 12, 11, 1), (5, 12, 12, 0),  # max_staleness 2 (below): capped by the distance
])
def test_rounds_ahead_leave_none_out_at_a_checkpoint(save_freq, total, step, expected):
    cfg = T.Config(save_freq=save_freq, max_staleness=2 if save_freq == 5 else 1)
    assert T.gen_batches_ahead(cfg, step, total) == expected


def test_rejection_mask_and_the_async_tis_default():
    old = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.9)]])
    rollout = torch.tensor([[math.log(0.2), math.log(0.3), math.log(0.4)]])  # ratios 2.5, 1, 2.25
    mask = torch.ones(1, 3)
    assert T.rollout_rs_mask(old, rollout, mask, "token", 2.4).tolist() == [[0.0, 1.0, 1.0]]
    assert T.rollout_rs_mask(rollout, old, mask, "token", 2.4).tolist() == [[0.0, 1.0, 1.0]]  # 1 / ratio: lower bound
    assert T.tis_cap(T.Config(rollout_gpus=1)) == 2.0
    assert T.tis_cap(T.Config(rollout_gpus=1, tis_imp_ratio_cap=3.0)) == 3.0
    assert T.tis_cap(T.Config()) == -1.0  # colocated: off unless asked for
