"""Float64 references for the tests, written from ALGORITHM.md's formulas and independent of train_dapo's own
functions: response log-probs and entropy from a plain forward of one sequence at a time (the padded path, no
packing), the overlong penalty, GRPO advantages, the KL estimators, the aggregation modes and the DAPO
objective of one mini-batch."""
import math

import torch
import torch.nn.functional as F


def response_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0):
    """log p(response token) and the entropy of the distribution it was drawn from, at `temperature`, from the
    model's logits for this sequence alone, in float64 (pass a float64 model for float64 all through).
    -> (logp [len(response_ids)], entropy [len(response_ids)])"""
    seq = torch.tensor([prompt_ids + response_ids])
    logits = model(seq[:, :-1])[0, len(prompt_ids) - 1:].double() / temperature
    log_q = torch.log_softmax(logits, -1)
    logp = log_q.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
    entropy = -(log_q.exp() * log_q).sum(-1)  # the textbook entropy, sum_v -q_v log q_v
    return logp, entropy


def batch_logprobs(model, prompts: list[list[int]], responses: list[list[int]], width: int,
                   temperature: float = 1.0):
    """response_logprobs of every trajectory, zero-padded to `width` tokens.
    -> (logp [T, width], entropy [T, width])"""
    rows = [response_logprobs(model, p, r, temperature) for p, r in zip(prompts, responses)]
    pad = lambda x: F.pad(x, (0, width - len(x)))  # noqa: E731
    return torch.stack([pad(lp) for lp, _ in rows]), torch.stack([pad(h) for _, h in rows])


def response_mask(responses: list[list[int]], width: int) -> torch.Tensor:
    """1.0 on the response tokens of each trajectory, float64 [T, width]."""
    rows = [[1.0 if j < len(r) else 0.0 for j in range(width)] for r in responses]
    return torch.tensor(rows, dtype=torch.float64)


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float) -> float:
    """ALGORITHM.md section 8: 0 up to max_length - buffer_len tokens, then linear down to -factor at
    max_length."""
    expected = max_length - buffer_len
    return min(-(length - expected) / buffer_len * factor, 0.0)


def grpo_advantages(rewards: list[float], groups: list[int], norm_by_std: bool = True, eps: float = 1e-6):
    """ALGORITHM.md section 2, in Python floats: (R - group mean) / (unbiased group std + eps); a group of one
    has mean 0 and std 1."""
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        if len(members) == 1:
            mu, sigma = 0.0, 1.0
        else:
            mu = sum(members) / len(members)
            sigma = math.sqrt(sum((x - mu) ** 2 for x in members) / (len(members) - 1))
        out.append((r - mu) / (sigma + eps) if norm_by_std else r - mu)
    return out


def kl(logp, ref_logp, kind: str):
    """ALGORITHM.md section 5, per token."""
    if kind == "kl":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "mse":
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "low_var_kl":
        k = (ref_logp - logp).clamp(-20, 20)
        return (k.exp() - k - 1).clamp(-10, 10)
    raise ValueError(kind)


def aggregate(x, mask, mode: str, max_response_length: int):
    """ALGORITHM.md section 4 over the N sequences of x [N, width]: s_j sums sequence j's masked values, t_j
    counts its tokens (a sequence with no token left counts s_j / t_j as 0)."""
    s = (x * mask).sum(-1)
    t = mask.sum(-1)
    if mode == "token-mean":
        return s.sum() / t.sum()
    if mode == "seq-mean-token-mean":
        return torch.where(t > 0, s / t.clamp(min=1), 0.0).sum() / len(s)
    if mode == "seq-mean-token-sum":
        return s.sum() / len(s)
    if mode == "seq-mean-token-sum-norm":
        return s.sum() / (len(s) * max_response_length)
    raise ValueError(mode)


def dapo_objective(*, logp, entropy, old_logp, adv, mask, cfg, ref_logp=None, rollout_logp=None) -> dict:
    """The loss that one mini-batch's optimizer step descends (ALGORITHM.md sections 3-6), from its per-token
    tensors [N, width] and advantages [N]; cfg is a train_dapo Config (only its knobs are read).
    -> {"loss", "pg_loss", "entropy", "kl_loss"} (0-dim float64 tensors; kl_loss only with use_kl_loss)"""
    a = adv[:, None].expand_as(logp)
    ratio = (logp - old_logp).clamp(-20, 20).exp()
    l1 = -a * ratio
    l2 = -a * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    c1 = torch.maximum(l1, l2)
    l3 = -a * cfg.clip_ratio_c
    per_token = torch.where(a < 0, torch.minimum(c1, l3), c1)
    cap = cfg.tis_imp_ratio_cap
    if cap > 0:  # truncated importance sampling: a constant weight per token
        per_token = per_token * (old_logp - rollout_logp).exp().clamp(max=cap).detach()
    agg = lambda x: aggregate(x, mask, cfg.loss_agg_mode, cfg.max_response_length)  # noqa: E731
    out = {"pg_loss": agg(per_token), "entropy": agg(entropy)}
    out["loss"] = out["pg_loss"] - cfg.entropy_coeff * out["entropy"]
    if cfg.use_kl_loss:
        out["kl_loss"] = agg(kl(logp, ref_logp, cfg.kl_loss_type))
        out["loss"] = out["loss"] + cfg.kl_loss_coef * out["kl_loss"]
    return out


def menu_objective(*, logp, entropy, old_logp, adv, mask, cfg, weight=None) -> dict:
    """The loss one mini-batch's optimizer step descends for cfg.loss_mode (ALGORITHM.md's loss-mode sections),
    from per-token tensors [N, width], advantages [N] or [N, width] and rollout-correction weights [N, width]
    (None: 1). -> {"loss", "pg_loss", "entropy"} (0-dim float64 tensors)"""
    a = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    w = torch.ones_like(logp) if weight is None else weight
    d = logp - old_logp
    mode, lo, hi = cfg.loss_mode, cfg.clip_ratio_low, cfg.clip_ratio_high
    t = mask.sum(-1).clamp(min=1)
    if mode == "gspo":  # the sequence ratio's value on every token, each token's own log-prob's gradient
        s = torch.exp(logp - logp.detach() + ((d * mask).sum(-1) / t)[:, None].detach())
        per_token = torch.maximum(-a * s, -a * s.clamp(1 - lo, 1 + hi))
    elif mode == "cispo":
        per_token = -d.exp().clamp(1 - lo, 1 + hi).detach() * a * logp
    elif mode == "sapo":
        tau = torch.where(a > 0, torch.tensor(cfg.tau_pos, dtype=d.dtype), torch.tensor(cfg.tau_neg, dtype=d.dtype))
        per_token = -a * 4 / tau * torch.sigmoid(tau * (d.exp() - 1))
    elif mode in ("clip_cov", "kl_cov"):
        per_token = covariance_surrogate(d, a, logp, mask, cfg)
    elif mode == "geo_mean":  # one value per sequence, on each of its tokens (seq-mean-token-mean: its mean)
        c = torch.where(a > 0, torch.minimum(d, d.clamp(-lo, hi)), torch.maximum(d, d.clamp(-lo, hi)))
        c = torch.where(a == 0, 0.0, c)
        seq = -(a * mask).sum(-1) / t * torch.exp((c * mask).sum(-1) / t)
        seq = seq * torch.exp((torch.log(w + 1e-10) * mask).sum(-1) / t)
        per_token, w = seq[:, None].expand_as(logp), torch.ones_like(logp)
    else:  # vanilla: PPO clip with clip-higher, dual clip for A < 0
        r = d.clamp(-20, 20).exp()
        c1 = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
        per_token = torch.where(a < 0, torch.minimum(c1, -a * cfg.clip_ratio_c), c1)
    agg = lambda x: aggregate(x, mask, cfg.loss_agg_mode, cfg.max_response_length)  # noqa: E731
    out = {"pg_loss": agg(per_token * w), "entropy": agg(entropy)}
    out["loss"] = out["pg_loss"] - cfg.entropy_coeff * out["entropy"]
    return out


def covariance_surrogate(d, a, logp, mask, cfg):
    """Clip-Cov and KL-Cov over these tokens (the mini-batch): cov = (A - mean A)(logp - mean logp), means over
    the response tokens. clip_cov (clip_cov_ratio large enough to cut every candidate): the PPO clip, with the
    loss of the unclipped tokens of cov in (clip_cov_lb, clip_cov_ub) zeroed. kl_cov: -A r, plus
    ppo_kl_coef |d| on the max(1, int(kl_cov_ratio x tokens)) tokens of largest cov."""
    on = mask > 0
    lp = logp.detach()
    cov = (a - a[on].mean()) * (lp - lp[on].mean())
    r = d.exp()
    if cfg.loss_mode == "clip_cov":
        l1, l2 = -a * r, -a * r.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
        cut = on & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & ~(l2 > l1)
        assert int(cut.sum()) <= max(int(cfg.clip_cov_ratio * int(on.sum())), 1)  # every candidate is cut
        return torch.where(cut, 0.0, torch.maximum(l1, l2))
    k = max(int(cfg.kl_cov_ratio * int(on.sum())), 1)
    kth = cov[on].sort(descending=True).values[k - 1]
    return -a * r + cfg.ppo_kl_coef * d.abs() * (on & (cov >= kth))


def reference_advantages(name, rewards, mask, groups, cfg):
    """Each estimator from its paper / verl's formula, in Python floats. rewards: token-level [T, R].
    -> float64 [T] or [T, R]"""
    R = rewards.sum(-1).tolist()
    lens = mask.sum(-1).tolist()
    g = groups.tolist()
    mates = [[k for k in range(len(g)) if g[k] == g[i]] for i in range(len(g))]
    mean = [sum(R[k] for k in m) / len(m) if len(m) > 1 else 0.0 for m in mates]
    std = [math.sqrt(sum((R[k] - mu) ** 2 for k in m) / (len(m) - 1)) if len(m) > 1 else 1.0
           for m, mu in zip(mates, mean)]
    if name == "grpo":
        return torch.tensor([(r - mu) / (s + 1e-6) if cfg.norm_adv_by_std else r - mu
                             for r, mu, s in zip(R, mean, std)], dtype=torch.float64)
    if name == "rloo":
        return torch.tensor([r - (sum(R[k] for k in m) - r) / (len(m) - 1) if len(m) > 1 else r
                             for r, m in zip(R, mates)], dtype=torch.float64)
    if name == "opo":
        return torch.tensor([r - sum(lens[k] * R[k] for k in m) / sum(lens[k] for k in m) if len(m) > 1 else r
                             for r, m in zip(R, mates)], dtype=torch.float64)
    if name == "grpo_passk":
        out = []
        for i, m in enumerate(mates):
            top = sorted((R[k] for k in m), reverse=True)
            best = next(k for k in m if R[k] == top[0])
            gap = (top[0] - top[1]) / (std[i] + 1e-6) if cfg.norm_adv_by_std else top[0] - top[1]
            out.append(gap if i == best else 0.0)
        return torch.tensor(out, dtype=torch.float64)
    if name == "reinforce_plus_plus":
        x = torch.tensor([[sum(cfg.gamma ** (u - t) * float(rewards[i, u]) for u in range(t, int(n)))
                           if t < n else 0.0 for t in range(mask.shape[1])] for i, n in enumerate(lens)],
                         dtype=torch.float64)
    else:  # reinforce_plus_plus_baseline: R - group mean on every response token
        x = torch.tensor([[r - mu] * mask.shape[1] for r, mu in zip(R, mean)], dtype=torch.float64)
    vals = x[mask > 0]
    return (x - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + 1e-8) * mask.double()


def reference_is_weights(old_logp, rollout_logp, mask, level, threshold, batch_normalize):
    """min(p_old / p_rollout, threshold) per token, or per sequence (product over its response), optionally
    divided by the batch mean (over response tokens, or over non-empty sequences). -> float64 [T, R]"""
    d = (old_logp - rollout_logp).double() * mask
    ratio = d.exp() if level == "token" else d.sum(-1, keepdim=True).exp().expand_as(d)
    w = ratio.clamp(max=threshold) * mask
    if batch_normalize:
        rows = mask.sum(-1) > 0
        w = w / (w[mask > 0].mean() if level == "token" else w[rows, 0].mean())
    return w
