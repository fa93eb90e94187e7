"""The DAPO/GRPO math of train_dapo.py against hand-computed values (ALGORITHM.md states the formulas)."""
import math
import typing

import numpy as np
import pytest
import torch

import train_dapo as T


def test_grpo_advantages_hand_values():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    adv = T.compute_grpo_advantages(scores, groups)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6),
                3.0 / (1.0 + 1e-6),  # a group of one: mean 0, std 1
                0.0, 0.0]  # equal scores: zero advantage, no division blow-up
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    dr = T.compute_grpo_advantages(scores, groups, norm_by_std=False)
    assert torch.allclose(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 3.0, 0.0, 0.0]))


def test_filter_groups_keeps_varying_groups_and_singletons():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert T.varying_groups(metric, groups).tolist() == [False, False, True, True, False, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_filter_groups_drops_constant_groups_of_any_value_exactly(dtype):
    """Groups whose members all hold the same non-dyadic value carry no signal and must go, whatever the float
    std of those identical values rounds to; groups that differ in the last bit stay; groups of one stay."""
    rng = np.random.default_rng(0)
    sizes = [3, 5, 6, 7, 9, 11, 12, 13]
    values = rng.uniform(-1, 1, size=200)
    std_keeps_one = False  # the test's own check that it exercises the rounding trap
    for v in values:
        for size in sizes:
            metric = torch.full((size,), v, dtype=dtype)
            std_keeps_one |= bool(np.std(metric.numpy()) > 0) or bool(metric.std() > 0)
            assert not T.varying_groups(metric, torch.zeros(size, dtype=torch.long)).any(), (v, size)
    assert std_keeps_one, "no constant group had a positive float std: the cases do not test the rounding"
    a = torch.tensor(0.37, dtype=dtype)
    metric = torch.stack([a, a, torch.nextafter(a, torch.tensor(1.0, dtype=dtype)), a, a, a, a])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])  # differs by one ulp | constant | a group of one
    assert T.varying_groups(metric, groups).tolist() == [True, True, True, False, False, False, True]


def test_kl_penalty_hand_values():
    lp, ref = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    assert torch.allclose(T.token_kl(lp, ref, "kl"), torch.tensor([1.0, -2.0]))
    assert torch.allclose(T.token_kl(lp, ref, "abs"), torch.tensor([1.0, 2.0]))
    assert torch.allclose(T.token_kl(lp, ref, "mse"), torch.tensor([0.5, 2.0]))
    # k3: k = ref - lp; exp(k) - k - 1
    assert torch.allclose(T.token_kl(lp, ref, "low_var_kl"),
                          torch.tensor([math.exp(-1) + 1 - 1, math.exp(2) - 2 - 1]))
    # clamps: k to [-20, 20], the result to [-10, 10]
    assert T.token_kl(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="unknown KL type"):
        T.token_kl(lp, ref, "k4")


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-mean", (1.5 + 4) / 2),
    ("seq-mean-token-sum", (3 + 4) / 2),
    ("seq-mean-token-sum-norm", 7 / (2 * 3)),  # / (sequences * max_response_length)
])
def test_agg_loss_modes(mode, expected):
    assert T.agg_loss(LOSS, MASK, mode, max_response_length=3).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", typing.get_args(T.AggMode))
def test_agg_loss_of_parts_with_the_whole_count_adds_up_to_the_whole(mode):
    """Each part divided by the whole batch's count (what the update does per micro-batch and rank) sums to the
    whole batch's loss."""
    loss, mask = torch.rand(5, 4, dtype=torch.float64), (torch.rand(5, 4) > 0.3).double()
    count = T.agg_count(mask, mode)
    parts = sum(T.agg_loss(loss[i:j], mask[i:j], mode, 4, count=count) for i, j in ((0, 2), (2, 3), (3, 5)))
    assert parts.item() == pytest.approx(T.agg_loss(loss, mask, mode, 4).item(), rel=1e-12)


def test_policy_loss_clip_higher_and_dual_clip_by_hand():
    ratios = torch.tensor([[1.0, 1.5, 0.5, 12.0, 3.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    old = torch.zeros(1, 5)
    logp = torch.log(ratios)
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is padding and must not count
    hp = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean")
    loss, m = T.policy_loss(logp=logp, old_logp=old, adv=adv, response_mask=mask, **hp)
    # token 1: ratio 1 -> -1; token 2: clip-higher at 1.28 -> -1.28 (clipped);
    # token 3: A<0, ratio 0.5 -> clamp to 0.8 -> 0.8 (clipped); token 4: A<0, ratio 12 -> dual clip at c=10
    assert loss.item() == pytest.approx((-1 - 1.28 + 0.8 + 10) / 4)
    assert float(m["pg_clipfrac"]) == pytest.approx(2 / 4)
    assert float(m["pg_clipfrac_lower"]) == pytest.approx(1 / 4)
    assert float(m["ppo_kl"]) == pytest.approx(-(0 + math.log(1.5) + math.log(0.5) + math.log(12)) / 4)
    # per-sequence advantages broadcast the same way
    loss1d, _ = T.policy_loss(logp=logp, old_logp=old, adv=torch.tensor([1.0]), response_mask=mask, **hp)
    # with A = +1 everywhere: ratio 0.5 -> max(-0.5, -0.8) = -0.5; ratio 12 -> max(-12, -1.28) = -1.28
    assert loss1d.item() == pytest.approx((-1 - 1.28 - 0.5 - 1.28) / 4)


def test_truncated_importance_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.5, 0.4, 0.3]]))  # p_old / p_rollout = 1, 0.5, 3 -> capped at 2
    w = T.truncated_is_weight(old.requires_grad_(), rollout, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 0.5, 2.0]) and not w.requires_grad
    logp = torch.zeros(1, 3)  # ratio 1 everywhere: per-token loss = -A
    loss, _ = T.policy_loss(logp=logp, old_logp=torch.zeros(1, 3), adv=torch.tensor([1.0]),
                            response_mask=torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.28,
                            clip_ratio_c=10.0, loss_agg_mode="token-mean", token_weight=w)
    assert loss.item() == pytest.approx(-(1.0 + 0.5 + 2.0) / 3)


def test_policy_loss_gradient_is_zero_where_clipped():
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = T.policy_loss(logp=logp, old_logp=torch.zeros(1, 2), adv=torch.tensor([[1.0, 1.0]]),
                            response_mask=torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.28,
                            clip_ratio_c=10.0, loss_agg_mode="token-mean")
    loss.backward()
    # clipped token (ratio 1.5 > 1.28): no gradient; unclipped: d(-A r / 2)/dlogp = -r/2
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-1.1 / 2)


def test_lr_schedule_warmup_then_cosine():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    cfg = T.Config(lr=1.0, lr_warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    sched = T.make_scheduler(opt, cfg, total_optimizer_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # warmup (s+1)/2, then cosine from 1 to 0.1 over the remaining 4 steps
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(0, 4)]
    assert lrs == pytest.approx(expected)
