"""
The dry run and the memory planner: `python train_dapo.py CONFIG --dry_run` checks the config, prints the
batch arithmetic and the per-GPU bytes of the run from its Config and the model's shape, for either rollout
engine (the built-in torch engine or vLLM), before any GPU is touched. memory_plan computes the terms,
format_memory_plan prints them side by side for several GPU sizes; train_dapo.py also asks memory_plan for
gradient_checkpointing="auto".
"""
import dataclasses
import math
import os

import data
import parallel
import rollout
from config import ConfigError, check_config, ref_offload
from hf import KNOWN_CONFIGS, load_config
from model import ModelConfig

GiB = 2**30
# term -> (phase, label). resident: all run long; training / generation: one at a time; step: the optimizer
# step, with the gradients, where optimizer_offload brings the AdamW states in for it
MEMORY_TERMS = {
    "params": ("resident", "fp32 params (FSDP/TP shard)"),
    "optimizer": ("resident", "AdamW exp_avg + exp_avg_sq (shard)"),
    "ref_params": ("resident", "reference model fp32 params (shard)"),
    "engine_weights": ("resident", "rollout engine's full weight copy"),
    "runtime": ("resident", "CUDA context, NCCL, allocator slack"),
    "grads": ("training", "fp32 grads (shard)"),
    "working": ("training", "unsharded compute-dtype weights"),
    "activations": ("training", "activations of one micro-batch"),
    "a2a_buffers": ("training", "EP all-to-all send + receive rows"),
    "logprob_buffer": ("training", "fp32 logits of one logprob_chunk (+ kept bf16 logits)"),
    "kv_cache": ("generation", "KV cache of the built-in engine"),
    "vllm_asleep": ("resident", "vLLM asleep (graph pool, allocator)"),
    "vllm_awake": ("generation", "vLLM awake: weights + KV pool"),
    "sync_bucket": ("generation", "weight push: a bucket + one full param"),
}
PHASES = ("resident", "training", "generation", "step")


def memory_plan(cfg, model_cfg, world_size: int, gpu_gib: float, runtime_gib: float = 3.0,
                engine: str = "torch") -> dict:
    """Estimate per-GPU memory of a run of train_dapo.train(cfg) (cfg: a Config, model_cfg: a ModelConfig)
    on world_size GPUs of gpu_gib GiB -> {"gib": {term: GiB}, "phase": {term: phase}, "host_gib",
    "training_gib", "generation_gib", "peak_gib", "verdict", "largest", "knob", "notes",
    "gradient_checkpointing", ...}; peak = resident + max(training, generation). README.md "The memory plan"
    states each term's formula. A bad mesh raises ValueError. gradient_checkpointing="auto": the fewest
    blocks (the first N) for which the peak is within 85% of the GPU (headroom for what the plan does not
    see), at most all but the last (its recompute follows its forward). Where the activations or the
    log-prob buffer are the largest term of a peak that does not fit, the knob comes with a value that fits,
    found by planning (_fitting_knob)."""
    return _plan(cfg, model_cfg, world_size, gpu_gib, runtime_gib, engine, advise=True)


def _plan(cfg, m, world_size: int, gpu_gib: float, runtime_gib: float, engine: str, advise: bool) -> dict:
    """memory_plan; advise=False leaves out the advice that plans the run again (the knob, the notes on
    faster choices): what those plans, and "auto"'s, are made with, so that none recurses and each is cheap."""
    L, asked = m.num_hidden_layers, cfg
    if cfg.gradient_checkpointing == "auto":
        cfg = _auto_checkpointing(cfg, m, world_size, gpu_gib, runtime_gib, engine)
    tp, sp, ep = cfg.tp_size, cfg.sp_size, cfg.ep_size
    dp = parallel.check_mesh(world_size, tp, sp, m.num_attention_heads, m.num_key_value_heads, ep_size=ep,
                             num_experts=m.num_experts)
    fsdp = dp * sp
    w = 4 if cfg.dtype == "float32" else 2
    P = m.num_params()
    h, hd, E, k = m.hidden_size, m.head_dim, m.num_experts, m.num_experts_per_tok
    q, kv = m.num_attention_heads * hd, m.num_key_value_heads * hd
    n_moe = sum(map(m.is_moe_layer, range(L)))
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if m.attention_bias else 0)  # split by TP
    norms = 2 * h + (2 * hd if m.qk_norm else 0)
    mlp = 3 * h * m.intermediate_size  # a dense layer's, split by TP
    experts, router = E * 3 * h * m.moe_intermediate_size, E * h  # a MoE layer's, replicated over TP
    by_tp = L * attn + (L - n_moe) * mlp
    root = P - L * (attn + norms) - (L - n_moe) * mlp - n_moe * (experts + router)  # embedding, lm_head, norm
    # every GPU run is FSDP2 (one GPU: a mesh of one); experts: 1/ep of each stack per EP rank, FSDP over
    # fsdp / ep: 1/fsdp a GPU, as without EP
    per_gpu = by_tp / (fsdp * tp) + (P - by_tp) / fsdp  # params held by one GPU
    state, host = _model_state(cfg, per_gpu)
    gib = {k: 0.0 if k in host else v / GiB for k, v in state.items()}
    host_gib = sum(host.values()) / GiB
    gib.update(engine_weights=w * P / GiB, runtime=runtime_gib)
    block_params = []  # one GPU's share of a block's weights, for each kind of block the model has
    if n_moe < L:
        block_params.append(attn / tp + norms + mlp / tp)  # dense
    if n_moe > 0:
        block_params.append(attn / tp + norms + router + experts / ep)  # MoE
    if fsdp == 1:  # a mesh of one keeps every weight gathered through a mini-batch (accumulate_grads)
        gib["working"] = w * (per_gpu + max(block_params)) / GiB
    else:
        gib["working"] = 2 * w * (root + max(block_params)) / GiB
    seq = cfg.max_prompt_length + cfg.max_response_length
    tokens = (cfg.ppo_max_token_len_per_gpu * sp if cfg.use_dynamic_bsz
              else cfg.ppo_micro_batch_size_per_gpu * seq)
    local = math.ceil(tokens / sp)  # this GPU's share under sequence parallelism
    per_token = [block_activation_bytes(m, i, tp, compiled=cfg.compile is not False) for i in range(L)]
    scale = local * w / 2  # bytes counted for bf16 above; w / 2 scales them
    ckpt = cfg.gradient_checkpointing
    n_ckpt = L if ckpt is True else int(ckpt)  # the first n_ckpt blocks keep only their input
    # backward runs last block first: the others' activations are gone before the first recompute
    acts = local * h * w * n_ckpt + max(sum(per_token[n_ckpt:]), max(per_token[:n_ckpt], default=0)) * scale
    gib["activations"] = acts / GiB
    gib["a2a_buffers"] = 2 * local * k * h * w / GiB if ep > 1 else 0.0
    gib["logprob_buffer"] = _logprob_buffer_bytes(cfg, m, local, n_ckpt) / GiB
    rows = max(cfg.max_num_seqs, cfg.n)  # built-in engine
    kv_token = L * 2 * m.num_key_value_heads * hd * w  # bytes per token: k and v of every layer
    gib["kv_cache"] = rows * rollout.cache_positions(seq) * kv_token / GiB
    vllm = engine == "vllm" and not cfg.rollout_gpus  # asynchronous: the engines live on the generator GPUs
    gib["vllm_asleep"] = 1.0 if vllm and cfg.free_cache_engine else 0.0
    gib["vllm_awake"], vllm_kv_gib, vllm_note = 0.0, 0.0, None
    if vllm:
        gib["vllm_awake"], vllm_kv_gib, vllm_note = _vllm_awake(cfg, m, gpu_gib, w, seq, kv_token)
    largest = max(m.vocab_size * h, 2 * m.moe_intermediate_size * h * E)  # gathered whole by the push
    gib["sync_bucket"] = (min(cfg.weight_sync_bucket_mb * 2**20, w * P) + w * largest) / GiB if vllm else 0.0
    generator_gib = gib["engine_weights"] + gib["kv_cache"] + runtime_gib
    if vllm or cfg.rollout_gpus:  # vLLM's pool replaces them; asynchronous: they live on the generator GPUs
        gib["engine_weights"] = gib["kv_cache"] = 0.0

    phase = {k: MEMORY_TERMS[k][0] for k in gib}
    if not cfg.free_cache_engine:  # the engine stays awake through training
        phase["vllm_awake"] = phase["kv_cache"] = "resident"
    if cfg.optimizer_offload and not cfg.param_offload:
        gib["optimizer"], phase["optimizer"] = state["optimizer"] / GiB, "step"
    total = {p: sum(v for k, v in gib.items() if phase[k] == p) for p in PHASES}
    total["step"] += gib["grads"]  # the step reads the gradients
    peak_phase = max(("training", "generation", "step"), key=total.get)  # ties: the first
    peak = total["resident"] + total[peak_phase]
    fits = peak <= gpu_gib and (not vllm or vllm_kv_gib > 0)
    largest = max((k for k in gib if phase[k] in ("resident", peak_phase) and k != "runtime"), key=gib.get)

    notes = _generators_note(cfg, world_size, engine, generator_gib) if cfg.rollout_gpus else []
    if advise:
        notes += _faster_choices(asked, m, world_size, gpu_gib, runtime_gib, engine)
    if vllm:
        notes.append(vllm_note)
        if vllm_kv_gib <= 0:
            largest = "vllm_awake"
    notes.append(_model_note(n_moe, E, ep, gpu_gib, P))
    knob = None
    if not fits and advise:  # where activations are too large, a value of the knob that fits, found by planning
        knob = (_fitting_knob(largest, asked, m, world_size, gpu_gib, runtime_gib, engine, dp, n_moe > 0)
                if largest in ("activations", "logprob_buffer") else _memory_knob(largest, cfg, n_moe > 0))
    return {"world_size": world_size, "dp": dp, "sp": sp, "tp": tp, "ep": ep, "gpu_gib": gpu_gib,
            "num_params": P, "num_active_params": m.num_active_params(), "engine": engine,
            "tokens_per_micro_batch": tokens, "kv_rows": rows, "gib": gib, "phase": phase,
            "host_gib": host_gib, "resident_gib": total["resident"], "training_gib": total["training"],
            "generation_gib": total["generation"], "step_gib": total["step"], "peak_gib": peak,
            "peak_phase": peak_phase,
            "verdict": "fits" if fits else "does not fit", "largest": largest,
            "knob": knob, "notes": notes,
            "gradient_checkpointing": cfg.gradient_checkpointing}


def _auto_checkpointing(cfg, m, world_size: int, gpu_gib: float, runtime_gib: float, engine: str):
    """gradient_checkpointing="auto" resolved: cfg with the fewest blocks (the first N) checkpointed for which
    the peak is within 85% of the GPU, at most all but the last (its recompute follows its forward)."""
    L = m.num_hidden_layers

    def fits_with(n_blocks):
        with_n = dataclasses.replace(cfg, gradient_checkpointing=n_blocks)
        return (_plan(with_n, m, world_size, gpu_gib, runtime_gib, engine, advise=False)["peak_gib"]
                <= 0.85 * gpu_gib)
    n = next((n for n in range(L - 1) if fits_with(n)), L - 1)
    return dataclasses.replace(cfg, gradient_checkpointing=n or False)


def _model_state(cfg, per_gpu: float) -> tuple[dict, dict]:
    """Bytes of the fp32 parameters, gradients, AdamW states and reference weights one GPU holds (per_gpu:
    its parameters), and the part of them the offload knobs keep on the host instead -> (state, host)."""
    use_ref = cfg.use_kl_loss or cfg.use_kl_in_reward
    state = {"params": 4 * per_gpu, "grads": 4 * per_gpu, "optimizer": 8 * per_gpu,
             "ref_params": 4 * per_gpu if use_ref else 0}
    if cfg.param_offload:  # FSDP2's CPU offload: all of it on the host
        host = {k: v for k, v in state.items() if k != "ref_params"}
    elif cfg.optimizer_offload:  # the AdamW states on the host, on the GPU for the step
        host = {"optimizer": state["optimizer"]}
    else:
        host = {}
    if ref_offload(cfg):  # the reference model's shards: ref_param_offload, else as param_offload
        host["ref_params"] = state["ref_params"]
    return state, host


def _faster_choices(cfg, m, world_size: int, gpu_gib: float, runtime_gib: float,
                    engine: str) -> list[str]:
    """memory_plan's notes on the faster choices cfg did not make, each planned alike (the same run with one
    knob changed; "auto" checkpointing planned for it): the engine kept awake, the AdamW step on the GPU."""
    choices = []
    if cfg.free_cache_engine and not cfg.rollout_gpus:
        choices.append(("free_cache_engine=False (the engine stays awake: no wake or sleep a step)",
                        {"free_cache_engine": False}))
    if cfg.param_offload:  # FSDP2's CPU offload runs the AdamW step on the host
        if cfg.optimizer_offload:
            kept = "the AdamW states still on the host between optimizer steps"
        else:
            kept = "every state on the GPU"
        choices.append(("param_offload=False (params and grads on the GPU and the optimizer step there, "
                        f"{kept})", {"param_offload": False}))
    notes = []
    for choice, change in choices:
        p = _plan(dataclasses.replace(cfg, **change), m, world_size, gpu_gib, runtime_gib, engine, advise=False)
        notes.append(f"{choice} {p['verdict']}: peak {p['peak_gib']:.1f} of {gpu_gib:g} GiB, "
                     f"gradient_checkpointing {p['gradient_checkpointing']}")
    return notes


def _logprob_buffer_bytes(cfg, m, local: int, n_ckpt: int) -> int:
    """The log-prob head on one GPU's local tokens of a micro-batch: one chunk's fp32 logits, softmax and
    their gradient, plus, compiled without checkpointing, the bf16 logits it keeps of every token it
    computes. It computes response tokens only: at most max_response_length a sequence (a token budget's may
    all be)."""
    head = local
    if not cfg.use_dynamic_bsz:
        head = min(local, cfg.ppo_micro_batch_size_per_gpu * cfg.max_response_length)
    nbytes = min(cfg.logprob_chunk, head) * m.vocab_size * 4 * 3
    if n_ckpt == 0 and cfg.compile is not False:
        nbytes += head * m.vocab_size * 2
    return nbytes


def _vllm_awake(cfg, m, gpu_gib: float, w: int, seq: int, kv_token: int) -> tuple[float, float, str]:
    """What a colocated vLLM engine takes on each of its GPUs while awake, in GiB: its weights' share, its KV
    pool (rollout.vllm_kv_cache_bytes, or the user's kv_cache_memory_bytes) and ~1 GiB of activations; or
    gpu_memory_utilization x GPU where vLLM sizes the pool itself. -> (awake GiB, the engine's KV room over
    its gen_tp GPUs in GiB (<= 0: the weights leave none), the plan's note). kv_token: KV bytes a token."""
    P = m.num_params()
    kv_pool = rollout.vllm_kv_cache_bytes(
        m, max_model_len=seq, max_num_seqs=cfg.max_num_seqs, gen_tp=cfg.gen_tp,
        gpu_memory_utilization=cfg.gpu_memory_utilization, gpu_bytes=gpu_gib * GiB, dtype_bytes=w)
    kv_pool = cfg.vllm_kwargs.get("kv_cache_memory_bytes", kv_pool)  # the engine takes the user's size too
    if kv_pool is not None:
        awake = (w * P / cfg.gen_tp + kv_pool + rollout.VLLM_RESERVE_BYTES) / GiB
        note = (f"vLLM engine of TP {cfg.gen_tp}: a KV pool of {kv_pool / GiB:.1f} GiB a GPU, room for "
                f"max_num_seqs={cfg.max_num_seqs} sequences of max length ({seq} tokens), less than "
                f"gpu_memory_utilization={cfg.gpu_memory_utilization:g} would give")
        return awake, kv_pool * cfg.gen_tp / GiB, note
    # vLLM fills its share of the GPU: KV room = that less the bf16 weights and ~1 GiB of activations a GPU
    kv_gib = cfg.gpu_memory_utilization * gpu_gib * cfg.gen_tp - 2 * P / GiB - cfg.gen_tp
    seqs = kv_gib * GiB / (kv_token * seq)
    short = "" if seqs >= cfg.n else f": fewer than n={cfg.n}, raise gpu_memory_utilization or gen_tp"
    note = (f"vLLM engine of TP {cfg.gen_tp}: {cfg.gpu_memory_utilization:g} x {gpu_gib:g} GiB x "
            f"{cfg.gen_tp} GPUs - weights {2 * P / GiB:.1f} GiB leaves ~{kv_gib:.0f} GiB of "
            f"KV cache = {seqs:.0f} sequences of max length ({seq} tokens) in flight{short}")
    return cfg.gpu_memory_utilization * gpu_gib, kv_gib, note


def check_host_memory(cfg, model_cfg, world_size: int, ranks_on_node: int, host_gib: float, engine: str):
    """param_offload keeps each rank's fp32 weights, gradients and AdamW states in host memory,
    optimizer_offload its AdamW states, ref_param_offload the reference model's weights: refuse, before
    anything is loaded, a run whose ranks on one node would need more than 90% of it (the OOM killer would end it mid-step; the rest is the processes' own)."""
    per_rank = memory_plan(cfg, model_cfg, world_size, 80.0, engine=engine)["host_gib"]
    if per_rank * ranks_on_node > 0.9 * host_gib:
        if cfg.param_offload:
            what = "param_offload: the offloaded fp32 weights, gradients and AdamW states"
            alone = ", optimizer_offload alone (only the AdamW states on the host)"
        elif cfg.optimizer_offload:
            what, alone = "optimizer_offload: the offloaded AdamW states", ""
        else:
            what, alone = "ref_param_offload: the reference model's offloaded fp32 weights", ""
        raise ConfigError(
            f"{what} take {per_rank:.1f} GiB of host memory per GPU, {per_rank * ranks_on_node:.1f} GiB "
            f"for the {ranks_on_node} GPU(s) on this node, which has {host_gib:.0f} GiB (at most 90% of it "
            f"can go to them); shard them over more GPUs (n_gpus_per_node, nnodes){alone} or train a smaller "
            "model")


def block_activation_bytes(m, layer: int, tp: int = 1, compiled: bool = True) -> float:
    """What decoder block `layer` keeps for backward, per token, in bf16 bytes (README "The memory plan";
    bench/activations.py measures both modes). Eager: 2 RMSNorms x (fp32 input 4h + output 2h), the q/k/v and
    gate/up inputs 2h + 2h, attention's q, k, v (repeated to all heads) and output 8q, the MLP's gate, up,
    silu(gate) and product 8i. Compiled (torch.compile'd blocks, the default on CUDA): Inductor fuses each
    RMSNorm and SiLU(gate) x up into one kernel that saves less: 8h + 8q + 6i. With q/k norms 6q + 6kv more
    (measured eager only). A MoE layer's MLP instead (not measured): top-k rows through experts of width I,
    8kI, the sorted rows, outputs and those back in token order, 6kh, and the fp32 router logits and
    probabilities, 8E. TP splits the q, kv and i parts."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    split = 8 * q + (6 * q + 6 * kv if m.qk_norm else 0)
    norms_and_inputs = 8 * h if compiled else 16 * h
    if m.is_moe_layer(layer):
        k, E = m.num_experts_per_tok, m.num_experts
        return norms_and_inputs + split / tp + 8 * k * m.moe_intermediate_size + 6 * k * h + 8 * E
    mlp = 6 * m.intermediate_size if compiled else 8 * m.intermediate_size
    return norms_and_inputs + (split + mlp) / tp


def _generators_note(cfg, world_size: int, engine: str, generator_gib: float) -> list[str]:
    """memory_plan's note on asynchronous rollout's generator GPUs, which the plan's terms do not cover."""
    if engine == "vllm":
        return [f"{world_size} trainer GPUs; the {cfg.rollout_gpus} generator GPUs hold "
                f"{cfg.rollout_gpus // cfg.gen_tp} vLLM engine(s) of TP {cfg.gen_tp}, awake throughout: "
                f"gpu_memory_utilization={cfg.gpu_memory_utilization:g} of each (nothing else runs there: "
                "raise it to ~0.9)"]
    return [f"{world_size} trainer GPUs; each of the {cfg.rollout_gpus} generator GPUs holds the built-in "
            f"engine: {generator_gib:.2f} GiB (weights, KV cache, runtime)"]


def _model_note(n_moe: int, E: int, ep: int, gpu_gib: float, P: int) -> str:
    """memory_plan's note on the model's kind (n_moe MoE layers of E experts, ep_size ep, P params): how a MoE
    model's experts are laid out over the GPUs, or for a dense model the KV room a vLLM engine would have."""
    if n_moe and ep > 1:
        return (f"EP {ep}: each GPU computes {E // ep} of {E} experts a MoE layer; all-to-all rows "
                "assume balanced routing (a skewed router sends more to some GPUs)")
    if n_moe:
        return (f"MoE without EP: FSDP gathers all {E} experts of a layer on every GPU "
                "(working weights); ep_size splits them")
    room = ", ".join(f"TP {t}: {0.8 * gpu_gib * t - 2 * P / GiB:.0f}" for t in (1, 2, 4, 8))
    return (f"with the vLLM engine (rollout_engine='vllm'), GiB left for KV per engine at "
            f"gpu_memory_utilization 0.8 of {gpu_gib:g} GiB: {room}")


def _memory_knob(term: str, cfg, moe: bool = False) -> str:
    """What to turn when `term` is the largest part of a peak that does not fit."""
    budget = "ppo_max_token_len_per_gpu" if cfg.use_dynamic_bsz else "ppo_micro_batch_size_per_gpu"
    if term == "ref_params" and not ref_offload(cfg):
        return ("ref_param_offload=True (the reference model's weights on the host, the actor's stay), or more "
                "GPUs (smaller shards)")
    if term in ("params", "grads", "optimizer", "ref_params") and not cfg.optimizer_offload:
        return ("optimizer_offload=True (the AdamW states on the host between optimizer steps), or more GPUs "
                "(smaller shards)")
    if term in ("params", "grads", "optimizer", "ref_params"):
        return ("param_offload=True (weights, gradients and the optimizer step on the host: much slower), or "
                "more GPUs (smaller shards)")
    if term == "working" and moe:
        return "ep_size (splits each MoE layer's experts over ep_size GPUs)"
    if term == "working":
        return "tp_size (splits the unsharded block weights), or more GPUs"
    if term == "a2a_buffers":
        return f"{budget} (rows exchanged per MoE layer), or sp_size"
    if term == "vllm_awake":
        return ("gen_tp (vLLM's bf16 weights, 2 bytes x params / gen_tp per GPU, must fit in "
                "gpu_memory_utilization x GPU with room for the KV cache), or gpu_memory_utilization")
    if term == "engine_weights":
        return ("rollout_engine='vllm' with gen_tp > 1 (each engine splits the weights over gen_tp GPUs; the "
                "built-in engine holds a full copy on every GPU)")
    if term == "activations" and cfg.gradient_checkpointing is not True:
        return "gradient_checkpointing=True"
    if term == "activations":
        return (f"{budget}, or sp_size (sequence parallelism splits each micro-batch's tokens over "
                "sp_size GPUs)")
    if term == "logprob_buffer":
        return "logprob_chunk"
    if cfg.max_num_seqs > cfg.n:  # kv_cache
        return f"max_num_seqs (now {cfg.max_num_seqs}; a multiple of n={cfg.n})"
    return (f"max_response_length (max_num_seqs is at its floor, one group of n={cfg.n} rows), or "
            "rollout_engine='vllm' (its paged KV cache grows with the sequences, within "
            "gpu_memory_utilization)")


def _fitting_knob(term: str, cfg, m, world_size: int, gpu_gib: float, runtime_gib: float, engine: str,
                  dp: int, moe: bool) -> str:
    """What to turn, and to what, when `term` ("activations" or "logprob_buffer") is the largest part of a
    peak that does not fit: every candidate is planned (cfg as asked, "auto" checkpointing planned for it),
    so the value named fits this GPU. In order: checkpointing every block; for the log-prob buffer the
    largest smaller logprob_chunk that fits; else the largest micro-batch that fits, as the run counts it
    (ppo_micro_batch_size_per_gpu: a divisor of the per-rank mini-batch, as check_config asks; the token
    budget ppo_max_token_len_per_gpu: a multiple of 1024, or one sequence, the least check_config takes),
    with checkpointing where the budget alone does not fit. Where not even one sequence a micro-batch with
    every block checkpointed fits, sequence parallelism or more GPUs; or, if the activations are then no
    longer the largest term, what turns that one (_memory_knob). Each search is a bisection: memory grows
    with the micro-batch, the chunk and the budget."""
    def fits(**change):
        p = _plan(dataclasses.replace(cfg, **change), m, world_size, gpu_gib, runtime_gib, engine, advise=False)
        return p["verdict"] == "fits"
    ckpt = cfg.gradient_checkpointing
    if ckpt is not True and fits(gradient_checkpointing=True):
        return "gradient_checkpointing=True"
    if term == "logprob_buffer":
        chunk = _largest_fitting(lambda c: fits(logprob_chunk=c), range(1, cfg.logprob_chunk))
        if chunk is not None:
            return f"logprob_chunk={chunk} (tokens a chunk of the fp32 log-prob computation)"
    sp, seq = cfg.sp_size, cfg.max_prompt_length + cfg.max_response_length
    one_seq = math.ceil(seq / sp)  # the least token budget: one sequence over the SP group
    per_rank = cfg.ppo_mini_batch_size * cfg.n // dp
    if cfg.use_dynamic_bsz:
        now = cfg.ppo_max_token_len_per_gpu
    else:
        now = math.ceil(cfg.ppo_micro_batch_size_per_gpu * seq / sp)  # no budget fits that does not fit now
    budgets = [one_seq] + list(range(1024 * (one_seq // 1024 + 1), now, 1024))
    sizes = [k for k in range(1, cfg.ppo_micro_batch_size_per_gpu) if per_rank % k == 0]

    def budget(**with_ckpt):
        """The largest micro-batch that fits, as the knob to turn, or None."""
        t = _largest_fitting(lambda t: fits(**with_ckpt, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=t),
                             budgets)
        tokens = None if t is None else f"ppo_max_token_len_per_gpu={t}"
        if t is not None and cfg.log_prob_max_token_len_per_gpu * sp < seq:  # check_config asks it of both
            tokens += f" and log_prob_max_token_len_per_gpu={one_seq}"
        if cfg.use_dynamic_bsz:
            over = f" over sp_size={sp} GPUs, {one_seq}" if sp > 1 else ""
            return tokens and (f"{tokens} (the largest that fits: a multiple of 1024 tokens, or the least, one "
                               f"sequence of max_prompt_length + max_response_length = {seq}{over})")
        k = _largest_fitting(lambda k: fits(**with_ckpt, ppo_micro_batch_size_per_gpu=k), sizes)
        if k is None:
            return None
        alternative = f"; or use_dynamic_bsz=True with {tokens}" if tokens else ""
        return (f"ppo_micro_batch_size_per_gpu={k} (the largest divisor of the per-rank mini-batch of "
                f"{per_rank} trajectories that fits{alternative})")
    knob = budget()
    if knob is None and ckpt is not True:
        knob = budget(gradient_checkpointing=True)
        knob = knob and f"gradient_checkpointing=True with {knob}"
    if knob is not None:
        return knob
    least = {"gradient_checkpointing": True}
    least.update({"ppo_max_token_len_per_gpu": one_seq} if cfg.use_dynamic_bsz else
                 {"ppo_micro_batch_size_per_gpu": 1})
    smallest = dataclasses.replace(cfg, **least)
    p = _plan(smallest, m, world_size, gpu_gib, runtime_gib, engine, advise=False)
    at_least = ", ".join(f"{k}={v}" for k, v in least.items())
    if p["largest"] in ("activations", "logprob_buffer"):
        return (f"sp_size (sequence parallelism splits each micro-batch's tokens over sp_size GPUs), or more "
                f"GPUs: even one sequence a micro-batch ({at_least}) does not fit")
    return (f"{_memory_knob(p['largest'], smallest, moe)}: even one sequence a micro-batch ({at_least}) does "
            f"not fit, and then the largest term is the {MEMORY_TERMS[p['largest']][1]}")


def _largest_fitting(fits, values):
    """The largest of `values` (ascending, fits true of a prefix of them) for which fits(value) holds, or
    None where not even the first does: a bisection, a few plans where a scan would take thousands."""
    lo, hi = 0, len(values)  # values[:lo] fit, values[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            lo = mid + 1
        else:
            hi = mid
    return values[lo - 1] if lo else None


def format_memory_plan(plans: list[dict]) -> str:
    """A text table of plans from memory_plan, one column each (e.g. the same config at gpu_gib 80 and 141):
    every term, the phase totals, the peak, the verdict, and the knob to turn where a plan does not fit."""
    p0 = plans[0]
    head = [f"{p['gpu_gib']:g} GiB" for p in plans]
    width = max(14, *(len(x) + 2 for x in head))

    def cols(vals):
        return "".join(f"{v:>{width}}" for v in vals)
    sp = f" x sp {p0['sp']}" if p0["sp"] > 1 else ""
    per_gpu = f" ({math.ceil(p0['tokens_per_micro_batch'] / p0['sp'])} per GPU)" if p0["sp"] > 1 else ""
    active = p0["num_active_params"] < p0["num_params"]
    active = f" ({p0['num_active_params'] / 1e9:.2f}B active a token)" if active else ""
    ep = f", ep {p0['ep']}" if p0["ep"] > 1 else ""
    out = [f"memory per GPU (GiB): {p0['num_params'] / 1e9:.2f}B params{active}, world {p0['world_size']} = "
           f"dp {p0['dp']}{sp} x tp {p0['tp']}{ep}, {p0['tokens_per_micro_batch']} tokens per update "
           f"micro-batch{per_gpu}, KV cache {p0['kv_rows']} rows",
           f"  {'':11}{'':38}" + cols(head)]
    for phase in PHASES:
        for i, (term, (_, label)) in enumerate((t, v) for t, v in MEMORY_TERMS.items()
                                               if p0["phase"][t] == phase):
            out.append(f"  {phase if i == 0 else '':11}{label:38}"
                       + cols(f"{p['gib'][term]:.2f}" for p in plans))
    for key, label in (("host_gib", "host (offloaded states), per GPU"), ("resident_gib", "resident"),
                       ("training_gib", "training phase"), ("generation_gib", "generation phase"),
                       ("step_gib", "optimizer step phase (+ grads)"),
                       ("peak_gib", "peak = resident + max(phases)")):
        out.append(f"  {'':11}{label:38}" + cols(f"{p[key]:.2f}" for p in plans))
    out.append(f"  {'':11}{'gradient_checkpointing':38}"
               + cols(str(p["gradient_checkpointing"]) for p in plans))
    out.append(f"  {'':11}{'verdict':38}" + cols(p["verdict"] for p in plans))
    for p in plans:
        if p["knob"]:
            out.append(f"  {p['gpu_gib']:g} GiB: does not fit by {p['peak_gib'] - p['gpu_gib']:.1f} GiB; "
                       f"largest term: {MEMORY_TERMS[p['largest']][1]} ({p['gib'][p['largest']]:.1f} GiB); "
                       f"turn: {p['knob']}")
    out += [f"  note: {n}" for n in dict.fromkeys(n for p in plans for n in p["notes"])]  # each note once
    return "\n".join(out)


# -----------------------------------------------------------------------------
# the dry run: batch arithmetic and the memory plan, before any GPU is touched

def optimizer_steps_per_step(cfg) -> int:
    """ppo_epochs passes over train_batch_size groups, one optimizer step per ppo_mini_batch_size groups."""
    return cfg.ppo_epochs * cfg.train_batch_size // cfg.ppo_mini_batch_size


def batch_arithmetic(cfg, world_size: int, num_train_prompts: int | None = None) -> dict:
    """What one step generates and trains on, per rank and in all
    (README "Batch vocabulary" in ALGORITHM.md)."""
    B, M, G = cfg.train_batch_size, cfg.ppo_mini_batch_size, cfg.n
    dp = world_size // (cfg.tp_size * cfg.sp_size)
    a = {"world_size": world_size, "prompts_per_gen_batch": cfg.gen_batch_size,
         "trajectories_per_gen_batch": cfg.gen_batch_size * G, "trajectories_per_step": B * G,
         "optimizer_steps_per_step": optimizer_steps_per_step(cfg), "mini_batch_trajectories": M * G,
         "per_rank_mini_batch": M * G // dp}
    if cfg.use_dynamic_bsz:
        a["accumulation_steps"] = "token budget"
    else:
        a["accumulation_steps"] = a["per_rank_mini_batch"] // cfg.ppo_micro_batch_size_per_gpu
    if num_train_prompts is not None:
        a["train_prompts"] = num_train_prompts
        a["steps_per_epoch (if no group is filtered)"] = math.ceil(num_train_prompts / B)
    return a


def dry_run(cfg):
    """Check the config, print the batch arithmetic and a per-GPU memory plan; touches no GPU and needs
    neither the model nor the data to be present (a known model shape and a note stand in)."""
    # torchrun's world size, else the config's
    world_size = int(os.environ.get("WORLD_SIZE", cfg.nnodes * cfg.n_gpus_per_node))
    model_present = os.path.isfile(os.path.join(cfg.model_path, "config.json"))
    files_present = all(os.path.isfile(f) for f in cfg.train_files + cfg.val_files)
    check_config(cfg, world_size, check_files=model_present and files_present)
    if model_present:
        model_cfg = load_config(cfg.model_path)
    else:
        name = os.path.basename(os.path.normpath(os.path.expanduser(cfg.model_path))).lower()
        if name not in KNOWN_CONFIGS:
            raise ConfigError(f"model_path={cfg.model_path!r} has no config.json and {name!r} is not a known "
                              f"shape ({', '.join(sorted(KNOWN_CONFIGS))}); "
                              "point model_path at the model directory")
        model_cfg = ModelConfig.from_hf(KNOWN_CONFIGS[name])
        print(f"note: {cfg.model_path} not found; planning with the published shape of {name}")
    n_train = None
    if files_present:
        n_train = data.check_parquet_schema(cfg.train_files, cfg.prompt_key)
    else:
        print("note: data files not found; skipping their checks and the epoch arithmetic")
    print(f"config OK ({model_cfg.architecture}, {model_cfg.num_params() / 1e9:.2f} B parameters, "
          f"world size {world_size})")
    trainer_ranks = world_size - cfg.rollout_gpus
    for k, v in batch_arithmetic(cfg, trainer_ranks, n_train).items():
        print(f"  {k}: {v}")
    # what "auto" picks on a CUDA machine with this one's packages; "vllm" is planned even where it is not
    # installed
    if cfg.rollout_engine == "vllm":
        engine = "vllm"
    else:
        engine = rollout.resolve_engine(cfg.rollout_engine, "cuda")
    print(f"rollout engine planned for: {engine}")
    plans = [memory_plan(cfg, model_cfg, trainer_ranks, gpu_gib, engine=engine) for gpu_gib in (80, 141)]
    print(format_memory_plan(plans))
