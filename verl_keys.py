"""
verl's keys: one table, VERL_KEYS, from every verl config key we know to what it becomes here. A key is
translated (it sets Config fields, converting units, renamed choices and verl's -1 / null conventions), a
no-op (accepted and reported: e.g. use_remove_padding, since every forward is packed), or refused with its
reason and the nearest nanodapo knob (no Ray, no Megatron backend, no critic, ...). config.parse_args takes
verl's dotted keys on the command line through it, tools/from_verl.py turns a verl launch script into a
config file through it, and README's "Coming from verl" table is markdown_table()'s output:

    t = translate([("actor_rollout_ref.rollout.n", "16"), ("trainer.logger", "[console,wandb]")])
    t.fields            # {"n": (16, "actor_rollout_ref.rollout.n"), "logger": (["console", "wandb"], ...)}
    t.refused, t.unknown  # [(key, raw, why)], [(key, did-you-mean)]

A whole verl run (a launch script, or a command line of verl keys with no config file) also takes verl's
defaults where nanodapo's differ (VERL_DEFAULTS): a translated run is the verl run, not nanodapo's.
"""
import dataclasses
import difflib
import os
import re
import typing


class Refused(Exception):
    """A verl key or value nanodapo cannot express: the reason and the nearest nanodapo knob."""

    def __init__(self, reason: str, knob: str = ""):
        super().__init__(reason)
        self.reason, self.knob = reason, knob


def parse_value(raw: str):
    """A Hydra override's value as verl reads it, after the shell took its quotes: true / True / false, null,
    ints, floats (0., 1e-6), 'quoted' strings, [lists] and {dicts} of bare or quoted words; else a string."""
    s = raw.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    if s.startswith("[") and s.endswith("]"):
        return [parse_value(x) for x in split_top(s[1:-1])]
    if s.startswith("{") and s.endswith("}"):
        pairs = [x.partition(":") for x in split_top(s[1:-1])]
        return {parse_value(k): parse_value(v) for k, _, v in pairs}
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    if re.fullmatch(r"[-+]?\d[\d_]*", s):
        return int(s)
    if re.fullmatch(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", s, re.I):
        return float(s)
    return s


def split_top(s: str) -> list[str]:
    """Split at the commas outside brackets and quotes, each item stripped ('' -> [];
    "0.1,(0.9, 0.99),'a,b'" -> ["0.1", "(0.9, 0.99)", "'a,b'"]; an empty item stays, as '')."""
    parts, depth, quote, cur = [], 0, None, ""
    for c in s:
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += c
    return [x.strip() for x in parts + [cur]] if s.strip() else []


@dataclasses.dataclass(frozen=True)
class Rule:
    kind: str  # "set": sets Config fields; "no-op": accepted, changes nothing; "refused": not supported
    fields: tuple = ()  # the Config fields it sets
    note: str = ""  # units, conventions; for no-op and refused keys the reason
    convert: typing.Callable = None  # (verl value, all verl keys given, the key) -> {field: value}
    knob: str = ""  # the nearest nanodapo knob of a refused key


def same(field, note=""):
    """The verl key is the Config field, value as it is."""
    return Rule("set", (field,), note, lambda v, given, key: {field: v})


def to(field, fn, note=""):
    """The verl key is the Config field, value converted by fn (which may raise Refused)."""
    return Rule("set", (field,), note, lambda v, given, key: {field: fn(v)})


def noop(reason):
    """Accepted with any value; changes nothing here."""
    return Rule("no-op", (), reason, lambda v, given, key: {})


def noop_if(ok, when, reason, knob=""):
    """A no-op for the values ok() accepts (`when` says which), refused with `reason` for any other."""
    def convert(v, given, key):
        if not ok(v):
            raise Refused(reason, knob)
        return {}
    return Rule("no-op", (), f"no-op {when}; else refused: {reason}", convert, knob)


def refused(reason, knob=""):
    return Rule("refused", (), reason, None, knob)


def is_off(v) -> bool:
    return v is None or v is False or v == 0 or v in ("", [], {})


def off(reason, knob=""):
    """A switch or path that is a no-op while off (False, null, 0, empty), refused when on."""
    return noop_if(is_off, "when off (False, null, 0, empty)", reason, knob)


def only(values, reason, knob=""):
    return noop_if(lambda v: v in values, "for " + " / ".join(map(str, values)), reason, knob)


def choice(field, mapping, note=""):
    """A renamed choice: verl's value -> ours; values missing from mapping are refused."""
    def fn(v):
        if v not in mapping:
            raise Refused(f"{v!r} is not one of verl's values nanodapo has: {', '.join(map(str, mapping))}",
                          field)
        return mapping[v]
    return to(field, fn, note or "; ".join(f"{a} -> {b}" for a, b in mapping.items() if a != b))


def same_as(key, field, default, note):
    """A key verl lets differ from `key` but nanodapo has one knob for: accepted when it equals `key`'s
    value (or its default when `key` is not given)."""
    def convert(v, given, k):
        other = given.get(key, default)
        if v != other:
            raise Refused(f"{v!r} differs from {key}={other!r}; {note}", field)
        return {field: v}
    return Rule("set", (field,), f"must equal {key}: {note}", convert)


def non_positive_is(value_here, note):
    return lambda v: value_here if v is None or v <= 0 else v


def logger_names(v):
    names = [v] if isinstance(v, str) else list(v)
    ours = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow",
            "file": "jsonl"}
    other = [n for n in names if n not in ours]
    if other:
        raise Refused(f"{', '.join(map(repr, other))} is not a logger here (console, jsonl, tensorboard, wandb, "
                      "mlflow; vemlp_wandb is the Volcano Engine ML platform's wandb: use wandb)", "logger")
    return [ours[n] for n in names]


def resume_mode(v, given, key):
    if v in ("auto", "disable"):
        return {"resume": v}
    if v == "resume_path":
        path = given.get("trainer.resume_from_path")
        if not path:
            raise Refused("resume_mode=resume_path needs trainer.resume_from_path", "resume")
        return {"resume": path}
    raise Refused(f"{v!r}: verl's modes are auto, disable, resume_path", "resume")


def resume_from_path(v, given, key):
    if given.get("trainer.resume_mode") != "resume_path":
        return {}  # verl reads it only with resume_mode=resume_path
    return {}  # trainer.resume_mode sets resume


def reward_fn(v, given, key):
    path = given.get("custom_reward_function.path")
    if is_off(path):
        return {}
    return {"reward_fn": f"{os.path.expanduser(path)}:{given.get('custom_reward_function.name', 'compute_score')}"}


def rollout_rs_threshold(v, given, key):
    """A number (the upper bound; the lower is its inverse), or verl's newer "lower_upper" string."""
    if isinstance(v, str) and "_" in v:
        lower, _, upper = v.partition("_")
        return {"rollout_rs_threshold": float(upper), "rollout_rs_threshold_lower": float(lower)}
    return {"rollout_rs_threshold": -1.0 if v is None else float(v)}


def vllm_kwarg(v, given, key):
    return {"vllm_kwargs": {key.rsplit(".", 1)[1]: v}}


def override_config(v, given, key):
    name = key.rsplit(".", 1)[1]
    if name.endswith(("dropout", "pdrop")) and v == 0:
        return {}
    if name == "router_aux_loss_coef":
        raise Refused("the coefficient is the model's config.json router_aux_loss_coef; set "
                      "router_aux_loss=True to add the loss", "router_aux_loss")
    raise Refused(f"the model has no dropout and takes no config.json overrides ({name}); edit the model "
                  "directory's config.json", "model_path")


def kl_type(field):
    return choice(field, {"kl": "kl", "k1": "kl", "abs": "abs", "mse": "mse", "k2": "mse",
                          "low_var_kl": "low_var_kl", "k3": "low_var_kl"})


def path_list(v):
    files = [v] if isinstance(v, str) else list(v)
    return [os.path.expanduser(f) for f in files]


AR = "actor_rollout_ref."
A, R, RO = AR + "actor.", AR + "ref.", AR + "rollout."
NO_RAY = "no Ray: torchrun launches the ranks"
NO_MEGATRON = "no Megatron backend: FSDP2 + TP (tp_size), EP (ep_size), Ulysses SP (sp_size)"
NO_CRITIC = "no critic: GRPO group advantages (verl builds none for adv_estimator=grpo either)"
PACKED = "always on: every forward is packed, no padding tokens are computed"
NO_PROFILER = "no built-in profiler (bench/ has the profiling scripts)"
ONE_DYN = "one use_dynamic_bsz for update and log-prob passes"
ONE_LOGPROB = "one knob for old and reference log-probs"

VERL_KEYS = {
    # data
    "data.train_files": to("train_files", path_list, "parquet, verl's schema"),
    "data.val_files": to("val_files", path_list, "parquet, verl's schema"),
    "data.prompt_key": same("prompt_key"),
    "data.max_prompt_length": same("max_prompt_length"),
    "data.max_response_length": same("max_response_length"),
    "data.train_batch_size": same("train_batch_size", "prompts, global"),
    "data.gen_batch_size": same("gen_batch_size", "prompts, global; verl's default: train_batch_size"),
    "data.truncation": same("truncation", "error / left / right / middle"),
    "data.filter_overlong_prompts": same("filter_overlong_prompts"),
    "data.train_max_samples": same("train_max_samples"),
    "data.val_max_samples": same("val_max_samples"),
    "data.shuffle": same("shuffle"),
    "data.seed": to("seed", lambda v: 0 if v is None else v, "null -> 0"),
    "data.apply_chat_template_kwargs": same("chat_template_kwargs", "e.g. {enable_thinking: False}"),
    "data.reward_fn_key": only(("data_source",), "verifiers are chosen by each row's data_source"),
    "data.val_batch_size": noop("validation generates every val prompt at once (verl deprecated it)"),
    "data.dataloader_num_workers": noop("prompts are read from memory"),
    "data.filter_overlong_prompts_workers": noop("prompts are filtered in-process"),
    "data.validation_shuffle": off("val prompts are taken in order"),
    "data.return_raw_chat": noop("prompts are chat messages, templated by nanodapo"),
    "data.return_raw_input_ids": noop("prompts are chat messages, templated by nanodapo"),
    "data.return_full_prompt": noop("prompts are chat messages, templated by nanodapo"),
    "data.return_multi_modal_inputs": noop("text only"),
    "data.image_key": noop("text only"),
    "data.video_key": noop("text only"),
    "data.tokenizer": off("the tokenizer is model_path's", "model_path"),
    "data.use_shm": off("files are read from disk"),
    "data.trust_remote_code": noop("no code from the model or data directory is run"),
    "data.custom_cls.*": off("a custom dataset class: prepare verl-schema parquet with tools/prepare_data.py",
                             "train_files"),
    "data.sampler.*": off("prompts are sampled by a seeded shuffle (shuffle, seed)", "shuffle"),
    "data.datagen.*": off("no dynamic data generation"),
    "data.source": noop("not read by verl either (added with +); verifiers follow each row's data_source"),
    # model
    AR + "model.path": to("model_path", os.path.expanduser, "an HF model directory"),
    AR + "model.enable_gradient_checkpointing": same("gradient_checkpointing",
                                                     "True / False; nanodapo also takes an int or 'auto'"),
    AR + "model.use_remove_padding": noop(PACKED),
    AR + "model.enable_activation_offload": off("activations stay on the GPU", "gradient_checkpointing"),
    AR + "model.lora_rank": off("no LoRA: full fine-tuning"),
    AR + "model.lora_alpha": noop("used only with lora_rank > 0"),
    AR + "model.target_modules": noop("used only with lora_rank > 0"),
    AR + "model.exclude_modules": noop("used only with lora_rank > 0"),
    AR + "model.use_liger": noop("log-probs are computed in fp32 chunks (logprob_chunk) without Liger"),
    AR + "model.use_fused_kernels": noop("plain torch forward; log-probs in fp32 chunks (logprob_chunk)"),
    AR + "model.fused_kernel_options.impl_backend": noop("plain torch forward"),
    AR + "model.trust_remote_code": noop("architectures are built in: no code from the model directory is run"),
    AR + "model.use_shm": off("the model is read from disk"),
    AR + "model.custom_chat_template": off("the chat template is the tokenizer's: edit tokenizer_config.json",
                                           "model_path"),
    AR + "model.external_lib": off("architectures are built in (Llama, Qwen2, Qwen3, Qwen3-MoE)"),
    AR + "model.override_config.*": Rule("no-op", (), "no-op for dropout 0 (the model has no dropout); other "
                                         "overrides refused: edit config.json", override_config),
    AR + "hybrid_engine": only((True,), "the engine is always colocated with training (or on rollout_gpus)",
                               "rollout_gpus"),
    AR + "nccl_timeout": noop("collectives use torch's timeout; a stuck rank is caught by watchdog_timeout_s"),
    # actor
    A + "strategy": only(("fsdp", "fsdp2"), NO_MEGATRON),
    A + "ppo_mini_batch_size": same("ppo_mini_batch_size", "prompts, global"),
    A + "ppo_micro_batch_size_per_gpu": same("ppo_micro_batch_size_per_gpu", "trajectories per GPU"),
    A + "ppo_micro_batch_size": off("verl's deprecated global micro-batch: give ppo_micro_batch_size_per_gpu",
                                    "ppo_micro_batch_size_per_gpu"),
    A + "use_dynamic_bsz": same("use_dynamic_bsz", "micro-batches by token budget"),
    A + "ppo_max_token_len_per_gpu": same("ppo_max_token_len_per_gpu", "per GPU; an SP group's is sp_size x"),
    A + "ppo_epochs": same("ppo_epochs"),
    A + "shuffle": noop("mini-batches are taken in order within a step (verl's FSDP actor does not read it)"),
    A + "clip_ratio": only((0.2,), "verl's actor clips with clip_ratio_low / clip_ratio_high (0.2 by default); "
                           "set those", "clip_ratio_low"),
    A + "clip_ratio_low": same("clip_ratio_low"),
    A + "clip_ratio_high": same("clip_ratio_high", "verl's default 0.2, nanodapo's 0.28"),
    A + "clip_ratio_c": same("clip_ratio_c", "verl's default 3.0, nanodapo's 10.0"),
    A + "policy_loss.loss_mode": same("loss_mode", "ALGORITHM.md 3a (one nanodapo does not have is refused)"),
    A + "policy_loss.clip_cov_ratio": same("clip_cov_ratio"),
    A + "policy_loss.clip_cov_lb": same("clip_cov_lb"),
    A + "policy_loss.clip_cov_ub": same("clip_cov_ub"),
    A + "policy_loss.kl_cov_ratio": same("kl_cov_ratio"),
    A + "policy_loss.ppo_kl_coef": same("ppo_kl_coef"),
    A + "policy_loss.tau_pos": same("tau_pos"),
    A + "policy_loss.tau_neg": same("tau_neg"),
    A + "loss_agg_mode": same("loss_agg_mode"),
    A + "use_token_level_loss": to("loss_agg_mode", lambda v: "token-mean" if v else "seq-mean-token-mean",
                                   "verl's old key: True -> token-mean, False -> seq-mean-token-mean"),
    A + "loss_scale_factor": off("seq-mean-token-sum-norm divides by sequences x max_response_length",
                                 "loss_agg_mode"),
    A + "entropy_coeff": same("entropy_coeff"),
    A + "use_kl_loss": same("use_kl_loss"),
    A + "kl_loss_coef": same("kl_loss_coef"),
    A + "kl_loss_type": kl_type("kl_loss_type"),
    A + "use_torch_compile": to("compile", lambda v: "auto" if v else False,
                                "True -> 'auto' (compiled on CUDA GPUs, eager on the CPU)"),
    A + "ulysses_sequence_parallel_size": same("sp_size", "Ulysses all-to-all over heads"),
    A + "entropy_from_logits_with_chunking": noop("entropy is always computed in chunks (logprob_chunk)"),
    A + "entropy_checkpointing": noop("the log-prob head is chunked (logprob_chunk)"),
    A + "grad_clip": same("grad_clip"),
    A + "tis_imp_ratio_cap": same("tis_imp_ratio_cap", "-1 = off"),
    A + "checkpoint.save_contents": noop("a checkpoint holds the model, optimizer and trainer state"),
    A + "checkpoint.load_contents": noop("a checkpoint holds the model, optimizer and trainer state"),
    A + "checkpoint.async_save": off("checkpoints are written synchronously"),
    A + "optim.lr": same("lr"),
    A + "optim.lr_warmup_steps": to("lr_warmup_steps", lambda v: max(v, 0), "verl's -1 (use the ratio) -> 0"),
    A + "optim.lr_warmup_steps_ratio": only((0, 0.0), "give the warmup in optimizer steps", "lr_warmup_steps"),
    A + "optim.weight_decay": same("weight_decay", "verl's default 0.01, nanodapo's 0.1"),
    A + "optim.betas": same("betas"),
    A + "optim.clip_grad": same("grad_clip", "verl's optimizer-side name"),
    A + "optim.min_lr_ratio": to("min_lr_ratio", lambda v: 0.0 if v is None else v, "null -> 0"),
    A + "optim.warmup_style": choice("lr_scheduler", {"constant": "constant", "cosine": "cosine"}),
    A + "optim.lr_scheduler_type": choice("lr_scheduler", {"constant": "constant", "cosine": "cosine"}),
    A + "optim.num_cycles": only((0.5,), "the cosine schedule is half a cycle", "lr_scheduler"),
    A + "optim.total_training_steps": noop("set by verl's trainer from trainer.total_training_steps"),
    A + "optim.optimizer": only(("AdamW",), "torch AdamW"),
    A + "optim.override_optimizer_config.*": refused("Megatron's optimizer options: torch AdamW here",
                                                     "optimizer_offload"),
    A + "fsdp_config.param_offload": same("param_offload", "FSDP2's CPU offload: params, grads, AdamW "
                                          "states and step on the host"),
    A + "fsdp_config.optimizer_offload": same("optimizer_offload", "AdamW states on the host between steps"),
    A + "fsdp_config.offload_policy": to("param_offload", bool, "FSDP2's CPUOffloadPolicy is param_offload"),
    A + "fsdp_config.fsdp_size": only((-1,), "FSDP shards over all data-parallel ranks"),
    A + "fsdp_config.wrap_policy.*": noop("every decoder block is an FSDP unit"),
    A + "fsdp_config.reshard_after_forward": noop("FSDP2 reshards after forward"),
    A + "fsdp_config.forward_prefetch": noop("FSDP2's default prefetch"),
    A + "fsdp_config.model_dtype": only(("fp32", "float32"), "master weights are fp32; compute in dtype",
                                        "dtype"),
    A + "megatron.tensor_model_parallel_size": same("tp_size", "FSDP2 + TP"),
    A + "megatron.expert_model_parallel_size": same("ep_size", "experts split over ep_size ranks"),
    A + "megatron.*": refused(NO_MEGATRON),
    A + "profiler.*": noop(NO_PROFILER),
    A + "router_replay.mode": choice("router_replay", {"disabled": False, "R3": True},
                                     "R3 -> True (vLLM's routing replayed)"),
    # reference model
    R + "fsdp_config.param_offload": same("ref_param_offload", "the reference model's weights on the host"),
    R + "fsdp_config.*": noop("the reference model is sharded like the actor"),
    R + "log_prob_micro_batch_size_per_gpu": same("log_prob_micro_batch_size_per_gpu", ONE_LOGPROB),
    R + "log_prob_micro_batch_size": off("verl's deprecated global micro-batch",
                                        "log_prob_micro_batch_size_per_gpu"),
    R + "log_prob_use_dynamic_bsz": same_as(A + "use_dynamic_bsz", "use_dynamic_bsz", False, ONE_DYN),
    R + "log_prob_max_token_len_per_gpu": same("log_prob_max_token_len_per_gpu", ONE_LOGPROB),
    R + "ulysses_sequence_parallel_size": same_as(A + "ulysses_sequence_parallel_size", "sp_size", 1,
                                                  "the reference model follows the actor's sp_size"),
    R + "strategy": only(("fsdp", "fsdp2"), NO_MEGATRON),
    R + "use_torch_compile": noop("the reference model is compiled like the actor (compile)"),
    R + "entropy_from_logits_with_chunking": noop("log-probs are computed in chunks"),
    R + "entropy_checkpointing": noop("log-probs are computed in chunks"),
    R + "megatron.*": refused(NO_MEGATRON),
    R + "profiler.*": noop(NO_PROFILER),
    # rollout
    RO + "name": choice("rollout_engine", {"vllm": "vllm", "hf": "torch"},
                        "vllm; hf -> torch (the built-in engine); sglang refused"),
    RO + "mode": noop("the engine runs in-process, whichever verl mode"),
    RO + "n": same("n", "responses per prompt (the group)"),
    RO + "temperature": same("temperature"),
    RO + "top_p": same("top_p"),
    RO + "top_k": to("top_k", lambda v: -1 if v is None or v <= 0 else v, "0 or -1 -> -1 (off)"),
    RO + "do_sample": only((True,), "training rollouts sample: a greedy group has no variance", "temperature"),
    RO + "prompt_length": same("max_prompt_length"),
    RO + "response_length": same("max_response_length"),
    RO + "dtype": choice("dtype", {"bfloat16": "bfloat16", "float16": "float16", "bf16": "bfloat16",
                                   "fp16": "float16"}),
    RO + "gpu_memory_utilization": same("gpu_memory_utilization"),
    RO + "ignore_eos": off("a response ends at EOS"),
    RO + "enforce_eager": same("enforce_eager"),
    RO + "cudagraph_capture_sizes": Rule("set", ("vllm_kwargs",), "passed to vllm.LLM",
                                         lambda v, given, key: {} if v is None else
                                         {"vllm_kwargs": {"cudagraph_capture_sizes": v}}),
    RO + "free_cache_engine": same("free_cache_engine"),
    RO + "tensor_model_parallel_size": same("gen_tp", "world_size / gen_tp engines"),
    RO + "max_num_batched_tokens": same("max_num_batched_tokens"),
    RO + "max_model_len": noop("vLLM's context is max_prompt_length + max_response_length"),
    RO + "max_num_seqs": same("max_num_seqs"),
    RO + "log_prob_micro_batch_size_per_gpu": same("log_prob_micro_batch_size_per_gpu", ONE_LOGPROB),
    RO + "log_prob_micro_batch_size": off("verl's deprecated global micro-batch",
                                         "log_prob_micro_batch_size_per_gpu"),
    RO + "log_prob_use_dynamic_bsz": same_as(A + "use_dynamic_bsz", "use_dynamic_bsz", False, ONE_DYN),
    RO + "log_prob_max_token_len_per_gpu": same("log_prob_max_token_len_per_gpu", ONE_LOGPROB),
    RO + "disable_log_stats": noop("vLLM's stats are not logged"),
    RO + "enable_chunked_prefill": same("enable_chunked_prefill"),
    RO + "load_format": noop("weights are pushed from the trainer"),
    RO + "layered_summon": noop("weights are pushed in buckets (weight_sync_bucket_mb)"),
    RO + "multi_stage_wake_up": noop("the engine wakes weights, then KV cache"),
    RO + "over_sample_rate": off("every response of a gen batch is awaited"),
    RO + "calculate_log_probs": same("calculate_log_probs"),
    RO + "update_weights_bucket_megabytes": same("weight_sync_bucket_mb"),
    RO + "enable_rollout_routing_replay": noop("router_replay (from actor.router_replay.mode) turns it on"),
    RO + "skip_rollout": off("rollouts are always generated"),
    RO + "skip_dump_dir": noop("rollouts are always generated"),
    RO + "val_kwargs.n": same("val_n", "validation only: never the training n"),
    RO + "val_kwargs.temperature": same("val_temperature", "validation only"),
    RO + "val_kwargs.top_p": same("val_top_p", "validation only"),
    RO + "val_kwargs.top_k": to("val_top_k", lambda v: -1 if v is None or v <= 0 else v,
                                "validation only; 0 or -1 -> -1 (off)"),
    RO + "val_kwargs.do_sample": same("val_do_sample", "validation only; False = greedy (verl's default)"),
    RO + "engine_kwargs.vllm.*": Rule("set", ("vllm_kwargs",), "passed to vllm.LLM as they are", vllm_kwarg),
    RO + "engine_kwargs.sglang.*": refused("no SGLang engine", "rollout_engine"),
    RO + "multi_turn.enable": off("no multi-turn or tool rollouts"),
    RO + "multi_turn.*": noop("used only with multi_turn.enable"),
    RO + "agent.*": noop("no agent loop: the engine generates single-turn responses"),
    RO + "trace.*": noop("no rollout tracing"),
    RO + "profiler.*": noop(NO_PROFILER),
    RO + "nnodes": refused("asynchronous mode puts the generators on the last rollout_gpus ranks",
                           "rollout_gpus"),
    RO + "n_gpus_per_node": refused("asynchronous mode puts the generators on the last rollout_gpus ranks",
                                    "rollout_gpus"),
    # critic and reward
    "critic.*": noop(NO_CRITIC),
    "reward_model.enable": off("no model-based reward: rule verifiers by data_source, or reward_fn", "reward_fn"),
    "reward_model.reward_manager": only(("naive", "dapo", "prime"),
                                        "verifiers by data_source; overlong shaping from overlong_buffer"),
    "reward_model.launch_reward_fn_async": noop("scoring runs in reward_num_workers processes"),
    "reward_model.overlong_buffer.enable": same("overlong_buffer", "DAPO overlong shaping"),
    "reward_model.overlong_buffer.len": same("overlong_buffer_len"),
    "reward_model.overlong_buffer.penalty_factor": same("overlong_penalty_factor"),
    "reward_model.overlong_buffer.log": noop("the overlong penalty is always logged"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": same("overlong_buffer", "DAPO overlong shaping"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": same("overlong_buffer_len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": same("overlong_penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": noop("the overlong penalty is always logged"),
    "reward_model.reward_kwargs.max_resp_len": same_as("data.max_response_length", "max_response_length", None,
                                                       "the overlong buffer ends at max_response_length"),
    "reward_model.sandbox_fusion.url": off("no code sandbox: verifiers run in-process", "reward_fn"),
    "reward_model.sandbox_fusion.*": noop("used only with sandbox_fusion.url"),
    "reward_model.*": noop("used only with reward_model.enable=True (a reward model), which is refused"),
    "custom_reward_function.path": Rule("set", ("reward_fn",), "reward_fn = 'path.py:name', verl's signature",
                                        reward_fn),
    "custom_reward_function.name": Rule("set", ("reward_fn",), "with .path: reward_fn = 'path.py:name'",
                                        lambda v, given, key: {}),
    "custom_reward_function.overlong_buffer.enable": same("overlong_buffer", "DAPO overlong shaping"),
    "custom_reward_function.overlong_buffer.len": same("overlong_buffer_len"),
    "custom_reward_function.overlong_buffer.penalty_factor": same("overlong_penalty_factor"),
    "custom_reward_function.overlong_buffer.log": noop("the overlong penalty is always logged"),
    # algorithm
    "algorithm.adv_estimator": same("adv_estimator", "ALGORITHM.md 3b (one nanodapo does not have, e.g. gae: no "
                                "critic, is refused)"),
    "algorithm.norm_adv_by_std_in_grpo": same("norm_adv_by_std", "False = Dr.GRPO"),
    "algorithm.gamma": same("gamma", "reinforce_plus_plus's discount (the other estimators ignore it)"),
    "algorithm.lam": noop("GRPO has no GAE (verl's grpo ignores it too)"),
    "algorithm.use_kl_in_reward": same("use_kl_in_reward"),
    "algorithm.kl_penalty": kl_type("kl_penalty"),
    "algorithm.kl_ctrl.kl_coef": same("kl_coef"),
    "algorithm.kl_ctrl.type": only(("fixed",), "a fixed kl_coef", "kl_coef"),
    "algorithm.kl_ctrl.horizon": noop("used only by the adaptive controller"),
    "algorithm.kl_ctrl.target_kl": noop("used only by the adaptive controller"),
    "algorithm.use_pf_ppo": off("no PF-PPO reweighting"),
    "algorithm.pf_ppo.*": noop("used only with use_pf_ppo"),
    "algorithm.filter_groups.enable": same("filter_groups", "dynamic sampling"),
    "algorithm.filter_groups.metric": to("filter_groups_metric", lambda v: "acc" if v is None else v,
                                         "acc / score / seq_reward / seq_final_reward"),
    "algorithm.filter_groups.max_num_gen_batches": to("max_num_gen_batches", non_positive_is(0, ""),
                                                      "non-positive = no limit, as in verl"),
    "algorithm.rollout_correction.rollout_is": same("rollout_is", "token / sequence; null = off"),
    "algorithm.rollout_correction.rollout_is_threshold": same("rollout_is_threshold"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": same("rollout_is_batch_normalize"),
    "algorithm.rollout_correction.rollout_rs": choice("rollout_rs", {
        None: None, "token": "token", "sequence": "sequence", "geometric": "geometric", "token_k1": "token",
        "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}),
    "algorithm.rollout_correction.rollout_rs_threshold": Rule(
        "set", ("rollout_rs_threshold", "rollout_rs_threshold_lower"),
        'a number, or verl\'s "lower_upper" string', rollout_rs_threshold),
    "algorithm.rollout_correction.rollout_rs_threshold_lower": same("rollout_rs_threshold_lower"),
    # trainer
    "trainer.total_epochs": same("total_epochs"),
    "trainer.total_training_steps": to("total_training_steps", lambda v: v or 0, "null -> 0 (from epochs)"),
    "trainer.project_name": same("project_name"),
    "trainer.experiment_name": same("experiment_name"),
    "trainer.logger": to("logger", logger_names, "console, wandb, tensorboard, mlflow; file -> jsonl"),
    "trainer.log_val_generations": same("log_val_generations"),
    "trainer.nnodes": same("nnodes", "torchrun --nnodes; sizes --dry_run"),
    "trainer.n_gpus_per_node": same("n_gpus_per_node", "torchrun --nproc-per-node; sizes --dry_run"),
    "trainer.save_freq": to("save_freq", lambda v: -1 if v is None or v < 0 else v,
                            "-1 = never, as in verl; 0 = only at the end"),
    "trainer.test_freq": to("test_freq", lambda v: 0 if v is None or v <= 0 else v,
                            "verl's -1 -> 0: no periodic validation (nanodapo still validates at the end)"),
    "trainer.val_before_train": same("val_before_train"),
    "trainer.val_only": off("training runs; validation alone is not a mode", "val_before_train"),
    "trainer.critic_warmup": noop(NO_CRITIC),
    "trainer.default_local_dir": to("out_dir", os.path.expanduser, "metrics, checkpoints, val generations"),
    "trainer.default_hdfs_dir": off("checkpoints are written to out_dir only", "out_dir"),
    "trainer.del_local_ckpt_after_load": off("checkpoints are kept (keep_last prunes)", "keep_last"),
    "trainer.resume_mode": Rule("set", ("resume",), "auto / disable; resume_path -> resume = resume_from_path",
                                resume_mode),
    "trainer.resume_from_path": Rule("set", ("resume",), "with resume_mode=resume_path", resume_from_path),
    "trainer.max_actor_ckpt_to_keep": to("keep_last", lambda v: v or 0, "null -> 0 (keep all)"),
    "trainer.max_critic_ckpt_to_keep": noop(NO_CRITIC),
    "trainer.device": choice("device", {"cuda": "cuda", "npu": "npu", "cpu": "cpu"}),
    "trainer.balance_batch": noop("micro-batches are balanced by tokens with use_dynamic_bsz"),
    "trainer.rollout_data_dir": off("rollouts are not dumped; val generations go to out_dir", "out_dir"),
    "trainer.validation_data_dir": off("val generations go to out_dir", "log_val_generations"),
    "trainer.esi_redundant_time": noop("no elastic-server instance deadline"),
    "trainer.ray_wait_register_center_timeout": noop(NO_RAY),
    "trainer.use_legacy_worker_impl": noop("one worker implementation"),
    "trainer.profile_steps": off(NO_PROFILER),
    "trainer.balance_batch_mode": noop("micro-batches are balanced by tokens with use_dynamic_bsz"),
    "global_profiler.*": noop(NO_PROFILER),
    "ray_init.*": noop(NO_RAY),
    "ray_kwargs.*": noop(NO_RAY),
    "hydra.*": noop("no Hydra: config files are plain Python"),
    # asynchronous recipes
    "async_training.partial_rollout": same("partial_rollout"),
    "async_training.staleness_threshold": refused("verl's is a fraction of extra samples; nanodapo bounds "
                                                  "policy versions", "max_staleness"),
    # the DAPO recipe scripts' shell variables (recipe/dapo/*.sh), which guides pass as --name=value
    "train_prompt_bsz": same("train_batch_size", "the DAPO recipe scripts' variable"),
    "gen_prompt_bsz": same("gen_batch_size", "the DAPO recipe scripts' variable"),
    "train_prompt_mini_bsz": same("ppo_mini_batch_size", "the DAPO recipe scripts' variable"),
    "n_resp_per_prompt": same("n", "the DAPO recipe scripts' variable"),
    "enable_filter_groups": same("filter_groups", "the DAPO recipe scripts' variable"),
    "enable_overlong_buffer": same("overlong_buffer", "the DAPO recipe scripts' variable"),
    "actor_ppo_max_token_len": same("ppo_max_token_len_per_gpu", "the DAPO recipe scripts' variable"),
    "infer_ppo_max_token_len": same("log_prob_max_token_len_per_gpu", "the DAPO recipe scripts' variable"),
    "sp_size": same("sp_size", "the DAPO recipe scripts' variable (nanodapo's name too)"),
    "gen_tp": same("gen_tp", "the DAPO recipe scripts' variable (nanodapo's name too)"),
    "dynamic_bsz_warmup_steps": refused("not a verl option (no verl config key reads it): use_dynamic_bsz "
                                        "has no warmup in verl or here", "use_dynamic_bsz"),
}

# verl's defaults where nanodapo's differ and change what a run computes, validates or saves: a whole verl run
# takes them for the fields none of its keys set (performance knobs keep nanodapo's: gradient_checkpointing,
# compile, gen_tp, max_num_seqs, max_num_batched_tokens; and logger). A Derived value comes from the fields
# so far, as verl's ${...} interpolation does.
class Derived(typing.NamedTuple):
    fn: typing.Callable  # the fields so far -> the value
    shown: str  # what README's table says


VERL_DEFAULTS = {  # field -> (verl's value, verl's key)
    "model_path": (os.path.expanduser("~/models/deepseek-llm-7b-chat"), AR + "model.path"),
    "train_files": ([os.path.expanduser("~/data/rlhf/gsm8k/train.parquet")], "data.train_files"),
    "val_files": ([os.path.expanduser("~/data/rlhf/gsm8k/test.parquet")], "data.val_files"),
    "max_response_length": (512, "data.max_response_length"),
    "train_batch_size": (1024, "data.train_batch_size"),
    "gen_batch_size": (Derived(lambda f: f["train_batch_size"], "train_batch_size"), "data.gen_batch_size"),
    "n": (1, RO + "n"),
    "ppo_mini_batch_size": (256, A + "ppo_mini_batch_size"),
    "log_prob_max_token_len_per_gpu": (Derived(lambda f: f.get("ppo_max_token_len_per_gpu", 16384),
                                               "ppo_max_token_len_per_gpu"),
                                       RO + "log_prob_max_token_len_per_gpu"),
    "clip_ratio_high": (0.2, A + "clip_ratio_high"),
    "clip_ratio_c": (3.0, A + "clip_ratio_c"),
    "weight_decay": (0.01, A + "optim.weight_decay"),
    "filter_groups": (False, "algorithm.filter_groups.enable"),
    "max_num_gen_batches": (0, "algorithm.filter_groups.max_num_gen_batches"),
    "overlong_buffer": (False, "reward_model.overlong_buffer.enable"),
    "overlong_penalty_factor": (0.0, "reward_model.overlong_buffer.penalty_factor"),
    "val_temperature": (0.0, RO + "val_kwargs.temperature"),
    "val_top_p": (1.0, RO + "val_kwargs.top_p"),
    "val_do_sample": (False, RO + "val_kwargs.do_sample"),
    "total_epochs": (30, "trainer.total_epochs"),
    "n_gpus_per_node": (8, "trainer.n_gpus_per_node"),
    "test_freq": (0, "trainer.test_freq"),
    "save_freq": (-1, "trainer.save_freq"),
    "log_val_generations": (0, "trainer.log_val_generations"),
    "project_name": ("verl_examples", "trainer.project_name"),
    "experiment_name": ("gsm8k", "trainer.experiment_name"),
    "out_dir": (Derived(lambda f: f"checkpoints/{f['project_name']}/{f['experiment_name']}",
                        "checkpoints/{project_name}/{experiment_name}"), "trainer.default_local_dir"),
}


# -----------------------------------------------------------------------------
# translating

@dataclasses.dataclass
class Translation:
    fields: dict = dataclasses.field(default_factory=dict)  # Config field -> (value, the verl key it came from)
    translated: list = dataclasses.field(default_factory=list)  # the keys that set fields
    noops: list = dataclasses.field(default_factory=list)  # (key, raw value, why it changes nothing)
    refused: list = dataclasses.field(default_factory=list)  # (key, raw value, why, with the nearest knob)
    unknown: list = dataclasses.field(default_factory=list)  # (key, the closest known name or "")
    defaults: dict = dataclasses.field(default_factory=dict)  # field -> (verl's default, verl's key)

    def problems(self) -> list[str]:
        """One line per refused or unknown key: the reason or the closest name."""
        lines = [f"{key}={raw}: not supported: {why}" for key, raw, why in self.refused]
        lines += [f"{key}: unknown config key" + (f"; did you mean {close!r}?" if close else "")
                  for key, close in self.unknown]
        return lines

    def report(self) -> list[str]:
        """What the translation did, said once: counts, the no-ops, verl's defaults taken."""
        lines = [f"verl keys: {len(self.translated)} translated, {len(self.noops)} no-op"]
        lines += [f"  no-op {key}={raw}: {why}" for key, raw, why in self.noops]
        if self.defaults:
            lines.append("  verl's defaults where nanodapo's differ: " + ", ".join(
                f"{f}={v!r}" for f, (v, _) in self.defaults.items()))
        return lines


def normalize(key: str) -> str:
    """Hydra's prefixes off: --key, +key, ++key -> key."""
    return key.strip().removeprefix("--").lstrip("+")


def lookup(key: str) -> tuple[str, Rule] | None:
    """A verl key's rule: its own row, else the longest `prefix.*` row that covers it."""
    if key in VERL_KEYS:
        return key, VERL_KEYS[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        pattern = ".".join(parts[:i]) + ".*"
        if pattern in VERL_KEYS:
            return pattern, VERL_KEYS[pattern]
    return None


def closest(key: str, fields) -> str:
    """The known verl key or Config field nearest to a mistyped key ('' if none is close)."""
    exact = [k for k in VERL_KEYS if not k.endswith("*")]
    pool = exact + list(fields) if "." not in key else exact
    match = difflib.get_close_matches(key, pool, n=1, cutoff=0.75)
    if match:
        return match[0]
    tail = key.rsplit(".", 1)[-1]  # README's old rule a.b.c=v -> --c=v: name the verl key that ends in .c
    ends = [k for k in exact if k.endswith("." + tail)]
    return ends[0] if len(ends) == 1 else ""


def translate(pairs, fields=(), verl_defaults: bool = False, base: dict | None = None) -> Translation:
    """[(verl key, raw value)] -> Translation. fields: Config's field names (for did-you-mean hints).
    verl_defaults: the keys are a whole verl run, so verl's defaults fill the fields they leave unset
    (base: the Config's values so far, which derived defaults read where no verl key set the field)."""
    t = Translation()
    given = {}
    for key, raw in pairs:
        given[normalize(key)] = parse_value(raw) if isinstance(raw, str) else raw
    raws = {normalize(k): raw for k, raw in pairs}
    setters = {}  # field -> [(verl key, value)]
    for key, value in given.items():
        found = lookup(key)
        if found is None:
            t.unknown.append((key, closest(key, fields)))
            continue
        _, rule = found
        try:
            if rule.kind == "refused":
                raise Refused(rule.note, rule.knob)
            out = rule.convert(value, given, key)
        except Refused as e:
            t.refused.append((key, raws[key], e.reason + (f" (nanodapo: {e.knob})" if e.knob else "")))
            continue
        if rule.kind == "no-op":
            t.noops.append((key, raws[key], rule.note))
        else:  # translated (a key like resume_from_path reaches its field through another key)
            t.translated.append(key)
        for field, v in out.items():
            setters.setdefault(field, []).append((key, v))
    for field, sets in setters.items():
        if field == "vllm_kwargs":
            t.fields[field] = ({k: v for _, d in sets for k, v in d.items()}, ", ".join(k for k, _ in sets))
            continue
        values = {repr(v) for _, v in sets}
        if len(values) > 1:
            keys = " and ".join(f"{k}={v!r}" for k, v in sets)
            t.refused.append((sets[0][0], raws[sets[0][0]], f"{keys} set {field} to different values; "
                              "nanodapo has one knob for both"))
            continue
        t.fields[field] = (sets[0][1], sets[0][0])
    if verl_defaults:
        values = {**(base or {}), **{f: v for f, (v, _) in t.fields.items()}}
        for field, (default, key) in VERL_DEFAULTS.items():
            if field not in t.fields:
                value = default.fn(values) if isinstance(default, Derived) else default
                values[field] = value
                t.defaults[field] = (value, key)
    return t


def verl_key_like(arg: str) -> bool:
    """Is a command-line word a verl override (a.b.c=v, +a.b=v, --a.b=v)?"""
    key, eq, _ = arg.strip().partition("=")
    return bool(eq) and bool(re.fullmatch(r"(--|\+\+?)?[A-Za-z_][\w]*(\.[\w]+)+", key))


# -----------------------------------------------------------------------------
# README's table

def markdown_table() -> str:
    """README's "Coming from verl" tables, generated from VERL_KEYS: translated keys, no-ops, refused keys."""
    def esc(s):
        return s.replace("|", "\\|")
    out = ["| verl key | nanodapo `Config` key | note |", "|---|---|---|"]
    for key, rule in VERL_KEYS.items():
        if rule.kind == "set":
            out.append(f"| `{key}` | {', '.join(f'`{f}`' for f in rule.fields)} | {esc(rule.note)} |")
    out += ["", "Accepted, changing nothing here, and reported once:", "",
            "| verl key | why |", "|---|---|"]
    out += [f"| `{key}` | {esc(rule.note)} |" for key, rule in VERL_KEYS.items() if rule.kind == "no-op"]
    out += ["", "Refused, with the reason and the nearest nanodapo knob:", "",
            "| verl key | why | nanodapo |", "|---|---|---|"]
    out += [f"| `{key}` | {esc(rule.note)} | {f'`{rule.knob}`' if rule.knob else ''} |"
            for key, rule in VERL_KEYS.items() if rule.kind == "refused"]
    out += ["", "A whole verl run takes verl's defaults where nanodapo's differ:", "",
            "| nanodapo `Config` key | verl's default | verl key |", "|---|---|---|"]
    home = os.path.expanduser("~")
    for field, (value, key) in VERL_DEFAULTS.items():
        shown = value.shown if isinstance(value, Derived) else repr(value).replace(home, "~")
        out.append(f"| `{field}` | {esc(shown)} | `{key}` |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
