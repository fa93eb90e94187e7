"""train_dapo.py's loop: dynamic sampling, exact token-mean over micro-batches, the entropy and router terms,
resume, and a few real end-to-end steps on a tiny model."""
import copy
import importlib.util
import json
import os
import types

import pytest
import torch

import config
import data
import hf
import model as M
import parallel
import reference as ref
import train_dapo as T
from conftest import ROOT, random_batch, tiny_train_config
from tools import plot

# -----------------------------------------------------------------------------
# dynamic sampling


def fake_round(accs_per_group, n, offset):
    """A generation round whose groups have the given per-trajectory accuracies."""
    G = len(accs_per_group)
    acc = torch.tensor([a for g in accs_per_group for a in g], dtype=torch.float32)
    return T.Trajectories(
        prompt_ids=[[1]] * (G * n), response_ids=[[2]] * (G * n),
        group_ids=torch.arange(G).repeat_interleave(n) + offset, rollout_logp=torch.zeros(G * n, 4),
        response_mask=torch.ones(G * n, 4), finish_reasons=["stop"] * (G * n), data_sources=["x"] * (G * n),
        acc=acc, score=acc * 2 - 1, seq_reward=acc * 2 - 1, seq_final_reward=acc * 2 - 1)


def test_dynamic_sampling_refills_across_rounds_and_trims_to_whole_groups():
    cfg = T.Config(train_batch_size=3, gen_batch_size=2, n=2, max_response_length=4)
    rounds = [[[1, 0], [1, 1]],  # 1 varying group
              [[0, 0], [0, 0]],  # none
              [[0, 1], [1, 0]]]  # 2 more -> 3, done
    calls = []

    def gen():
        for r in range(1, 10):
            calls.append(r)
            yield fake_round(rounds[r - 1], 2, offset=10 * r)

    batch, everything, n_rounds = T.dynamic_sampling(gen(), cfg)
    assert n_rounds == 3 and calls == [1, 2, 3]  # no round generated beyond the one that completes the batch
    assert len(everything) == 12 and len(batch) == 6
    assert batch.group_ids.tolist() == [10, 10, 30, 30, 31, 31]
    assert batch.acc.tolist() == [1, 0, 0, 1, 1, 0]


def test_dynamic_sampling_keeps_exactly_train_batch_size_groups():
    cfg = T.Config(train_batch_size=1, gen_batch_size=3, n=2, max_response_length=4)
    batch, _, n_rounds = T.dynamic_sampling(iter([fake_round([[1, 0], [0, 1], [1, 0]], 2, 0)]), cfg)
    assert n_rounds == 1 and batch.group_ids.tolist() == [0, 0]


def test_dynamic_sampling_error_names_numbers_and_knobs():
    cfg = T.Config(train_batch_size=2, gen_batch_size=2, n=2, max_response_length=4, max_num_gen_batches=3)
    with pytest.raises(T.RunError, match="after 3 gen batches of 2 prompts only 1 of "
                                           "train_batch_size=2.*max_num_gen_batches"):
        T.dynamic_sampling((fake_round([[1, 0], [1, 1]] if r == 1 else [[0, 0], [1, 1]], 2, 10 * r)
                            for r in range(1, 5)), cfg)


def test_a_stop_while_refilling_ends_dynamic_sampling():
    cfg = T.Config(train_batch_size=2, gen_batch_size=2, n=2, max_response_length=4, max_num_gen_batches=0)
    made = []

    def gen_batches():  # never enough varying groups: without the stop this would refill forever
        for r in range(1, 100):
            if r == 4:
                raise T.StopRequested  # what the rollout's agreement raises once a rank got a signal
            made.append(r)
            yield fake_round([[0, 0], [1, 1]], 2, 10 * r)

    with pytest.raises(T.StopRequested):
        T.dynamic_sampling(gen_batches(), cfg)
    assert made == [1, 2, 3]


def test_no_filter_takes_the_first_round():
    cfg = T.Config(train_batch_size=2, gen_batch_size=2, n=2, max_response_length=4, filter_groups=False)
    batch, _, n_rounds = T.dynamic_sampling(iter([fake_round([[1, 1], [0, 0]], 2, 0)]), cfg)
    assert n_rounds == 1 and len(batch) == 4


# -----------------------------------------------------------------------------
# token-mean over the whole mini-batch is exact whatever the micro-batch split


def grads_after_update(cfg, traj, m=None):
    if m is None:
        cfg_m = M.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1)
        m = M.Transformer(cfg_m).init_weights(seed=0).double()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    seen = []  # the gradients the optimizer step reads (update_policy frees them after it)
    opt.register_step_pre_hook(lambda *_: seen.append(torch.cat([
        p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten() for p in m.parameters()])))
    sched = T.make_scheduler(opt, cfg, 1)
    T.update_policy(m, opt, sched, traj, cfg, parallel.init_distributed("cpu"))
    assert len(seen) == 1  # one mini-batch: one optimizer step
    assert all(p.grad is None for p in m.parameters())  # freed for the rollout
    return seen[0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_split_does_not_change_gradients(mode):
    traj = random_batch()
    base = dict(train_batch_size=3, n=2, ppo_mini_batch_size=3, max_response_length=7, grad_clip=1e9,
                loss_agg_mode=mode, entropy_coeff=0.01, temperature=1.0)
    whole = grads_after_update(T.Config(**base, ppo_micro_batch_size_per_gpu=6), traj)
    for split in (1, 2, 3):
        g = grads_after_update(T.Config(**base, ppo_micro_batch_size_per_gpu=split), traj)
        assert torch.allclose(g, whole, atol=1e-5, rtol=1e-4), split
    budget = grads_after_update(T.Config(**base, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=15), traj)
    assert torch.allclose(budget, whole, atol=1e-5, rtol=1e-4)


def test_entropy_term_is_linear_in_its_coefficient():
    """The gradient at coefficient 0 is where the gradients at 0.5 and 1.0 extrapolate to."""
    traj = random_batch()
    base = dict(train_batch_size=3, n=2, ppo_mini_batch_size=3, max_response_length=7, grad_clip=1e9,
                temperature=1.0, ppo_micro_batch_size_per_gpu=6)
    g0, g1, g2 = (grads_after_update(T.Config(**base, entropy_coeff=c), traj) for c in (0.0, 0.5, 1.0))
    assert not torch.allclose(g1, g0)  # the term is there when the coefficient is not 0
    torch.testing.assert_close(g0, 2 * g1 - g2, rtol=1e-5, atol=1e-7)  # the log-prob head computes in fp32


def test_entropy_coefficient_zero_keeps_the_entropy_out_of_the_backward(monkeypatch):
    """With entropy_coeff=0 (DAPO) no gradient flows into the entropy (its fp32 backward over the vocabulary is
    skipped); with a coefficient it does."""
    reached = []
    real = T.sequence_logprobs

    def spy(*args, **kwargs):
        logp, ent = real(*args, **kwargs)
        if ent is not None and ent.requires_grad:
            ent.register_hook(lambda g: reached.append(True))
        return logp, ent

    monkeypatch.setattr(T, "sequence_logprobs", spy)
    base = dict(train_batch_size=3, n=2, ppo_mini_batch_size=3, max_response_length=7, temperature=1.0,
                ppo_micro_batch_size_per_gpu=6)
    grads_after_update(T.Config(**base, entropy_coeff=0.0), random_batch())
    assert reached == []
    grads_after_update(T.Config(**base, entropy_coeff=0.5), random_batch())
    assert reached


def test_router_aux_loss_adds_the_models_coefficient_times_the_load_balancing_gradient(tmp_path):
    from moe_util import save_hf_moe
    save_hf_moe(tmp_path / "moe", router_aux_loss_coef=0.5)
    load = lambda: hf.from_pretrained(str(tmp_path / "moe"), dtype=torch.float64)  # noqa: E731
    traj = random_batch(vocab=61)
    base = dict(train_batch_size=3, n=2, ppo_mini_batch_size=3, max_response_length=7, grad_clip=1e9,
                temperature=1.0, ppo_micro_batch_size_per_gpu=6)  # one micro-batch: the aux loss is its own
    plain = grads_after_update(T.Config(**base), traj, load())
    with_aux = grads_after_update(T.Config(**base, router_aux_loss=True), traj, load())
    m = load()  # the reference: 0.5 x the load-balancing loss of the same packed forward, on its own
    loads = []
    T.sequence_logprobs(m, traj, list(range(6)), T.Config(**base), with_entropy=False, router_loads=loads)
    (0.5 * M.load_balancing_loss(loads, m.config.num_experts_per_tok)).backward()
    expected = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten() for p in m.parameters()])
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(with_aux - plain, expected, rtol=0, atol=1e-4 * expected.abs().max().item())  # fp32 head


# -----------------------------------------------------------------------------
# end to end on a tiny random model (few steps, CI time)


def read_metrics(out_dir):
    return [json.loads(x) for x in open(out_dir / "metrics.jsonl")]


def stable(rows):
    """Metrics that must be identical between runs (no timings)."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


DEMO_MODEL = os.path.join(ROOT, "demo", "model")  # warm-started: answers "Answer: N", sometimes rightly


def test_end_to_end_steps_and_exact_resume(tiny_dir, tmp_path):
    """The demo model on tiny_dir's addition problems: it earns rewards (a random model never answers in the
    verifier's format), so the advantages are not the overlong penalty's alone."""
    full = tmp_path / "full"
    demo = dict(reward_num_workers=1, model_path=DEMO_MODEL, lr=2e-4)  # configs/tiny.py's (1e-3 collapses it)
    trained = T.train(tiny_train_config(tiny_dir, full, total_training_steps=3, **demo))
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["val/acc"] > 0 and max(r["train/acc"] for r in rows[1:]) > 0
    for r in rows[1:]:  # arith scores 1 for the right sum and -1 for anything else
        assert r["train/score_mean"] == pytest.approx(2 * r["train/acc"] - 1)
    for key in ("train/acc", "train/score_mean", "response_length/mean", "response_length/max",
                "response_length/clip_ratio", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                "actor/ppo_kl", "actor/grad_norm", "actor/lr", "sampling/num_gen_batches",
                "sampling/kept_group_frac", "rollout/logp_mismatch", "timing_s/gen", "timing_s/reward",
                "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/step", "perf/tokens_per_s"):
        assert key in rows[1], key
    assert rows[1]["rollout/logp_mismatch"] < 1e-4  # engine and trainer agree on log-probs before the update
    for r in rows[1:]:  # the phases (validation included) and the rest, "other", add up to the step
        phases = {k: v for k, v in r.items() if k.startswith("timing_s/") and k not in ("timing_s/step", "timing_s/sync_val")}
        assert "timing_s/other" in phases and abs(sum(phases.values()) - r["timing_s/step"]) < 1e-6
        assert r["timing_s/other"] >= 0 and ("timing_s/testing" in r) == ("val/acc" in r)
    assert "val/acc" in rows[0] and "val/acc" in rows[2] and "val/acc" in rows[3]
    assert (full / "checkpoints" / "step_3" / "COMPLETE").exists()
    export = str(full / "checkpoints" / "step_3")  # an HF model directory, usable as a model_path
    exported, initial = (hf.from_pretrained(path, dtype=torch.float32) for path in (export, DEMO_MODEL))
    for (name, p), (exported_name, q) in zip(trained.state_dict().items(), exported.state_dict().items()):
        assert exported_name == name and torch.equal(q, p), name  # the weights the run ended with
    assert any(not torch.equal(p, q) for p, q in zip(initial.parameters(), exported.parameters()))
    assert data.Tokenizer.from_pretrained(export).eos_token_ids == data.Tokenizer.from_pretrained(
        DEMO_MODEL).eos_token_ids
    config.check_config(tiny_train_config(tiny_dir, tmp_path / "from_export", model_path=export))
    if importlib.util.find_spec("matplotlib"):
        assert plot.main([str(full)]) == 0 and (full / "metrics.png").stat().st_size > 10_000

    # the stopped and resumed run keeps AdamW's states on the host between steps (optimizer_offload): the step,
    # the checkpoint and the resume bring them in, and the metrics are the uninterrupted run's
    part = tmp_path / "part"
    offload = dict(optimizer_offload=True, **demo)
    T.train(tiny_train_config(tiny_dir, part, total_training_steps=1, **offload))  # "stopped" after step 1
    T.train(tiny_train_config(tiny_dir, part, total_training_steps=3, **offload))  # resume="auto"
    resumed = [r for r in read_metrics(part) if r["step"] != 1 or "train/acc" in r]
    assert all(r["perf/optimizer_offload_s"] > 0 for r in resumed if "train/acc" in r)
    assert not any("perf/optimizer_offload_s" in r for r in rows)
    by_step = {r["step"]: r for r in stable(resumed) if "train/acc" in r}
    expected = {r["step"]: r for r in stable(rows) if "train/acc" in r}
    for s in (1, 2, 3):
        got = {k: v for k, v in by_step[s].items() if not k.startswith("val/")}
        want = {k: v for k, v in expected[s].items() if not k.startswith("val/")}
        assert got == want, s


def test_kl_loss_and_ppo_epochs_path(tiny_dir, tmp_path, monkeypatch):
    """Two epochs over two mini-batches: four optimizer steps, each on the KL (low_var_kl, token mean) of its
    mini-batch from the policy as that step found it to the reference; actor/kl_loss is their mean. The first
    step's is 0 (the policy still is the reference), the later ones are not. The in-reward KL is that of the
    policy that generated the batch, the reference itself at step 1: it subtracts exactly 0."""
    batches, weights = [], []  # what update_policy was given; the weights at each optimizer step
    real_update, real_setup = T.update_policy, T.setup

    def update(model, optimizer, scheduler, traj, *args, **kwargs):
        batches.append(copy.deepcopy(traj))
        return real_update(model, optimizer, scheduler, traj, *args, **kwargs)

    def setup(cfg):
        run = real_setup(cfg)
        run.optimizer.register_step_pre_hook(lambda *_: weights.append(copy.deepcopy(run.model.state_dict())))
        return run

    monkeypatch.setattr(T, "update_policy", update)
    monkeypatch.setattr(T, "setup", setup)
    cfg = tiny_train_config(tiny_dir, tmp_path, total_training_steps=1, use_kl_loss=True, ppo_epochs=2,
                            use_dynamic_bsz=True, ppo_max_token_len_per_gpu=200,
                            log_prob_max_token_len_per_gpu=200, val_files=[], use_kl_in_reward=True,
                            filter_groups_metric="seq_final_reward")
    T.train(cfg)
    row = read_metrics(tmp_path)[-1]
    assert row["step"] == 1 and len(batches) == 1 and len(weights) == 4
    assert row["rollout/logp_mismatch"] < 1e-4  # the old log-probs: the engine's policy's
    b = batches[0]
    assert torch.equal(b.old_logp, b.ref_logp) and torch.equal(b.seq_final_reward, b.seq_reward)

    model = hf.from_pretrained(str(tiny_dir / "model"), dtype=torch.float64)  # the reference: initial weights
    with torch.no_grad():
        ref_logp, _ = ref.batch_logprobs(model, b.prompt_ids, b.response_ids, cfg.max_response_length,
                                         cfg.temperature)
    size = cfg.ppo_mini_batch_size * cfg.n
    kls = []
    for k, state in enumerate(weights):  # epoch 0: mini-batches 0, 1; epoch 1: 0, 1
        model.load_state_dict({name: v.double() for name, v in state.items()})
        idx = list(range(k % 2 * size, (k % 2 + 1) * size))
        with torch.no_grad():
            logp, _ = ref.batch_logprobs(model, [b.prompt_ids[i] for i in idx],
                                         [b.response_ids[i] for i in idx], cfg.max_response_length,
                                         cfg.temperature)
        mask = b.response_mask[idx].double()
        kls.append(((ref.kl(logp, ref_logp[idx], "low_var_kl") * mask).sum() / mask.sum()).item())
    assert kls[0] == pytest.approx(0, abs=1e-9) and min(kls[1:]) > 1e-6
    assert row["actor/kl_loss"] == pytest.approx(sum(kls) / 4, rel=1e-4)


def test_the_cpu_demo_config_runs_a_few_steps(tmp_path):
    """configs/tiny.py as shipped (demo/model, demo/data), cut to 2 steps and a small validation."""
    cfg, _ = T.parse_args(T.Config, [os.path.join(ROOT, "configs", "tiny.py"), f"--out_dir={tmp_path}",
                           "--total_training_steps=2", "--val_max_samples=16", "--test_freq=0", "--logger=['jsonl']"])
    cfg.model_path, cfg.train_files, cfg.val_files = (os.path.join(ROOT, cfg.model_path),
                                                       [os.path.join(ROOT, f) for f in cfg.train_files],
                                                       [os.path.join(ROOT, f) for f in cfg.val_files])
    T.train(cfg)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["val/acc"] > 0.1  # the warm start already answers in the format, often correctly
    assert rows[2]["response_length/mean"] < cfg.max_response_length


def test_dynamic_sampling_explains_why_groups_are_dropped():
    """group_outcomes counts groups by why they are kept or dropped, likely_cause names the reason a step starves,
    and a starved step's error says both."""
    cfg = T.Config(train_batch_size=2, gen_batch_size=4, n=2, max_response_length=4, max_num_gen_batches=2)
    traj = fake_round([[1, 0], [1, 1], [0, 0], [0, 0]], 2, 0)  # varying, solved, failed, failed
    traj.answer_found = torch.tensor([True, True, True, True, False, False, True, False])
    out = T.group_outcomes(traj, cfg)
    assert out == {"groups_varying": 0.25, "groups_all_correct": 0.25, "groups_all_wrong": 0.5,
                   "groups_constant_other": 0.0, "no_answer_frac": 0.375, "response_length_mean": 1.0}
    assert T.likely_cause({**out, "no_answer_frac": 0.95}).startswith("no response matched the answer format")
    assert T.likely_cause({**out, "groups_all_correct": 0.9}).startswith("every group is solved")
    assert T.likely_cause({**out, "groups_all_wrong": 0.95}).startswith("every group fails")
    assert "25% varying, 25% all correct, 50% all wrong; 38% of responses without" in T.describe_outcomes(out)
    failed = fake_round([[0, 0], [0, 0]], 2, 0)
    failed.answer_found = torch.zeros(4, dtype=torch.bool)
    with pytest.raises(T.RunError, match=r"100% all wrong; 100% of responses without a parsable answer.*Likely "
                                         r"cause: no response matched the answer format"):
        T.dynamic_sampling(iter([failed, failed]), cfg)


def test_the_heap_is_frozen_once_after_the_first_step_and_unfrozen_however_the_run_ends(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    """The collector's heap freeze comes after step 1's update and before step 2's (compilation and warm-up
    are done), once, and train() undoes it on its way out, also when the run fails."""
    events = []
    update = T.update_policy

    def counted_update(*args, **kwargs):
        events.append("update")
        if len([e for e in events if e == "update"]) == fail_at:
            raise T.RunError("stop here")
        return update(*args, **kwargs)
    monkeypatch.setattr(T, "update_policy", counted_update)
    monkeypatch.setattr(T.gc, "freeze", lambda: events.append("freeze"))
    monkeypatch.setattr(T.gc, "unfreeze", lambda: events.append("unfreeze"))
    fail_at = 0
    T.train(tiny_train_config(tiny_dir, tmp_path / "a", total_training_steps=3, save_freq=-1, test_freq=0))
    assert events == ["update", "freeze", "update", "update", "unfreeze"]
    events.clear()
    fail_at = 2
    with pytest.raises(T.RunError, match="stop here"):
        T.train(tiny_train_config(tiny_dir, tmp_path / "b", total_training_steps=3, save_freq=-1, test_freq=0))
    assert events == ["update", "freeze", "update", "unfreeze"]


@pytest.mark.parametrize("param_offload,ref_param_offload,ref_offloaded", [
    (False, True, True), (True, False, False), (True, None, True), (False, None, False)])
def test_the_reference_model_offloads_on_its_own_knob(monkeypatch, param_offload, ref_param_offload,
                                                       ref_offloaded):
    """build_policy: the policy follows param_offload, the reference ref_param_offload (None: as the policy),
    in both where its shards are materialized and FSDP's offload."""
    built = []

    def fake_from_pretrained(path, dtype, device, parallelize):
        built.append((device.type, parallelize.keywords["offload"]))
        return types.SimpleNamespace(eval=lambda: types.SimpleNamespace(requires_grad_=lambda flag: None))

    monkeypatch.setattr(T, "from_pretrained", fake_from_pretrained)
    cfg = T.Config(use_kl_loss=True, param_offload=param_offload, ref_param_offload=ref_param_offload,
                   gradient_checkpointing=True, compile=False)
    dims = types.SimpleNamespace(sharded=True, device=torch.device("cuda"))
    T.build_policy(cfg, dims, "torch", torch.bfloat16, False, log=lambda msg: None)
    policy_place = ("cpu", True) if param_offload else ("cuda", False)
    assert built == [policy_place, ("cpu", True) if ref_offloaded else ("cuda", False)]
