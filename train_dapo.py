"""
DAPO / GRPO training: the Config, the algorithm and the loop, in the order of one step. Beside it, config.py
reads and checks a Config (verl_keys.py translates verl's keys), trajectories.py holds what a step passes around
and scores it, rollout.py generates, checkpoint.py saves and resumes, plan.py plans memory (--dry_run).

    python train_dapo.py configs/tiny.py                  # CPU demo: learns arithmetic in minutes
    python train_dapo.py configs/tiny.py --lr=3e-4 --n=4  # override any Config field
    python train_dapo.py configs/qwen32b.py --dry_run     # check the config, print batch arithmetic + memory
    torchrun --nproc-per-node 8 train_dapo.py configs/qwen2.5_7b_dapo.py

The algorithm is DAPO (Yu et al. 2025): GRPO's group-normalised advantages with no critic, the clipped policy
loss with a higher upper clip (clip-higher) and a dual clip for negative advantages, a token-mean loss over
the whole mini-batch, dynamic sampling (only groups whose reward varies are trained on) and overlong reward
shaping. KL terms, entropy bonus and truncated importance sampling are there as knobs; there is no critic and
no reward model. Beside DAPO's loss and GRPO's advantages the algorithm section holds the field's other choices,
each a small function named by its choice: loss_mode (POLICY_LOSSES), adv_estimator (ADV_ESTIMATORS) and the
rollout correction (rollout_is, rollout_rs). ALGORITHM.md states every formula and where nanodapo differs from
verl.

One training step, in the order this file reads:
 1. sample gen_batch_size prompts              5. advantages (adv_estimator; GRPO: group-normalised)
 2. generate n responses each                  6. old (and reference) log-probs, packed; rollout correction
 3. score them (verifier + overlong shaping)   7. ppo_epochs x mini-batches of policy-gradient updates (loss_mode)
 4. keep groups with reward variance, refill   8. metrics, validation, checkpoint
train_step runs steps 1-7; fit runs the loop around it (8, stop signals, the checks of each update).
"""
from __future__ import annotations  # Config's choice types (AggMode, ...) are declared beside their functions

import contextlib
import functools
import gc
import itertools
import json
import math
import os
import sys
import time
import typing
from typing import Literal
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

import checkpoint
import data
import parallel
import plan
import reliability
import reward
from checkpoint import CheckpointError, CheckpointInputError, fault_point
from config import ConfigError, check_config, parse_args, ref_offload
from data import Tokenizer
from hf import from_pretrained, load_config
from model import IGNORE_INDEX, load_balancing_loss, pack_sequences
from reliability import StopFlag, StopRequested, report_failure
from async_rollout import Bridge, RolloutQueue, gen_batches_ahead, serve_rollouts
from rollout import GenerationStopped, SamplingParams, TorchEngine, VLLMEngine, engine_results, resolve_engine
from trajectories import PEAK_GIB, Trajectories, concat_trajectories, generate_share, timed

# -----------------------------------------------------------------------------
# config: every knob, verl's names (prompts are counted globally, over all ranks)

@dataclass
class Config:
    # model and data
    model_path: str = "demo/model"  # HF model directory (config.json + safetensors + tokenizer files)
    train_files: list[str] = field(default_factory=lambda: ["demo/data/train.parquet"])  # verl-schema parquet
    val_files: list[str] = field(default_factory=lambda: ["demo/data/val.parquet"])  # [] = no validation
    prompt_key: str = "prompt"  # column holding the chat messages
    # chat template variables, e.g. {"enable_thinking": False}
    chat_template_kwargs: dict = field(default_factory=dict)
    max_prompt_length: int = 512  # templated prompt tokens
    max_response_length: int = 1024  # generated tokens per response
    truncation: Literal[data.TRUNCATION_MODES] = "error"  # an overlong prompt: error, or cut left/right/middle
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length instead
    train_max_samples: int = -1  # use only the first N train prompts (-1 = all)
    val_max_samples: int = -1  # use only the first N val prompts (-1 = all)
    shuffle: bool = True  # shuffle train prompts each epoch (seeded)
    # batch sizes (ALGORITHM.md "Batch vocabulary")
    train_batch_size: int = 32  # prompt groups per training step
    gen_batch_size: int = 32  # prompts per gen batch (dynamic sampling runs gen batches until enough groups)
    n: int = 8  # responses per prompt (group size)
    ppo_mini_batch_size: int = 32  # prompts per optimizer step
    ppo_micro_batch_size_per_gpu: int = 64  # trajectories per forward/backward (ignored with use_dynamic_bsz)
    ppo_epochs: int = 1  # passes over each training batch
    use_dynamic_bsz: bool = False  # micro-batches by token budget instead of by count
    ppo_max_token_len_per_gpu: int = 16384  # token budget of one update micro-batch
    log_prob_micro_batch_size_per_gpu: int = 64  # trajectories per old/ref log-prob forward
    log_prob_max_token_len_per_gpu: int = 32768  # token budget of one log-prob micro-batch
    # policy loss (defaults are DAPO's; verl's actor defaults to clip_ratio_high 0.2, clip_ratio_c 3.0)
    clip_ratio_low: float = 0.2  # eps_low: ratio >= 1 - eps_low
    clip_ratio_high: float = 0.28  # eps_high (clip-higher): ratio <= 1 + eps_high
    clip_ratio_c: float = 10.0  # dual-clip bound for negative advantages (> 1)
    # the policy loss (ALGORITHM.md "Loss modes"): vanilla | gspo | cispo | geo_mean | clip_cov | kl_cov | sapo
    loss_mode: LossMode = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: the share of response tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance band of the tokens it may cut
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: the share of tokens (largest covariance) given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: the coefficient of |logp - old_logp| on those tokens
    tau_pos: float = 1.0  # sapo: the gate's temperature where A > 0
    tau_neg: float = 1.05  # sapo: the gate's temperature where A <= 0
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    loss_agg_mode: AggMode = "token-mean"
    # the advantage (ALGORITHM.md "Advantage estimators"): grpo | rloo | reinforce_plus_plus |
    # reinforce_plus_plus_baseline | opo | grpo_passk
    adv_estimator: AdvEstimator = "grpo"
    norm_adv_by_std: bool = True  # GRPO (and grpo_passk): divide by group std; False = Dr.GRPO
    gamma: float = 1.0  # reinforce_plus_plus: the discount of the token returns
    entropy_coeff: float = 0.0  # loss -= entropy_coeff * entropy
    router_aux_loss: bool = False  # MoE: add the load-balancing loss x router_aux_loss_coef (config.json)
    router_replay: bool = False  # MoE + vLLM: trainer forwards route each token to the experts vLLM chose
    # KL (a reference model is built only when one of these is on)
    use_kl_loss: bool = False  # add kl_loss_coef * KL(policy || ref) to the loss (GRPO)
    kl_loss_coef: float = 0.001
    kl_loss_type: KLType = "low_var_kl"  # kl | abs | mse | low_var_kl
    use_kl_in_reward: bool = False  # subtract kl_coef * KL from the reward before advantages
    kl_coef: float = 0.001
    kl_penalty: KLType = "kl"  # KL estimator for the in-reward penalty
    # dynamic sampling (DAPO)
    filter_groups: bool = True  # keep only groups whose metric varies
    filter_groups_metric: FilterMetric = "acc"  # acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 10  # gen batches per step before giving up (<= 0 = unlimited, as in verl)
    # reward
    reward_fn: str | None = None  # "path/to/file.py:function_name", or None for the built-in verifiers
    reward_num_workers: int = 2  # scoring processes (0 = score inline, no timeout)
    reward_timeout: float = 10.0  # seconds per response before it scores 0 (counted in reward/num_timeouts)
    overlong_buffer: bool = True  # DAPO overlong reward shaping
    overlong_buffer_len: int = 256  # last tokens before max_response_length where the penalty ramps up
    overlong_penalty_factor: float = 1.0  # penalty at max_response_length
    # optimizer (AdamW; verl's default weight decay is 0.01, DAPO's recipe uses 0.1)
    lr: float = 1e-6
    lr_warmup_steps: int = 0  # linear warmup, in optimizer steps
    lr_scheduler: Literal["constant", "cosine"] = "constant"  # after warmup
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    # a non-finite grad norm skips the update
    grad_clip: float = 1.0  # max global grad norm (> 0; float("inf") = no clipping)
    # activation checkpointing: all blocks, none, the first N, or "auto" (the fewest that fit the memory plan)
    gradient_checkpointing: bool | int | str = "auto"
    logprob_chunk: int = 1024  # tokens per chunk of the fp32 log-prob/entropy computation
    # sampling
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    val_n: int = 1  # samples per val prompt (val/acc is mean@val_n)
    val_temperature: float = 1.0
    val_top_p: float = 0.7
    val_top_k: int = -1
    val_do_sample: bool = True  # False = greedy validation
    # auto: vllm on CUDA when installed, else torch (the built-in engine)
    rollout_engine: Literal["auto", "torch", "vllm"] = "auto"
    max_num_seqs: int = 256  # sequences an engine decodes at once
    weight_sync_bucket_mb: int = 512  # trainer -> engine weight push, in buckets of this size
    free_cache_engine: bool = True  # the engine frees its KV cache (vLLM: and weights) after each rollout
    calculate_log_probs: bool = False  # vLLM's sampled-token log-probs, for rollout/logp_mismatch (costly)
    # vLLM engine (rollout_engine="vllm"): world_size / gen_tp engines, colocated with training
    gen_tp: int = 1  # tensor parallel size of one engine (verl: rollout.tensor_model_parallel_size)
    # the most of the GPU vLLM's weights + KV cache take while awake; its KV pool is only as large as
    # max_num_seqs sequences of max length need (vllm_kwargs={"kv_cache_memory_bytes": ..} sets it yourself)
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False  # no CUDA graphs / torch.compile in vLLM (fast start, slower decode)
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 0  # vLLM's token budget per engine step (0 = vLLM's default)
    # passed to vllm.LLM as is, e.g. {"cudagraph_capture_sizes": [..]}
    vllm_kwargs: dict = field(default_factory=dict)
    # truncated importance sampling: token losses x min(p_old / p_rollout, cap)
    tis_imp_ratio_cap: float = -1.0  # -1 = off (async mode: 2.0)
    # rollout correction over the batch (ALGORITHM.md "Rollout correction"): importance weights p_old / p_rollout
    # per token or per sequence, truncated at rollout_is_threshold; None = off
    rollout_is: RolloutIS = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False  # divide the weights by their mean over the training batch
    # rejection: drop tokens (token) or whole sequences (sequence: the product of the ratios; geometric: their
    # geometric mean) whose ratio is outside [rollout_rs_threshold_lower, rollout_rs_threshold]
    rollout_rs: RolloutRS = None  # None with rollout_rs_threshold set: token
    rollout_rs_threshold: float = -1.0  # -1 = off
    rollout_rs_threshold_lower: float = -1.0  # -1 = 1 / rollout_rs_threshold
    # asynchronous rollout (README "Asynchronous mode")
    rollout_gpus: int = 0  # 0 = colocated; N: the last N torchrun ranks only generate, the others only train
    max_staleness: int = 1  # async: step s trains on tokens sampled by policy versions >= s - max_staleness
    # async: newer weights reach the generators at their next decode step, not after the gen batch in flight;
    # its unfinished responses go on with them (each token keeps the version that sampled it)
    partial_rollout: bool = True
    # a rank waiting on another (async: the trainer for generators, a generator for requests) says so every
    # watchdog_log_s and stops the run after watchdog_timeout_s (a stuck or dead rank)
    watchdog_log_s: float = 60.0
    watchdog_timeout_s: float = 1800.0
    # parallelism (torchrun sets the world size; dp = world_size / (tp_size * sp_size) replicas see different
    # data; FSDP2 shards parameters, gradients and optimizer states over dp x sp)
    tp_size: int = 1  # tensor parallel degree for training
    sp_size: int = 1  # Ulysses sequence parallel degree: ranks that split each micro-batch's tokens
    ep_size: int = 1  # expert parallelism (MoE): ranks of the dp x sp ranks that split each layer's experts
    # torch.compile the decoder blocks (the built-in engine's too): "auto" = on CUDA GPUs, eager elsewhere
    compile: bool | Literal["auto"] = "auto"
    # FSDP2's CPU offload: fp32 params, gradients and AdamW states on the host, the optimizer step there too
    param_offload: bool = False
    ref_param_offload: bool | None = None  # reference model weights on the host (None: as param_offload)
    # AdamW's states (8 bytes a parameter) on the host between optimizer steps, on the GPU for the step itself
    optimizer_offload: bool = False
    # schedule
    total_epochs: int = 1
    total_training_steps: int = 0  # 0 = derived from total_epochs; a step = train_batch_size kept groups
    test_freq: int = 5  # validate every N steps (0 = never, except at the end if val_files)
    save_freq: int = 0  # checkpoint every N steps (0 = only at the end, -1 = never)
    val_before_train: bool = True
    log_val_generations: int = 5  # example val generations saved per validation
    # run
    out_dir: str = "out/run"  # metrics.jsonl, checkpoints/, val generations
    resume: str = "auto"  # auto (latest complete checkpoint in out_dir) | disable | path/to/checkpoint
    keep_last: int = 0  # keep only the newest N checkpoints (0 = all); pruned after a new one is complete
    max_consecutive_skips: int = 5  # stop the run after this many non-finite updates in a row
    logp_mismatch_warn: float = 0.05  # warn above this mean |rollout - trainer| logp (stale weights: ~0.1)
    seed: int = 0
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    cpu_threads: int = 0  # torch intra-op threads on CPU (0 = torch's default; 1 is fastest for tiny models)
    # compute dtype on accelerators (master weights and optimizer stay fp32)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard | wandb | mlflow
    project_name: str = "nanodapo"
    experiment_name: str = "run"
    nnodes: int = 1  # for --dry_run's arithmetic (torchrun's WORLD_SIZE wins at run time)
    n_gpus_per_node: int = 1

    def check_algorithm(self, world_size: int = 1):
        """What the chosen loss mode, estimator and rollout correction need of the other knobs (the rules live
        beside their functions, check_algorithm); config.check_config calls it."""
        check_algorithm(self, world_size)


class RunError(RuntimeError):
    """The run cannot continue (dynamic sampling starved, repeated non-finite updates, stale weights)."""


# -----------------------------------------------------------------------------
# the algorithm: small pure functions (tensors are [trajectories, response tokens] unless noted)

def compute_grpo_advantages(scores, group_ids, norm_by_std: bool = True, eps: float = 1e-6):
    """A_i = (R_i - mean_group) / (std_group + eps), std unbiased; a group of one has mean 0, std 1.
    [T] -> [T]"""
    scores = scores.double()
    adv = torch.empty_like(scores)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero()[:, 0]
        r = scores[idx]
        mu, sigma = (r.mean(), r.std()) if len(idx) > 1 else (r.new_tensor(0.0), r.new_tensor(1.0))
        adv[idx] = (r - mu) / (sigma + eps) if norm_by_std else r - mu
    return adv.float()


# advantage estimators: adv_estimator -> f(token_level_rewards, response_mask, group_ids, cfg) -> [T] or
# [T, R]. token_level_rewards [T, R]: the sequence reward on the last response token, minus kl_coef x token
# KL on every response token (use_kl_in_reward), 0 elsewhere; R_i = its sum over the trajectory

def group_sum(x, group_ids):
    """For each trajectory, the sum of x [T] over its group, and the group's size. -> ([T], [T])"""
    _, group, size = torch.unique(group_ids, return_inverse=True, return_counts=True)
    total = x.new_zeros(len(size)).index_add_(0, group, x)
    return total[group], size[group].to(x.dtype)


def masked_whiten(x, mask):
    """(x - mean) / sqrt(var + 1e-8), mean and unbiased variance over the response tokens of mask."""
    mask = mask.to(x.dtype)
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = ((x - mean).square() * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) * (var + 1e-8).rsqrt()


def grpo_advantages(token_level_rewards, response_mask, group_ids, cfg):
    """GRPO: A_i = (R_i - mean_group R) / (std_group R + 1e-6), compute_grpo_advantages. -> [T]"""
    return compute_grpo_advantages(token_level_rewards.sum(-1), group_ids, cfg.norm_adv_by_std)


def rloo_advantages(token_level_rewards, response_mask, group_ids, cfg):
    """RLOO (Ahmadian et al. 2024): each response's baseline is the mean reward of the others in its group,
        A_i = R_i - (sum_group R - R_i) / (G - 1);   a group of one: A_i = R_i. -> [T]"""
    r = token_level_rewards.sum(-1).double()
    total, size = group_sum(r, group_ids)
    return torch.where(size > 1, r - (total - r) / (size - 1).clamp(min=1), r).float()


def opo_advantages(token_level_rewards, response_mask, group_ids, cfg):
    """OPO (Hao et al. 2025): the length-weighted mean reward of the group is the baseline,
        A_i = R_i - sum_group(|y_j| R_j) / sum_group |y_j|      (|y|: response tokens)
    a group of one: A_i = R_i. -> [T]"""
    r, length = token_level_rewards.sum(-1).double(), response_mask.sum(-1).double()
    weighted, size = group_sum(length * r, group_ids)
    tokens, _ = group_sum(length, group_ids)
    return torch.where(size > 1, r - weighted / tokens.clamp(min=1), r).float()


def reinforce_plus_plus_advantages(token_level_rewards, response_mask, group_ids, cfg):
    """REINFORCE++ (Hu 2025): each token's discounted return to the end of its response (the rewards are 0
    after it), whitened over the batch's response tokens (no group baseline):
        G_t = r_t + gamma G_(t+1),   A_t = (G_t - mean G) / sqrt(var G + 1e-8)
    -> [T, R], 0 off the response"""
    rewards, mask = token_level_rewards.double(), response_mask.double()
    returns, running = torch.zeros_like(rewards), rewards.new_zeros(len(rewards))
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + cfg.gamma * running
        returns[:, t] = running
    return (masked_whiten(returns, mask) * mask).float()


def reinforce_plus_plus_baseline_advantages(token_level_rewards, response_mask, group_ids, cfg):
    """REINFORCE++-baseline (Hu 2025): the group mean is the baseline, then the batch whitens,
        A_it = whiten(R_i - mean_group R) over the batch's response tokens (a group of one: mean 0).
    -> [T, R], 0 off the response"""
    r, mask = token_level_rewards.sum(-1).double(), response_mask.double()
    total, size = group_sum(r, group_ids)
    centred = torch.where(size > 1, r - total / size, r)[:, None] * mask
    return (masked_whiten(centred, mask) * mask).float()


def grpo_passk_advantages(token_level_rewards, response_mask, group_ids, cfg):
    """Pass@k (arXiv 2503.19595, verl's grpo_passk): only the best response of each group learns,
        A_best = (R_max - R_second) / (std_group R + 1e-6)   (R_max - R_second without norm_adv_by_std),
    every other response 0 (a tie for best: 0). Groups need 2 responses or more. -> [T]"""
    r = token_level_rewards.sum(-1).double()
    adv = torch.zeros_like(r)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero()[:, 0]
        if len(idx) < 2:
            raise ValueError(f"grpo_passk needs groups of 2 responses or more; group {int(g)} has {len(idx)}")
        top, best = r[idx].topk(2)
        gap = top[0] - top[1]
        adv[idx[best[0]]] = gap / (r[idx].std() + 1e-6) if cfg.norm_adv_by_std else gap
    return adv.float()


ADV_ESTIMATORS = {"grpo": grpo_advantages, "rloo": rloo_advantages,
                  "reinforce_plus_plus": reinforce_plus_plus_advantages,
                  "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
                  "opo": opo_advantages, "grpo_passk": grpo_passk_advantages}
AdvEstimator = Literal[tuple(ADV_ESTIMATORS)]


def token_level_rewards(seq_reward, response_mask, token_kl_penalty=None):
    """[T] rewards on the last response token of each trajectory, minus token_kl_penalty [T, R] (kl_coef x
    token KL, use_kl_in_reward) on every response token: verl's token_level_rewards. -> [T, R]"""
    mask = response_mask.to(seq_reward.dtype)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    out = torch.zeros_like(mask).scatter(1, last[:, None], seq_reward[:, None]) * mask
    return out if token_kl_penalty is None else out - token_kl_penalty * mask


def varying_groups(metric, group_ids):
    """Keep the trajectories of groups whose metric is not constant, and every group of one. -> bool [T]
    Exact (max != min in the metric's dtype): a float std of identical values can round above 0."""
    _, group, size = torch.unique(group_ids, return_inverse=True, return_counts=True)
    hi = metric.new_zeros(len(size)).scatter_reduce(0, group, metric, "amax", include_self=False)
    lo = metric.new_zeros(len(size)).scatter_reduce(0, group, metric, "amin", include_self=False)
    return ((hi != lo) | (size == 1))[group]


KLType = Literal["kl", "abs", "mse", "low_var_kl"]  # kl_loss_type, kl_penalty


def token_kl(logp, ref_logp, kind: KLType):
    """Per-token KL estimate: kl (k1) | abs | mse (k2) | low_var_kl (k3, clamped)."""
    if kind == "kl":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "mse":
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":
        k = (ref_logp - logp).clamp(-20, 20)
        return (k.exp() - k - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL type {kind!r}; choose one of {typing.get_args(KLType)}")


AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def agg_loss(loss_mat, mask, mode: AggMode, max_response_length: int | None = None, *,
             count: float | None = None):
    """Reduce a per-token loss to a scalar (ALGORITHM.md "Aggregation"). count: what the mode divides by,
    tokens (token-mean) or sequences (seq-* modes); None = this batch's own. The update passes the whole
    mini-batch's count over all ranks, so the micro-batches' losses add up to the mini-batch's."""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / (mask.sum().clamp(min=1) if count is None else count)
    seq_sum = (loss_mat * mask).sum(-1)
    num_seqs = len(seq_sum) if count is None else count
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant normaliser, not the response's length
        return seq_sum.sum() / (num_seqs * max_response_length)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {typing.get_args(AggMode)}")


def agg_count(mask, mode: str) -> float:
    """What agg_loss divides by for these trajectories: response tokens (token-mean) or sequences."""
    return float(mask.sum()) if mode == "token-mean" else float(mask.shape[0])


def token_mean(x, mask):
    """Mean of a per-token quantity over response tokens."""
    mask = mask.float()
    return (x.float() * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(*, logp, old_logp, adv, response_mask, clip_ratio_low: float, clip_ratio_high: float,
                clip_ratio_c: float, loss_agg_mode: str, max_response_length: int | None = None,
                count: float | None = None, token_weight=None):
    """Clipped surrogate with clip-higher and dual clip. adv is [T] or [T, R]; token_weight (e.g. truncated
    importance weights) multiplies the per-token loss before aggregation; count as in agg_loss.
    -> (loss, metrics as 0-dim tensors)"""
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    d = (logp - old_logp).clamp(-20, 20)
    ratio = d.exp()
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    c1 = torch.maximum(l1, l2)
    l3 = -adv * clip_ratio_c
    loss_mat = torch.where(adv < 0, torch.minimum(l3, c1), c1)
    if token_weight is not None:
        loss_mat = loss_mat * token_weight
    metrics = {"pg_clipfrac": token_mean(l2 > l1, response_mask).detach(),
               "pg_clipfrac_lower": token_mean((c1 > l3) & (adv < 0), response_mask).detach(),
               "ppo_kl": token_mean(-d, response_mask).detach()}
    return agg_loss(loss_mat, response_mask, loss_agg_mode, max_response_length, count=count), metrics


# policy losses: loss_mode -> f(logp, old_logp, adv, response_mask, cfg, *, count, token_weight)
# -> (loss, metrics); adv is [T] (one per trajectory) or [T, R]; count and token_weight as in policy_loss

def per_token(adv, like):
    """adv [T] on every token of its trajectory, or adv [T, R] as it is."""
    return adv[:, None].expand_as(like) if adv.dim() == 1 else adv


def pg_metrics(log_ratio, response_mask, clipped=None, clipped_lower=None) -> dict:
    """The columns every loss mode logs, as token means: pg_clipfrac (of `clipped`), pg_clipfrac_lower (of
    `clipped_lower`; 0 where the mode has none), ppo_kl = mean(old_logp - logp)."""
    none = torch.zeros_like(log_ratio, dtype=torch.bool)
    return {"pg_clipfrac": token_mean(none if clipped is None else clipped, response_mask).detach(),
            "pg_clipfrac_lower": token_mean(none if clipped_lower is None else clipped_lower,
                                            response_mask).detach(),
            "ppo_kl": token_mean(-log_ratio, response_mask).detach()}


def weighted_agg(loss_mat, response_mask, cfg, count, token_weight):
    """token_weight x loss_mat (rollout correction), reduced by loss_agg_mode over count (agg_loss)."""
    if token_weight is not None:
        loss_mat = loss_mat * token_weight
    return agg_loss(loss_mat, response_mask, cfg.loss_agg_mode, cfg.max_response_length, count=count)


def vanilla_policy_loss(logp, old_logp, adv, response_mask, cfg, *, count=None, token_weight=None):
    """PPO's clipped surrogate with clip-higher and dual clip: policy_loss with cfg's knobs."""
    return policy_loss(logp=logp, old_logp=old_logp, adv=adv, response_mask=response_mask,
                       clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                       clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
                       max_response_length=cfg.max_response_length, count=count, token_weight=token_weight)


def gspo_policy_loss(logp, old_logp, adv, response_mask, cfg, *, count=None, token_weight=None):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios,
        s_i = exp(mean_t (logp - old_logp)),   s_it = sg(s_i) * exp(logp_t - sg(logp_t))   (value s_i)
        loss_it = max(-A s_it, -A clamp(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))
    log s_it clamped at 10 (verl). No dual clip. The paper's mean over sequences: loss_agg_mode
    seq-mean-token-mean (config refuses others)."""
    adv, mask = per_token(adv, logp), response_mask.to(logp.dtype)
    d = logp - old_logp
    seq_d = (d * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    s = (logp - logp.detach() + seq_d.detach()).clamp(max=10.0).exp()
    l1 = -adv * s
    l2 = -adv * s.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    loss = weighted_agg(torch.maximum(l1, l2), response_mask, cfg, count, token_weight)
    return loss, pg_metrics(d, response_mask, clipped=l2 > l1)


def cispo_policy_loss(logp, old_logp, adv, response_mask, cfg, *, count=None, token_weight=None):
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped ratio, a constant,
        r = exp(clamp(logp - old_logp, -20, 20)),   w = sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        loss = -w A logp
    Every token keeps a gradient, -w A dlogp: the clip bounds its weight instead of dropping it."""
    adv = per_token(adv, logp)
    d = (logp - old_logp).clamp(-20, 20)
    ratio = d.exp()
    w = ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high).detach()
    loss = weighted_agg(-w * adv * logp, response_mask, cfg, count, token_weight)
    return loss, pg_metrics(d, response_mask, clipped=ratio != w)


def geo_mean_policy_loss(logp, old_logp, adv, response_mask, cfg, *, count=None, token_weight=None):
    """GMPO (Zhao et al. 2025): one loss per sequence, its mean advantage times the geometric mean of its
    token ratios, each clipped in log space on the side its advantage makes pessimistic:
        d_t = logp - old_logp,   e_t = clamp(d_t, -clip_ratio_low, clip_ratio_high)
        c_t = sgn(A_t) min(sgn(A_t) d_t, sgn(A_t) e_t)
        loss_i = -mean_t(A_t) exp(mean_t c_t)                  (means over sequence i's response tokens)
    clip_ratio_low/high bound log r here (the paper: 0.4 each), not r. A token weight enters as its sequence's
    geometric mean, exp(mean_t log(w_t + 1e-10)). Mean over sequences: loss_agg_mode seq-mean-token-mean
    (config refuses others)."""
    adv, mask = per_token(adv, logp), response_mask.to(logp.dtype)
    n = mask.sum(-1).clamp(min=1)
    d = logp - old_logp
    d_clip = d.clamp(-cfg.clip_ratio_low, cfg.clip_ratio_high)
    sgn = adv.sign()
    c = sgn * torch.minimum(sgn * d, sgn * d_clip)
    seq_loss = -(adv * mask).sum(-1) / n * ((c * mask).sum(-1) / n).exp()
    if token_weight is not None:
        seq_loss = seq_loss * ((token_weight + 1e-10).log() * mask).sum(-1).div(n).exp()
    loss = agg_loss(seq_loss[:, None].expand_as(logp), response_mask, cfg.loss_agg_mode,
                    cfg.max_response_length, count=count)
    clipped = d != d_clip
    return loss, pg_metrics(d, response_mask, clipped=clipped & (adv > 0), clipped_lower=clipped & (adv < 0))


def sapo_policy_loss(logp, old_logp, adv, response_mask, cfg, *, count=None, token_weight=None):
    """SAPO (Qwen, arXiv 2511.20347): a smooth gate instead of the hard clip,
        r = exp(clamp(logp - old_logp, -20, 20)),   tau = tau_pos where A > 0, else tau_neg
        loss = -A f(r),   f(r) = 4 / tau * sigmoid(tau (r - 1))
    f'(r) = 4 sigma (1 - sigma): 1 at r = 1 (the vanilla gradient), fading as r leaves 1, faster for a
    larger tau. The paper's mean over sequences: loss_agg_mode seq-mean-token-mean (config refuses others)."""
    adv = per_token(adv, logp)
    d = (logp - old_logp).clamp(-20, 20)
    tau = torch.where(adv > 0, logp.new_tensor(cfg.tau_pos), logp.new_tensor(cfg.tau_neg))
    gate = torch.sigmoid(tau * (d.exp() - 1)) * 4 / tau
    loss = weighted_agg(-adv * gate, response_mask, cfg, count, token_weight)
    return loss, pg_metrics(d, response_mask)


def token_covariance(adv, logp, mask):
    """cov_t = (A_t - mean A) (logp_t - mean logp), means over the response tokens of mask; a constant."""
    logp, mask = logp.detach(), mask.to(logp.dtype)
    mean = lambda x: (x * mask).sum() / mask.sum().clamp(min=1)  # noqa: E731
    return (adv - mean(adv)) * (logp - mean(logp))


def clip_cov_policy_loss(logp, old_logp, adv, response_mask, cfg, *, count=None, token_weight=None):
    """Clip-Cov (Cui et al. 2025): PPO's clipped surrogate (no dual clip), with the gradient of a few tokens
    cut:
    among the tokens the ratio clip left alone whose token_covariance lies in (clip_cov_lb, clip_cov_ub),
    a random max(1, int(clip_cov_ratio x response tokens)) get loss x 0. Those are the tokens whose
    covariance drives the entropy down. The choice is over the tokens passed in; config makes them the
    whole mini-batch (one micro-batch, one data-parallel rank)."""
    adv, mask = per_token(adv, logp), response_mask > 0
    d = logp - old_logp
    ratio = d.exp()
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    cov = token_covariance(adv, logp, mask)
    candidates = ((cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & mask & ~(l2 > l1)).nonzero()
    n_cut = max(int(cfg.clip_cov_ratio * mask.sum().item()), 1)
    cut = candidates[torch.randperm(len(candidates))[:n_cut]]
    keep = torch.ones_like(logp)
    keep[cut[:, 0], cut[:, 1]] = 0
    loss = weighted_agg(torch.maximum(l1, l2) * keep, response_mask, cfg, count, token_weight)
    return loss, pg_metrics(d, response_mask, clipped=keep == 0)


def kl_cov_policy_loss(logp, old_logp, adv, response_mask, cfg, *, count=None, token_weight=None):
    """KL-Cov (Cui et al. 2025): the unclipped surrogate, plus a KL penalty on the
    max(1, int(kl_cov_ratio x response tokens)) tokens of largest token_covariance:
        loss_t = -A r + ppo_kl_coef |logp - old_logp|  there,   -A r elsewhere;   r = exp(logp - old_logp)
    The penalty is 0 where logp = old_logp (config refuses the single on-policy pass). The choice is over the
    tokens passed in; config makes them the whole mini-batch (one micro-batch, one data-parallel rank)."""
    adv, mask = per_token(adv, logp), response_mask > 0
    d = logp - old_logp
    cov = token_covariance(adv, logp, mask).masked_fill(~mask, -math.inf)
    k = max(int(cfg.kl_cov_ratio * mask.sum().item()), 1)
    penalised = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    penalised[cov.flatten().topk(k).indices] = True
    penalised = penalised.view_as(cov)
    loss_mat = -adv * d.exp() + cfg.ppo_kl_coef * d.abs() * penalised
    loss = weighted_agg(loss_mat, response_mask, cfg, count, token_weight)
    return loss, pg_metrics(d, response_mask, clipped=penalised)


POLICY_LOSSES = {"vanilla": vanilla_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss,
                 "geo_mean": geo_mean_policy_loss, "clip_cov": clip_cov_policy_loss,
                 "kl_cov": kl_cov_policy_loss, "sapo": sapo_policy_loss}
LossMode = Literal[tuple(POLICY_LOSSES)]
SEQUENCE_LOSSES = ("gspo", "geo_mean", "sapo")  # their papers' mean over sequences: seq-mean-token-mean
COVARIANCE_LOSSES = ("clip_cov", "kl_cov")  # choose tokens over what they are given: the whole mini-batch


def truncated_is_weight(old_logp, rollout_logp, cap: float):
    """TIS: min(p_old / p_rollout, cap) per token, a constant (no gradient). Corrects for the rollout engine
    sampling from slightly different probabilities than the trainer computes (bf16 kernels, vLLM vs torch)."""
    return (old_logp - rollout_logp).clamp(max=math.log(cap)).exp().detach()


# rollout correction (verl's algorithm.rollout_correction), on the whole training batch once its old log-probs
# exist: the ratio p_old / p_rollout of the trainer's to the engine's probabilities, at a level

def token_log_ratio(log_ratio, response_mask):
    """Each token's own log(p_old / p_rollout)."""
    return log_ratio


def sequence_log_ratio(log_ratio, response_mask):
    """On each token, its sequence's sum over the response: the log of the product of the token ratios."""
    return log_ratio.masked_fill(response_mask == 0, 0).sum(-1, keepdim=True).expand_as(log_ratio)


def geometric_log_ratio(log_ratio, response_mask):
    """On each token, its sequence's mean over the response: the log of the geometric mean of the token
    ratios (0 for a sequence without response tokens)."""
    n = response_mask.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
    return sequence_log_ratio(log_ratio, response_mask) / n


LOG_RATIO_LEVELS = {"token": token_log_ratio, "sequence": sequence_log_ratio,
                    "geometric": geometric_log_ratio}
RolloutIS = Literal[None, "token", "sequence"]  # rollout_is
RolloutRS = Literal[None, "token", "sequence", "geometric"]  # rollout_rs


def rollout_is_weights(old_logp, rollout_logp, response_mask, level: str, threshold: float,
                       batch_normalize: bool = False):
    """Rollout importance weights (verl's rollout_is): the ratio at `level` (token: each token's; sequence:
    the product over the response, on all its tokens), truncated, a constant:
        w = min(exp(clamp(level's log ratio, -20, 20)), threshold)          (0 off the response)
    batch_normalize: w / its mean over the response tokens (token) or the non-empty sequences (sequence), so
    that the weights average 1; the mean is over what is passed in: the whole training batch. -> [T, R]"""
    mask = response_mask.to(old_logp.dtype)
    log_ratio = LOG_RATIO_LEVELS[level](old_logp - rollout_logp, mask)
    w = (log_ratio.clamp(-20, 20).exp() * mask).clamp(max=threshold).detach()
    if not batch_normalize:
        return w
    if level == "token":
        mean = (w * mask).sum() / mask.sum().clamp(min=1)
    else:
        seqs = mask.sum(-1) > 0
        mean = ((w * mask).sum(-1)[seqs] / mask.sum(-1)[seqs]).mean()
    return w / mean if mean > 1e-8 else w


def rollout_rs_mask(old_logp, rollout_logp, response_mask, level: str, threshold: float,
                    threshold_lower: float = -1.0):
    """Rollout rejection (verl's rollout_rs): 1 where the ratio at `level` (token; sequence: the product over
    the response; geometric: its geometric mean) lies in [threshold_lower, threshold], else 0 (at the
    sequence levels, the whole sequence); threshold_lower -1 = 1 / threshold. Compared in log space.
    -> [T, R]"""
    log_ratio = LOG_RATIO_LEVELS[level](old_logp - rollout_logp, response_mask)
    lower = math.log(threshold_lower) if threshold_lower > 0 else -math.log(threshold)
    return ((log_ratio >= lower) & (log_ratio <= math.log(threshold))).float()


def rollout_rs_level(cfg):
    """rollout_rs; left None with rollout_rs_threshold set, "token" (the threshold's meaning on its own)."""
    return cfg.rollout_rs or ("token" if cfg.rollout_rs_threshold > 0 else None)


def check_algorithm(cfg: Config, world_size: int = 1):
    """What the chosen loss mode, estimator and rollout correction need of the other knobs: ConfigError naming
    them, before any work. (world_size: torchrun's ranks, generators included.)"""
    if cfg.loss_mode in SEQUENCE_LOSSES and cfg.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(f"loss_mode={cfg.loss_mode!r} takes its paper's mean over sequences (verl forces it, "
                          "whatever loss_agg_mode says): set loss_agg_mode='seq-mean-token-mean'")
    if cfg.loss_mode in COVARIANCE_LOSSES:
        whole = cfg.ppo_mini_batch_size * cfg.n
        trainer_ranks = world_size - cfg.rollout_gpus
        if trainer_ranks != cfg.tp_size or cfg.use_dynamic_bsz or cfg.ppo_micro_batch_size_per_gpu != whole:
            raise ConfigError(f"loss_mode={cfg.loss_mode!r} chooses its tokens among those of one forward (verl: "
                              "per micro-batch and rank), and a micro-batch split must not change the loss: "
                              "train on one data-parallel rank (sp_size=1), with use_dynamic_bsz=False and "
                              f"ppo_micro_batch_size_per_gpu = ppo_mini_batch_size * n = {whole}")
        if cfg.clip_cov_lb >= cfg.clip_cov_ub:
            raise ConfigError(f"clip_cov_lb={cfg.clip_cov_lb} must be < clip_cov_ub={cfg.clip_cov_ub}")
    if cfg.loss_mode == "kl_cov" and cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size == cfg.train_batch_size:
        raise ConfigError("loss_mode='kl_cov' penalises |logp - old_logp|, which is 0 on a single on-policy pass "
                          "(ppo_epochs=1, one mini-batch): set ppo_epochs > 1 or a smaller ppo_mini_batch_size")
    if cfg.adv_estimator == "grpo_passk" and cfg.n < 2:
        raise ConfigError("adv_estimator='grpo_passk' rewards the best response of each group: set n >= 2")
    if cfg.rollout_is is not None and cfg.tis_imp_ratio_cap > 0:
        raise ConfigError("rollout_is and tis_imp_ratio_cap would multiply two importance weights: keep one "
                          "(rollout_is='token' with rollout_is_threshold=cap is the same correction, "
                          "computed once a batch)")
    if cfg.rollout_is_batch_normalize and cfg.rollout_is is None:
        raise ConfigError("rollout_is_batch_normalize=True normalises the weights of rollout_is, which is off: "
                          "set rollout_is='token' or 'sequence'")
    if cfg.rollout_rs is not None and cfg.rollout_rs_threshold < 0:
        raise ConfigError(f"rollout_rs={cfg.rollout_rs!r} rejects by rollout_rs_threshold, which is off (-1): "
                          "set it, e.g. 2.0")
    if cfg.rollout_rs_threshold_lower > 0 and cfg.rollout_rs_threshold < 0:
        raise ConfigError("rollout_rs_threshold_lower is the lower bound of rollout_rs_threshold, which is off "
                          "(-1): set it too")


ASYNC_TIS_CAP = 2.0


def tis_cap(cfg) -> float:
    """tis_imp_ratio_cap; in async mode, left off (-1) and no rollout_is chosen, ASYNC_TIS_CAP:
    stale rollouts always need the correction."""
    default = cfg.rollout_gpus and cfg.tis_imp_ratio_cap < 0 and cfg.rollout_is is None
    return ASYNC_TIS_CAP if default else cfg.tis_imp_ratio_cap


def logp_mismatch(trainer_logp, rollout_logp, mask):
    """Mean |rollout log-prob - trainer log-prob| over response tokens:
    how far the engine's policy is from ours."""
    return token_mean((trainer_logp - rollout_logp).abs(), mask)


# -----------------------------------------------------------------------------
# steps 1-3: rollout and reward

def sync_weights(engine, model, version: int, cfg: Config, dtype: torch.dtype):
    """Push the policy's weights into the engine (bucketed full tensors) unless it already holds `version`."""
    if engine.shares_weights:  # the built-in engine on the trainer's own module: nothing to copy
        engine.weights_version = version
    elif engine.weights_version != version:
        engine.load_weights(
            parallel.iter_full_weights(model, cfg.weight_sync_bucket_mb * 2**20, dtype=dtype), version)


def train_params(cfg: Config, tokenizer, seed: int) -> SamplingParams:
    # only when something needs them: vLLM then computes them for the whole batch, at a large cost in speed
    correction = tis_cap(cfg) > 0 or cfg.rollout_is is not None or rollout_rs_level(cfg) is not None
    logprobs = cfg.calculate_log_probs or correction
    return SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_tokens=cfg.max_response_length, stop_token_ids=tokenizer.eos_token_ids,
                          seed=seed, logprobs=logprobs)


def rollout(run: "Run", cfg: Config, prompts: list[dict], params: SamplingParams, *, version: int,
            group_offset: int, timing: dict) -> tuple[Trajectories, dict]:
    """Steps 2-3 for a list of prompts: wake the engine, give it the policy's weights (`version`), generate
    and score this engine's share of the prompts, sleep.
    Every rank gets all the trajectories and reward counts."""
    engine, dims = run.engine, run.dims
    run.model.eval()
    with timed("wake_sleep", timing):
        engine.wake_up(["weights"])
    with timed("sync", timing):
        sync_weights(engine, run.model, version, cfg, run.compute_dtype)  # after a level-2 sleep: a full push
    with timed("wake_sleep", timing):
        engine.wake_up(["kv_cache"])
    try:
        traj, counts = generate_share(run.engine, run.tokenizer, run.scorer, prompts, params, cfg,
                                      engine_index=dims.rank // run.gen_tp, engines=dims.world_size // run.gen_tp,
                                      version=version, group_offset=group_offset, timing=timing,
                                      should_stop=run.stop.signalled)
    except (GenerationStopped, reward.ScoringStopped):
        traj = counts = None  # this rank's share is dropped; the agreement below stops every rank
    if cfg.free_cache_engine:  # else it stays awake: no wake or sleep next time, the pushes only
        with timed("wake_sleep", timing):
            engine.sleep()
    if run.stop.agreed(dims):  # every rank at the same point, whether its share finished or not
        raise StopRequested
    if traj is not None:  # colocated, every token is `version`'s: nothing reads them, none travel
        traj.versions = None
    mine = (traj, counts) if dims.rank % run.gen_tp == 0 else None  # the TP ranks of an engine hold copies
    routing = None
    if mine is not None and traj.routed_experts is not None:  # stays here: fetch_routing sends what is used
        routing, traj.routed_experts = traj.routed_experts, None
        traj.routing_owner = torch.full((len(traj),), dims.rank)
    parts = engine_results(parallel.all_gather_objects(mine, dims), run.gen_tp)
    out = concat_trajectories([t for t, _ in parts if len(t)], cfg.max_response_length)
    if cfg.router_replay:
        out.routed_experts = [None] * len(out)
        if routing is not None:  # this rank's rows go where its engine's part starts
            start = sum(len(t) for t, _ in parts[:dims.rank // run.gen_tp])
            out.routed_experts[start:start + len(routing)] = routing
    return out, {k: sum(c[k] for _, c in parts) for k in parts[0][1]}


GEN_BATCH_SEEDS = 1000  # gen batch r of step s samples with seed + 1000 s + r (distinct below 1000 a step)


def gen_batches(run: "Run", cfg: Config, *, step: int, version: int, timing: dict, counts: dict):
    """Steps 1-3, one gen batch after another: sample gen_batch_size prompts, generate n responses each, score
    them (and with use_kl_in_reward, subtract the KL penalty). Colocated, this rank's engine generates them
    now; in asynchronous mode they are taken from the generator ranks, which were asked ahead.
    Yields one gen batch's Trajectories at a time."""
    next_gen_batch = colocated_gen_batch if run.rollouts is None else asked_gen_batch
    for r in itertools.count(1):
        traj, c = next_gen_batch(run, cfg, step=step, r=r, version=version, timing=timing)
        fault_point("gen", step)
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
        traj.seq_final_reward, kl_penalty = traj.seq_reward, None
        if cfg.use_kl_in_reward:  # seq_final_reward = seq_reward - kl_coef * sum of token KL
            with timed("ref", timing):
                traj.ref_logp = compute_logprobs(run.ref_model, traj, cfg, run.dims)
                traj.old_logp = compute_logprobs(run.model, traj, cfg, run.dims)  # kept for step 6
            kl = token_kl(traj.old_logp, traj.ref_logp, cfg.kl_penalty)
            traj.seq_final_reward = traj.seq_reward - cfg.kl_coef * (kl * traj.response_mask).sum(-1)
            kl_penalty = cfg.kl_coef * kl
        traj.token_level_rewards = token_level_rewards(traj.seq_reward, traj.response_mask, kl_penalty)
        yield traj


def colocated_gen_batch(run: "Run", cfg: Config, *, step: int, r: int, version: int,
                        timing: dict) -> tuple[Trajectories, dict]:
    """Gen batch r of the step, generated now by the engines on the training ranks."""
    prompts = [run.train_prompts[i] for i in run.sampler.next_indices(cfg.gen_batch_size)]
    params = train_params(cfg, run.tokenizer, cfg.seed + GEN_BATCH_SEEDS * step + r)
    return rollout(run, cfg, prompts, params, version=version, group_offset=r * cfg.gen_batch_size,
                   timing=timing)


def asked_gen_batch(run: "Run", cfg: Config, *, step: int, r: int, version: int,
                    timing: dict) -> tuple[Trajectories, dict]:
    """Asynchronous mode: the oldest gen batch asked of the generator ranks (asked now if none is pending)."""
    if not run.rollouts.pending:
        run.rollouts.ask_gen_batch(version, timing)
    traj, counts = run.rollouts.take(run.rollouts.pending[0], timing)
    traj.group_ids += r * cfg.gen_batch_size
    return traj, counts


# -----------------------------------------------------------------------------
# step 4: dynamic sampling

def group_outcomes(traj: Trajectories, cfg: Config) -> dict:
    """Why dynamic sampling keeps or drops groups -> fractions of the groups whose filter metric varies
    (kept), and of the constant ones, all correct (solved), all wrong, or neither; the fraction of responses
    in which the verifier found no answer (None with a custom reward_fn), and the mean response length."""
    _, group = torch.unique(traj.group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1
    varying = torch.zeros(num_groups, dtype=torch.bool)
    varying[group] = varying_groups(getattr(traj, cfg.filter_groups_metric), traj.group_ids)  # same per group
    acc = traj.acc.float()
    lowest = acc.new_zeros(num_groups).scatter_reduce(0, group, acc, "amin", include_self=False)
    highest = acc.new_zeros(num_groups).scatter_reduce(0, group, acc, "amax", include_self=False)
    all_correct = ~varying & (lowest == 1)
    all_wrong = ~varying & (highest == 0)
    # the rest: accuracy varies but the filter metric does not (e.g. a score that ignores correctness)
    constant_other = ~varying & ~all_correct & ~all_wrong
    counts = {"varying": varying, "all_correct": all_correct, "all_wrong": all_wrong,
              "constant_other": constant_other}
    out = {f"groups_{k}": int(v.sum()) / num_groups for k, v in counts.items()}
    out["no_answer_frac"] = None
    if traj.answer_found is not None:
        out["no_answer_frac"] = 1 - traj.answer_found.float().mean().item()
    out["response_length_mean"] = sum(len(r) for r in traj.response_ids) / len(traj)
    return out


def describe_outcomes(outcomes: dict) -> str:
    """group_outcomes in words, for the progress line."""
    text = (f"groups: {outcomes['groups_varying']:.0%} varying, "
            f"{outcomes['groups_all_correct']:.0%} all correct, {outcomes['groups_all_wrong']:.0%} all wrong")
    if outcomes["groups_constant_other"]:
        text += f", {outcomes['groups_constant_other']:.0%} constant otherwise"
    if outcomes["no_answer_frac"] is not None:
        text += f"; {outcomes['no_answer_frac']:.0%} of responses without a parsable answer"
    return text + f"; mean response length {outcomes['response_length_mean']:.0f} tokens"


def likely_cause(outcomes: dict) -> str:
    """The most likely reason no group (or too few) varies, from group_outcomes."""
    if outcomes["no_answer_frac"] is not None and outcomes["no_answer_frac"] >= 0.9:
        return ("no response matched the answer format (the verifier found no answer in "
                f"{outcomes['no_answer_frac']:.0%} of them): check that the prompt asks for the format the "
                "data_source's verifier reads")
    if outcomes["groups_all_correct"] >= 0.9:
        return "every group is solved: the data is too easy for the model"
    if outcomes["groups_all_wrong"] >= 0.9:
        return "every group fails: the data is too hard for the model (or its answers are judged wrong)"
    if outcomes["groups_constant_other"] >= 0.5:
        return ("filter_groups_metric is constant within groups even where accuracy varies: "
                "choose another metric")
    return "a mix of solved and failed groups; more gen batches should find varying ones"


FilterMetric = Literal["acc", "score", "seq_reward", "seq_final_reward"]  # Trajectories fields, per trajectory


def kept_mask(traj: Trajectories, cfg: Config) -> torch.Tensor:
    """The trajectories dynamic sampling keeps: filter_groups on the metric named by filter_groups_metric."""
    if not cfg.filter_groups:
        return torch.ones(len(traj), dtype=torch.bool)
    return varying_groups(getattr(traj, cfg.filter_groups_metric), traj.group_ids)  # a Trajectories field


def dynamic_sampling(gen_batches, cfg: Config, progress=None):
    """DAPO dynamic sampling: take gen batches from the iterator `gen_batches` until train_batch_size groups
    whose filter metric varies are collected, then keep exactly train_batch_size whole groups.
    progress(r, kept, generated) is called after each gen batch (r of them so far, kept groups, the list of
    generated Trajectories).
    -> (training batch, all generated trajectories, gen batches used)"""
    kept, generated, n_kept = [], [], 0
    for r, traj in enumerate(gen_batches, start=1):
        generated.append(traj)
        keep = kept_mask(traj, cfg)
        if keep.any():
            kept.append(traj.select(keep.nonzero()[:, 0].tolist()))
            n_kept += int(keep.sum()) // cfg.n
        if progress is not None:
            progress(r, n_kept, generated)
        if n_kept >= cfg.train_batch_size:
            break
        if cfg.max_num_gen_batches > 0 and r >= cfg.max_num_gen_batches:
            outcomes = group_outcomes(concat_trajectories(generated, cfg.max_response_length), cfg)
            raise RunError(
                f"dynamic sampling: after {cfg.max_num_gen_batches} gen batches of {cfg.gen_batch_size} "
                f"prompts only {n_kept} of train_batch_size={cfg.train_batch_size} groups have varying "
                f"{cfg.filter_groups_metric} ({describe_outcomes(outcomes)}). Likely cause: "
                f"{likely_cause(outcomes)}. Raise max_num_gen_batches (0 = unlimited) or gen_batch_size, "
                f"change filter_groups_metric, or set filter_groups=False")
    R = cfg.max_response_length
    batch = concat_trajectories(kept, R).select(list(range(cfg.train_batch_size * cfg.n)))  # whole groups
    return batch, concat_trajectories(generated, R), r


# -----------------------------------------------------------------------------
# steps 5-6: log-probs over a batch (packed: no padding tokens are computed)

def micro_batches(traj: Trajectories, idx: list[int], count: int, token_budget: int | None,
                  dims) -> list[list[int]]:
    """Split trajectory indices into micro-batches by count, or by token budget (use_dynamic_bsz). Every rank
    gets the same number of micro-batches: a sharded model's forward is a collective."""
    if token_budget is None:
        return [idx[i:i + count] for i in range(0, len(idx), count)]
    lens = [len(traj.prompt_ids[i]) + len(traj.response_ids[i]) for i in idx]
    split = data.balanced_micro_batches(lens, token_budget)
    n = parallel.all_reduce_max(len(split), dims)
    if n > len(split):
        split = data.balanced_micro_batches(lens, token_budget, min_num_micro_batches=n)
    return [[idx[j] for j in mb] for mb in split]


def fetch_routing(traj: Trajectories, needed: list[int], dims) -> int:
    """Router replay: bring the routing of trajectories `needed` to this rank from the ranks that generated
    them (a collective: every rank calls it at the same point) -> the bytes received. Nothing to do without
    router replay, or where every rank holds every row (routing_owner None)."""
    if traj.routed_experts is None or traj.routing_owner is None:
        return 0
    held = {i: row for i, row in enumerate(traj.routed_experts) if row is not None}
    rows, nbytes = parallel.exchange_rows(held, traj.routing_owner.tolist(), needed, dims)
    for i, row in rows.items():
        traj.routed_experts[i] = row
    return nbytes


def update_share(num_traj: int, mb_size: int, dims) -> list[int]:
    """The trajectories this rank trains on in update_policy: its share of every mini-batch."""
    mine = []
    for start in range(0, num_traj, mb_size):
        mine += rank_share(list(range(start, min(start + mb_size, num_traj))), dims)
    return mine


def rank_share(idx: list[int], dims) -> list[int]:
    """This data-parallel rank's contiguous slice of idx (ranks of one TP/SP group share data)."""
    per = len(idx) // dims.dp
    return idx[dims.dp_rank * per:(dims.dp_rank + 1) * per]


def sequence_logprobs(model, traj: Trajectories, idx: list[int], cfg: Config, with_entropy: bool | str,
                      router_loads=None, device=None):
    """Packed forward of prompt+response for trajectories idx
    -> (logp, entropy) [len(idx), R] on response tokens.
    router_loads: a list that MoE layers append their routing statistics to (for the load-balancing loss)."""
    seqs = [traj.prompt_ids[i] + traj.response_ids[i] for i in idx]
    device = device or model.output_weight.device  # the accelerator: offloaded weights live on the host
    ids, pos, batch = pack_sequences([s[:-1] for s in seqs], device)
    # response token j of sequence i is target (len(prompt) - 1 + j) of its packed document; the head skips
    # the targets before it (a prompt's own). Built before the forward: no copy to the device waits for it
    first = [len(traj.prompt_ids[i]) - 1 for i in idx]
    targets = torch.tensor([t for i, f in zip(idx, first) for t in [IGNORE_INDEX] * f + traj.response_ids[i]],
                           device=device)[None]
    R = traj.response_mask.shape[1]
    starts = batch.cu_seqlens[:-1].long() + torch.tensor(first, device=device)
    gather = (starts[:, None] + torch.arange(R, device=device)[None]).clamp(max=ids.shape[1] - 1)
    mask = traj.response_mask[idx].to(device)
    routed = None
    # row t of a trajectory: the experts the engine sent its input token t to
    if traj.routed_experts is not None:
        missing = [i for i in idx if traj.routed_experts[i] is None]
        if missing:
            raise RuntimeError(f"router replay: the routing of trajectories {missing[:5]} is not on this "
                               "rank; fetch_routing brings it before the forwards that use it")
        routed = torch.cat([traj.routed_experts[i] for i in idx]).to(device)[None]
        if routed.shape[1] != ids.shape[1]:
            raise RuntimeError(f"router replay: {routed.shape[1]} routed tokens for "
                               f"{ids.shape[1]} input tokens")
    logp, ent = model(ids, pos, batch, target_ids=targets, temperature=cfg.temperature,
                      with_entropy=with_entropy, logprob_chunk=cfg.logprob_chunk, router_loads=router_loads,
                      routed_experts=routed)
    return logp[0][gather] * mask, (ent[0][gather] * mask if ent is not None else None)


@torch.no_grad()
def compute_logprobs(model, traj: Trajectories, cfg: Config, dims) -> torch.Tensor:
    """Log-probs of every trajectory's response under `model`: each dp rank computes its share in
    token-budget or counted micro-batches, then all ranks exchange them."""
    budget = cfg.log_prob_max_token_len_per_gpu * cfg.sp_size if cfg.use_dynamic_bsz else None  # per SP group
    model.eval()
    mine = list(range(len(traj)))
    if dims.dp > 1:  # pad to a multiple of dp with repeats so every rank runs the same forwards
        mine = rank_share(mine + mine[:(-len(mine)) % dims.dp], dims)
    out = torch.zeros_like(traj.response_mask, dtype=torch.float32)
    fetch_routing(traj, mine, dims)
    for mb in micro_batches(traj, mine, cfg.log_prob_micro_batch_size_per_gpu, budget, dims):
        logp, _ = sequence_logprobs(model, traj, mb, cfg, with_entropy=False, device=dims.device)
        out[mb] = logp.float().cpu()
    parallel.reshard(model, dims)
    if dims.dp > 1:
        for idx, part in parallel.all_gather_objects((mine, out[mine]), dims):
            out[idx] = part
    return out


# -----------------------------------------------------------------------------
# step 7: the policy update

def update_policy(model, optimizer, scheduler, traj: Trajectories, cfg: Config, dims) -> dict:
    """ppo_epochs x mini-batches; each mini-batch is one optimizer step. Every rank holds the whole batch and
    trains on its share of each mini-batch. One normalisation: a micro-batch's loss is its sum divided by the
    whole mini-batch's count (tokens or sequences, over all ranks), and gradients are summed over ranks
    (FSDP's division is off), so the gradient is the mini-batch's whatever the micro-batch split or
    world size.
    traj.old_logp None: the loop left the old log-probs to this update (old_logp_from_update): each forward's
    own log-probs, detached, are the old ones."""
    mb_size = cfg.ppo_mini_batch_size * cfg.n
    budget = cfg.ppo_max_token_len_per_gpu * cfg.sp_size if cfg.use_dynamic_bsz else None  # per SP group
    n_minibatches = cfg.ppo_epochs * math.ceil(len(traj) / mb_size)
    # the update's forwards measure the engine's log-prob mismatch only where the loop could not (no old log-probs
    # before the update) and the engine returned log-probs (NaN: not asked for)
    measure_mismatch = traj.old_logp is None and not traj.rollout_logp.isnan().any()
    sums, grad_norms, skipped = {}, [], 0  # sums: this rank's share of each metric, 0-dim tensors on device
    fetch_routing(traj, update_share(len(traj), mb_size, dims), dims)
    model.train()
    for _ in range(cfg.ppo_epochs):
        for start in range(0, len(traj), mb_size):
            # the global mini-batch: every rank has it
            idx = list(range(start, min(start + mb_size, len(traj))))
            count = agg_count(traj.response_mask[idx], cfg.loss_agg_mode)
            # a sum of 0 (every token rejected: rollout_rs_threshold) counts as 1.0
            tokens = float(traj.response_mask[idx].sum()) or 1.0
            optimizer.zero_grad(set_to_none=True)
            finite = torch.ones((), dtype=torch.bool, device=dims.device)
            mbs = micro_batches(traj, rank_share(idx, dims), cfg.ppo_micro_batch_size_per_gpu, budget, dims)
            for i, mb in enumerate(mbs):
                parallel.accumulate_grads(model, dims, last=i == len(mbs) - 1)
                loss, terms, m = micro_batch_loss(model, traj, mb, cfg, dims, count=count,
                                                  num_micro_batches=len(mbs), measure_mismatch=measure_mismatch)
                loss.backward()
                finite &= torch.isfinite(loss.detach())
                mb_share = float(traj.response_mask[mb].sum()) / tokens  # of the mini-batch's response tokens
                for k, v in m.items():  # per-token means of this micro-batch, weighted by its share of tokens
                    sums[k] = sums.get(k, 0.0) + v * mb_share / n_minibatches
                for k, v in terms.items():  # already divided by the mini-batch's count: they add up
                    sums[k] = sums.get(k, 0.0) + v / n_minibatches
            grad_norm = parallel.clip_grad_norm_(list(model.parameters()), cfg.grad_clip)
            if math.isfinite(grad_norm) and bool(finite):
                optimizer.step()
            else:  # a non-finite loss or gradient would poison the weights: skip and log it
                skipped += 1
            optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free for the rollout
            scheduler.step()
            grad_norms.append(grad_norm)
    sums = parallel.sum_over_dp(sums, dims)  # the dp ranks' shares add up; TP/SP ranks hold copies
    out = {("rollout/logp_mismatch" if k == "logp_mismatch" else f"actor/{k}"): v for k, v in sums.items()}
    out.update({"actor/grad_norm": sum(grad_norms) / len(grad_norms), "actor/lr": scheduler.get_last_lr()[0],
                "actor/skipped_updates": skipped})
    return out


def micro_batch_loss(model, traj: Trajectories, mb: list[int], cfg: Config, dims, *, count: float,
                     num_micro_batches: int, measure_mismatch: bool) -> tuple[torch.Tensor, dict, dict]:
    """The objective of micro-batch mb, its share of the mini-batch's (count: the mini-batch's, agg_loss):
    the policy loss of loss_mode weighted by the rollout correction, minus entropy_coeff x entropy, plus the
    KL loss and MoE's load-balancing loss -> (the loss to backward, its terms detached, the loss mode's
    per-token metrics; with measure_mismatch, logp_mismatch against the engine's log-probs too)."""
    device = dims.device
    router_aux = cfg.router_aux_loss and model.config.num_experts > 0
    # copied before the forward: a copy from pageable memory waits for the GPU to finish
    mask, adv = traj.response_mask[mb].to(device), traj.adv[mb].to(device)
    rollout_logp = traj.rollout_logp[mb].to(device)
    old_logp = None if traj.old_logp is None else traj.old_logp[mb].to(device)
    ref_logp = traj.ref_logp[mb].to(device) if cfg.use_kl_loss else None
    router_loads = [] if router_aux else None
    logp, ent = sequence_logprobs(model, traj, mb, cfg, with_entropy=bool(cfg.entropy_coeff) or "detached",
                                  router_loads=router_loads, device=device)
    logp, ent = logp.float(), ent.float()
    if old_logp is None:
        old_logp = logp.detach()
    weight = None  # rollout correction: the batch's importance weights, or truncated IS here
    if traj.rollout_is_weights is not None:
        weight = traj.rollout_is_weights[mb].to(device)
    elif tis_cap(cfg) > 0:
        weight = truncated_is_weight(old_logp, rollout_logp, tis_cap(cfg))
    agg = dict(mask=mask, mode=cfg.loss_agg_mode, max_response_length=cfg.max_response_length, count=count)
    pg_loss, metrics = POLICY_LOSSES[cfg.loss_mode](logp, old_logp, adv, mask, cfg, count=count,
                                                    token_weight=weight)
    entropy = agg_loss(ent, **agg)
    # entropy_coeff 0: no entropy backward
    loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg_loss
    terms = {"pg_loss": pg_loss.detach(), "entropy": entropy.detach()}
    if cfg.use_kl_loss:
        kl = agg_loss(token_kl(logp, ref_logp, cfg.kl_loss_type), **agg)
        loss = loss + cfg.kl_loss_coef * kl
        terms["kl_loss"] = kl.detach()
    if router_aux:
        # over this micro-batch's tokens on all ranks (collective), averaged over micro-batches
        group = dims.fsdp_mesh.get_group() if dims.world_size > 1 else None
        aux = load_balancing_loss(parallel.reduce_router_loads(router_loads, group),
                                  model.config.num_experts_per_tok) / num_micro_batches
        loss = loss + model.config.router_aux_loss_coef * aux
        terms["router_aux_loss"] = aux.detach() / dims.dp  # every dp rank holds the same value
    if measure_mismatch:
        metrics["logp_mismatch"] = logp_mismatch(old_logp, rollout_logp, mask)
    return loss, terms, metrics


def old_logp_from_update(cfg: Config) -> bool:
    """Can the update's own forward give the old log-probs? Only for one pass (one epoch, one mini-batch) over
    data the current weights just generated, and when nothing needs them before the update: never in
    asynchronous mode (the generators' weights lag) or with rollout correction (its weights and rejection are
    computed from them over the whole batch)."""
    one_pass = cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size == cfg.train_batch_size
    correction = cfg.rollout_is is not None or rollout_rs_level(cfg) is not None
    return one_pass and not cfg.rollout_gpus and not correction


def make_scheduler(optimizer, cfg: Config, total_optimizer_steps: int):
    """Linear warmup (step s gets (s+1)/warmup of lr, so the first update is not wasted)
    then constant or cosine."""
    def factor(s):
        if s < cfg.lr_warmup_steps:
            return (s + 1) / cfg.lr_warmup_steps
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (s - cfg.lr_warmup_steps) / max(1, total_optimizer_steps - cfg.lr_warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# -----------------------------------------------------------------------------
# the loop

@dataclass
class Run:
    """What setup() builds once; the loop reads it.
    A generator rank (async mode) has no policy (None fields)."""
    dims: parallel.ParallelDims
    tokenizer: Tokenizer
    train_prompts: list[dict]
    val_prompts: list[dict]
    sampler: data.PromptSampler
    scorer: reward.RewardScorer
    engine: TorchEngine | VLLMEngine | None  # None on trainer ranks in async mode
    gen_tp: int  # ranks per engine
    compute_dtype: torch.dtype
    log: typing.Callable
    model: torch.nn.Module = None  # the policy: fp32 master weights
    ref_model: torch.nn.Module | None = None  # only when a KL term is on
    optimizer: torch.optim.Optimizer = None
    optimizer_states: parallel.OptimizerStateOffload | None = None  # optimizer_offload
    scheduler: torch.optim.lr_scheduler.LambdaLR = None
    total_steps: int = 0
    out_dir_lock: typing.IO | None = None  # held by rank 0 for the whole run
    rollouts: RolloutQueue | None = None  # async mode: gen batches asked of the generator ranks
    stop: StopFlag = None  # SIGTERM / SIGINT: set by train() (trainer ranks) or serve_rollouts (generators)


def say(msg: str):
    """Print a line (above the progress bar, if there is one), flushed."""
    tqdm.write(msg)
    sys.stdout.flush()


def train(cfg: Config):
    """The run cfg describes (fit), with the garbage collector's heap freeze undone on the way out, however it
    ends: what fit froze can be collected again once the run's objects are dropped."""
    try:
        return fit(cfg)
    finally:
        gc.unfreeze()


def freeze_gc_heap():
    """Take every object alive now (after the first step: what lives as long as the run) out of the garbage
    collector's scans, which vLLM's sleep runs in full every rollout; garbage is collected first."""
    gc.collect()
    gc.freeze()


def fit(cfg: Config):
    """Set up, resume, then train step by step until total steps or a stop signal -> the policy. Around each
    step (train_step): stop signals, the checks of its update, validation, metrics and checkpoints."""
    check_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # before any process group or device
    run = setup(cfg)
    if run.dims.is_generator:
        return serve_rollouts(run, cfg)
    dims, log = run.dims, run.log
    step, val_pending = restore(cfg, run)
    first_step = step
    if cfg.rollout_gpus:  # async mode: gen batches asked of the generator ranks
        run.rollouts = RolloutQueue(run, cfg, step, train_params(cfg, run.tokenizer, seed=None))
    logger = Logger(cfg, resumed_step=step) if dims.is_main else None
    run.stop = stop = StopFlag(log, on_force_exit=run.scorer.kill)
    bar = tqdm(total=run.total_steps, initial=step, desc="steps", dynamic_ncols=True,
               disable=not (dims.is_main and sys.stderr.isatty()))
    announce(run, cfg, step)
    version = step  # the policy's weight version: an engine holding another refuses to generate
    stopping = not validate_at_start(run, cfg, logger, step, val_pending)
    consecutive_skips = 0
    while step < run.total_steps and not stopping:
        t_step = time.perf_counter()
        timing = dict.fromkeys(("gen", "reward", "sync", "wake_sleep", "old_log_prob", "ref", "update_actor")
                               + (("gen_wait", "weight_transfer") if cfg.rollout_gpus else ()), 0.0)
        at_step_start = sampler_state(run), parallel.rng_state(dims.device)
        graphs_before = parallel.compiled_graphs()
        try:
            batch, metrics = train_step(run, cfg, step, version, timing,
                                        progress=functools.partial(report_refill, cfg=cfg, bar=bar, log=log))
        except StopRequested:  # leave as if this step never began: the resumed run draws the same prompts
            abandon_step(cfg, run, step, at_step_start)
            break
        version += 1
        step += 1
        fault_point("update", step)
        consecutive_skips = check_update(cfg, metrics, consecutive_skips, log)

        # 8. validation, metrics, checkpoint
        val_metrics, val_pending = validate_if_due(run, cfg, version, step, timing)
        metrics.update(val_metrics)
        metrics.update(time_and_perf_metrics(run, cfg, batch, timing, t_step, graphs_before))
        if dims.is_main:
            logger.log(step, {k: float(v) for k, v in metrics.items()})
        bar.update(1)
        stopping = stop.agreed(dims)
        last = step == run.total_steps
        if (cfg.save_freq > 0 and step % cfg.save_freq == 0) or (last and cfg.save_freq >= 0) or stopping:
            save_checkpoint(cfg, run, step, val_pending)
        if stopping:
            cut = " (its validation was cut short: the resumed run runs it first)" if val_pending else ""
            log(f"stopped by signal after step {step}{cut}; its checkpoint was written "
                f"{stop.seconds_since():.1f} s after the signal; resume with resume='auto'")
        if step == first_step + 1:  # compilation and the engine's warm-up are done
            del batch  # this step's data is not run-long
            freeze_gc_heap()
    bar.close()
    if logger is not None:
        logger.close()
    close_run(run)
    return run.model


def train_step(run: Run, cfg: Config, step: int, version: int, timing: dict,
               progress=None) -> tuple[Trajectories, dict]:
    """Steps 1-7 of training step step + 1, in order -> (the batch trained on, the step's metrics). A stop
    signal before the update raises StopRequested, the weights untouched. timing: each phase's seconds are
    added to it; progress: dynamic sampling's report after each gen batch."""
    counts, metrics = {}, {}
    # 1-4. gen batches (sample, generate, score) until train_batch_size groups have reward variance
    batch, generated, num_gen_batches = dynamic_sampling(
        gen_batches(run, cfg, step=step, version=version, timing=timing, counts=counts), cfg, progress)
    if run.rollouts is not None:  # async mode: the generators make the next gen batches while this one trains
        metrics.update(ask_ahead(run, cfg, batch, step, version, timing))

    # 5. advantages (adv_estimator) from the token-level rewards
    batch.adv = ADV_ESTIMATORS[cfg.adv_estimator](batch.token_level_rewards, batch.response_mask,
                                                  batch.group_ids, cfg)

    # 6. old (unless the update's forward gives them) and reference log-probs; rollout correction
    metrics.update(logprobs_for_update(run, cfg, batch, timing))
    if run.stop.agreed(run.dims):  # the last point where the step can be dropped: the update changes weights
        raise StopRequested

    # 7. update
    with timed("update_actor", timing):
        metrics.update(update_policy(run.model, run.optimizer, run.scheduler, batch, cfg, run.dims))
    if run.optimizer_states is not None:  # optimizer_offload's share of the update
        metrics["perf/optimizer_offload_s"] = run.optimizer_states.pop_seconds()
    metrics.update(rollout_metrics(generated, num_gen_batches, counts, cfg))
    metrics["sampler/epoch"] = run.sampler.epoch
    return batch, metrics


def validate_if_due(run: Run, cfg: Config, version: int, step: int, timing: dict) -> tuple[dict, bool]:
    """Step 8's validation, every test_freq steps and after the last -> (its metrics, whether a stop signal cut
    it short: the step is trained and checkpointed, and the resumed run validates it first)."""
    due = (cfg.test_freq > 0 and step % cfg.test_freq == 0) or step == run.total_steps
    if not run.val_prompts or not due:
        return {}, False
    try:
        with timed("testing", timing):
            return validate(run, cfg, version, step), False
    except StopRequested:
        return {}, True


def time_and_perf_metrics(run: Run, cfg: Config, batch: Trajectories, timing: dict, t_step: float,
                          graphs_before: int) -> dict:
    """The step's phase times (verl's timing_s/* names), throughput and peak memory, and the graphs
    torch.compile made during it (a new shape or a recompile shows up here)."""
    peaks = timing.pop(PEAK_GIB, {})
    timing = step_timing(timing, t_step, colocated=run.rollouts is None)
    metrics = {f"timing_s/{k}": v for k, v in timing.items()}
    metrics.update(perf_metrics(batch, timing["step"], run.dims, cfg, peaks))
    if parallel.compiled_graphs():  # torch.compile is on
        metrics["perf/compiled_graphs"] = parallel.compiled_graphs() - graphs_before
    return metrics


def announce(run: Run, cfg: Config, step: int):
    """The run's first line: what it will train, or why there is nothing to train."""
    if step >= run.total_steps:
        run.log(f"nothing to train: the checkpoint resumed is at step {step} and this run has "
                f"{run.total_steps} steps (total_training_steps, or total_epochs x steps per epoch); raise them "
                "to train further")
    else:
        run.log(f"training {run.total_steps} steps on {run.dims.world_size} x {run.dims.device.type}; "
                f"{json.dumps(plan.batch_arithmetic(cfg, run.dims.world_size, len(run.train_prompts)))}")


def ask_ahead(run: Run, cfg: Config, batch: Trajectories, step: int, version: int, timing: dict) -> dict:
    """Asynchronous mode, after dynamic sampling: ask the generator ranks for the gen batches the next steps
    will take, so that they generate while this step trains -> the batch's staleness metrics."""
    while len(run.rollouts.pending) < gen_batches_ahead(cfg, step + 1, run.total_steps):
        run.rollouts.ask_gen_batch(version, timing)
    return async_metrics(run, batch, version, cfg)


def check_update(cfg: Config, metrics: dict, consecutive_skips: int, log) -> int:
    """After an update: RunError after max_consecutive_skips steps in a row whose every optimizer step was
    skipped (non-finite), a warning where engine and trainer disagree on log-probs -> the new count of skips."""
    all_skipped = metrics["actor/skipped_updates"] == plan.optimizer_steps_per_step(cfg)
    consecutive_skips = consecutive_skips + 1 if all_skipped else 0
    if consecutive_skips >= cfg.max_consecutive_skips:
        raise RunError(f"{consecutive_skips} steps in a row had a non-finite loss or gradient norm and "
                       f"were skipped (max_consecutive_skips={cfg.max_consecutive_skips}); lower lr, "
                       "check grad_clip and the data, or resume from an earlier checkpoint")
    if float(metrics.get("rollout/logp_mismatch", 0.0)) > cfg.logp_mismatch_warn and not cfg.rollout_gpus:
        log(f"warning: rollout/logp_mismatch={float(metrics['rollout/logp_mismatch']):.3g} > "
            f"logp_mismatch_warn={cfg.logp_mismatch_warn}: engine and trainer disagree on log-probs "
            "(precision, weights?)")
    return consecutive_skips


def close_run(run: Run):
    """What the run holds open, in order: the generators' queue, the reward workers, the signal handlers,
    the out_dir lock, the process group."""
    if run.rollouts is not None:
        run.rollouts.close()
    run.scorer.close()
    run.stop.restore()
    if run.out_dir_lock is not None:
        run.out_dir_lock.close()
    parallel.shutdown()


def validate_at_start(run: Run, cfg: Config, logger, step: int, val_pending: bool) -> bool:
    """Before training (val_before_train), or the resumed step's validation that a stop cut short (it joins
    that step's row) -> False if a stop signal came during it."""
    if not run.val_prompts or not ((cfg.val_before_train and step == 0) or val_pending):
        return True
    try:
        metrics = validate(run, cfg, step, step)  # the weights' version is the step they come from
    except StopRequested:
        what = f"of step {step}" if step else "before training"
        run.log(f"stopped by signal during the validation {what}; nothing was trained")
        return False
    if run.dims.is_main:
        logger.log(step, metrics)
    return True


def logprobs_for_update(run: Run, cfg: Config, batch: Trajectories, timing: dict) -> dict:
    """Step 6 on the training batch: the old log-probs (unless the update's forward gives them), the reference
    log-probs when the KL loss is on, and the rollout correction against the engine's log-probs (importance
    weights, then rejection, both over the whole batch) -> metrics."""
    metrics = {}
    with timed("old_log_prob", timing):
        if batch.old_logp is None and not old_logp_from_update(cfg):
            batch.old_logp = compute_logprobs(run.model, batch, cfg, run.dims)
    if batch.old_logp is not None and not batch.rollout_logp.isnan().any():
        metrics["rollout/logp_mismatch"] = logp_mismatch(batch.old_logp, batch.rollout_logp,
                                                         batch.response_mask)
    if cfg.rollout_is is not None:  # on the response tokens before rejection, as verl
        batch.rollout_is_weights = rollout_is_weights(batch.old_logp, batch.rollout_logp, batch.response_mask,
                                                      cfg.rollout_is, cfg.rollout_is_threshold,
                                                      cfg.rollout_is_batch_normalize)
        metrics["rollout/is_mean"] = token_mean(batch.rollout_is_weights, batch.response_mask)
    level = rollout_rs_level(cfg)
    if level is not None:
        keep = rollout_rs_mask(batch.old_logp, batch.rollout_logp, batch.response_mask, level,
                               cfg.rollout_rs_threshold, cfg.rollout_rs_threshold_lower)
        metrics["rollout/rs_masked_frac"] = 1 - token_mean(keep, batch.response_mask)
        batch.response_mask = batch.response_mask * keep
    if cfg.use_kl_loss:
        with timed("ref", timing):
            batch.ref_logp = compute_logprobs(run.ref_model, batch, cfg, run.dims)
    return metrics


def abandon_step(cfg: Config, run: Run, step: int, at_step_start: tuple):
    """A stop during step + 1, before its update: drop what it generated (and the gen batches asked ahead),
    rewind the sampler and RNG to the step's start, so that a resumed run draws the same prompts, and write
    step's checkpoint."""
    if run.rollouts is not None:
        run.rollouts.close()
    run.sampler.load_state_dict(at_step_start[0])
    parallel.set_rng_state(at_step_start[1], run.dims.device)
    save_checkpoint(cfg, run, step)
    run.log(f"stopped by signal during step {step + 1}, which is dropped (a resumed run starts it again); "
            f"checkpoint of step {step} written {run.stop.seconds_since():.1f} s after the signal")


def step_timing(timing: dict, t_step: float, colocated: bool) -> dict:
    """Each phase's seconds, the step's, and (colocated) "other": what no phase accounts for (Python between
    phases, metrics, logging)."""
    timing = {**timing, "step": time.perf_counter() - t_step}
    if colocated:
        timing["other"] = timing["step"] - sum(v for k, v in timing.items() if k != "step")
    return timing


def perf_metrics(batch: Trajectories, step_s: float, dims, cfg: Config, peaks: dict) -> dict:
    """Throughput over all GPUs of the run (generators included), and this GPU's peak memory in the step and
    in each of its phases (peaks: timed's {phase: GiB}; each phase resets the allocator's peak)."""
    metrics = {"perf/tokens_per_s": batch.total_tokens() / step_s}
    metrics["perf/tokens_per_s_per_gpu"] = metrics["perf/tokens_per_s"] / (dims.world_size + cfg.rollout_gpus)
    if dims.device.type != "cpu":
        metrics["perf/max_memory_allocated_gib"] = max([parallel.max_memory_allocated_gib(dims.device),
                                                        *peaks.values()])
        metrics.update({f"perf/max_memory_allocated_gib/{k}": v for k, v in peaks.items()})
    return metrics


def setup(cfg: Config) -> Run:
    """Devices, data, reward, rollout engine, policy (+ reference), optimizer: cheap things that can fail
    first. A generator rank (async mode) gets its engine and no policy."""
    # async mode: the other trainer ranks wait in a collective while rank 0's watchdog waits on a generator
    timeout_s = cfg.watchdog_timeout_s + 300 if cfg.rollout_gpus else None
    dims = parallel.init_distributed(cfg.device, cfg.tp_size, cfg.sp_size, cfg.ep_size, cfg.rollout_gpus,
                                     timeout_s=timeout_s, gen_tp=cfg.gen_tp)
    if cfg.rollout_gpus and (dims.is_main or dims.is_generator):
        dims.bridge = Bridge.connect(dims, cfg.rollout_gpus, timeout_s)
    # before anything is written there
    out_dir_lock = checkpoint.lock_out_dir(cfg.out_dir) if dims.is_main else None
    try:
        # vllm installed? (a dry run needs not)
        engine_kind = resolve_engine(cfg.rollout_engine, dims.device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    parallel.seed_everything(cfg.seed)
    compute_dtype = torch.float32 if dims.device.type == "cpu" else getattr(torch, cfg.dtype)
    compile_blocks = parallel.compile_enabled(cfg.compile, dims.device.type)
    log = say if dims.is_main else (lambda msg: None)
    if dims.is_main:
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    tokenizer = Tokenizer.from_pretrained(cfg.model_path)
    train_prompts = load_prompts(cfg, tokenizer, cfg.train_files, cfg.train_max_samples)
    val_prompts = load_prompts(cfg, tokenizer, cfg.val_files, cfg.val_max_samples) if cfg.val_files else []
    reward.check_data_sources({p["data_source"] for p in train_prompts + val_prompts}, cfg.reward_fn)
    sampler = data.PromptSampler(len(train_prompts), seed=cfg.seed, shuffle=cfg.shuffle)
    scoring = not cfg.rollout_gpus or dims.is_generator  # async mode: trainer ranks score nothing
    scorer = reward.RewardScorer(cfg.reward_fn, num_workers=cfg.reward_num_workers if scoring else 0,
                                 timeout_s=cfg.reward_timeout)
    run = Run(dims=dims, tokenizer=tokenizer, train_prompts=train_prompts, val_prompts=val_prompts,
              sampler=sampler, scorer=scorer, engine=None, gen_tp=cfg.gen_tp, compute_dtype=compute_dtype,
              log=log, out_dir_lock=out_dir_lock)
    if dims.is_generator:
        run.engine = make_engine(cfg, dims, engine_kind, compute_dtype, compile_blocks, log)
        return run

    if cfg.param_offload or cfg.optimizer_offload or ref_offload(cfg):  # before anything is loaded
        plan.check_host_memory(cfg, load_config(cfg.model_path), dims.world_size,
                               int(os.environ.get("LOCAL_WORLD_SIZE", "1")), parallel.host_memory_gib(),
                               engine_kind)
    colocated = not cfg.rollout_gpus
    # colocated vLLM comes before the trainer's tensors: it sizes its KV cache from the memory free now
    if colocated and engine_kind == "vllm":
        run.engine = make_engine(cfg, dims, engine_kind, compute_dtype, compile_blocks, log)
    run.model, run.ref_model = build_policy(cfg, dims, engine_kind, compute_dtype, compile_blocks, log)
    if colocated and engine_kind == "torch":
        run.engine = make_engine(cfg, dims, engine_kind, compute_dtype, compile_blocks, log, policy=run.model)
        run.gen_tp = 1
    if not colocated:
        log(f"asynchronous rollout: {cfg.rollout_gpus} generator rank(s), {cfg.rollout_gpus // cfg.gen_tp} "
            f"{engine_kind} engine(s), max_staleness={cfg.max_staleness}, "
            f"partial_rollout={cfg.partial_rollout}, tis_imp_ratio_cap={tis_cap(cfg)}")
    run.optimizer, run.optimizer_states = build_optimizer(cfg, run.model, dims, log)
    steps_per_epoch = math.ceil(len(train_prompts) / cfg.train_batch_size)
    run.total_steps = cfg.total_training_steps or steps_per_epoch * cfg.total_epochs
    run.scheduler = make_scheduler(run.optimizer, cfg, run.total_steps * plan.optimizer_steps_per_step(cfg))
    return run


def make_engine(cfg: Config, dims, kind: str, compute_dtype: torch.dtype, compile_blocks: bool, log,
                policy=None) -> TorchEngine | VLLMEngine:
    """This rank's rollout engine, in one of three topologies:
    - a generator rank (async mode): its share of a vLLM engine of gen_tp generator ranks, or the built-in
      engine on a copy of its own; it never sleeps;
    - colocated vLLM: this rank's share of one of world_size / gen_tp engines, asleep until the first rollout;
    - the built-in engine on a training rank: the policy's own module in a CPU process (nothing to push),
      else a compute_dtype copy that the trainer pushes its weights into."""
    if kind == "vllm":
        ranks = cfg.rollout_gpus if dims.is_generator else dims.world_size
        engine = make_vllm_engine(cfg, ranks // cfg.gen_tp, log)
        if dims.is_generator:
            engine.wake_up()
        return engine
    shares_weights = policy is not None and not dims.sharded
    if shares_weights:
        model = policy
    else:
        model = from_pretrained(cfg.model_path, dtype=compute_dtype, device=dims.device)
    # check_config allows compile=True only where dims.sharded: never on the trainer's own module
    engine = TorchEngine(model, max_num_seqs=cfg.max_num_seqs, shares_weights=shares_weights,
                         compile=compile_blocks)
    features = ["built-in"]
    if engine.use_cuda_graph:
        features.append("CUDA graphs")
    if compile_blocks:
        features.append("compiled blocks")
    log(f"rollout engine: torch ({', '.join(features)})")
    return engine


def build_policy(cfg: Config, dims, engine_kind: str, compute_dtype: torch.dtype, compile_blocks: bool,
                 log) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy with its activation checkpointing, and the reference model when a KL term is on
    -> (policy, reference or None). fp32 master weights: a plain fp32 module in a CPU process, else TP / SP /
    FSDP2 shards (one GPU is a mesh of one) computing in compute_dtype; param_offload (ref_param_offload for
    the reference) keeps them on the host."""
    def build(offload: bool):  # FSDP's CPU offload wants the shards materialized on the host
        shard = None  # how from_pretrained wraps each module it builds
        if dims.sharded:
            shard = functools.partial(parallel.parallelize, dims=dims, param_dtype=compute_dtype,
                                      offload=offload, compile=compile_blocks)
        device = torch.device("cpu") if offload else dims.device
        return from_pretrained(cfg.model_path, dtype=torch.float32, device=device, parallelize=shard)

    model = build(cfg.param_offload)
    if compile_blocks:
        log(f"torch.compile: the policy's decoder blocks (compile={cfg.compile!r}), shapes dynamic from the "
            "start")
    ckpt = cfg.gradient_checkpointing
    if ckpt == "auto" and dims.device.type == "cpu":  # no memory plan for the host: checkpointing stays on
        ckpt = True
    elif ckpt == "auto":  # the memory plan's choice for this GPU
        props = torch.get_device_module(dims.device.type).get_device_properties(dims.device)
        gpu_gib = props.total_memory / 2**30
        ckpt = plan.memory_plan(cfg, model.config, dims.world_size, gpu_gib,
                                engine=engine_kind)["gradient_checkpointing"]
        log(f"gradient_checkpointing='auto' on {gpu_gib:.0f} GiB GPUs: {ckpt}")
    model.gradient_checkpointing = ckpt
    ref_model = None
    if cfg.use_kl_loss or cfg.use_kl_in_reward:
        ref_model = build(ref_offload(cfg))
        ref_model.eval().requires_grad_(False)
    return model, ref_model


def build_optimizer(cfg: Config, model, dims, log):
    """AdamW over the policy's parameters -> (optimizer, the optimizer_offload mover or None)."""
    # no full-size temporaries
    fused = dims.device.type == "cuda" and not cfg.param_offload
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                  weight_decay=cfg.weight_decay,
                                  fused=fused or None)  # None, not False: False would turn foreach off too
    optimizer_states = None
    if cfg.optimizer_offload and not cfg.param_offload:  # param_offload keeps the states on the host anyway
        optimizer_states = parallel.OptimizerStateOffload(optimizer, pin=dims.device.type != "cpu")
        log("optimizer_offload: AdamW's states on the host between optimizer steps, on the GPU for each step")
    return optimizer, optimizer_states


def make_vllm_engine(cfg: Config, engines: int, log) -> VLLMEngine:
    """This rank's share of one of `engines` vLLM engines of gen_tp ranks (it sleeps until woken)."""
    t0 = time.perf_counter()
    engine_kwargs = dict(cfg.vllm_kwargs)
    if cfg.router_replay:
        engine_kwargs["enable_return_routed_experts"] = True
    engine = VLLMEngine(cfg.model_path, gen_tp=cfg.gen_tp, gpu_memory_utilization=cfg.gpu_memory_utilization,
                        max_model_len=cfg.max_prompt_length + cfg.max_response_length,
                        max_num_seqs=cfg.max_num_seqs, enforce_eager=cfg.enforce_eager,
                        enable_chunked_prefill=cfg.enable_chunked_prefill,
                        max_num_batched_tokens=cfg.max_num_batched_tokens or None, seed=cfg.seed,
                        dtype=cfg.dtype, engine_kwargs=engine_kwargs)
    if engine.kv_cache_bytes is None:
        kv_pool = f"KV pool: what gpu_memory_utilization={cfg.gpu_memory_utilization:g} leaves"
    else:
        kv_pool = f"KV pool: {engine.kv_cache_bytes / 2**30:.1f} GiB"
    log(f"rollout engine: vLLM, {engines} engine(s) of TP {cfg.gen_tp}, started in "
        f"{time.perf_counter() - t0:.0f} s; "
        f"{engine.awake_bytes / 2**30:.1f} GiB each while awake ({kv_pool})")
    return engine


def load_prompts(cfg: Config, tokenizer, files: list[str], max_samples: int) -> list[dict]:
    """The prompts of parquet files, chat-templated and tokenized with the config's length rules."""
    return data.load_prompts(files, tokenizer, prompt_key=cfg.prompt_key,
                             max_prompt_length=cfg.max_prompt_length, truncation=cfg.truncation,
                             filter_overlong_prompts=cfg.filter_overlong_prompts, max_samples=max_samples,
                             chat_template_kwargs=cfg.chat_template_kwargs)


def restore(cfg: Config, run: Run) -> tuple[int, bool]:
    """Load the checkpoint cfg.resume names ('auto': the newest usable one in out_dir) into the policy,
    optimizer, scheduler and sampler -> (the step it holds (0 = a fresh start), whether that step's
    validation is still to run: a stop cut it short).
    checkpoint.resume_state says what all-or-nothing means."""
    with optimizer_states_on_device(run):
        state = checkpoint.resume_state(cfg.resume, cfg.out_dir, run.model, run.optimizer, run.dims, run.log)
    if state is None:
        return 0, False
    run.scheduler.load_state_dict(state["scheduler"])
    run.sampler.load_state_dict(state["sampler"])
    checkpoint.apply_optimizer_knobs(cfg, run.optimizer, run.scheduler, run.log)
    return state["step"], state.get("val_pending", False)  # absent from older checkpoints


def optimizer_states_on_device(run: Run):
    """optimizer_offload: the optimizer's states where a checkpoint can read and write them (a with block)."""
    if run.optimizer_states is None:
        return contextlib.nullcontext()
    return run.optimizer_states.on_device()


def save_checkpoint(cfg: Config, run: Run, step: int, val_pending: bool = False):
    """Checkpoint (sharded model + optimizer, trainer state, an HF export), written atomically;
    prune old ones. val_pending: a stop cut the step's validation short, the resumed run runs it."""
    if step == 0 or cfg.save_freq < 0:  # nothing trained yet, or checkpoints are off
        return
    state = {"step": step, "scheduler": run.scheduler.state_dict(), "sampler": sampler_state(run),
             "val_pending": val_pending}
    t0 = time.perf_counter()
    with optimizer_states_on_device(run):
        checkpoint.save_step(cfg.out_dir, step, run.model, run.optimizer, state, run.dims,
                             dtype=run.compute_dtype, model_path=cfg.model_path, keep_last=cfg.keep_last)
    # what a stop signal needs on top of the step in flight: a launcher's grace period must cover it
    run.log(f"checkpoint step_{step} written in {time.perf_counter() - t0:.1f} s")


VAL_SEEDS = 7919  # validation after step s samples with seed + 7919 (s + 1): apart from the gen batches' seeds


def validate(run: Run, cfg: Config, version: int, step: int) -> dict:
    """Generate for the validation prompts (val_n each, val sampling knobs) and score: mean@val_n accuracy."""
    params = SamplingParams(n=cfg.val_n, temperature=cfg.val_temperature if cfg.val_do_sample else 0.0,
                            top_p=cfg.val_top_p, top_k=cfg.val_top_k, max_tokens=cfg.max_response_length,
                            stop_token_ids=run.tokenizer.eos_token_ids, seed=cfg.seed + VAL_SEEDS * (step + 1),
                            logprobs=False)  # validation scores answers only; vLLM's log-probs cost speed
    timing = {}
    if run.rollouts is None:
        traj, _ = rollout(run, cfg, run.val_prompts, params, version=version, group_offset=0, timing=timing)
    else:  # on the generators, after the gen batches asked before
        entry = run.rollouts.ask(list(range(len(run.val_prompts))), params, version, timing, None, val=True)
        traj, _ = run.rollouts.take(entry, timing)
    if run.dims.is_main:
        save_val_generations(traj, run.val_prompts, run.tokenizer, cfg, step)
    return {**validation_metrics(traj), "timing_s/sync_val": timing.get("sync", 0.0)}


def rollout_metrics(generated: Trajectories, num_gen_batches: int, counts: dict, cfg: Config) -> dict:
    """What the step generated (all gen batches, kept or not)."""
    lens = torch.tensor([len(r) for r in generated.response_ids], dtype=torch.float32)
    return {"train/acc": generated.acc.mean().item(), "train/score_mean": generated.score.mean().item(),
            "train/seq_reward_mean": generated.seq_reward.mean().item(),
            "response_length/mean": lens.mean().item(), "response_length/max": lens.max().item(),
            "response_length/clip_ratio": (lens >= cfg.max_response_length).float().mean().item(),
            "sampling/num_gen_batches": num_gen_batches,
            "sampling/kept_group_frac":
                int(kept_mask(generated, cfg).sum()) // cfg.n / (num_gen_batches * cfg.gen_batch_size),
            **{f"sampling/{k}": v for k, v in group_outcomes(generated, cfg).items()
               if k != "response_length_mean" and v is not None},
            **{f"reward/{k}": v for k, v in counts.items()}}


def sampler_state(run: Run) -> dict:
    """The sampler as it was before the oldest gen batch not yet trained on was drawn
    (async mode: gen batches asked ahead)."""
    pending = []
    if run.rollouts is not None:  # validation requests draw nothing from the sampler
        pending = [e for e in run.rollouts.pending if not e["request"].val]
    return pending[0]["sampler_state"] if pending else run.sampler.state_dict()


def async_metrics(run: Run, batch: Trajectories, version: int, cfg: Config) -> dict:
    """How many versions behind the policy the weights that sampled the batch's tokens were (beyond
    max_staleness is a bug: RunError), the share of responses that partial rollout continued with newer
    weights, and the prompts of all gen batches trained on so far (the sampler's position: each one's prompts
    follow the last's)."""
    mask = batch.response_mask > 0
    staleness = (version - batch.versions)[mask].float()
    if staleness.max() > cfg.max_staleness:
        raise RunError(f"step {version + 1} got tokens sampled {int(staleness.max())} policy versions ago, "
                       f"more than max_staleness={cfg.max_staleness}")
    newest = batch.versions.masked_fill(~mask, -1).amax(-1)
    oldest = batch.versions.masked_fill(~mask, version + 1).amin(-1)
    s = sampler_state(run)
    return {"rollout/staleness_mean": staleness.mean().item(),
            "rollout/staleness_max": staleness.max().item(),
            "rollout/partial_frac": (newest > oldest).float().mean().item(),
            "sampler/consumed_prompts": s["epoch"] * s["num_prompts"] + s["position"]}


DIAGNOSE_EVERY = 3  # gen batches between the dynamic-sampling progress lines of one step


def report_refill(r: int, kept: int, generated: list[Trajectories], cfg: Config, bar, log):
    """Dynamic sampling's progress: the progress bar after every gen batch; every DIAGNOSE_EVERY gen batches
    a line saying why groups are dropped, and once no group at all was kept, one sampled response and the
    likely cause."""
    if r == 1:
        return
    bar.set_postfix_str(f"gen batch {r}, {kept}/{cfg.train_batch_size} groups")
    if r % DIAGNOSE_EVERY:
        return
    traj = concat_trajectories(generated, cfg.max_response_length)
    outcomes = group_outcomes(traj, cfg)
    log(f"dynamic sampling: gen batch {r}, {kept} of {cfg.train_batch_size} groups kept so far; "
        f"{describe_outcomes(outcomes)}")
    if kept == 0 and r == DIAGNOSE_EVERY:
        i = int(torch.randint(len(traj), (1,), generator=torch.Generator().manual_seed(r)))
        log(f"dynamic sampling: no group kept after {r} gen batches; likely cause: {likely_cause(outcomes)}. "
            f"A sampled response (score {traj.score[i].item():g}): {traj.response_texts[i][:300]!r}")


# -----------------------------------------------------------------------------
# validation, checkpoints, signals, metrics

def validation_metrics(traj: Trajectories) -> dict:
    """mean@val_n accuracy per data_source and overall."""
    per_source = {f"val/acc/{ds}": traj.acc[torch.tensor([d == ds for d in traj.data_sources])].mean().item()
                  for ds in sorted(set(traj.data_sources))}
    return {"val/acc": traj.acc.mean().item(), "val/score_mean": traj.score.mean().item(), **per_source}


def save_val_generations(traj: Trajectories, val_prompts, tokenizer, cfg: Config, step: int):
    if cfg.log_val_generations <= 0:
        return
    with open(os.path.join(cfg.out_dir, f"val_generations_step{step}.jsonl"), "w") as f:
        for i in range(min(cfg.log_val_generations, len(traj))):
            p = val_prompts[i // cfg.val_n]
            f.write(json.dumps({"prompt": tokenizer.decode(p["prompt_ids"], skip_special_tokens=False),
                                "response": traj.response_texts[i], "ground_truth": p["ground_truth"],
                                "score": traj.score[i].item()}) + "\n")


def read_metrics(path: str) -> list[dict]:
    """Rows of a metrics.jsonl; a partial line (a crash mid-write) is skipped with a warning."""
    rows = []
    for i, line in enumerate(open(path), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            say(f"warning: {path} line {i} is not complete JSON (a crash while writing it?); skipped")
    return rows


def write_metrics(path: str, rows: list[dict]):
    """Replace a metrics.jsonl with rows; a crash mid-write leaves the old file."""
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


class Logger:
    """console + out_dir/metrics.jsonl always; tensorboard / wandb / mlflow when listed."""

    def __init__(self, cfg: Config, resumed_step: int = 0):
        self.cfg, self.backends = cfg, {}
        self.path, self.last_step = os.path.join(cfg.out_dir, "metrics.jsonl"), None
        if os.path.isfile(self.path):  # after a resume, drop rows of steps that will be run again
            rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= resumed_step]
            write_metrics(self.path, rows)
            self.last_step = rows[-1].get("step") if rows else None
        self.jsonl = open(self.path, "a")
        for name in cfg.logger:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.backends[name] = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))
            elif name == "wandb":
                import wandb
                wandb.init(project=cfg.project_name, name=cfg.experiment_name, config=asdict(cfg))
                self.backends[name] = wandb
            elif name == "mlflow":
                import mlflow
                mlflow.set_experiment(cfg.project_name)
                mlflow.start_run(run_name=cfg.experiment_name)
                self.backends[name] = mlflow

    def log(self, step: int, metrics: dict):
        """A row of metrics.jsonl; metrics for the last row's step (its validation, run at resume) join that
        row: one row per step, as in an uninterrupted run."""
        if step == self.last_step:
            self.jsonl.close()
            rows = read_metrics(self.path)
            rows[-1].update(metrics)
            write_metrics(self.path, rows)
            self.jsonl = open(self.path, "a")
        else:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        self.last_step = step
        for k, v in metrics.items() if "tensorboard" in self.backends else ():
            self.backends["tensorboard"].add_scalar(k, v, step)
        if "wandb" in self.backends:
            self.backends["wandb"].log(metrics, step=step)
        if "mlflow" in self.backends:  # mlflow refuses '@' in names
            self.backends["mlflow"].log_metrics({k.replace("@", "_at_"): v for k, v in metrics.items()},
                                                step=step)
        if "console" in self.cfg.logger:
            keys = [("val/acc", "val_acc"), ("train/acc", "acc"), ("train/score_mean", "score"),
                    ("response_length/mean", "len"), ("actor/entropy", "ent"), ("actor/pg_clipfrac", "clip"),
                    ("sampling/num_gen_batches", "gen_batches"), ("timing_s/step", "s")]
            say(f"step {step:4d} | "
                + " | ".join(f"{short} {metrics[k]:.3g}" for k, short in keys if k in metrics))

    def close(self):
        """Write out what the backends hold: tensorboard flushes its events, the wandb and mlflow runs end."""
        self.jsonl.close()
        if "tensorboard" in self.backends:
            self.backends["tensorboard"].close()
        if "wandb" in self.backends:
            self.backends["wandb"].finish()
        if "mlflow" in self.backends:
            self.backends["mlflow"].end_run()


# -----------------------------------------------------------------------------
# command line: train, --dry_run

# exit codes: 0 done (or stopped by a signal after a checkpoint), reliability.EXIT_BAD_INPUT,
# reliability.EXIT_RUN_FAILED, 128 + N a second signal N
BAD_INPUT = (ConfigError, CheckpointInputError, data.DataError, reward.RewardError, FileNotFoundError)
RUN_FAILED = (RunError, CheckpointError, reliability.WaitTimeout)


def main(argv: list[str]) -> int:
    try:
        cfg, flags = parse_args(Config, [a for a in argv if a != "--"])  # torchrun: script -- --key=value
        if flags["dry_run"]:
            plan.dry_run(cfg)
            return 0
        train(cfg)
    except BAD_INPUT + RUN_FAILED as e:
        report_failure(e)
        return reliability.EXIT_RUN_FAILED if isinstance(e, RUN_FAILED) else reliability.EXIT_BAD_INPUT
    except Exception as e:
        if not reliability.is_peer_failure(e):
            raise
        report_failure(e)  # another rank stopped first: it said why
        return reliability.EXIT_RUN_FAILED
    if parallel.torchrun_rank() == 0:
        print(f"metrics: {os.path.join(cfg.out_dir, 'metrics.jsonl')}")
        print(f"plot them: python tools/plot.py {cfg.out_dir}")
    return 0


if __name__ == "__main__":
    parallel.exit_process(main(sys.argv[1:]))
