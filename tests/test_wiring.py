"""The DAPO objective, wired end to end, each part against a float64 reference written from ALGORITHM.md
(tests/helpers/reference.py):
- the batch the loop hands update_policy: score + overlong penalty - in-reward KL, the group advantages of
  that final reward, old and reference log-probs, the token-rejection mask;
- the gradient of each optimizer step update_policy takes: clip-higher, dual clip, aggregation over the whole
  mini-batch, KL loss, entropy bonus, truncated IS, gradient clipping;
- a few real steps in which the reward has to rise."""
import copy
import math
import os
from dataclasses import dataclass

import pytest
import torch

import hf
import model as M
import parallel
import reference as ref
import trajectories
import train_dapo as T
from conftest import random_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_MODEL = os.path.join(ROOT, "demo", "model")
DEMO_TRAIN = os.path.join(ROOT, "demo", "data", "train.parquet")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds waiting, a lot of it on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def per_token(values, mask) -> torch.Tensor:
    """values[k % len(values)] on the k-th response token (row by row), 0 elsewhere; float64 [T, width]."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    positions = mask.nonzero().tolist()
    for k, (i, j) in enumerate(positions):
        out[i, j] = values[k % len(values)]
    return out


# -----------------------------------------------------------------------------
# update_policy: each optimizer step's gradient is the DAPO objective's, knob by knob

RATIOS = [1.0, 1.1, 1.25, 1.5, 0.9, 0.7, 12.0, 0.5, 3.0]  # p / p_old per token: inside and outside the clips
ADV = [1.0, -0.6, 0.8, -1.3, -0.4, 0.9]  # per trajectory, both signs in each group (dual clip: A < 0)
OLD_OVER_ROLLOUT = [1.0, 0.5, 3.0, 1.5, 0.8]  # p_old / p_rollout: TIS weights 1, 0.5, 2 (capped), 1.5, 0.8
REF_SHIFT = [0.3, -0.5, 0.1, 0.8, -0.2]  # ref_logp - logp per token
REJECTED = [(1, 2), (1, 5), (3, 0), (5, 3)]  # (trajectory, token) out of the loss, as token rejection leaves
BASE = dict(train_batch_size=3, n=2, ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=2,
            max_response_length=7, temperature=1.0, grad_clip=1e9)
KL_LOSS = dict(use_kl_loss=True, kl_loss_coef=0.5)
ONE_EACH = dict(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1)  # 3 mini-batches of 2 micro-batches
# name: (Config overrides, old_logp left to the update's own forward, REJECTED tokens masked out)
UPDATE_CASES = {
    "dapo": ({}, False, False),  # clip-higher 0.28, dual clip 10, token-mean: the defaults
    "old_logp_from_update": ({}, True, False),  # traj.old_logp None: the forward's own log-probs, detached
    "symmetric_clip_and_dual_clip_2.5": (dict(clip_ratio_high=0.2, clip_ratio_c=2.5), False, False),
    "entropy_bonus": (dict(entropy_coeff=0.1), False, False),
    "kl_loss_low_var_kl": ({**KL_LOSS, "kl_loss_type": "low_var_kl"}, False, False),
    "kl_loss_kl": ({**KL_LOSS, "kl_loss_type": "kl"}, False, False),
    "kl_loss_abs": ({**KL_LOSS, "kl_loss_type": "abs"}, False, False),
    "kl_loss_mse": ({**KL_LOSS, "kl_loss_type": "mse"}, False, False),
    "truncated_is": (dict(tis_imp_ratio_cap=2.0), False, False),
    "truncated_is_old_logp_from_update": (dict(tis_imp_ratio_cap=2.0), True, False),
    "rejected_tokens": ({}, False, True),
    "mini_batches_and_epochs": (dict(**ONE_EACH, ppo_epochs=2), False, False),
    "seq-mean-token-mean": (dict(loss_agg_mode="seq-mean-token-mean"), False, False),
    "seq-mean-token-sum": (dict(loss_agg_mode="seq-mean-token-sum"), False, False),
    "seq-mean-token-sum-norm": (dict(loss_agg_mode="seq-mean-token-sum-norm"), False, False),
    "temperature": (dict(temperature=0.7), False, False),
    "grad_clip": (dict(grad_clip=0.05), False, False),
    "everything": (dict(entropy_coeff=0.1, **KL_LOSS, tis_imp_ratio_cap=2.0, temperature=0.7, **ONE_EACH,
                        ppo_epochs=2, loss_agg_mode="seq-mean-token-mean"), False, True),
}


def tiny_policy() -> M.Transformer:
    """A one-block float64 policy over 40 tokens with peaked distributions (init std 0.5), so that entropy and
    KL have gradients of their own."""
    cfg = M.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    return M.Transformer(cfg).init_weights(std=0.5, seed=0).double()


def designed_batch(model, cfg: T.Config, from_update: bool, rejected: bool) -> T.Trajectories:
    """random_batch's 6 trajectories (3 groups of 2, 1 to 7 response tokens) with ADV, and old, rollout and
    reference log-probs set around the model's own so that each token's ratio, TIS weight and KL are known.
    from_update: no old_logp (the update's own forward gives them, as on the loop's one-pass path)."""
    traj = random_batch(vocab=40)
    with torch.no_grad():
        logp, _ = ref.batch_logprobs(model, traj.prompt_ids, traj.response_ids, cfg.max_response_length,
                                     cfg.temperature)
    mask = traj.response_mask
    log_of = lambda values: per_token([math.log(v) for v in values], mask)  # noqa: E731
    old = logp - log_of(RATIOS)
    behaviour = logp if from_update else old
    traj.old_logp = None if from_update else old.float()
    traj.rollout_logp = (behaviour - log_of(OLD_OVER_ROLLOUT)).float()
    traj.ref_logp = (logp + per_token(REF_SHIFT, mask)).float()
    traj.adv = torch.tensor(ADV)
    if rejected:
        traj.response_mask = mask.clone()
        for i, j in REJECTED:
            assert mask[i, j] == 1
            traj.response_mask[i, j] = 0.0
    return traj


class RecordingSGD(torch.optim.SGD):
    """SGD at learning rate 0 (the weights stay put, so every mini-batch is taken at the same point) that
    keeps the gradient each step is given, after clipping."""

    def __init__(self, params):
        self.tracked = list(params)
        super().__init__(self.tracked, lr=0.0)
        self.grads = []

    def step(self, closure=None):
        self.grads.append(flat([p.grad for p in self.tracked], self.tracked))
        return super().step(closure)


def flat(grads, params) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def update_steps(model, traj, cfg: T.Config):
    """Run update_policy. -> (the gradient of each optimizer step, its metrics)"""
    opt = RecordingSGD(model.parameters())
    dims = parallel.init_distributed("cpu")
    metrics = T.update_policy(model, opt, T.make_scheduler(opt, cfg, 1), traj, cfg, dims)
    return opt.grads, metrics


def reference_steps(model, traj, cfg: T.Config, objective=None) -> list[dict]:
    """For each optimizer step (ppo_epochs x mini-batches of ppo_mini_batch_size x n trajectories, in order):
    the reference objective's terms, its gradient (clipped to grad_clip) and the norm before clipping.
    objective(idx, logp, entropy) -> the terms of the mini-batch idx; None: the DAPO objective (ref.dapo_objective)
    of traj's own advantages and log-probs."""
    def dapo(idx, logp, entropy):
        pick = lambda x: x[idx].double()  # noqa: E731
        old = logp.detach() if traj.old_logp is None else pick(traj.old_logp)
        return ref.dapo_objective(logp=logp, entropy=entropy, old_logp=old, adv=pick(traj.adv),
                                  mask=pick(traj.response_mask), cfg=cfg, ref_logp=pick(traj.ref_logp),
                                  rollout_logp=pick(traj.rollout_logp))

    objective = objective or dapo
    params = list(model.parameters())
    size = cfg.ppo_mini_batch_size * cfg.n
    steps = []
    for _ in range(cfg.ppo_epochs):
        for start in range(0, len(traj), size):
            idx = list(range(start, start + size))
            logp, entropy = ref.batch_logprobs(model, [traj.prompt_ids[i] for i in idx],
                                               [traj.response_ids[i] for i in idx], cfg.max_response_length,
                                               cfg.temperature)
            terms = objective(idx, logp, entropy)
            grad = flat(torch.autograd.grad(terms["loss"], params, allow_unused=True), params)
            norm = grad.norm().item()
            if norm > cfg.grad_clip:
                grad = grad * cfg.grad_clip / (norm + 1e-6)
            steps.append({"grad": grad, "norm": norm, **{k: v.item() for k, v in terms.items()}})
    return steps


@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_each_optimizer_step_takes_the_gradient_of_the_dapo_objective(case):
    over, from_update, rejected = UPDATE_CASES[case]
    cfg = T.Config(**{**BASE, **over})
    model = tiny_policy()
    traj = designed_batch(model, cfg, from_update, rejected)
    want = reference_steps(model, traj, cfg)
    got, metrics = update_steps(model, traj, cfg)

    scale = max(s["grad"].abs().max().item() for s in want)
    assert len(got) == len(want) == cfg.ppo_epochs * cfg.train_batch_size // cfg.ppo_mini_batch_size
    for k, (g, w) in enumerate(zip(got, want)):  # the policy's log-prob head runs in fp32
        torch.testing.assert_close(g, w["grad"], rtol=1e-4, atol=1e-5 * scale, msg=f"optimizer step {k}")
    mean = lambda key: sum(s[key] for s in want) / len(want)  # noqa: E731
    for key in ("pg_loss", "entropy", "kl_loss"):  # the metrics: each term averaged over the optimizer steps
        if key in want[0]:
            assert float(metrics[f"actor/{key}"]) == pytest.approx(mean(key), rel=1e-5), key
    assert metrics["actor/grad_norm"] == pytest.approx(mean("norm"), rel=1e-5)

    # the case exercises its knob: the gradient differs from the plain DAPO case's far beyond the tolerance
    if case != "dapo":
        base = T.Config(**BASE)
        plain = reference_steps(model, designed_batch(model, base, False, False), base)
        first_epoch = sum(s["grad"] for s in want[:len(want) // cfg.ppo_epochs])
        assert (first_epoch - plain[0]["grad"]).abs().max() > 1e-2 * scale
    if cfg.grad_clip < 1e9:
        assert want[0]["norm"] > 2 * cfg.grad_clip  # the clip is active



# -----------------------------------------------------------------------------
# the menu: each loss mode, advantage estimator and rollout-correction weight through update_policy

SEQ = dict(loss_agg_mode="seq-mean-token-mean")  # gspo, geo_mean, sapo: their papers' aggregation
ONE_MICRO = dict(ppo_micro_batch_size_per_gpu=6)  # clip_cov, kl_cov: one micro-batch per mini-batch
# name: (Config overrides, how adv is made: None = designed_batch's ADV, or an adv_estimator's name)
MENU_CASES = {
    "gspo": (dict(loss_mode="gspo", **SEQ), None),
    "gspo_mini_batches": (dict(loss_mode="gspo", **SEQ, **ONE_EACH, ppo_epochs=2), None),
    "cispo": (dict(loss_mode="cispo"), None),
    "cispo_seq-mean-token-sum-norm": (dict(loss_mode="cispo", loss_agg_mode="seq-mean-token-sum-norm"), None),
    "geo_mean": (dict(loss_mode="geo_mean", **SEQ, clip_ratio_low=0.4, clip_ratio_high=0.4), None),
    "sapo": (dict(loss_mode="sapo", **SEQ, tau_pos=1.5, tau_neg=4.0), None),
    "clip_cov": (dict(loss_mode="clip_cov", **ONE_MICRO, clip_cov_ratio=1.0, clip_cov_lb=-0.5,
                      clip_cov_ub=0.5), None),
    "kl_cov": (dict(loss_mode="kl_cov", **ONE_MICRO, kl_cov_ratio=0.25, ppo_kl_coef=0.5), None),
    "kl_cov_mini_batches": (dict(loss_mode="kl_cov", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=2,
                                 ppo_epochs=2, kl_cov_ratio=0.25, ppo_kl_coef=0.5), None),
    "rollout_is_token": (dict(rollout_is="token", rollout_is_threshold=2.0), None),
    "rollout_is_sequence": (dict(rollout_is="sequence", rollout_is_threshold=2.0), None),
    "rollout_is_token_batch_normalize": (dict(rollout_is="token", rollout_is_threshold=2.0,
                                              rollout_is_batch_normalize=True), None),
    "rollout_is_sequence_batch_normalize_sapo": (dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                                      rollout_is_batch_normalize=True, loss_mode="sapo",
                                                      tau_pos=1.5, tau_neg=4.0, **SEQ), None),
    "rollout_is_token_geo_mean": (dict(rollout_is="token", rollout_is_threshold=2.0, loss_mode="geo_mean",
                                       **SEQ), None),
}
MENU_CASES.update({f"adv_{name}": (dict(adv_estimator=name, gamma=0.9), name) for name in T.ADV_ESTIMATORS})
# per trajectory: the sequence reward, and kl_coef x token KL on every response token (use_kl_in_reward)
SEQ_REWARD = [1.0, -1.0, 0.5, 0.5, 2.0, -0.5]
TOKEN_KL = [0.05, -0.1, 0.2, 0.0, -0.15, 0.12, 0.3]


def menu_batch(model, cfg, estimator):
    """designed_batch, with the advantages of `estimator` (both from train_dapo and from the reference) and the
    rollout-correction weights logprobs_for_update would add. -> (traj, reference adv, reference weights)"""
    traj = designed_batch(model, cfg, False, False)
    mask = traj.response_mask
    want_adv = traj.adv.double()
    if estimator is not None:
        kl = torch.tensor([[TOKEN_KL[(i + j) % len(TOKEN_KL)] for j in range(mask.shape[1])]
                           for i in range(len(mask))]) * mask
        rewards = T.token_level_rewards(torch.tensor(SEQ_REWARD), mask, kl)
        traj.adv = T.ADV_ESTIMATORS[estimator](rewards, mask, traj.group_ids, cfg)
        want_adv = ref.reference_advantages(estimator, rewards.double(), mask, traj.group_ids, cfg)
    traj.rollout_is_weights, want_w = None, None
    if cfg.rollout_is is not None:
        traj.rollout_is_weights = T.rollout_is_weights(traj.old_logp, traj.rollout_logp, mask, cfg.rollout_is,
                                                       cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize)
        want_w = ref.reference_is_weights(traj.old_logp, traj.rollout_logp, mask, cfg.rollout_is,
                                          cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize)
    return traj, want_adv, want_w


def menu_reference_steps(model, traj, cfg, adv, weight) -> list[dict]:
    """reference_steps with menu_objective: cfg's loss mode, the advantages adv and the rollout weights."""
    def menu(idx, logp, entropy):
        return ref.menu_objective(logp=logp, entropy=entropy, old_logp=traj.old_logp[idx].double(),
                                  adv=adv[idx], mask=traj.response_mask[idx].double(), cfg=cfg,
                                  weight=None if weight is None else weight[idx])
    return reference_steps(model, traj, cfg, menu)


@pytest.mark.parametrize("case", list(MENU_CASES))
def test_each_loss_mode_estimator_and_rollout_weight_is_the_gradient_update_policy_takes(case):
    over, estimator = MENU_CASES[case]
    cfg = T.Config(**{**BASE, **over})
    model = tiny_policy()
    traj, adv, weight = menu_batch(model, cfg, estimator)
    want = menu_reference_steps(model, traj, cfg, adv, weight)
    got, metrics = update_steps(model, traj, cfg)

    scale = max(s["grad"].abs().max().item() for s in want)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):  # the policy's log-prob head runs in fp32
        torch.testing.assert_close(g, w["grad"], rtol=1e-4, atol=1e-5 * scale, msg=f"optimizer step {k}")
    assert float(metrics["actor/pg_loss"]) == pytest.approx(sum(s["pg_loss"] for s in want) / len(want),
                                                            rel=1e-5)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):  # every mode logs verl's columns
        assert f"actor/{key}" in metrics
    # the case exercises its knob: its gradient differs from plain DAPO's (vanilla, GRPO, no weights)
    base = T.Config(**{**BASE, **{k: v for k, v in over.items() if k in ("ppo_mini_batch_size", "ppo_epochs",
                                                                         "ppo_micro_batch_size_per_gpu")}})
    plain_traj, plain_adv, _ = menu_batch(model, base, None)
    plain = menu_reference_steps(model, plain_traj, base, plain_adv, None)
    assert max((w["grad"] - p["grad"]).abs().max().item() for w, p in zip(want, plain)) > 1e-2 * scale


def test_vanilla_grpo_and_no_rollout_correction_are_the_defaults():
    cfg = T.Config()
    assert (cfg.loss_mode, cfg.adv_estimator, cfg.rollout_is, cfg.rollout_rs) == ("vanilla", "grpo", None, None)

# -----------------------------------------------------------------------------
# the loop: the batch update_policy is given, from the rollout of the demo model

@dataclass
class Update:
    batch: T.Trajectories
    weights: dict  # the policy's, when the update began


def record_updates(monkeypatch) -> list[Update]:
    """Make update_policy keep a copy of every batch it is given, with the weights it starts from."""
    seen, real = [], T.update_policy

    def spy(model, optimizer, scheduler, traj, *args, **kwargs):
        seen.append(Update(copy.deepcopy(traj), copy.deepcopy(model.state_dict())))
        return real(model, optimizer, scheduler, traj, *args, **kwargs)

    monkeypatch.setattr(T, "update_policy", spy)
    return seen


ENGINE_SHIFT = [0.0, 0.3, -1.0, -0.4, 1.5]  # engine minus trainer log-prob; |shift| > ln 2 is rejected at t=2


def skew_engine_logprobs(monkeypatch):
    """An engine whose log-probs differ from the trainer's by ENGINE_SHIFT (as other kernels or dtypes do)."""
    real = trajectories.generate_and_score

    def skewed(*args, **kwargs):
        traj, counts = real(*args, **kwargs)
        traj.rollout_logp = traj.rollout_logp + per_token(ENGINE_SHIFT, traj.response_mask).float()
        return traj, counts

    monkeypatch.setattr(trajectories, "generate_and_score", skewed)


def demo_cfg(out_dir, **over) -> T.Config:
    """The demo model (answers "Answer: N", often wrongly) on its addition data; at temperature 1.6 its
    responses vary in length, so the overlong penalty (from 9 of at most 14 tokens) differs within groups."""
    base = dict(model_path=DEMO_MODEL, train_files=[DEMO_TRAIN], val_files=[], max_prompt_length=32,
                max_response_length=14, overlong_buffer_len=6, train_batch_size=4, gen_batch_size=6, n=4,
                ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, temperature=1.6, lr=1e-4,
                max_num_gen_batches=20, reward_num_workers=0, cpu_threads=1, gradient_checkpointing=False,
                save_freq=-1, resume="disable", logger=["jsonl"], out_dir=str(out_dir))
    return T.Config(**{**base, **over})


KL_IN_REWARD = dict(use_kl_in_reward=True, kl_coef=1.0)
LOOP_CASES = {  # name: (Config overrides, steps, engine log-probs skewed)
    "dapo_overlong": ({}, 1, False),
    "kl_in_reward": (KL_IN_REWARD, 2, False),  # step 2: the policy has moved off the reference
    "kl_in_reward_low_var_kl": ({**KL_IN_REWARD, "kl_penalty": "low_var_kl"}, 2, False),
    "token_rejection": (dict(rollout_rs_threshold=2.0), 1, True),
    "everything": (dict(**KL_IN_REWARD, rollout_rs_threshold=2.0, tis_imp_ratio_cap=2.0, use_kl_loss=True,
                        ppo_epochs=2, ppo_mini_batch_size=2), 2, True),
    "rloo_kl_in_reward": (dict(**KL_IN_REWARD, adv_estimator="rloo"), 2, False),
    "reinforce_plus_plus_kl_in_reward": (dict(**KL_IN_REWARD, adv_estimator="reinforce_plus_plus", gamma=0.9),
                                         2, False),
    "sequence_rejection": (dict(rollout_rs="sequence", rollout_rs_threshold=2.0), 1, True),
    "geometric_rejection_sequence_is": (dict(rollout_rs="geometric", rollout_rs_threshold=1.2,
                                             rollout_is="sequence", rollout_is_threshold=3.0,
                                             rollout_is_batch_normalize=True), 1, True),
}


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_the_loop_hands_the_update_final_rewards_advantages_and_mask(case, tmp_path, monkeypatch):
    over, steps, skewed = LOOP_CASES[case]
    cfg = demo_cfg(tmp_path, total_training_steps=steps, **over)
    updates = record_updates(monkeypatch)
    if skewed:
        skew_engine_logprobs(monkeypatch)
    T.train(cfg)
    assert len(updates) == steps

    reference_model = hf.from_pretrained(DEMO_MODEL, dtype=torch.float64)  # the initial weights
    policy = hf.from_pretrained(DEMO_MODEL, dtype=torch.float64)
    width, t = cfg.max_response_length, cfg.rollout_rs_threshold
    for u in updates:
        b = u.batch
        policy.load_state_dict({k: v.double() for k, v in u.weights.items()})
        with torch.no_grad():  # the old policy generated the batch: its weights before this update
            old, _ = ref.batch_logprobs(policy, b.prompt_ids, b.response_ids, width, cfg.temperature)
            ref_logp, _ = ref.batch_logprobs(reference_model, b.prompt_ids, b.response_ids, width,
                                             cfg.temperature)
        mask = ref.response_mask(b.response_ids, width)
        groups = b.group_ids.tolist()

        # step 3: the verifier's score plus the overlong penalty
        penalty = [ref.overlong_penalty(len(r), width, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
                   for r in b.response_ids]
        seq_reward = [s + p for s, p in zip(b.score.tolist(), penalty)]
        assert b.seq_reward.tolist() == pytest.approx(seq_reward, abs=1e-6)
        # minus kl_coef x the summed KL of the generating policy from the reference
        kl_sum = (ref.kl(old, ref_logp, cfg.kl_penalty) * mask).sum(-1).tolist()
        final = seq_reward
        if cfg.use_kl_in_reward:
            final = [r - cfg.kl_coef * k for r, k in zip(seq_reward, kl_sum)]
        assert b.seq_final_reward.tolist() == pytest.approx(final, abs=1e-4)
        # step 5: advantages (adv_estimator) of the token-level rewards: the reward on the last response token,
        # minus kl_coef x token KL on every response token with use_kl_in_reward
        last = torch.zeros_like(mask)
        last[range(len(mask)), [len(r) - 1 for r in b.response_ids]] = 1
        rewards = last * torch.tensor(seq_reward, dtype=torch.float64)[:, None]
        if cfg.use_kl_in_reward:
            rewards = rewards - cfg.kl_coef * ref.kl(old, ref_logp, cfg.kl_penalty) * mask
        adv = ref.reference_advantages(cfg.adv_estimator, rewards, mask, b.group_ids, cfg)
        assert torch.allclose(b.adv.double(), adv, atol=1e-3)
        adv = adv.tolist()
        # step 6: old log-probs of the generating policy; left to the update's own forward only on one pass
        # over the batch that nothing before the update needs them for (the in-reward KL and the rollout
        # correction do)
        one_pass = cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size == cfg.train_batch_size
        correction = t > 0 or cfg.rollout_is is not None
        assert (b.old_logp is None) == (one_pass and not correction and not cfg.use_kl_in_reward)
        # rollout correction: importance weights on the response tokens, then rejection: a token (a sequence,
        # at the sequence levels) stays in the loss only where its p_old / p_rollout is in [1/t, t]
        log_ratio = (old - b.rollout_logp.double()) * mask
        if cfg.rollout_is is not None:
            want = ref.reference_is_weights(old, b.rollout_logp.double(), mask, cfg.rollout_is,
                                            cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize)
            assert torch.allclose(b.rollout_is_weights.double(), want, rtol=1e-4, atol=1e-6)
        if cfg.rollout_rs == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
        elif cfg.rollout_rs == "geometric":
            log_ratio = (log_ratio.sum(-1) / mask.sum(-1))[:, None].expand_as(mask)
        keep = mask * (log_ratio.abs() <= math.log(t)) if t > 0 else mask
        assert torch.equal(b.response_mask.double(), keep)
        if b.old_logp is not None:  # on the loss's tokens (a pass after the rejection leaves 0 on the others)
            assert ((b.old_logp.double() - old) * keep).abs().max() < 1e-4
        if cfg.use_kl_in_reward or cfg.use_kl_loss:
            assert ((b.ref_logp.double() - ref_logp) * keep).abs().max() < 1e-4

    # what the case is there to test happens in its last step
    plain = ref.grpo_advantages(b.score.tolist(), groups, cfg.norm_adv_by_std)
    adv = [a[0] if isinstance(a, list) else a for a in adv]  # a token-level estimator: its first token
    assert max(abs(x - y) for x, y in zip(adv, plain)) > 0.05  # shaping, KL and estimators move them
    if cfg.use_kl_in_reward:
        assert max(abs(k) for k in kl_sum) > 0.01
    if t > 0:
        assert 0 < int((mask - keep).sum()) < int(mask.sum())  # some tokens rejected, not all


# -----------------------------------------------------------------------------
# the direction of learning: a few real steps on a reward the tiny model can learn at once

LETTERS_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The fraction of the 8 response tokens that are lowercase ASCII letters (26 of the 259 byte tokens)."""
    return sum("a" <= c <= "z" for c in solution_str) / 8
'''


def test_the_reward_rises_within_a_few_steps(tiny_dir, tmp_path):
    """A random policy writes letters about a tenth of the time; ten updates that ascend the reward make them
    most of what it writes (about 0.9 of it; updates of the wrong sign take it to 0)."""
    (tmp_path / "letters.py").write_text(LETTERS_REWARD)
    cfg = T.Config(model_path=str(tiny_dir / "model"), train_files=[str(tiny_dir / "train.parquet")],
                   val_files=[], reward_fn=f"{tmp_path / 'letters.py'}:compute_score", max_prompt_length=64,
                   max_response_length=8, overlong_buffer=False, train_batch_size=4, gen_batch_size=4, n=8,
                   ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=32, filter_groups=False, lr=3e-2,
                   total_training_steps=10, reward_num_workers=0, cpu_threads=1, gradient_checkpointing=False,
                   save_freq=-1, resume="disable", logger=["jsonl"], out_dir=str(tmp_path / "run"))
    T.train(cfg)
    scores = [r["train/score_mean"] for r in T.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))]
    assert len(scores) == 10
    assert scores[0] < 0.2
    assert min(scores[-2:]) > 0.6, scores
