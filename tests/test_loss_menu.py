"""The loss modes, advantage estimators and rollout corrections against float64 references written here from
the papers' and verl's formulas (ALGORITHM.md), token by token in Python floats, on fixed tensors with ragged
masks (an empty row included): each loss's value and gradient, each estimator's advantages, each importance
weight and rejection mask, to 1e-6. The default mode, estimator and token rejection stay bit-identical."""
import math
from types import SimpleNamespace

import pytest
import torch

import train_dapo as M

TOL = dict(rtol=0, atol=1e-6)
L = 6  # response width
LENGTHS = [6, 3, 1, 4, 0, 5]  # ragged; the empty row is a trajectory whose every token was rejected
MASK = torch.tensor([[1.0 if j < n else 0.0 for j in range(L)] for n in LENGTHS], dtype=torch.float64)
# p / p_old per token, row by row: inside and outside both clips, far outside (dual clip, kl_cov's penalty)
RATIOS = [1.0, 1.1, 2.2, 0.7, 0.95, 3.0, 0.5, 1.25, 12.0, 0.85, 1.6, 1.02, 0.6, 1.15, 0.9, 2.2, 0.78, 1.05,
          0.3, 1.4, 1.2, 0.6, 0.82, 1.5, 1.3, 0.75, 1.08, 0.92, 1.7, 0.65, 1.12, 0.88, 1.22, 0.97, 1.45, 0.7]
ADV_SEQ = torch.tensor([1.0, -0.6, 0.8, -1.3, 0.5, -0.4], dtype=torch.float64)  # both signs
OLD = torch.linspace(-3.0, -0.2, len(LENGTHS) * L, dtype=torch.float64).reshape(len(LENGTHS), L)
LOGP = OLD + torch.tensor(RATIOS, dtype=torch.float64).log().reshape(len(LENGTHS), L)
ADV_TOK = ADV_SEQ[:, None] * torch.linspace(1.4, 0.4, L, dtype=torch.float64)  # [T, R], varies along tokens
WEIGHT = torch.linspace(0.5, 2.0, len(LENGTHS) * L, dtype=torch.float64).reshape(len(LENGTHS), L)
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def config(**over):
    """Every knob the menu reads, at values that set each one apart (SAPO's taus differ, clip-cov cuts every
    candidate so that its random pick does not matter)."""
    knobs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                 max_response_length=L, clip_cov_ratio=1.0, clip_cov_lb=-0.5, clip_cov_ub=0.2,
                 kl_cov_ratio=0.2, ppo_kl_coef=0.7, tau_pos=1.5, tau_neg=4.0, norm_adv_by_std=True, gamma=0.9)
    return SimpleNamespace(**{**knobs, **over})


def tokens(mask=MASK):
    """(i, j) of every response token, row by row."""
    return [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j] > 0]


# -----------------------------------------------------------------------------
# references: each mode's per-token loss and its derivative in log p, from the paper's / verl's formula

def ref_vanilla(d, a, cfg):
    """PPO clip with clip-higher and dual clip; the gradient is -A r where the unclipped term is taken."""
    r = math.exp(max(-20.0, min(20.0, d)))
    l1, l2 = -a * r, -a * min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
    value, grad = (l1, -a * r) if l1 >= l2 else (l2, 0.0)
    if a < 0 and -a * cfg.clip_ratio_c < value:
        return -a * cfg.clip_ratio_c, 0.0
    return value, grad


def ref_gspo(seq_d, a, cfg):
    """GSPO: the sequence ratio s = exp(mean d) on every token; d loss / d logp_t = -A s unless clipped."""
    s = math.exp(min(seq_d, 10.0))
    l1, l2 = -a * s, -a * min(max(s, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
    return (l1, -a * s) if l1 >= l2 else (l2, 0.0)


def ref_cispo(d, a, logp, cfg):
    """CISPO: -w A log p with w = clip(r) held constant."""
    w = min(max(math.exp(d), 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
    return -w * a * logp, -w * a


def ref_sapo(d, a, cfg):
    """SAPO: -A (4 / tau) sigmoid(tau (r - 1)); derivative in log p: -A 4 sigma (1 - sigma) r."""
    tau, r = (cfg.tau_pos if a > 0 else cfg.tau_neg), math.exp(d)
    sig = 1 / (1 + math.exp(-tau * (r - 1)))
    return -a * 4 / tau * sig, -a * 4 * sig * (1 - sig) * r


def covariances(adv, logp, mask):
    """{(i, j): (A - mean A)(logp - mean logp)} over the response tokens."""
    pos = tokens(mask)
    mean_a = sum(float(adv[i, j]) for i, j in pos) / len(pos)
    mean_l = sum(float(logp[i, j]) for i, j in pos) / len(pos)
    return {(i, j): (float(adv[i, j]) - mean_a) * (float(logp[i, j]) - mean_l) for i, j in pos}


def ref_agg_weight(mask, mode, count=None):
    """d loss / d (per-token loss) of each aggregation mode: the per-token weight W [T, R]."""
    t = mask.sum(-1, keepdim=True)
    if mode == "token-mean":
        return mask / (count or float(mask.sum()))
    n = count or mask.shape[0]
    if mode == "seq-mean-token-mean":
        return torch.where(t > 0, mask / t.clamp(min=1), 0.0) / n
    return mask / n if mode == "seq-mean-token-sum" else mask / (n * L)


def reference_loss(mode, cfg, adv, mask=MASK, weight=None, count=None):
    """-> (loss, d loss / d logp [T, R], {pg_clipfrac, pg_clipfrac_lower, ppo_kl}) in float64."""
    adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
    w = torch.ones_like(mask) if weight is None else weight
    d = LOGP - OLD
    value, grad = torch.zeros_like(mask), torch.zeros_like(mask)
    clip, lower = torch.zeros_like(mask), torch.zeros_like(mask)
    pos = tokens(mask)
    if mode == "geo_mean":
        return reference_geo_mean(cfg, adv, mask, w, count)
    cov = covariances(adv, LOGP, mask)
    if mode == "kl_cov":
        k = max(int(cfg.kl_cov_ratio * len(pos)), 1)
        penalised = set(sorted(pos, key=lambda p: -cov[p])[:k])
    for i, j in pos:
        dij, a = float(d[i, j]), float(adv[i, j])
        r = math.exp(dij)
        l1, l2 = -a * r, -a * min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
        if mode == "vanilla":
            value[i, j], grad[i, j] = ref_vanilla(dij, a, cfg)
            clip[i, j] = l2 > l1
            lower[i, j] = a < 0 and max(l1, l2) > -a * cfg.clip_ratio_c
        elif mode == "gspo":
            seq_d = sum(float(d[i, k]) for k in range(LENGTHS[i])) / LENGTHS[i]
            value[i, j], grad[i, j] = ref_gspo(seq_d, a, cfg)
            s = math.exp(seq_d)
            clip[i, j] = -a * min(max(s, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high) > -a * s
        elif mode == "cispo":
            value[i, j], grad[i, j] = ref_cispo(dij, a, float(LOGP[i, j]), cfg)
            clip[i, j] = not 1 - cfg.clip_ratio_low <= r <= 1 + cfg.clip_ratio_high
        elif mode == "sapo":
            value[i, j], grad[i, j] = ref_sapo(dij, a, cfg)
        elif mode == "clip_cov":  # every candidate is cut (clip_cov_ratio 1): its loss and gradient are 0
            cut = cfg.clip_cov_lb < cov[i, j] < cfg.clip_cov_ub and not l2 > l1
            value[i, j], grad[i, j] = (0.0, 0.0) if cut else (max(l1, l2), -a * r if l1 >= l2 else 0.0)
            clip[i, j] = cut
        elif mode == "kl_cov":
            pen = (i, j) in penalised
            value[i, j] = -a * r + cfg.ppo_kl_coef * abs(dij) * pen
            grad[i, j] = -a * r + cfg.ppo_kl_coef * math.copysign(1.0, dij) * pen
            clip[i, j] = pen
    W = ref_agg_weight(mask, cfg.loss_agg_mode, count) * w
    n_tok = len(pos)
    metrics = {"pg_clipfrac": float(clip.sum()) / n_tok, "pg_clipfrac_lower": float(lower.sum()) / n_tok,
               "ppo_kl": -sum(float(d[p]) for p in pos) / n_tok}
    return float((value * W).sum()), grad * W, metrics


def reference_geo_mean(cfg, adv, mask, w, count):
    """GMPO: per sequence -mean(A) exp(mean c_t), c_t = d_t or its clamp in log space, whichever the sign of A
    makes smaller in A c_t; d loss_i / d logp_t = loss_i / n_i where c_t = d_t, 0 where clamped."""
    loss, grad = 0.0, torch.zeros_like(mask)
    clip, lower, d = torch.zeros_like(mask), torch.zeros_like(mask), LOGP - OLD
    n_seq = count or mask.shape[0]
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        cs, active = [], []
        for j in range(n):
            dij, a = float(d[i, j]), float(adv[i, j])
            dc = min(max(dij, -cfg.clip_ratio_low), cfg.clip_ratio_high)
            c = dij if a * dij <= a * dc else dc  # the pessimistic one: min over A c (A = 0: c_t is 0)
            cs.append(0.0 if a == 0 else c)
            active.append(a != 0 and c == dij)
            clip[i, j], lower[i, j] = (dij != dc) and a > 0, (dij != dc) and a < 0
        omega = math.exp(sum(math.log(float(w[i, j]) + 1e-10) for j in range(n)) / n)
        seq_loss = -sum(float(adv[i, j]) for j in range(n)) / n * math.exp(sum(cs) / n) * omega
        loss += seq_loss / n_seq
        for j in range(n):
            grad[i, j] = seq_loss / n / n_seq if active[j] else 0.0
    pos = tokens(mask)
    metrics = {"pg_clipfrac": float(clip.sum()) / len(pos),
               "pg_clipfrac_lower": float(lower.sum()) / len(pos),
               "ppo_kl": -sum(float(d[p]) for p in pos) / len(pos)}
    return loss, grad, metrics


def allowed_agg(mode):
    return ["seq-mean-token-mean"] if mode in M.SEQUENCE_LOSSES else AGG_MODES


CASES = [(mode, agg, weighted) for mode in M.POLICY_LOSSES for agg in allowed_agg(mode)
         for weighted in (False, True)]


@pytest.mark.parametrize("mode,agg,weighted", CASES)
def test_each_loss_mode_value_gradient_and_metrics_match_the_reference(mode, agg, weighted):
    cfg = config(loss_agg_mode=agg)
    adv = ADV_SEQ if mode == "geo_mean" else ADV_TOK  # GMPO's advantage is per sequence (verl's too)
    weight = WEIGHT if weighted else None
    logp = LOGP.clone().requires_grad_()
    loss, metrics = M.POLICY_LOSSES[mode](logp, OLD, adv, MASK, cfg, token_weight=weight)
    loss.backward()
    want, want_grad, want_metrics = reference_loss(mode, cfg, adv, weight=weight)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(logp.grad, want_grad, **TOL)
    for k, v in want_metrics.items():
        assert float(metrics[k]) == pytest.approx(v, abs=1e-6), k
        assert metrics[k].dim() == 0 and not metrics[k].requires_grad
    assert (logp.grad * (1 - MASK)).abs().max() == 0  # nothing flows into padding


def test_the_fixed_tensors_exercise_each_mode():
    """The cases above would miss a wrong clip or selection if nothing were clipped or selected."""
    for mode in ("vanilla", "gspo", "cispo", "geo_mean", "clip_cov", "kl_cov"):
        cfg = config(loss_agg_mode=allowed_agg(mode)[0])
        _, grad, m = reference_loss(mode, cfg, ADV_SEQ if mode == "geo_mean" else ADV_TOK)
        assert 0 < m["pg_clipfrac"] < 1, mode
        if mode in ("vanilla", "gspo", "geo_mean", "clip_cov"):  # some tokens have no gradient, not all
            assert 0 < int(((grad == 0) & (MASK > 0)).sum()) < MASK.sum(), mode
    cfg = config()
    assert 0 < reference_loss("vanilla", cfg, ADV_TOK)[2]["pg_clipfrac_lower"]  # the dual clip too
    assert 0 < reference_loss("geo_mean", config(loss_agg_mode="seq-mean-token-mean"),
                              ADV_SEQ)[2]["pg_clipfrac_lower"]
    cov, d = covariances(ADV_TOK, LOGP, MASK), LOGP - OLD
    unclipped = [v for p, v in cov.items() if 0.8 <= d[p].exp() <= 1.28 or d[p] * ADV_TOK[p] < 0]
    out_of_band = [v for v in unclipped if not cfg.clip_cov_lb < v < cfg.clip_cov_ub]
    assert min(out_of_band) < cfg.clip_cov_lb and max(out_of_band) > cfg.clip_cov_ub  # both bounds matter


@pytest.mark.parametrize("mode", list(M.POLICY_LOSSES))
def test_per_trajectory_advantages_broadcast_like_per_token_ones(mode):
    cfg = config(loss_agg_mode=allowed_agg(mode)[0])
    a, _ = M.POLICY_LOSSES[mode](LOGP, OLD, ADV_SEQ, MASK, cfg)
    b, _ = M.POLICY_LOSSES[mode](LOGP, OLD, ADV_SEQ[:, None].expand_as(LOGP).clone(), MASK, cfg)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


@pytest.mark.parametrize("mode", [m for m in M.POLICY_LOSSES if m not in M.COVARIANCE_LOSSES])
def test_parts_divided_by_the_whole_count_add_up_to_the_whole(mode):
    """What update_policy does per micro-batch: each part's loss over the mini-batch's count sums to the
    mini-batch's loss. (The covariance modes choose over what they are given: config gives them it all.)"""
    for agg in allowed_agg(mode):
        cfg = config(loss_agg_mode=agg)
        count = float(MASK.sum()) if agg == "token-mean" else float(len(MASK))
        whole, _ = M.POLICY_LOSSES[mode](LOGP, OLD, ADV_SEQ, MASK, cfg, token_weight=WEIGHT)
        parts = sum(M.POLICY_LOSSES[mode](LOGP[i:j], OLD[i:j], ADV_SEQ[i:j], MASK[i:j], cfg, count=count,
                                          token_weight=WEIGHT[i:j])[0] for i, j in ((0, 2), (2, 5), (5, 6)))
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12), agg
        want, _, _ = reference_loss(mode, cfg, ADV_SEQ, weight=WEIGHT, count=count)
        assert whole.item() == pytest.approx(want, abs=1e-6)


def test_vanilla_is_policy_loss_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(5, 9, generator=g) - 2, torch.randn(5, 9, generator=g) - 2
    mask, adv = (torch.rand(5, 9, generator=g) > 0.3).float(), torch.randn(5, generator=g)
    w = torch.rand(5, 9, generator=g)
    for agg in AGG_MODES:
        cfg = config(loss_agg_mode=agg, clip_ratio_c=10.0, max_response_length=9)
        a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        got, gm = M.vanilla_policy_loss(a, old, adv, mask, cfg, count=7.0, token_weight=w)
        want, wm = M.policy_loss(logp=b, old_logp=old, adv=adv, response_mask=mask, clip_ratio_low=0.2,
                                 clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode=agg,
                                 max_response_length=9, count=7.0, token_weight=w)
        got.backward(), want.backward()
        assert torch.equal(got, want) and torch.equal(a.grad, b.grad)
        assert gm.keys() == wm.keys() and all(torch.equal(gm[k], wm[k]) for k in gm)


def test_clip_cov_cuts_a_random_clip_cov_ratio_share_of_the_candidates():
    cfg = config(clip_cov_ratio=0.15)  # int(0.15 x 19 tokens) = 2 of the candidates
    cov = covariances(ADV_TOK, LOGP, MASK)
    d = LOGP - OLD
    candidates = {p for p, v in cov.items() if cfg.clip_cov_lb < v < cfg.clip_cov_ub
                  and not (-ADV_TOK[p] * d[p].exp().clamp(0.8, 1.28) > -ADV_TOK[p] * d[p].exp())}
    assert len(candidates) > 2
    picks = set()
    for seed in range(8):
        torch.manual_seed(seed)
        logp = LOGP.clone().requires_grad_()
        loss, m = M.clip_cov_policy_loss(logp, OLD, ADV_TOK, MASK, cfg)
        loss.backward()
        ratio_clipped = {p for p in tokens()
                         if -ADV_TOK[p] * d[p].exp().clamp(0.8, 1.28) > -ADV_TOK[p] * d[p].exp()}
        cut = {p for p in tokens() if logp.grad[p] == 0} - ratio_clipped
        assert len(cut) == 2 and cut <= candidates
        assert float(m["pg_clipfrac"]) == pytest.approx(2 / MASK.sum().item())
        picks |= cut
    assert len(picks) > 2  # the pick is random, not always the same tokens
    cfg = config(clip_cov_ratio=1e-6)  # at least one token
    _, m = M.clip_cov_policy_loss(LOGP, OLD, ADV_TOK, MASK, cfg)
    assert float(m["pg_clipfrac"]) == pytest.approx(1 / 19)


# -----------------------------------------------------------------------------
# advantage estimators

GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
ADV_LENGTHS = [4, 2, 5, 1, 3, 5, 2, 4, 3, 5]
ADV_MASK = torch.tensor([[1.0 if j < n else 0.0 for j in range(5)] for n in ADV_LENGTHS])
SEQ_REWARD = torch.tensor([1.0, -1.0, 0.5, 1.0, 0.0, 2.0, -0.5, 1.0, 0.25, 1.0])  # group 3: a tie for best
TOKEN_KL = torch.linspace(-0.2, 0.3, 50).reshape(10, 5) * ADV_MASK  # kl_coef x token KL, in-reward KL


def rewards_tensor():
    return M.token_level_rewards(SEQ_REWARD, ADV_MASK, TOKEN_KL)


def seq_rewards():
    """R_i: the reward minus the trajectory's summed in-reward KL, as Python floats."""
    return [float(r) - float(TOKEN_KL[i].sum()) for i, r in enumerate(SEQ_REWARD)]


def members(i, groups=GROUPS):
    return [k for k in range(len(groups)) if groups[k] == groups[i]]


def whiten(values):
    """{key: value} -> whitened over all values, unbiased variance + 1e-8."""
    xs = list(values.values())
    mu = sum(xs) / len(xs)
    var = sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)
    return {k: (x - mu) / math.sqrt(var + 1e-8) for k, x in values.items()}


def ref_advantages(name, cfg, groups=GROUPS):
    """Python-float advantages: [T] lists, or {(i, t): A} for the token-level estimators."""
    R = seq_rewards()
    out = []
    for i in range(len(R)):
        g = [R[k] for k in members(i, groups)]
        mu = sum(g) / len(g)
        std = math.sqrt(sum((x - mu) ** 2 for x in g) / (len(g) - 1)) if len(g) > 1 else 1.0
        if name == "grpo":
            out.append((R[i] - (mu if len(g) > 1 else 0.0)) / ((std if len(g) > 1 else 1.0) + 1e-6))
        elif name == "rloo":
            out.append(R[i] - (sum(g) - R[i]) / (len(g) - 1) if len(g) > 1 else R[i])
        elif name == "opo":
            lens = [ADV_LENGTHS[k] for k in members(i, groups)]
            base = sum(n * x for n, x in zip(lens, g)) / sum(lens) if len(g) > 1 else 0.0
            out.append(R[i] - base)
        elif name == "grpo_passk":
            best = max(g)
            first_best = next(k for k in members(i, groups) if R[k] == best)
            second = sorted(g)[-2]
            out.append((best - second) / ((std if cfg.norm_adv_by_std else 0.0) + (1e-6 if cfg.norm_adv_by_std
                                                                                     else 1.0))
                       if i == first_best else 0.0)
    if name == "reinforce_plus_plus_baseline":
        centred = {}
        for i in range(len(R)):
            g = [R[k] for k in members(i, groups)]
            for t in range(ADV_LENGTHS[i]):
                centred[i, t] = R[i] - (sum(g) / len(g) if len(g) > 1 else 0.0)
        return whiten(centred)
    if name == "reinforce_plus_plus":
        returns = {}
        for i, n in enumerate(ADV_LENGTHS):
            for t in range(n):
                returns[i, t] = sum(cfg.gamma ** (u - t) * float(rewards_tensor()[i, u]) for u in range(t, n))
        return whiten(returns)
    return out


def as_matrix(ref):
    out = torch.zeros(ADV_MASK.shape, dtype=torch.float64)
    for (i, t), v in ref.items():
        out[i, t] = v
    return out


@pytest.mark.parametrize("name", list(M.ADV_ESTIMATORS))
@pytest.mark.parametrize("norm", [True, False])
def test_each_estimator_matches_its_reference(name, norm):
    cfg = config(norm_adv_by_std=norm)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3]) if name == "grpo_passk" else GROUPS
    adv = M.ADV_ESTIMATORS[name](rewards_tensor(), ADV_MASK, groups, cfg)
    want = ref_advantages(name, cfg, groups)
    if name == "grpo" and not norm:
        R = seq_rewards()
        want = [R[i] - (sum(R[k] for k in members(i)) / len(members(i)) if len(members(i)) > 1 else 0.0)
                for i in range(len(R))]
    if isinstance(want, dict):
        assert adv.shape == ADV_MASK.shape
        torch.testing.assert_close(adv.double(), as_matrix(want), **TOL)
    else:
        assert adv.shape == (len(want),)
        torch.testing.assert_close(adv.double(), torch.tensor(want, dtype=torch.float64), **TOL)


def test_grpo_is_compute_grpo_advantages_bit_for_bit():
    for norm in (True, False):
        got = M.grpo_advantages(rewards_tensor(), ADV_MASK, GROUPS, config(norm_adv_by_std=norm))
        assert torch.equal(got, M.compute_grpo_advantages(rewards_tensor().sum(-1), GROUPS, norm))


def test_passk_gives_only_the_best_response_an_advantage_and_refuses_a_group_of_one():
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    adv = M.grpo_passk_advantages(rewards_tensor(), ADV_MASK, groups, config())
    assert int((adv != 0).sum()) == 4 and bool((adv >= 0).all())  # the best of each group, none below 0
    tie = M.token_level_rewards(torch.tensor([1.0, 0.0, 1.0]), ADV_MASK[:3])
    assert M.grpo_passk_advantages(tie, ADV_MASK[:3], torch.zeros(3), config()).abs().max() == 0
    with pytest.raises(ValueError, match="grpo_passk needs groups of 2"):
        M.grpo_passk_advantages(rewards_tensor(), ADV_MASK, GROUPS, config())


def test_token_level_rewards_put_the_reward_on_the_last_response_token():
    tlr = M.token_level_rewards(SEQ_REWARD, ADV_MASK)
    for i, n in enumerate(ADV_LENGTHS):
        assert tlr[i, n - 1] == SEQ_REWARD[i] and int((tlr[i] != 0).sum()) <= 1
    torch.testing.assert_close(rewards_tensor(), tlr - TOKEN_KL)


# -----------------------------------------------------------------------------
# rollout correction: importance weights and rejection masks against p_old / p_rollout

ROLLOUT = OLD - torch.tensor([0.05, -0.4, 0.9, -0.02, 0.3, -1.2] * 6, dtype=torch.float64).reshape(6, L) / 3


def ref_log_ratio(level, i, j):
    """log p_old / p_rollout at a level, for token (i, j)."""
    d = [float(OLD[i, k] - ROLLOUT[i, k]) for k in range(LENGTHS[i])]
    if level == "token":
        return float(OLD[i, j] - ROLLOUT[i, j])
    if level == "sequence":
        return sum(d)
    return sum(d) / len(d) if d else 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_rollout_is_weights_match_the_reference(level, normalize):
    threshold = 1.3
    got = M.rollout_is_weights(OLD, ROLLOUT, MASK, level, threshold, normalize)
    want = torch.zeros_like(MASK)
    for i, j in tokens():
        want[i, j] = min(math.exp(ref_log_ratio(level, i, j)), threshold)
    if normalize:  # mean 1 over the response tokens, or over the non-empty sequences
        per = [float(want[i, 0]) for i, n in enumerate(LENGTHS) if n] if level == "sequence" else \
              [float(want[p]) for p in tokens()]
        want = want / (sum(per) / len(per))
    torch.testing.assert_close(got, want, **TOL)
    assert 0 < int((want == want.max()).sum()) < MASK.sum() and not got.requires_grad  # some truncated


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("explicit_lower", [False, True])
def test_rollout_rs_masks_match_the_reference(level, explicit_lower):
    threshold = {"token": 1.25, "sequence": 1.25, "geometric": 1.05}[level]
    lower = {"token": 0.9, "sequence": 0.9, "geometric": 0.99}[level] if explicit_lower else -1.0
    got = M.rollout_rs_mask(OLD, ROLLOUT, MASK, level, threshold, lower)
    lo = math.log(lower) if lower > 0 else -math.log(threshold)
    want = torch.tensor([[float(lo <= ref_log_ratio(level, i, j) <= math.log(threshold)) for j in range(L)]
                         for i in range(len(LENGTHS))], dtype=torch.float64)
    torch.testing.assert_close(got.double() * MASK, want * MASK, **TOL)
    kept = (want * MASK).sum()
    assert 0 < kept < MASK.sum()  # some rejected, not all
    if lower > 0:  # the explicit lower bound matters: 1 / threshold would keep another set
        assert not torch.equal(got, M.rollout_rs_mask(OLD, ROLLOUT, MASK, level, threshold))


def test_token_rejection_keeps_the_earlier_rule_bit_for_bit():
    """rollout_rs_threshold alone is token rejection as before: |log(p_old / p_rollout)| <= log t, at the
    bounds too."""
    t = 2.0
    d = torch.tensor([0.0, math.log(t), -math.log(t), math.log(t) + 1e-7, 0.69, -0.7, 5.0, -5.0])
    old, rollout = torch.randn(3, 8) + d, torch.randn(3, 8)
    rollout = torch.cat([rollout[:1], old[1:2] - d, rollout[2:]])  # row 1: the ratios exactly at the bounds
    mask = torch.ones(3, 8)
    assert torch.equal(M.rollout_rs_mask(old, rollout, mask, "token", t),
                       ((old - rollout).abs() <= math.log(t)).float())
    assert M.rollout_rs_level(SimpleNamespace(rollout_rs=None, rollout_rs_threshold=2.0)) == "token"
    assert M.rollout_rs_level(SimpleNamespace(rollout_rs=None, rollout_rs_threshold=-1.0)) is None
    geometric = SimpleNamespace(rollout_rs="geometric", rollout_rs_threshold=1.1)
    assert M.rollout_rs_level(geometric) == "geometric"
