"""
DAPO / GRPO training, one file: the config, the algorithm and the loop.

    python train_dapo.py configs/tiny.py                         # CPU demo: learns arithmetic in minutes
    python train_dapo.py configs/tiny.py --lr=3e-4 --n=4         # override any Config field
    python train_dapo.py configs/qwen32b.py --dry_run            # check the config, print batch arithmetic
    python train_dapo.py --plot out/tiny                         # PNG of reward, accuracy, length, entropy
    torchrun --nproc-per-node 8 train_dapo.py configs/qwen2.5_7b_dapo.py

One training step, in the order this file reads (REFERENCE.md has the exact semantics):
 1. sample gen_batch_size prompts              5. group-normalized advantages
 2. generate n responses each                  6. old (and reference) log-probs, packed
 3. score them (verifier + overlong shaping)   7. ppo_epochs x mini-batches of clipped policy-gradient updates
 4. keep groups with reward variance, refill   8. metrics, validation, checkpoint
"""
import ast
import contextlib
import difflib
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
import types
import typing
from dataclasses import asdict, dataclass, field

import torch

# -----------------------------------------------------------------------------
# config


@dataclass
class Config:
    # model and data
    model_path: str = "demo/model"  # HF model directory (config.json + safetensors + tokenizer files)
    train_files: list[str] = field(default_factory=lambda: ["demo/data/train.parquet"])  # parquet, verl schema
    val_files: list[str] = field(default_factory=lambda: ["demo/data/val.parquet"])  # [] = no validation
    prompt_key: str = "prompt"  # column holding the chat messages
    max_prompt_length: int = 512  # templated prompt tokens
    max_response_length: int = 1024  # generated tokens per response
    truncation: str = "error"  # overlong prompt: error | left | right | middle
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length instead
    train_max_samples: int = -1  # use only the first N train prompts (-1 = all)
    val_max_samples: int = -1  # use only the first N val prompts (-1 = all)
    shuffle: bool = True  # shuffle train prompts each epoch (seeded)
    # batch sizes (prompts are counted globally; see REFERENCE.md "Batch vocabulary")
    train_batch_size: int = 32  # prompt groups per training step
    gen_batch_size: int = 32  # prompts per generation round (dynamic sampling draws rounds until enough groups)
    n: int = 8  # responses per prompt (group size)
    ppo_mini_batch_size: int = 32  # prompts per optimizer step
    ppo_micro_batch_size_per_gpu: int = 64  # trajectories per forward/backward (ignored with use_dynamic_bsz)
    ppo_epochs: int = 1  # passes over each training batch
    use_dynamic_bsz: bool = False  # micro-batches by token budget instead of by count
    ppo_max_token_len_per_gpu: int = 16384  # token budget of one update micro-batch
    log_prob_micro_batch_size_per_gpu: int = 64  # trajectories per old/ref log-prob forward
    log_prob_max_token_len_per_gpu: int = 32768  # token budget of one log-prob micro-batch
    # policy loss
    clip_ratio_low: float = 0.2  # eps_low: ratio >= 1 - eps_low
    clip_ratio_high: float = 0.28  # eps_high (clip-higher): ratio <= 1 + eps_high
    clip_ratio_c: float = 10.0  # dual-clip bound for negative advantages (> 1)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    norm_adv_by_std: bool = True  # GRPO: divide by group std; False = Dr.GRPO
    entropy_coeff: float = 0.0  # loss -= entropy_coeff * entropy
    # KL (a reference model is built only when one of these is on)
    use_kl_loss: bool = False  # add kl_loss_coef * KL(policy || ref) to the loss (GRPO)
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # kl | abs | mse | low_var_kl
    use_kl_in_reward: bool = False  # subtract kl_coef * KL from the reward before advantages
    kl_coef: float = 0.001
    kl_penalty: str = "kl"  # KL estimator for the in-reward penalty
    # dynamic sampling (DAPO)
    filter_groups: bool = True  # keep only groups whose metric varies
    filter_groups_metric: str = "acc"  # acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 10  # generation rounds per step before giving up (0 = unlimited)
    # reward
    reward_fn: str | None = None  # "path/to/file.py:function_name", or None for the built-in verifiers
    reward_num_workers: int = 2  # scoring processes (0 = score inline, no timeout)
    reward_timeout: float = 10.0  # seconds per response before it scores 0 (counted in reward/num_timeouts)
    overlong_buffer: bool = True  # DAPO overlong reward shaping
    overlong_buffer_len: int = 256  # last tokens before max_response_length where the penalty ramps up
    overlong_penalty_factor: float = 1.0  # penalty at max_response_length
    # optimizer
    lr: float = 1e-6
    lr_warmup_steps: int = 0  # linear warmup, in optimizer steps
    lr_scheduler: str = "constant"  # constant | cosine (after warmup)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # max global grad norm; a non-finite norm skips the update
    gradient_checkpointing: bool = True  # activation checkpointing per decoder block
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
    rollout_engine: str = "auto"  # auto (vllm on CUDA when installed, else torch) | torch (built-in) | vllm
    max_num_seqs: int = 256  # sequences an engine decodes at once
    weight_sync_bucket_mb: int = 512  # trainer -> engine weight push, in buckets of this size
    # vLLM engine (rollout_engine="vllm"): world_size / gen_tp engines, colocated with training
    gen_tp: int = 1  # tensor parallel size of one engine (verl: rollout.tensor_model_parallel_size)
    gpu_memory_utilization: float = 0.5  # fraction of the GPU for vLLM's weights + KV cache while it is awake
    enforce_eager: bool = False  # no CUDA graphs / torch.compile in vLLM (fast start, slower decode)
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 0  # vLLM's token budget per engine step (0 = vLLM's default)
    vllm_kwargs: dict = field(default_factory=dict)  # passed to vllm.LLM as is, e.g. {"cudagraph_capture_sizes": [..]}
    tis_imp_ratio_cap: float = -1.0  # truncated importance sampling: weight token losses by min(p_old / p_rollout, cap)
    # parallelism (torchrun sets the world size; dp = world_size / (tp_size * sp_size) replicas see different data;
    # FSDP2 shards parameters, gradients and optimizer states over dp x sp)
    tp_size: int = 1  # tensor parallel degree for training
    sp_size: int = 1  # Ulysses sequence parallel degree: ranks that split each micro-batch's tokens (verl: ulysses_sequence_parallel_size)
    compile: bool = False  # torch.compile each decoder block (multi-GPU runs)
    param_offload: bool = False  # FSDP2 CPU offload of parameters (and, with it, gradients + optimizer step)
    optimizer_offload: bool = False  # same policy as param_offload: FSDP2 offloads all three together
    # schedule
    total_epochs: int = 1
    total_training_steps: int = 0  # 0 = derived from total_epochs; a step = train_batch_size kept groups
    test_freq: int = 5  # validate every N steps (0 = never, except at the end if val_files)
    save_freq: int = 0  # checkpoint every N steps (0 = only at the end, -1 = never)
    val_before_train: bool = True
    log_val_generations: int = 5  # example val generations saved per validation
    # run
    out_dir: str = "out/run"  # metrics.jsonl, checkpoints/, val generations, plot
    resume: str = "auto"  # auto (latest complete checkpoint in out_dir) | disable | path/to/checkpoint
    keep_last: int = 0  # keep only the newest N checkpoints (0 = keep all); pruned after a new one is complete
    max_consecutive_skips: int = 5  # stop the run after this many non-finite updates in a row
    # warn when mean |rollout - trainer| log-prob exceeds this: bf16 with fresh weights measured 0.014-0.022 on
    # the H200 (random 1.5B model, the worst case: entropy ~11.6 nats); stale weights give ~0.1
    logp_mismatch_warn: float = 0.05
    seed: int = 0
    device: str = "auto"  # auto | cuda | npu | cpu
    cpu_threads: int = 0  # torch intra-op threads on CPU (0 = torch's default; 1 is fastest for tiny models)
    dtype: str = "bfloat16"  # compute dtype on accelerators (master weights and optimizer stay fp32)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard | wandb | mlflow
    project_name: str = "nanodapo"
    experiment_name: str = "run"
    nnodes: int = 1  # for --dry_run's arithmetic (torchrun's WORLD_SIZE wins at run time)
    n_gpus_per_node: int = 1


class ConfigError(ValueError):
    """A bad knob, file or directory, found before any expensive work; the message names it and the fix."""


class RunError(RuntimeError):
    """The run cannot continue (dynamic sampling starved, repeated non-finite updates, stale weights)."""


def _type_ok(value, tp) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value)
    if tp is dict:
        return isinstance(value, dict)
    if origin is tuple:
        return isinstance(value, (tuple, list)) and len(value) == len(args) and all(
            _type_ok(v, a) for v, a in zip(value, args))
    return isinstance(value, tp)


def _set(cfg: Config, key: str, value, where: str):
    hints = typing.get_type_hints(Config)
    if key not in hints:
        close = difflib.get_close_matches(key, hints, n=1)
        raise ConfigError(f"unknown config key {key!r} ({where})" + (f"; did you mean {close[0]!r}?" if close else ""))
    tp = hints[key]
    if isinstance(value, str) and typing.get_origin(tp) is list:
        value = [value]  # train_files="a.parquet" means one file
    if not _type_ok(value, tp):
        raise ConfigError(f"{key}={value!r} ({where}) has type {type(value).__name__}; expected "
                          f"{getattr(tp, '__name__', str(tp))}")
    if typing.get_origin(tp) is tuple:
        value = tuple(value)
    if tp is float or float in typing.get_args(tp):
        value = float(value) if isinstance(value, int) else value
    setattr(cfg, key, value)


def parse_args(argv: list[str]) -> tuple[Config, dict]:
    """CONFIG.py (plain Python assignments) then --key=value overrides (ast.literal_eval, bare strings ok)."""
    cfg, flags = Config(), {"dry_run": False}
    for arg in argv:
        if arg == "--dry_run":
            flags["dry_run"] = True
        elif arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"{arg}: overrides are written --key=value")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string
            _set(cfg, key, value, f"command line {arg}")
        else:
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found")
            scope = {}
            with open(arg) as f:
                exec(compile(f.read(), arg, "exec"), scope)  # a config file is plain Python
            for key, value in scope.items():
                if not key.startswith("_") and not isinstance(value, (types.ModuleType, types.FunctionType, type)):
                    _set(cfg, key, value, f"config file {arg}")
    return cfg, flags


def world_size_for(cfg: Config) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.nnodes * cfg.n_gpus_per_node


def validate(cfg: Config, world_size: int = 1, check_files: bool = True):
    """Cross-field checks, before anything expensive. Raises ConfigError naming the knob and the fix."""
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    for k in ("train_batch_size", "gen_batch_size", "n", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
              "ppo_epochs", "max_prompt_length", "max_response_length", "log_prob_micro_batch_size_per_gpu",
              "max_num_seqs", "total_epochs"):
        need(getattr(cfg, k) > 0, f"{k}={getattr(cfg, k)} must be > 0")
    B, M, G = cfg.train_batch_size, cfg.ppo_mini_batch_size, cfg.n
    need(B % M == 0, f"ppo_mini_batch_size={M} must divide train_batch_size={B} (one optimizer step per mini-batch)")
    need(cfg.gen_batch_size >= B or cfg.filter_groups,
         f"gen_batch_size={cfg.gen_batch_size} < train_batch_size={B} needs filter_groups=True (refill rounds)")
    need(cfg.tp_size >= 1 and cfg.sp_size >= 1 and world_size % (cfg.tp_size * cfg.sp_size) == 0,
         f"tp_size={cfg.tp_size} x sp_size={cfg.sp_size} must divide the world size {world_size}")
    dp = world_size // (cfg.tp_size * cfg.sp_size)
    need((M * G) % dp == 0, f"ppo_mini_batch_size*n={M * G} trajectories must split evenly over "
                            f"{dp} data-parallel ranks (world_size / (tp_size * sp_size))")
    need(not cfg.compile or world_size > 1, "compile=True is for sharded runs (torchrun, 2+ GPUs): on one device the "
                                            "built-in engine decodes with the trainer's own module, untested compiled")
    per_rank = M * G // dp
    need(cfg.use_dynamic_bsz or per_rank % cfg.ppo_micro_batch_size_per_gpu == 0,
         f"ppo_micro_batch_size_per_gpu={cfg.ppo_micro_batch_size_per_gpu} must divide the per-rank mini-batch "
         f"ppo_mini_batch_size*n/dp={per_rank}")
    max_seq = cfg.max_prompt_length + cfg.max_response_length
    if cfg.use_dynamic_bsz:
        for k in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
            need(getattr(cfg, k) >= max_seq, f"{k}={getattr(cfg, k)} must be >= max_prompt_length + "
                                             f"max_response_length = {max_seq} (one sequence must fit)")
    need(cfg.clip_ratio_c > 1.0, f"clip_ratio_c={cfg.clip_ratio_c} must be > 1 (dual clip)")
    need(0 <= cfg.clip_ratio_low < 1 and cfg.clip_ratio_high >= 0, "clip ratios: 0 <= clip_ratio_low < 1, "
                                                                    "clip_ratio_high >= 0")
    choices = {"loss_agg_mode": AGG_MODES, "kl_loss_type": KL_TYPES, "kl_penalty": KL_TYPES,
               "filter_groups_metric": FILTER_METRICS, "truncation": ("error", "left", "right", "middle"),
               "lr_scheduler": ("constant", "cosine"), "rollout_engine": ("auto", "torch", "vllm"),
               "device": ("auto", "cuda", "npu", "cpu"), "dtype": ("bfloat16", "float16", "float32")}
    for k, allowed in choices.items():
        need(getattr(cfg, k) in allowed, f"{k}={getattr(cfg, k)!r}; choose one of {', '.join(allowed)}")
    for lg in cfg.logger:
        need(lg in ("console", "jsonl", "tensorboard", "wandb", "mlflow"),
             f"logger {lg!r}; choose from console, jsonl, tensorboard, wandb, mlflow")
        module = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}.get(lg)
        need(module is None or importlib.util.find_spec(module) is not None,
             f"logger {lg!r} is listed but {module} is not installed; pip install {module} or remove it from logger")
    if cfg.overlong_buffer:
        need(0 < cfg.overlong_buffer_len <= cfg.max_response_length,
             f"overlong_buffer_len={cfg.overlong_buffer_len} must be in (0, max_response_length="
             f"{cfg.max_response_length}]")
    need(0 < cfg.top_p <= 1 and 0 < cfg.val_top_p <= 1, "top_p and val_top_p must be in (0, 1]")
    need(cfg.temperature > 0, "temperature must be > 0 for training rollouts (log-probs are taken under it)")
    need(cfg.gen_tp >= 1 and world_size % cfg.gen_tp == 0,
         f"gen_tp={cfg.gen_tp} must divide the world size {world_size} (world_size / gen_tp vLLM engines)")
    need(cfg.gen_tp == 1 or cfg.rollout_engine != "torch", f"gen_tp={cfg.gen_tp} needs rollout_engine='vllm' (the "
                                                            "built-in engine generates on one GPU per rank)")
    need(0 < cfg.gpu_memory_utilization < 1, f"gpu_memory_utilization={cfg.gpu_memory_utilization} must be in (0, 1)")
    need(cfg.tis_imp_ratio_cap == -1 or cfg.tis_imp_ratio_cap >= 1,
         f"tis_imp_ratio_cap={cfg.tis_imp_ratio_cap}: use -1 (off) or a cap >= 1 (e.g. 2)")
    if not check_files:
        return
    import data
    import model as M
    need(os.path.isfile(os.path.join(cfg.model_path, "config.json")),
         f"model_path={cfg.model_path!r} has no config.json; point it at an HF model directory")
    try:
        model_cfg = M.load_config(cfg.model_path)
        M.safetensors_files(cfg.model_path)
        tok = M.Tokenizer.from_pretrained(cfg.model_path)
    except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"model_path={cfg.model_path!r}: {type(e).__name__}: {e}") from None
    heads = cfg.tp_size * cfg.sp_size
    need(model_cfg.num_attention_heads % heads == 0, f"tp_size x sp_size = {heads} must divide the model's "
                                                      f"num_attention_heads={model_cfg.num_attention_heads}")
    need(tok.chat_template is not None, f"the tokenizer in {cfg.model_path!r} has no chat template "
         "(tokenizer_config.json 'chat_template' or chat_template.jinja); add one: prompts are templated")
    if cfg.resume not in ("auto", "disable"):
        need(os.path.isfile(os.path.join(cfg.resume, "COMPLETE")),
             f"cannot resume from {cfg.resume!r}: not a complete checkpoint directory (no COMPLETE marker); use "
             "resume='auto' (the newest complete one in out_dir/checkpoints) or resume='disable'")
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write_test.{os.getpid()}")  # one per rank: ranks race
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"out_dir={cfg.out_dir!r} is not writable ({e}); choose another out_dir") from None
    n_train = data.check_parquet_schema(cfg.train_files, cfg.prompt_key)
    need(n_train >= cfg.gen_batch_size or cfg.train_max_samples > 0,
         f"train_files hold {n_train} prompts, fewer than gen_batch_size={cfg.gen_batch_size}")
    if cfg.val_files:
        data.check_parquet_schema(cfg.val_files, cfg.prompt_key)
    import reward
    try:
        reward.load_reward_fn(cfg.reward_fn)  # a missing file or function fails here, not at step 1000
    except ValueError as e:
        raise ConfigError(str(e)) from None


def batch_arithmetic(cfg: Config, world_size: int, num_train_prompts: int | None = None) -> dict:
    B, M, G = cfg.train_batch_size, cfg.ppo_mini_batch_size, cfg.n
    a = {"world_size": world_size, "prompts_per_generation_round": cfg.gen_batch_size,
         "trajectories_per_generation_round": cfg.gen_batch_size * G, "trajectories_per_step": B * G,
         "optimizer_steps_per_step": cfg.ppo_epochs * B // M, "mini_batch_trajectories": M * G,
         "per_rank_mini_batch": M * G // (world_size // (cfg.tp_size * cfg.sp_size))}
    a["accumulation_steps"] = ("token budget" if cfg.use_dynamic_bsz else
                               a["per_rank_mini_batch"] // cfg.ppo_micro_batch_size_per_gpu)
    if num_train_prompts is not None:
        a["train_prompts"] = num_train_prompts
        a["steps_per_epoch (if no group is filtered)"] = math.ceil(num_train_prompts / B)
    return a


# -----------------------------------------------------------------------------
# the algorithm: small pure functions (tensors are [trajectories, response tokens] unless noted)

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "abs", "mse", "low_var_kl")
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def compute_grpo_advantages(scores, group_ids, norm_by_std: bool = True, eps: float = 1e-6):
    """A_i = (R_i - mean_group) / (std_group + eps), std unbiased; a group of one has mean 0, std 1. [T] -> [T]"""
    scores = scores.double()
    adv = torch.empty_like(scores)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero()[:, 0]
        r = scores[idx]
        mu, sigma = (r.mean(), r.std()) if len(idx) > 1 else (r.new_tensor(0.0), r.new_tensor(1.0))
        adv[idx] = (r - mu) / (sigma + eps) if norm_by_std else r - mu
    return adv.float()


def filter_groups(metric, group_ids):
    """Keep trajectories of groups whose metric varies (std > 0), and every group of size one. -> bool [T]"""
    keep = torch.zeros(len(metric), dtype=torch.bool)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero()[:, 0]
        keep[idx] = len(idx) == 1 or bool(metric[idx].double().std() > 0)
    return keep


def kl_penalty(logp, ref_logp, kind: str):
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
    raise ValueError(f"unknown KL type {kind!r}; choose one of {KL_TYPES}")


def agg_loss(loss_mat, mask, mode: str, max_response_length: int | None = None):
    """Reduce a per-token loss to a scalar over the given trajectories (REFERENCE.md "Aggregation")."""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1)
    seq_sum = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / (len(seq_sum) * max_response_length)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {AGG_MODES}")


def policy_loss(logp, old_logp, adv, mask, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
                loss_agg_mode: str, max_response_length: int | None = None, token_weight=None):
    """Clipped surrogate with clip-higher and dual clip. adv is [T] or [T, R]; token_weight (e.g. truncated
    importance weights) multiplies the per-token loss before aggregation. -> (loss, metrics)"""
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
    m = mask.float()
    tmean = lambda x: (x.float() * m).sum() / m.sum().clamp(min=1)  # noqa: E731
    metrics = {"pg_clipfrac": tmean(l2 > l1).item(), "pg_clipfrac_lower": tmean((c1 > l3) & (adv < 0)).item(),
               "ppo_kl": tmean(-d).item()}
    return agg_loss(loss_mat, mask, loss_agg_mode, max_response_length), metrics


def truncated_is_weight(old_logp, rollout_logp, cap: float):
    """TIS: min(p_old / p_rollout, cap) per token, a constant (no gradient). Corrects for the rollout engine
    sampling from slightly different probabilities than the trainer computes (bf16 kernels, vLLM vs torch)."""
    return (old_logp - rollout_logp).clamp(max=math.log(cap)).exp().detach()


def overlong_scores(resp_lens: list[int], cfg: Config) -> list[float]:
    import reward
    if not cfg.overlong_buffer:
        return [0.0] * len(resp_lens)
    return [reward.overlong_penalty(n, cfg.max_response_length, cfg.overlong_buffer_len,
                                    cfg.overlong_penalty_factor) for n in resp_lens]


# -----------------------------------------------------------------------------
# a batch of trajectories, and log-probs over it (packed: no padding tokens are computed)


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
    seq_final_reward: torch.Tensor | None = None  # [T] seq_reward - kl_coef * KL (use_kl_in_reward), else seq_reward
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    adv: torch.Tensor | None = None

    def __len__(self):
        return len(self.response_ids)

    def select(self, idx: list[int]) -> "Trajectories":
        t = torch.tensor(idx, dtype=torch.long)
        pick = lambda v: (v[t] if isinstance(v, torch.Tensor) else [v[i] for i in idx] if isinstance(v, list)  # noqa
                          else v)
        return Trajectories(**{k: pick(v) for k, v in self.__dict__.items()})

    def total_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))


def concat_trajectories(parts: list[Trajectories], R: int) -> Trajectories:
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


def micro_batches(traj: Trajectories, idx: list[int], count: int, token_budget: int | None, dims) -> list[list[int]]:
    """Split trajectory indices into micro-batches by count, or by token budget (use_dynamic_bsz). Every rank
    gets the same number of micro-batches: a sharded model's forward is a collective."""
    if token_budget is None:
        return [idx[i:i + count] for i in range(0, len(idx), count)]
    import data
    import parallel
    lens = [len(traj.prompt_ids[i]) + len(traj.response_ids[i]) for i in idx]
    split = data.balanced_micro_batches(lens, token_budget)
    n = parallel.all_reduce_max(len(split), dims)
    if n > len(split):
        split = data.balanced_micro_batches(lens, token_budget, min_num_micro_batches=n)
    return [[idx[j] for j in mb] for mb in split]


def rank_share(idx: list[int], dims) -> list[int]:
    """This data-parallel rank's contiguous slice of idx (ranks of one TP group share data)."""
    per = len(idx) // dims.dp
    return idx[dims.dp_rank * per:(dims.dp_rank + 1) * per]


def sequence_logprobs(model, traj: Trajectories, idx: list[int], cfg: Config, with_entropy: bool):
    """Packed forward of prompt+response for trajectories idx -> (logp, entropy) [len(idx), R] on response tokens."""
    from model import pack_sequences
    seqs = [traj.prompt_ids[i] + traj.response_ids[i] for i in idx]
    device = model.output_weight.device
    ids, pos, batch = pack_sequences([s[:-1] for s in seqs], device)
    targets = torch.tensor([t for s in seqs for t in s[1:]], device=device)[None]
    logp, ent = model(ids, pos, batch, target_ids=targets, temperature=cfg.temperature,
                      with_entropy=with_entropy, logprob_chunk=cfg.logprob_chunk)
    # response token j of sequence i is target (len(prompt) - 1 + j) of its packed document
    R = traj.response_mask.shape[1]
    starts = batch.cu_seqlens[:-1].long() + torch.tensor([len(traj.prompt_ids[i]) - 1 for i in idx], device=device)
    gather = (starts[:, None] + torch.arange(R, device=device)[None]).clamp(max=ids.shape[1] - 1)
    mask = traj.response_mask[idx].to(device)
    out_logp = logp[0][gather] * mask
    out_ent = ent[0][gather] * mask if ent is not None else None
    return out_logp, out_ent


@torch.no_grad()
def compute_logprobs(model, traj: Trajectories, cfg: Config, ctx, dims) -> torch.Tensor:
    """Log-probs of every trajectory's response under `model`: each dp rank computes its share in
    token-budget or counted micro-batches, then all ranks exchange them."""
    import parallel
    budget = cfg.log_prob_max_token_len_per_gpu * cfg.sp_size if cfg.use_dynamic_bsz else None  # per SP group
    mine = list(range(len(traj)))
    if dims.dp > 1:  # pad to a multiple of dp with repeats so every rank runs the same forwards
        mine = mine + mine[:(-len(mine)) % dims.dp]
        mine = rank_share(mine, dims)
    out = torch.zeros_like(traj.response_mask, dtype=torch.float32)
    for mb in micro_batches(traj, mine, cfg.log_prob_micro_batch_size_per_gpu, budget, dims):
        with ctx:
            logp, _ = sequence_logprobs(model, traj, mb, cfg, with_entropy=False)
        out[mb] = logp.float().cpu()
    if dims.dp > 1:
        for idx, part in parallel.all_gather_objects((mine, out[mine]), dims):
            out[idx] = part
    return out


# -----------------------------------------------------------------------------
# the policy update


def update_policy(model, optimizer, scheduler, traj: Trajectories, cfg: Config, ctx, dims) -> dict:
    """ppo_epochs x mini-batches; each mini-batch is one optimizer step. Every rank holds the whole batch
    and trains on its share of each mini-batch. A micro-batch's loss is weighted by its share of the whole
    mini-batch's tokens (token-mean) or sequences, times dp x sp because FSDP averages gradients over ranks,
    so the gradient is exactly that of the whole mini-batch whatever the micro-batch split or world size."""
    import parallel
    T, G = len(traj), cfg.n
    mb_size = cfg.ppo_mini_batch_size * G
    budget = cfg.ppo_max_token_len_per_gpu * cfg.sp_size if cfg.use_dynamic_bsz else None  # per SP group
    sums, grad_norms, skipped = {}, [], 0
    n_minibatches = cfg.ppo_epochs * math.ceil(T / mb_size)
    model.train()
    for _ in range(cfg.ppo_epochs):
        for start in range(0, T, mb_size):
            idx = list(range(start, min(start + mb_size, T)))
            total_tokens = float(traj.response_mask[idx].sum())  # global: every rank sees the whole batch
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for mb in micro_batches(traj, rank_share(idx, dims), cfg.ppo_micro_batch_size_per_gpu, budget, dims):
                mask = traj.response_mask[mb]
                weight = (float(mask.sum()) / total_tokens if cfg.loss_agg_mode == "token-mean"
                          else len(mb) / len(idx))
                with ctx:
                    logp, ent = sequence_logprobs(model, traj, mb, cfg, with_entropy=True)
                logp, ent, mask = logp.float(), ent.float(), mask.to(logp.device)
                old = traj.old_logp[mb].to(logp.device) if traj.old_logp is not None else logp.detach()
                tis = (truncated_is_weight(old, traj.rollout_logp[mb].to(logp.device), cfg.tis_imp_ratio_cap)
                       if cfg.tis_imp_ratio_cap > 0 else None)
                pg_loss, m = policy_loss(logp, old, traj.adv[mb].to(logp.device), mask, cfg.clip_ratio_low,
                                         cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.loss_agg_mode,
                                         cfg.max_response_length, token_weight=tis)
                entropy = agg_loss(ent, mask, cfg.loss_agg_mode, cfg.max_response_length)
                # without the term (DAPO: coefficient 0) the backward skips the fp32 entropy over the vocabulary
                loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg_loss
                m.update(pg_loss=pg_loss.item(), entropy=entropy.item())
                if cfg.use_kl_loss:
                    kl = agg_loss(kl_penalty(logp, traj.ref_logp[mb].to(logp.device), cfg.kl_loss_type), mask,
                                  cfg.loss_agg_mode, cfg.max_response_length)
                    loss = loss + cfg.kl_loss_coef * kl
                    m["kl_loss"] = kl.item()
                if traj.old_logp is None:  # on-policy shortcut: this forward's log-probs are the old ones
                    m["logp_mismatch"] = _mismatch(logp.detach().cpu(), traj.rollout_logp[mb], mask.cpu())
                # FSDP averages over dp x sp ranks; the SP ranks of a group each hold the gradient of their tokens
                (loss * weight * dims.fsdp_size).backward()
                finite = finite and math.isfinite(loss.item())
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v * weight * dims.dp / n_minibatches
            grad_norm = parallel.clip_grad_norm_(list(model.parameters()), cfg.grad_clip)
            if math.isfinite(grad_norm) and finite:
                optimizer.step()
            else:  # a non-finite loss or gradient would poison the weights: skip and log it
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            grad_norms.append(grad_norm)
    sums = parallel.all_reduce_mean(sums, dims)
    out = {f"actor/{k}": v for k, v in sums.items() if k != "logp_mismatch"}
    if "logp_mismatch" in sums:
        out["rollout/logp_mismatch"] = sums["logp_mismatch"]
    out.update({"actor/grad_norm": sum(grad_norms) / len(grad_norms), "actor/lr": scheduler.get_last_lr()[0],
                "actor/skipped_updates": skipped})
    return out


def _mismatch(trainer_logp, rollout_logp, mask) -> float:
    """mean |rollout log-prob - trainer log-prob| over response tokens"""
    mask = mask.float()
    return float(((trainer_logp - rollout_logp).abs() * mask).sum() / mask.sum().clamp(min=1))


def make_scheduler(optimizer, cfg: Config, total_optimizer_steps: int):
    """Linear warmup (step s gets (s+1)/warmup of lr, so the first update is not wasted) then constant or cosine."""
    def factor(s):
        if s < cfg.lr_warmup_steps:
            return (s + 1) / cfg.lr_warmup_steps
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (s - cfg.lr_warmup_steps) / max(1, total_optimizer_steps - cfg.lr_warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# -----------------------------------------------------------------------------
# rollout + reward: one generation round


def generate_and_score(engine, tokenizer, scorer, prompts: list[dict], cfg: Config, seed: int, *, n: int,
                       temperature: float, top_p: float, top_k: int, group_offset: int = 0, version=None):
    """Generate n responses per prompt and score them -> (Trajectories, texts, reward stats)."""
    from rollout import SamplingParams
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_tokens=cfg.max_response_length, stop_token_ids=tokenizer.eos_token_ids, seed=seed)
    t0 = time.perf_counter()
    outputs = engine.generate([p["prompt_ids"] for p in prompts], params, version=version)
    t_gen = time.perf_counter() - t0
    comps = [(p, c) for p, cs in zip(prompts, outputs) for c in cs]
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in comps]
    eos = tokenizer.special.get("eos_token")
    texts = [t[:-len(eos)] if eos and t.endswith(eos) else t for t in texts]  # REFERENCE: strip a trailing EOS
    results, stats = scorer.score([(p["data_source"], t, p["ground_truth"], p["extra_info"])
                                   for (p, _), t in zip(comps, texts)])
    stats = {**stats, "gen_s": t_gen, "reward_s": time.perf_counter() - t0 - t_gen}
    R = cfg.max_response_length
    T = len(comps)
    rollout_logp, mask = torch.zeros(T, R), torch.zeros(T, R)
    for i, (_, c) in enumerate(comps):
        rollout_logp[i, :len(c.token_ids)] = torch.tensor(c.logprobs)
        mask[i, :len(c.token_ids)] = 1
    resp_lens = [len(c.token_ids) for _, c in comps]
    score = torch.tensor([r["score"] for r in results], dtype=torch.float32)
    traj = Trajectories(
        prompt_ids=[p["prompt_ids"] for p, _ in comps], response_ids=[c.token_ids for _, c in comps],
        group_ids=torch.arange(len(prompts)).repeat_interleave(n) + group_offset, rollout_logp=rollout_logp,
        response_mask=mask, finish_reasons=[c.finish_reason for _, c in comps],
        data_sources=[p["data_source"] for p, _ in comps],
        acc=torch.tensor([float(r["acc"]) for r in results]), score=score,
        seq_reward=score + torch.tensor(overlong_scores(resp_lens, cfg)))
    return traj, texts, stats


def filter_metric(traj: Trajectories, name: str) -> torch.Tensor:
    return {"acc": traj.acc, "score": traj.score, "seq_reward": traj.seq_reward,
            "seq_final_reward": traj.seq_final_reward}[name]


def kept_groups(traj: Trajectories, cfg: Config) -> int:
    if not cfg.filter_groups:
        return len(traj) // cfg.n
    return int(filter_groups(filter_metric(traj, cfg.filter_groups_metric), traj.group_ids).sum()) // cfg.n


def dynamic_sampling(generation_round, cfg: Config):
    """DAPO dynamic sampling: call generation_round(r) (r = 1, 2, ...) until train_batch_size groups whose
    filter metric varies have been collected, then keep exactly train_batch_size whole groups.
    -> (training batch, all generated trajectories, rounds used)"""
    kept, generated, n_kept, r = [], [], 0, 0
    while n_kept < cfg.train_batch_size:
        r += 1
        if cfg.max_num_gen_batches > 0 and r > cfg.max_num_gen_batches:
            raise RunError(
                f"dynamic sampling: after {cfg.max_num_gen_batches} generation rounds of {cfg.gen_batch_size} "
                f"prompts only {n_kept} of train_batch_size={cfg.train_batch_size} groups have varying "
                f"{cfg.filter_groups_metric}. The data may be too easy or too hard for the model; raise "
                f"max_num_gen_batches (0 = unlimited) or gen_batch_size, change filter_groups_metric, or "
                f"set filter_groups=False")
        traj = generation_round(r)
        generated.append(traj)
        keep = (filter_groups(filter_metric(traj, cfg.filter_groups_metric), traj.group_ids)
                if cfg.filter_groups else torch.ones(len(traj), dtype=torch.bool))
        if keep.any():
            kept.append(traj.select(keep.nonzero()[:, 0].tolist()))
            n_kept += int(keep.sum()) // cfg.n
    R = cfg.max_response_length
    batch = concat_trajectories(kept, R).select(list(range(cfg.train_batch_size * cfg.n)))  # whole groups
    return batch, concat_trajectories(generated, R), r


# -----------------------------------------------------------------------------
# checkpoints (parallel.py writes them atomically; here: what goes in, and the HF export)


def export_hf(model, path: str, dims, dtype):
    """Full weights gathered bucket by bucket, written by rank 0 as an HF model directory (transformers/vLLM)."""
    import model as M
    import parallel
    full = {}
    for bucket in parallel.iter_full_weights(model, dtype=dtype):
        if dims.is_main:
            full.update((k, v.cpu()) for k, v in bucket)
    if dims.is_main:
        M.save_pretrained(model, path, state_dict=full)


def check_resume_shape(path: str, model):
    import model as M
    saved, cur = M.load_config(path), model.config
    fields_ = ("architecture", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    diff = [f"{f}: checkpoint {getattr(saved, f)} vs model_path {getattr(cur, f)}" for f in fields_
            if getattr(saved, f) != getattr(cur, f)]
    if diff:
        raise ConfigError(f"checkpoint {path} holds a different model ({'; '.join(diff)}); point out_dir "
                          "elsewhere, or set resume='disable' to start fresh")


# -----------------------------------------------------------------------------
# metrics


class Logger:
    """console + out_dir/metrics.jsonl always; tensorboard / wandb / mlflow when listed."""

    def __init__(self, cfg: Config, resumed_step: int = 0):
        self.cfg, self.backends = cfg, {}
        os.makedirs(cfg.out_dir, exist_ok=True)
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        if os.path.isfile(path):  # after a resume, drop rows of steps that will be run again
            rows = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= resumed_step]
            with open(path, "w") as f:
                f.writelines(rows)
        self.jsonl = open(path, "a")
        for name in cfg.logger:
            if name in ("console", "jsonl"):
                continue
            try:
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
            except ImportError as e:
                raise ConfigError(f"logger {name!r} is listed but not installed ({e}); pip install it or "
                                  f"remove it from logger") from e

    def log(self, step: int, metrics: dict):
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if "tensorboard" in self.backends:
            for k, v in metrics.items():
                self.backends["tensorboard"].add_scalar(k, v, step)
        if "wandb" in self.backends:
            self.backends["wandb"].log(metrics, step=step)
        if "mlflow" in self.backends:
            self.backends["mlflow"].log_metrics({k.replace("@", "_at_"): v for k, v in metrics.items()}, step=step)
        if "console" in self.cfg.logger:
            keys = [("val/acc", "val_acc"), ("train/acc", "acc"), ("train/score_mean", "score"),
                    ("response_length/mean", "len"), ("actor/entropy", "ent"), ("actor/pg_clipfrac", "clip"),
                    ("sampling/num_gen_batches", "gen_rounds"), ("timing/step", "s")]
            parts = [f"{short} {metrics[k]:.3g}" for k, short in keys if k in metrics]
            print(f"step {step:4d} | " + " | ".join(parts), flush=True)


def plot(out_dir: str) -> str:
    """PNG of reward, accuracy, response length and entropy over steps, from metrics.jsonl."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')") from e
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"no metrics.jsonl in {out_dir!r}; pass the out_dir of a run")
    rows = [json.loads(line) for line in open(path)]
    panels = [("train/score_mean", "reward (score)"), (("train/acc", "val/acc"), "accuracy"),
              ("response_length/mean", "response length"), ("actor/entropy", "entropy")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (keys, title) in zip(axes, panels):
        for k in (keys if isinstance(keys, tuple) else (keys,)):
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if k.startswith("val") else None, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(out_dir, "metrics.png")
    fig.savefig(png, dpi=100)
    return png


# -----------------------------------------------------------------------------
# validation


def validation_metrics(traj: Trajectories) -> dict:
    """mean@val_n accuracy per data_source and overall."""
    metrics = {"val/acc": traj.acc.mean().item(), "val/score_mean": traj.score.mean().item()}
    for ds in sorted(set(traj.data_sources)):
        sel = torch.tensor([d == ds for d in traj.data_sources])
        metrics[f"val/acc/{ds}"] = traj.acc[sel].mean().item()
    return metrics


def save_val_generations(traj: Trajectories, texts: list[str], val_prompts, tokenizer, cfg: Config, step: int):
    if cfg.log_val_generations <= 0:
        return
    with open(os.path.join(cfg.out_dir, f"val_generations_step{step}.jsonl"), "w") as f:
        for i in range(min(cfg.log_val_generations, len(texts))):
            p = val_prompts[i // cfg.val_n]
            f.write(json.dumps({"prompt": tokenizer.decode(p["prompt_ids"], skip_special_tokens=False),
                                "response": texts[i], "ground_truth": p["ground_truth"],
                                "score": traj.score[i].item()}) + "\n")


# -----------------------------------------------------------------------------
# the loop


def install_stop_handlers(log) -> dict:
    """SIGTERM / SIGINT (preemption, Ctrl-C): finish the current step, checkpoint, exit 0. A second signal
    exits at once."""
    stop = {"requested": False}

    def handler(signum, frame):
        if stop["requested"]:
            log("second signal: exiting now without a checkpoint")
            os._exit(128 + signum)
        stop["requested"] = True
        log(f"signal {signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
            "(send it again to exit now)")

    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        stop["restore"] = lambda: [signal.signal(s, h) for s, h in previous.items()]
    return stop


def fault_point(name: str, step: int):
    """Fault-injection hook for the crash tests: NANODAPO_FAULT=name:step kills this process with SIGKILL."""
    if os.environ.get("NANODAPO_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def train(cfg: Config):
    import data
    import model as M
    import parallel
    import reward
    from rollout import TorchEngine, VLLMEngine, engine_results, engine_share, resolve_engine
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # before any process group or device
    dims = parallel.init_distributed(cfg.device, cfg.tp_size, cfg.sp_size)
    try:
        engine_kind = resolve_engine(cfg.rollout_engine, dims.device.type)  # vllm installed? (a dry run needs not)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    device, main_rank = dims.device, dims.is_main
    if cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    parallel.seed_everything(cfg.seed)
    compute_dtype = torch.float32 if device.type == "cpu" else getattr(torch, cfg.dtype)
    log = print if main_rank else (lambda *a, **k: None)
    if main_rank:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    # data, tokenizer, reward (cheap things that can fail come first)
    tokenizer = M.Tokenizer.from_pretrained(cfg.model_path)
    load = lambda files, k: data.load_prompts(  # noqa: E731
        files, tokenizer, prompt_key=cfg.prompt_key, max_prompt_length=cfg.max_prompt_length,
        truncation=cfg.truncation, filter_overlong_prompts=cfg.filter_overlong_prompts, max_samples=k)
    train_prompts = load(cfg.train_files, cfg.train_max_samples)
    val_prompts = load(cfg.val_files, cfg.val_max_samples) if cfg.val_files else []
    sampler = data.PromptSampler(len(train_prompts), seed=cfg.seed, shuffle=cfg.shuffle)
    scorer = reward.RewardScorer(cfg.reward_fn, num_workers=cfg.reward_num_workers, timeout_s=cfg.reward_timeout)

    # the vLLM engine comes before the trainer's tensors: it sizes its KV cache from the memory free now, then
    # sleeps (weights and cache released) until the first rollout
    engine, gen_tp = None, cfg.gen_tp
    if engine_kind == "vllm":
        t0 = time.perf_counter()
        engine = VLLMEngine(cfg.model_path, gen_tp=gen_tp, gpu_memory_utilization=cfg.gpu_memory_utilization,
                            max_model_len=cfg.max_prompt_length + cfg.max_response_length,
                            max_num_seqs=cfg.max_num_seqs, enforce_eager=cfg.enforce_eager,
                            enable_chunked_prefill=cfg.enable_chunked_prefill,
                            max_num_batched_tokens=cfg.max_num_batched_tokens or None, seed=cfg.seed,
                            dtype=cfg.dtype, engine_kwargs=cfg.vllm_kwargs)
        log(f"rollout engine: vLLM, {dims.world_size // gen_tp} engine(s) of TP {gen_tp}, started in "
            f"{time.perf_counter() - t0:.0f} s; {engine.awake_bytes / 2**30:.1f} GiB each while awake")

    # the policy: fp32 master weights. One device: plain module under autocast. Several: TP / SP / FSDP2 shards
    # with bf16 compute; a rollout engine then holds its own weights, pushed from these before every rollout.
    sharded = dims.world_size > 1
    shard = (lambda m: parallel.parallelize(m, dims, param_dtype=compute_dtype,  # noqa: E731
                                            offload=cfg.param_offload or cfg.optimizer_offload,
                                            compile=cfg.compile)) if sharded else None
    model = M.from_pretrained(cfg.model_path, dtype=torch.float32, device=device, parallelize=shard)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    ref_model = None  # built only when a KL term is on
    if cfg.use_kl_loss or cfg.use_kl_in_reward:
        ref_model = M.from_pretrained(cfg.model_path, dtype=torch.float32, device=device, parallelize=shard)
        ref_model.eval().requires_grad_(False)
    ctx = contextlib.nullcontext() if sharded else parallel.autocast(device, compute_dtype)
    if engine is None:  # the built-in engine: the trainer's own module on one device, else a full bf16 copy
        gen_model = M.from_pretrained(cfg.model_path, dtype=compute_dtype, device=device) if sharded else model
        engine, gen_tp = TorchEngine(gen_model, max_num_seqs=cfg.max_num_seqs, shares_weights=not sharded), 1
        log(f"rollout engine: torch (built-in{', CUDA graphs' if engine.use_cuda_graph else ''})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(train_prompts) / cfg.train_batch_size)
    total_steps = cfg.total_training_steps or steps_per_epoch * cfg.total_epochs
    scheduler = make_scheduler(optimizer, cfg, total_steps * cfg.ppo_epochs * cfg.train_batch_size //
                               cfg.ppo_mini_batch_size)

    step = 0
    ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
    candidates = {"auto": parallel.complete_checkpoints(ckpt_root), "disable": []}.get(cfg.resume, [cfg.resume])
    for ckpt in candidates:  # newest first; a corrupt one is reported and skipped
        check_resume_shape(ckpt, model)
        try:
            state = parallel.load_checkpoint(ckpt, model, optimizer, dims)
        except (Exception, CheckpointException) as e:  # any unreadable file: try the previous checkpoint
            if cfg.resume != "auto":
                raise ConfigError(f"cannot resume from {ckpt}: {type(e).__name__}: {e}") from e
            log(f"warning: checkpoint {ckpt} is unreadable ({type(e).__name__}: {e}); trying the previous one")
            continue
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        step = state["step"]
        log(f"resumed from {ckpt} at step {step}")
        break
    logger = Logger(cfg, resumed_step=step) if main_rank else None
    stop = install_stop_handlers(log)
    log(f"training {total_steps} steps ({steps_per_epoch} per epoch) on {dims.world_size} x {device.type}; "
        f"{json.dumps(batch_arithmetic(cfg, dims.world_size, len(train_prompts)))}")

    # weight versions: the policy's advances with every update; the engine records the version it holds and
    # refuses to generate with another (rollout.StaleWeightsError)
    version = {"policy": 0}
    gen_ctx = ctx if isinstance(engine, TorchEngine) else contextlib.nullcontext()

    def sync_weights() -> float:
        """Push the trainer's weights into the engine (bucketed full tensors) unless it holds them; -> seconds."""
        if engine.weights_version == version["policy"]:
            return 0.0
        if engine.shares_weights:  # the built-in engine on the trainer's own module
            engine.weights_version = version["policy"]
            return 0.0
        t0 = time.perf_counter()
        buckets = parallel.iter_full_weights(model, cfg.weight_sync_bucket_mb * 2**20, dtype=compute_dtype)
        engine.load_weights(buckets, version["policy"])
        return time.perf_counter() - t0

    def rollout(prompts, seed, group_offset, **sampling) -> Trajectories:
        """Each engine generates and scores its share of the prompts; every rank gets the whole round."""
        e, lo, hi = engine_share(len(prompts), dims.world_size, gen_tp, dims.rank)
        model.eval()
        engine.wake_up(["weights"])
        t_sync = sync_weights()  # after a level-2 sleep the engine holds no weights: a full push every time
        engine.wake_up(["kv_cache"])
        with gen_ctx:
            traj, texts, stats = generate_and_score(engine, tokenizer, scorer, prompts[lo:hi], cfg,
                                                    seed=seed + 100003 * e, group_offset=group_offset + lo,
                                                    version=version["policy"], **sampling)
        engine.sleep()
        mine = (traj, texts, stats) if dims.rank % gen_tp == 0 else None  # the TP ranks of an engine hold copies
        parts = engine_results(parallel.all_gather_objects(mine, dims), gen_tp)
        traj = concat_trajectories([p[0] for p in parts if len(p[0])], cfg.max_response_length)
        stats = {key: sum(p[2][key] for p in parts) for key in stats}
        stats["gen_s"], stats["reward_s"], stats["sync_s"] = parts[0][2]["gen_s"], parts[0][2]["reward_s"], t_sync
        return traj, [t for p in parts for t in p[1]], stats

    def validate_now(at_step: int) -> dict:
        traj, texts, stats = rollout(val_prompts, seed=cfg.seed + 7919 * (at_step + 1), group_offset=0, n=cfg.val_n,
                                 temperature=cfg.val_temperature if cfg.val_do_sample else 0.0,
                                 top_p=cfg.val_top_p, top_k=cfg.val_top_k)
        metrics = validation_metrics(traj)
        if main_rank:
            save_val_generations(traj, texts, val_prompts, tokenizer, cfg, at_step)
        return {**metrics, "timing/sync_val": stats["sync_s"]}

    if val_prompts and cfg.val_before_train and step == 0:
        m = validate_now(step)
        if main_rank:
            logger.log(step, m)

    consecutive_skips = 0
    while step < total_steps:
        t_step = time.perf_counter()
        timing = {"gen": 0.0, "reward": 0.0, "old_logp": 0.0, "ref": 0.0, "update": 0.0, "sync": 0.0}
        timeouts = [0]

        # 1-4: generation rounds until train_batch_size groups with reward variance survive
        def generation_round(r: int) -> Trajectories:
            prompts = [train_prompts[i] for i in sampler.next_indices(cfg.gen_batch_size)]
            traj, _, stats = rollout(prompts, seed=cfg.seed + 1000 * step + r, group_offset=r * cfg.gen_batch_size,
                                     n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
            fault_point("gen", step)
            timing["gen"] += stats["gen_s"]
            timing["reward"] += stats["reward_s"]
            timing["sync"] += stats["sync_s"]
            timeouts[0] += stats["num_timeouts"]
            t0 = time.perf_counter()
            traj.seq_final_reward = traj.seq_reward
            if cfg.use_kl_in_reward:  # seq_final_reward = seq_reward - kl_coef * sum of token KL
                traj.ref_logp = compute_logprobs(ref_model, traj, cfg, ctx, dims)
                traj.old_logp = compute_logprobs(model, traj, cfg, ctx, dims)  # kept: step 6 needs no second pass
                kl = kl_penalty(traj.old_logp, traj.ref_logp, cfg.kl_penalty)
                traj.seq_final_reward = traj.seq_reward - cfg.kl_coef * (kl * traj.response_mask).sum(-1)
            timing["ref"] += time.perf_counter() - t0
            return traj

        batch, everything, rounds = dynamic_sampling(generation_round, cfg)

        # 5. advantages from the (final) scalar reward, per group
        batch.adv = compute_grpo_advantages(batch.seq_final_reward, batch.group_ids, cfg.norm_adv_by_std)

        # 6. old log-probs (skipped when the update is a single on-policy pass) and reference log-probs
        t0 = time.perf_counter()
        model.eval()
        on_policy = cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size == cfg.train_batch_size
        metrics = {}
        if not on_policy and batch.old_logp is None:
            batch.old_logp = compute_logprobs(model, batch, cfg, ctx, dims)
        if batch.old_logp is not None:
            metrics["rollout/logp_mismatch"] = _mismatch(batch.old_logp, batch.rollout_logp, batch.response_mask)
        timing["old_logp"] = time.perf_counter() - t0
        if cfg.use_kl_loss:
            t0 = time.perf_counter()
            batch.ref_logp = compute_logprobs(ref_model, batch, cfg, ctx, dims)
            timing["ref"] += time.perf_counter() - t0

        # 7. update
        t0 = time.perf_counter()
        metrics.update(update_policy(model, optimizer, scheduler, batch, cfg, ctx, dims))
        version["policy"] += 1
        timing["update"] = time.perf_counter() - t0
        step += 1
        fault_point("update", step)
        all_skipped = metrics["actor/skipped_updates"] == cfg.ppo_epochs * cfg.train_batch_size // cfg.ppo_mini_batch_size
        consecutive_skips = consecutive_skips + 1 if all_skipped else 0
        if consecutive_skips >= cfg.max_consecutive_skips:
            raise RunError(f"{consecutive_skips} steps in a row had a non-finite loss or gradient norm and were "
                           f"skipped (max_consecutive_skips={cfg.max_consecutive_skips}); lower lr, check grad_clip and "
                           f"the data, or resume from an earlier checkpoint")
        if metrics.get("rollout/logp_mismatch", 0.0) > cfg.logp_mismatch_warn:
            log(f"warning: rollout/logp_mismatch={metrics['rollout/logp_mismatch']:.3g} > logp_mismatch_warn="
                f"{cfg.logp_mismatch_warn}: engine and trainer disagree on log-probs (precision, weights?)")

        # 8. metrics, validation, checkpoint
        lens = torch.tensor([len(r) for r in everything.response_ids], dtype=torch.float32)
        metrics.update({
            "train/acc": everything.acc.mean().item(), "train/score_mean": everything.score.mean().item(),
            "train/seq_reward_mean": everything.seq_reward.mean().item(),
            "response_length/mean": lens.mean().item(), "response_length/max": lens.max().item(),
            "response_length/clip_ratio": (lens >= cfg.max_response_length).float().mean().item(),
            "sampling/num_gen_batches": rounds,
            "sampling/kept_group_frac": kept_groups(everything, cfg) / (rounds * cfg.gen_batch_size),
            "reward/num_timeouts": timeouts[0], "sampler/epoch": sampler.epoch,
        })
        last = step == total_steps
        if val_prompts and ((cfg.test_freq > 0 and step % cfg.test_freq == 0) or last):
            metrics.update(validate_now(step))
        timing["step"] = time.perf_counter() - t_step
        metrics.update({f"timing/{k}": v for k, v in timing.items()})
        metrics["perf/tokens_per_s"] = batch.total_tokens() / timing["step"]
        metrics["perf/tokens_per_s_per_gpu"] = metrics["perf/tokens_per_s"] / dims.world_size
        if device.type != "cpu":
            metrics["perf/max_memory_allocated_gib"] = parallel.max_memory_allocated_gib(device)
        if main_rank:
            logger.log(step, metrics)
        stopping = parallel.all_reduce_max(int(stop["requested"]), dims) > 0
        if (cfg.save_freq > 0 and step % cfg.save_freq == 0) or (last and cfg.save_freq >= 0) or stopping:
            state = {"step": step, "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict()}

            def export(tmp):  # runs between the sharded write and the COMPLETE marker
                export_hf(model, tmp, dims, compute_dtype)
                fault_point("checkpoint", step)
            parallel.save_checkpoint(os.path.join(ckpt_root, f"step_{step}"), model, optimizer, state, dims, export)
            parallel.prune_checkpoints(ckpt_root, cfg.keep_last, dims)
        if stopping:
            log(f"stopped by signal after step {step}; checkpoint written, resume with resume='auto'")
            break
    scorer.close()
    stop.get("restore", lambda: None)()
    parallel.shutdown()
    return model


def dry_run(cfg: Config):
    """Check the config, print the batch arithmetic and a per-GPU memory plan; touches no GPU and needs
    neither the model nor the data to be present (a known model shape and a note stand in)."""
    import data
    import model as M
    import parallel
    from rollout import resolve_engine
    ws = world_size_for(cfg)
    present = os.path.isfile(os.path.join(cfg.model_path, "config.json"))
    files_present = all(os.path.isfile(f) for f in cfg.train_files + cfg.val_files)
    validate(cfg, ws, check_files=present and files_present)
    if present:
        model_cfg = M.load_config(cfg.model_path)
    else:
        name = os.path.basename(os.path.normpath(os.path.expanduser(cfg.model_path))).lower()
        if name not in M.KNOWN_CONFIGS:
            raise ConfigError(f"model_path={cfg.model_path!r} has no config.json and {name!r} is not a known shape "
                              f"({', '.join(sorted(M.KNOWN_CONFIGS))}); point model_path at the model directory")
        model_cfg = M.ModelConfig.from_hf(M.KNOWN_CONFIGS[name])
        print(f"note: {cfg.model_path} not found; planning with the published shape of {name}")
    n_train = data.check_parquet_schema(cfg.train_files, cfg.prompt_key) if files_present else None
    if not files_present:
        print("note: data files not found; skipping their checks and the epoch arithmetic")
    print(f"config OK ({model_cfg.architecture}, {model_cfg.num_params() / 1e9:.2f} B parameters, world size {ws})")
    for k, v in batch_arithmetic(cfg, ws, n_train).items():
        print(f"  {k}: {v}")
    # what "auto" picks on a CUDA machine with this one's packages; "vllm" is planned even where it is not installed
    engine = cfg.rollout_engine if cfg.rollout_engine == "vllm" else resolve_engine(cfg.rollout_engine, "cuda")
    print(f"rollout engine planned for: {engine}")
    print(parallel.format_memory_plan([parallel.memory_plan(cfg, model_cfg, ws, g, engine=engine) for g in (80, 141)]))


def main(argv: list[str]) -> int:
    import data
    import reward
    if argv[:1] == ["--plot"]:
        try:
            print(f"wrote {plot(argv[1] if len(argv) > 1 else Config().out_dir)}")
            return 0
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        cfg, flags = parse_args([a for a in argv if a != "--"])  # torchrun: script -- --key=value
        if flags["dry_run"]:
            dry_run(cfg)
            return 0
        train(cfg)
    except (ConfigError, data.DataError, reward.RewardError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"metrics: {os.path.join(cfg.out_dir, 'metrics.jsonl')}")
        try:
            print(f"plot: {plot(cfg.out_dir)}")
        except ConfigError as e:
            print(f"(no plot: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
