"""
What one training step passes around, and its step 3 (scoring):

- Trajectories: a batch of scored responses, one row per response (prompt and response tokens, the engine's
  log-probs, verifier accuracy and score, the reward after overlong shaping; the loop adds old and
  reference log-probs and advantages as the step goes on);
- generate_and_score: generate on a rollout engine, decode, verify, shape overlong responses -> Trajectories;
  generate_share: one engine's slice of the prompts;
- timed: the phase timer behind the timing_s/* metrics and each phase's peak memory.

The engines (rollout.py) know nothing of rewards or of the loop; train_dapo.py and async_rollout.py call
these.
"""
import contextlib
import math
import time
from dataclasses import dataclass

import torch

import reward
from rollout import SamplingParams, engine_share, generate_resumable


@dataclass
class Trajectories:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    group_ids: torch.Tensor  # [T] index of the prompt group
    rollout_logp: torch.Tensor  # [T, R] sampled-token log-probs from the engine
    response_mask: torch.Tensor  # [T, R] 1 on response tokens
    finish_reasons: list[str]
    data_sources: list[str]
    acc: torch.Tensor  # [T] verifier accuracy
    score: torch.Tensor  # [T] verifier score
    seq_reward: torch.Tensor  # [T] score + overlong penalty
    # [T] seq_reward - kl_coef * KL (use_kl_in_reward), else seq_reward
    seq_final_reward: torch.Tensor | None = None
    # [T, R] verl's token-level rewards: seq_reward on the last response token, minus kl_coef * token KL on
    # every response token (use_kl_in_reward); what the advantage estimators read
    token_level_rewards: torch.Tensor | None = None
    # [T, R] the policy version whose weights sampled each response token (after a partial rollout's weight
    # update, the rest of a response comes from the newer version; padding: the version asked for); the
    # colocated loop drops it (every token there is the step's version)
    versions: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    adv: torch.Tensor | None = None  # [T] or [T, R], as the advantage estimator gives it
    rollout_is_weights: torch.Tensor | None = None  # [T, R] rollout importance weights (rollout_is)
    response_texts: list[str] | None = None  # decoded responses, as scored
    # [T] bool: the built-in verifier parsed an answer (None: a reward_fn)
    answer_found: torch.Tensor | None = None
    # router replay: per trajectory [prompt + response - 1, layers, top_k], held by the rank that generated it
    # (routing_owner) and by the ranks that fetched it to train on it (fetch_routing); None elsewhere
    routed_experts: list | None = None
    routing_owner: torch.Tensor | None = None  # [T] the rank that generated each trajectory

    def __len__(self):
        return len(self.response_ids)

    def select(self, idx: list[int]) -> "Trajectories":
        """The trajectories at positions idx, in that order (every per-trajectory field; None stays None)."""
        rows = torch.tensor(idx, dtype=torch.long)
        picked = {}
        for name, value in self.__dict__.items():
            if isinstance(value, torch.Tensor):
                picked[name] = value[rows]
            elif isinstance(value, list):
                picked[name] = [value[i] for i in idx]
            else:
                picked[name] = value
        return Trajectories(**picked)

    def total_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))


def concat_trajectories(parts: list[Trajectories], R: int) -> Trajectories:
    """The parts' trajectories in order, as one batch; per-token fields are padded to R columns."""
    out = {}
    for k in parts[0].__dict__:
        vals = [getattr(p, k) for p in parts]
        if vals[0] is None:
            out[k] = None
        elif isinstance(vals[0], list):
            out[k] = [x for v in vals for x in v]
        elif vals[0].dim() == 2:
            out[k] = torch.cat([torch.nn.functional.pad(v, (0, R - v.shape[1])) for v in vals])
        else:
            out[k] = torch.cat(vals)
    return Trajectories(**out)


PEAK_GIB = "peak_gib"  # timing's key for the phases' peaks of torch's allocator, {phase: GiB}
_open_peaks = []  # peak bytes so far of each timed block now open on this process, outermost first


def _gpu_allocator():
    """torch.cuda where it is in use (its allocator tracks a peak), else None."""
    return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None


@contextlib.contextmanager
def timed(name: str, timing: dict):
    """Add the block's wall time to timing[name]; on a GPU also the peak of torch's allocator during the
    block to timing["peak_gib"][name] (the largest over a step's blocks of that name). The peak is reset at
    each block's start; a block inside another gives the outer one its peak, so each block's figure covers
    all of it."""
    gpu = _gpu_allocator()
    if gpu is not None:
        _open_peaks[:] = [max(p, gpu.max_memory_allocated()) for p in _open_peaks]
        gpu.reset_peak_memory_stats()
        _open_peaks.append(0)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0
        if gpu is not None:
            peak = max(_open_peaks.pop(), gpu.max_memory_allocated())
            _open_peaks[:] = [max(p, peak) for p in _open_peaks]
            peaks = timing.setdefault(PEAK_GIB, {})
            peaks[name] = max(peaks.get(name, 0.0), peak / 2**30)


def generate_and_score(engine, tokenizer, scorer, prompts: list[dict], params: SamplingParams, cfg, *,
                       group_offset: int, version: int, timing: dict, should_stop=None,
                       pause=None) -> tuple[Trajectories, dict]:
    """Generate params.n responses per prompt on this engine and score them -> (Trajectories, reward counts).
    should_stop() True (a stop signal) abandons both: GenerationStopped or reward.ScoringStopped. pause:
    partial rollout (generate_resumable)."""
    with timed("gen", timing):
        outputs, token_versions = generate_resumable(engine, [p["prompt_ids"] for p in prompts], params,
                                                     version=version, should_stop=should_stop, pause=pause)
    comps = [(p, c) for p, cs in zip(prompts, outputs) for c in cs]
    with timed("reward", timing):
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in comps]
        eos = tokenizer.special.get("eos_token")
        # a trailing EOS is not the answer
        texts = [t[:-len(eos)] if eos and t.endswith(eos) else t for t in texts]
        results, counts = scorer.score([(p["data_source"], t, p["ground_truth"], p["extra_info"])
                                        for (p, _), t in zip(comps, texts)], should_stop=should_stop)
    rollout_logp = torch.zeros(len(comps), cfg.max_response_length)
    mask = torch.zeros_like(rollout_logp)
    versions = torch.full(rollout_logp.shape, version, dtype=torch.int32)
    for i, (_, c) in enumerate(comps):
        rollout_logp[i, :len(c.token_ids)] = torch.tensor(c.logprobs) if c.logprobs is not None else math.nan
        mask[i, :len(c.token_ids)] = 1
        if token_versions is not None:
            versions[i, :len(c.token_ids)] = torch.tensor(token_versions[i], dtype=torch.int32)
    score = torch.tensor([r["score"] for r in results], dtype=torch.float32)
    answer_found = None  # a custom reward_fn need not say whether it found an answer
    if cfg.reward_fn is None:
        answer_found = torch.tensor([r["pred"] is not None for r in results])
    overlong = [reward.overlong_penalty(len(c.token_ids), cfg.max_response_length, cfg.overlong_buffer_len,
                                        cfg.overlong_penalty_factor) if cfg.overlong_buffer else 0.0
                for _, c in comps]
    traj = Trajectories(
        prompt_ids=[p["prompt_ids"] for p, _ in comps], response_ids=[c.token_ids for _, c in comps],
        group_ids=torch.arange(len(prompts)).repeat_interleave(params.n) + group_offset,
        rollout_logp=rollout_logp, response_mask=mask, finish_reasons=[c.finish_reason for _, c in comps],
        data_sources=[p["data_source"] for p, _ in comps],
        acc=torch.tensor([float(r["acc"]) for r in results]), score=score,
        seq_reward=score + torch.tensor(overlong), response_texts=texts,
        versions=versions, answer_found=answer_found,
        routed_experts=[c.routed_experts for _, c in comps] if cfg.router_replay else None)
    return traj, counts


ENGINE_SEED_STRIDE = 100003  # engine e samples with seed + 100003 e: the engines of one gen batch draw apart


def generate_share(engine, tokenizer, scorer, prompts: list[dict], params: SamplingParams, cfg, *,
                   engine_index: int, engines: int, version: int, group_offset: int, timing: dict,
                   should_stop=None, pause=None) -> tuple[Trajectories, dict]:
    """Engine `engine_index` of `engines` generates and scores its slice of the prompts, seeded apart from
    the others; should_stop() True abandons it (GenerationStopped, reward.ScoringStopped); pause: partial
    rollout."""
    _, lo, hi = engine_share(len(prompts), engines, 1, engine_index)
    params = SamplingParams(**{**params.__dict__, "seed": params.seed + ENGINE_SEED_STRIDE * engine_index})
    return generate_and_score(engine, tokenizer, scorer, prompts[lo:hi], params, cfg,
                              group_offset=group_offset + lo, version=version, timing=timing,
                              should_stop=should_stop, pause=pause)
