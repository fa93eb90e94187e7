"""
The command line and the config checks. The Config dataclass itself (every knob, its default and its meaning)
lives in train_dapo.py; this file reads a config file and --key=value overrides into it, and checks a Config
before anything expensive happens:

    cfg, flags = parse_args(Config, ["configs/tiny.py", "--lr=3e-4"])
    check_config(cfg, world_size=1)        # ConfigError naming the knob or file, and the fix

A config file is plain Python: its top-level assignments override Config's defaults. An override is
--key=value, parsed with ast.literal_eval (a bare word is a string). Unknown keys and wrong types are errors.
"""
import ast
import importlib.util
import math
import os
import traceback
import types
import typing

import data
import parallel
import reward
import verl_keys
from data import Tokenizer
from hf import check_weights

class ConfigError(ValueError):
    """A bad knob, file or directory, found before any expensive work; the message names it and the fix."""


# -----------------------------------------------------------------------------
# parsing: config files and --key=value

def parse_args(config_class, argv: list[str]) -> tuple[typing.Any, dict]:
    """CONFIG.py files (plain Python assignments), verl's dotted keys (a.b.c=v, +a.b.c=v, --a.b.c=v; through
    verl_keys.VERL_KEYS), then nanodapo's --key=value -> (config, flags). Given verl keys and no config file,
    the base is verl's defaults where they differ from nanodapo's: a pasted verl command line is the verl run.
    Refused and unknown verl keys stop here, one line each; no-ops are reported once."""
    cfg, flags = config_class(), {"dry_run": False}
    files, verl, ours = [], [], []
    fields = typing.get_type_hints(config_class)
    for arg in map(str.strip, argv):  # a launch script's stray backslash-space leaves blanks
        if not arg:
            continue
        if arg == "--dry_run" or arg.startswith("--dry_run="):
            flags["dry_run"] = dry_run_flag(arg)
        elif verl_keys.verl_key_like(arg) or ("=" in arg and not arg.startswith("--")
                                              and arg.partition("=")[0] not in fields
                                              and not os.path.isfile(arg)):
            verl.append(tuple(arg.split("=", 1)))
        elif arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"{arg}: overrides are written --key=value")
            if key not in fields and verl_keys.lookup(key):  # a recipe script's variable (--train_prompt_bsz)
                verl.append((key, raw))
            else:
                ours.append((key, raw, arg))
        elif "=" in arg and arg.partition("=")[0] in fields:
            key, _, raw = arg.partition("=")
            ours.append((key, raw, arg))
        else:
            files.append(arg)
    for path in files:
        for key, value in run_config_file(path).items():
            if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
                continue  # imports, helpers and private names are not knobs
            set_field(cfg, key, value, f"config file {path}")
    if verl:
        apply_verl(cfg, verl_keys.translate(verl, fields, verl_defaults=not files, base=vars(cfg)))
    for key, raw, arg in ours:
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare string
        set_field(cfg, key, value, f"command line {arg}")
    return cfg, flags


def dry_run_flag(arg: str) -> bool:
    """--dry_run, --dry_run=True / False (like every other knob)."""
    raw = arg.partition("=")[2] or "True"
    if raw.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"{arg}: write --dry_run or --dry_run=True / False")
    return raw.lower() in ("true", "1")


def apply_verl(cfg, t):
    """Set cfg from a verl_keys.Translation, after refusing it whole if any key is refused or unknown;
    say once, on the first rank, what it did."""
    if t.refused or t.unknown:
        raise ConfigError("verl keys nanodapo does not take (nothing has run):\n  " + "\n  ".join(t.problems()))
    for field, (value, _) in t.defaults.items():
        set_field(cfg, field, value, "verl's default")
    for field, (value, key) in t.fields.items():
        if field == "vllm_kwargs":
            value = {**cfg.vllm_kwargs, **value}
        set_field(cfg, field, value, f"verl key {key}")
    if parallel.torchrun_rank() == 0:
        print("\n".join(t.report()))


def run_config_file(path: str) -> dict:
    """Execute a config file (plain Python assignments) -> its namespace; errors name the file and line."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found")
    scope = {}
    try:
        exec(compile(open(path).read(), path, "exec"), scope)
    except SyntaxError as e:
        raise ConfigError(f"config file {path} line {e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 (any error in the user's Python)
        frames = traceback.extract_tb(e.__traceback__)
        line = next((fr.lineno for fr in reversed(frames) if fr.filename == path), "?")
        raise ConfigError(f"config file {path} line {line}: {type(e).__name__}: {e}") from None
    return scope


def set_field(cfg, key: str, value, where: str):
    """cfg.key = value after checking the key exists and the value has the field's type; `where` says where
    the value came from, for the error message."""
    hints = typing.get_type_hints(type(cfg))
    if key not in hints:
        message = f"unknown config key {key!r} ({where})"
        close = verl_keys.closest(key, hints)
        if close in hints:
            message += f"; did you mean {close!r}?"
        elif close:
            rule = verl_keys.VERL_KEYS[close]
            ours = f" (nanodapo: {', '.join(rule.fields)})" if rule.fields else ""
            message += f"; did you mean verl's {close!r}{ours}? verl keys are written whole: {close}=..."
        raise ConfigError(message)
    tp = hints[key]
    if isinstance(value, str) and typing.get_origin(tp) is list:
        value = [value]  # train_files="a.parquet" means one file
    if not type_matches(value, tp):
        raise ConfigError(f"{key}={value!r} ({where}){wrong_type(value, tp)}")
    if typing.get_origin(tp) is tuple:
        value = tuple(value)
    if (tp is float or float in typing.get_args(tp)) and isinstance(value, int):
        value = float(value)
    setattr(cfg, key, value)


def type_matches(value, tp) -> bool:
    """Does value have the annotated type tp?
    (int is a float; bool is not an int; lists and tuples by element; a Literal is its values)"""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(type_matches(value, a) for a in args)
    if origin is typing.Literal:  # a choice: one of the values (True is not 1)
        return any(value == a and type(value) is type(a) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(type_matches(v, args[0]) for v in value)
    if tp is dict:
        return isinstance(value, dict)
    if origin is tuple:
        if not isinstance(value, (tuple, list)) or len(value) != len(args):
            return False
        return all(type_matches(v, a) for v, a in zip(value, args))
    return isinstance(value, tp)


def choices(tp) -> list:
    """The values a choice knob allows: a Literal annotation's, with True and False where the Literal is in
    a union with bool (compile: bool | Literal["auto"]); [] for any other type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return list(args)
    if origin in (typing.Union, types.UnionType):
        literal = [c for a in args for c in choices(a)]
        return literal + [True, False] if literal and bool in args else literal
    return []


def wrong_type(value, tp) -> str:
    """What an error says of a value that does not match tp: the choices, or the type expected."""
    if choices(tp):
        return "; choose one of " + ", ".join(map(str, choices(tp)))
    return f" has type {type(value).__name__}; expected {getattr(tp, '__name__', str(tp))}"


# -----------------------------------------------------------------------------
# the allowed values of every knob

POSITIVE = (lambda v: v > 0, "> 0")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
ALL_OR_POSITIVE = (lambda v: v == -1 or v > 0, "-1 (all) or > 0")
OFF_OR_POSITIVE = (lambda v: v == -1 or v > 0, "-1 (off) or > 0")
IN_UNIT_INTERVAL = (lambda v: 0 < v <= 1, "in (0, 1]")
KNOB_RANGES = {  # knob -> (test, what the message says is allowed)
    **{k: POSITIVE for k in (
        "train_batch_size", "gen_batch_size", "n", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
        "ppo_epochs", "max_prompt_length", "max_response_length", "log_prob_micro_batch_size_per_gpu",
        "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "max_num_seqs", "total_epochs",
        "logprob_chunk", "val_n", "reward_timeout", "weight_sync_bucket_mb", "max_consecutive_skips",
        "temperature", "gen_tp", "tp_size", "sp_size", "ep_size", "nnodes", "n_gpus_per_node",
        "max_staleness", "watchdog_log_s", "watchdog_timeout_s", "tau_pos", "tau_neg")},
    **{k: NON_NEGATIVE for k in (
        "lr", "weight_decay", "lr_warmup_steps", "seed", "total_training_steps", "test_freq", "keep_last",
        "reward_num_workers", "kl_loss_coef", "kl_coef", "overlong_penalty_factor",
        "log_val_generations", "cpu_threads", "val_temperature", "max_num_batched_tokens",
        "logp_mismatch_warn", "rollout_gpus", "clip_ratio_high", "ppo_kl_coef")},
    "train_max_samples": ALL_OR_POSITIVE,
    "val_max_samples": ALL_OR_POSITIVE,
    "top_k": OFF_OR_POSITIVE,
    "val_top_k": OFF_OR_POSITIVE,
    "top_p": IN_UNIT_INTERVAL,
    "val_top_p": IN_UNIT_INTERVAL,
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "save_freq": (lambda v: v >= -1, ">= -1 (-1 = never)"),
    "clip_ratio_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "clip_ratio_c": (lambda v: v > 1, "> 1 (dual clip)"),
    "gpu_memory_utilization": (lambda v: 0 < v < 1, "in (0, 1)"),
    "tis_imp_ratio_cap": (lambda v: v == -1 or v >= 1, "-1 (off) or a cap >= 1, e.g. 2"),
    "rollout_rs_threshold": (lambda v: v == -1 or v > 1, "-1 (off) or a threshold > 1, e.g. 2"),
    "rollout_rs_threshold_lower": (lambda v: v == -1 or 0 < v < 1, "-1 (1 / rollout_rs_threshold) or in (0, 1)"),
    "rollout_is_threshold": (lambda v: v >= 1, ">= 1, e.g. 2"),
    "clip_cov_ratio": IN_UNIT_INTERVAL,
    "kl_cov_ratio": IN_UNIT_INTERVAL,
    "gamma": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "grad_clip": (lambda v: v > 0, "> 0 (0 would zero every update and a negative value flip the gradients); "
                                   "float('inf') in a config file turns clipping off"),
    "betas": (lambda v: all(0 <= b < 1 for b in v), "two values in [0, 1)"),
}
LOGGERS = {"console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


# -----------------------------------------------------------------------------
# the checks

def ref_offload(cfg) -> bool:
    """Is the reference model's copy on the host? ref_param_offload, or the actor's param_offload when None
    (verl's ref.fsdp_config.param_offload is its own key: its GRPO examples offload the reference only)."""
    return cfg.param_offload if cfg.ref_param_offload is None else cfg.ref_param_offload


def check_config(cfg, world_size: int = 1, check_files: bool = True):
    """Every knob and cross-field rule, then (check_files) the model, data, reward and out_dir, before
    anything expensive. Raises ConfigError naming the knob or file and the fix."""
    check_knobs(cfg)
    check_batch_and_mesh(cfg, world_size)
    if hasattr(cfg, "check_algorithm"):  # the loss mode's, estimator's and rollout correction's needs
        cfg.check_algorithm(world_size)
    if not check_files:
        return
    trainer_ranks = world_size - cfg.rollout_gpus
    try:
        parallel.device_type(cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_model_dir(cfg, trainer_ranks)
    check_out_dir(cfg)
    n_train = data.check_parquet_schema(cfg.train_files, cfg.prompt_key)
    if n_train < cfg.gen_batch_size and cfg.train_max_samples <= 0:
        raise ConfigError(f"train_files hold {n_train} prompts, fewer than "
                          f"gen_batch_size={cfg.gen_batch_size}")
    if cfg.val_files:
        data.check_parquet_schema(cfg.val_files, cfg.prompt_key)
    try:
        reward.load_reward_fn(cfg.reward_fn)  # a missing file or function fails here, not at step 1000
    except reward.RewardError as e:
        raise ConfigError(str(e)) from None


def check_knobs(cfg):
    """Each knob on its own: numeric ranges, choices, gradient_checkpointing, loggers."""
    for k, (ok, allowed) in KNOB_RANGES.items():
        v = getattr(cfg, k)
        if isinstance(v, float) and math.isnan(v) or not ok(v):
            raise ConfigError(f"{k}={v!r} must be {allowed}")
    for k, tp in typing.get_type_hints(type(cfg)).items():  # the choices: Literal annotations
        if choices(tp) and not type_matches(getattr(cfg, k), tp):
            raise ConfigError(f"{k}={getattr(cfg, k)!r}{wrong_type(getattr(cfg, k), tp)}")
    ckpt = cfg.gradient_checkpointing
    blocks = type(ckpt) is int and ckpt >= 0
    if ckpt not in (True, False, "auto") and not blocks:
        raise ConfigError(f"gradient_checkpointing={ckpt!r}; choose True, False, 'auto' or an int N >= 0 "
                          "(the first N blocks)")
    for name in cfg.logger:
        if name not in LOGGERS:
            raise ConfigError(f"logger {name!r}; choose from {', '.join(LOGGERS)}")
        package = LOGGERS[name]
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"logger {name!r} is listed but {package} is not installed; "
                              f"pip install {package} or remove it")
    if cfg.resume not in ("auto", "disable") and not os.path.isdir(cfg.resume):
        raise ConfigError(f"resume={cfg.resume!r}: use 'auto', 'disable' or the path of a checkpoint "
                          "directory (out_dir/checkpoints/step_N)")


def check_batch_and_mesh(cfg, world_size: int):
    """The rules between knobs: batch sizes against each other and the ranks,
    asynchronous and engine layouts."""
    B, M, G = cfg.train_batch_size, cfg.ppo_mini_batch_size, cfg.n
    if B % M:
        raise ConfigError(f"ppo_mini_batch_size={M} must divide train_batch_size={B} (one optimizer step per "
                          "mini-batch)")
    if cfg.gen_batch_size < B and not cfg.filter_groups:
        raise ConfigError(f"gen_batch_size={cfg.gen_batch_size} < train_batch_size={B} needs "
                          "filter_groups=True (dynamic sampling refills with more gen batches)")
    if cfg.rollout_gpus:
        if cfg.rollout_gpus >= world_size:
            raise ConfigError(f"rollout_gpus={cfg.rollout_gpus} must be < the world size {world_size} "
                              "(torchrun's ranks): the first ranks train, the last rollout_gpus generate; "
                              "launch more ranks, or rollout_gpus=0 (colocated)")
        if cfg.rollout_gpus % cfg.gen_tp:
            raise ConfigError(f"gen_tp={cfg.gen_tp} must divide rollout_gpus={cfg.rollout_gpus}: the "
                              "generator ranks form vLLM engines of gen_tp ranks each")
        if cfg.router_replay:
            raise ConfigError("router_replay=True is not supported with rollout_gpus > 0 yet (the routing "
                              "would have to travel from the generators, and a response that partial rollout "
                              "continues mixes two versions' routing): set router_replay=False, or "
                              "rollout_gpus=0")
    trainer_ranks = world_size - cfg.rollout_gpus  # the mesh rules apply to them
    try:
        dp = parallel.check_mesh(trainer_ranks, cfg.tp_size, cfg.sp_size, ep_size=cfg.ep_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if (M * G) % dp:
        raise ConfigError(f"ppo_mini_batch_size*n={M * G} trajectories must split evenly over {dp} "
                          "data-parallel ranks (world_size / (tp_size * sp_size))")
    if cfg.router_replay and cfg.rollout_engine != "vllm":
        raise ConfigError("router_replay=True replays the routing vLLM records "
                          "(enable_return_routed_experts): set rollout_engine='vllm'")
    device = parallel.device_type() if cfg.device == "auto" else cfg.device
    if cfg.compile is True and trainer_ranks == 1 and device == "cpu":
        raise ConfigError("compile=True compiles the sharded policy (a GPU, or torchrun ranks); one CPU "
                          "process trains a plain module that the built-in engine decodes with: "
                          "set compile=False")
    per_rank = M * G // dp
    if not cfg.use_dynamic_bsz and per_rank % cfg.ppo_micro_batch_size_per_gpu:
        raise ConfigError(f"ppo_micro_batch_size_per_gpu={cfg.ppo_micro_batch_size_per_gpu} must divide the "
                          f"per-rank mini-batch ppo_mini_batch_size*n/dp={per_rank}")
    max_seq = cfg.max_prompt_length + cfg.max_response_length
    if cfg.use_dynamic_bsz:
        for k in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
            if getattr(cfg, k) * cfg.sp_size < max_seq:
                raise ConfigError(f"{k}={getattr(cfg, k)} x sp_size={cfg.sp_size} must be >= "
                                  f"max_prompt_length + max_response_length = {max_seq} "
                                  "(one sequence must fit an SP group's budget)")
    if cfg.overlong_buffer and not 0 < cfg.overlong_buffer_len <= cfg.max_response_length:
        raise ConfigError(f"overlong_buffer_len={cfg.overlong_buffer_len} must be in (0, max_response_length="
                          f"{cfg.max_response_length}]")
    if cfg.gen_tp != 1 and cfg.rollout_engine == "torch":
        raise ConfigError(f"gen_tp={cfg.gen_tp} needs rollout_engine='vllm' (the built-in engine generates "
                          "on one GPU per rank)")
    if not cfg.rollout_gpus and trainer_ranks % cfg.gen_tp:
        raise ConfigError(f"gen_tp={cfg.gen_tp} must divide the world size {trainer_ranks} "
                          "(world_size / gen_tp vLLM engines)")


def check_model_dir(cfg, world_size: int):
    """config.json, weights, tokenizer and chat template of model_path, and the context the run needs."""
    if not os.path.isfile(os.path.join(cfg.model_path, "config.json")):
        raise ConfigError(f"model_path={cfg.model_path!r} has no config.json; "
                          "point it at an HF model directory")
    try:
        model_cfg = check_weights(cfg.model_path)  # safetensors headers: names, shapes, truncation
        parallel.check_mesh(world_size, cfg.tp_size, cfg.sp_size, model_cfg.num_attention_heads,
                            model_cfg.num_key_value_heads, cfg.ep_size, model_cfg.num_experts)
        tok = Tokenizer.from_pretrained(cfg.model_path)
        tok.check_chat_template(cfg.chat_template_kwargs)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConfigError(f"model_path={cfg.model_path!r}: {e}") from None
    for knob in ("router_aux_loss", "router_replay"):
        if getattr(cfg, knob) and not model_cfg.num_experts:
            raise ConfigError(f"{knob}=True but {cfg.model_path} is not a mixture-of-experts model; "
                              "remove it")
    ckpt = cfg.gradient_checkpointing
    if type(ckpt) is int and ckpt > model_cfg.num_hidden_layers:
        raise ConfigError(f"gradient_checkpointing={ckpt} is more blocks than the model's "
                          f"{model_cfg.num_hidden_layers}")
    context = cfg.max_prompt_length + cfg.max_response_length
    if context > model_cfg.max_position_embeddings:
        raise ConfigError(f"max_prompt_length + max_response_length = {context} exceeds the model's context, "
                          f"max_position_embeddings={model_cfg.max_position_embeddings} in "
                          f"{cfg.model_path}/config.json; shorten max_prompt_length or max_response_length")


def check_out_dir(cfg):
    """out_dir writable; resume='disable' never mixes with an earlier run's checkpoints."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write_test.{os.getpid()}")  # one per rank: ranks race
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"out_dir={cfg.out_dir!r} is not writable ({e}); choose another out_dir") from None
    ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
    if cfg.resume == "disable" and os.path.isdir(ckpt_root) and os.listdir(ckpt_root):
        raise ConfigError(f"resume='disable' but {ckpt_root} holds an earlier run's checkpoints, which a "
                          "later resume='auto' would take for this run's; choose a new out_dir, "
                          "resume='auto' to continue that run, or delete the checkpoints")
