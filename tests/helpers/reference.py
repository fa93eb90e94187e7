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
