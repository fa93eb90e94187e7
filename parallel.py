"""
Devices, in one place: which accelerator (cuda / npu / cpu), its process-group backend, autocast,
RNG state, synchronize and memory stats. Nothing else in nanodapo names a device type.

And multi-device training: process groups from torchrun, a (dp, sp, tp) device mesh, tensor parallelism
(DTensor plans), Ulysses sequence parallelism, per-block torch.compile, FSDP2 sharding with bf16 compute over
fp32 master weights, and full weights gathered in buckets for the rollout engine.
"""
import contextlib
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def device_type(requested: str = "auto") -> str:
    """'auto' -> the accelerator torch sees (cuda, npu via torch_npu when installed), else cpu."""
    if requested != "auto":
        return requested
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        pass
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is not None and acc.type in BACKENDS:
        return acc.type
    return "cpu"


def get_device(requested: str = "auto") -> torch.device:
    kind = device_type(requested)
    return torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 compute over fp32 master weights on accelerators; plain fp32 on CPU."""
    if device.type == "cpu" or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def max_memory_allocated_gib(device: torch.device) -> float:
    if device.type == "cpu":
        return 0.0
    return torch.get_device_module(device.type).max_memory_allocated() / 2**30


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state()
    return state


def set_rng_state(state: dict, device: torch.device):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["device"])


# -----------------------------------------------------------------------------
# process groups and the device mesh (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; plain python = 1 rank)


@dataclass
class ParallelDims:
    """world = dp x sp x tp ranks; rank = (dp_rank * sp + sp_rank) * tp + tp_rank (TP innermost, on one node).

    dp: data-parallel replicas, the groups that see different data. The sp x tp ranks of one replica run the same
    micro-batches: TP splits the weights' heads and features, SP the tokens. FSDP shards parameters, gradients and
    optimizer states over the dp x sp ranks of the same TP index (fsdp_size) and averages gradients over them."""
    world_size: int
    rank: int
    local_rank: int
    tp: int
    device: torch.device
    sp: int = 1
    mesh: object = None  # DeviceMesh ("dp", "sp", "tp") when world_size > 1
    fsdp_mesh: object = None  # its ("dp", "sp") dimensions flattened: the ranks FSDP shards over

    @property
    def dp(self) -> int:
        return self.world_size // (self.sp * self.tp)

    @property
    def fsdp_size(self) -> int:
        return self.dp * self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.sp * self.tp)

    @property
    def sp_rank(self) -> int:
        return self.rank // self.tp % self.sp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", tp: int = 1, sp: int = 1) -> ParallelDims:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if tp < 1 or world % tp:
        raise ValueError(f"tp_size={tp} must divide the world size {world} (dp = world_size / tp_size)")
    if sp < 1 or world % (tp * sp):
        raise ValueError(f"sp_size={sp} x tp_size={tp} = {sp * tp} must divide the world size {world} "
                         "(dp = world_size / (sp_size x tp_size))")
    kind = device_type(device)
    dev = torch.device("cpu")
    if kind != "cpu":
        torch.get_device_module(kind).set_device(local_rank)
        dev = torch.device(kind, local_rank)
    mesh = fsdp_mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        if not dist.is_initialized():
            backend = BACKENDS[kind] if kind == "cpu" else f"cpu:gloo,{kind}:{BACKENDS[kind]}"
            dist.init_process_group(backend=backend)
        mesh = init_device_mesh(kind, (world // (tp * sp), sp, tp), mesh_dim_names=("dp", "sp", "tp"))
        fsdp_mesh = mesh["dp", "sp"]._flatten("fsdp")
    return ParallelDims(world, rank, local_rank, tp, dev, sp=sp, mesh=mesh, fsdp_mesh=fsdp_mesh)


def shutdown():
    if dist.is_initialized():
        dist.barrier()  # without it a rank can abort at exit while another still talks
        dist.destroy_process_group()


def all_gather_objects(obj, dims: ParallelDims) -> list:
    """Every rank's obj, in rank order (picklable Python objects; small metadata and token lists)."""
    if dims.world_size == 1:
        return [obj]
    out = [None] * dims.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_mean(values: dict, dims: ParallelDims) -> dict:
    """Mean of a dict of floats over ranks (same keys on every rank)."""
    if dims.world_size == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / dims.world_size for k, v in zip(keys, t.tolist())}


def barrier(dims: ParallelDims):
    if dims.world_size > 1:
        dist.barrier()


# -----------------------------------------------------------------------------
# tensor parallel, sequence parallel, compile and FSDP2, applied in torchtitan's order: TP, activation
# checkpointing (model flag), compile, FSDP

# q/k/v/gate/up split their output features (heads) across TP ranks, o/down their input features, so each
# block needs one all-reduce after attention and one after the MLP; norms and embeddings stay replicated.
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def apply_tp(model, tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    cfg = model.config
    if cfg.num_key_value_heads % tp_mesh.size() or cfg.num_attention_heads % tp_mesh.size():
        raise ValueError(f"tp_size={tp_mesh.size()} must divide num_attention_heads={cfg.num_attention_heads} "
                         f"and num_key_value_heads={cfg.num_key_value_heads}")
    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in model.model.layers:
        parallelize_module(block, tp_mesh, {k: style[v]() for k, v in TP_PLAN.items()})
        if cfg.qk_norm:  # Qwen3's per-head q/k norms see only this rank's heads: sum their gradients
            block.self_attn.q_norm.grad_sum_group = block.self_attn.k_norm.grad_sum_group = tp_mesh.get_group()


def apply_sp(model, sp_mesh, tp: int = 1):
    """Ulysses sequence parallelism (model.py, split_for_sp): the packed log-prob forward splits its tokens over
    sp_mesh's ranks, which all pass the same row and get the same outputs. Each rank attends with 1/sp of this
    TP rank's query heads; kv heads fewer than sp are repeated in the forward."""
    sp, heads = sp_mesh.size(), model.config.num_attention_heads
    if heads % (tp * sp):
        raise ValueError(f"num_attention_heads={heads} must be divisible by tp_size x sp_size = {tp} x {sp}: "
                         "sequence parallelism gives every rank an equal share of each TP rank's heads")
    model.sp_group = sp_mesh.get_group()


def apply_compile(model):
    """torch.compile each decoder block, in place: nn.Module.compile keeps the parameter names (HF's), where a
    torch.compile wrapper module would prefix them with _orig_mod. Blocks, not the whole model, as torchtitan: the
    blocks are alike (no layer index inside), so all share one graph and compile time is that of one block. Shapes:
    torch's default: the second token count seen recompiles once with a symbolic token count, while heads and
    features stay static. (dynamic=True would make those symbolic too.) All blocks of one forward see the same
    shapes, so an activation-checkpoint recompute finds the graph its forward used."""
    for block in model.model.layers:
        block.compile()


def apply_fsdp(model, fsdp_mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, offload: bool = False):
    """fully_shard each decoder block, then the root (embeddings, final norm, output layer). Parameters stay
    fp32 (the master copy, sharded, as are AdamW's states); compute runs in param_dtype, gradients reduce in fp32.

    Inputs are not cast (cast_forward_inputs=False): a block's hidden states are in param_dtype already (they come
    from the param_dtype embedding), and RoPE's cos/sin stay fp32, as model.py means them to. With the cast,
    activation checkpointing failed on 2 H200s (torch 2.11): the block's recompute in backward got fp32 cos/sin
    where its forward had bf16 ones (CheckpointError; torch 2.13 on the CPU casts in both)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    kw = dict(mesh=fsdp_mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def parallelize(model, dims: ParallelDims, param_dtype=torch.bfloat16, offload: bool = False, compile: bool = False):
    """Shard `model` for dims: TP, SP, optionally compile each block, then FSDP2 over dims.fsdp_mesh. FSDP
    averages gradients over dims.fsdp_size ranks: a rank's loss scaled by fsdp_size makes that average a sum."""
    if dims.tp > 1:
        apply_tp(model, dims.mesh["tp"])
    if dims.sp > 1:
        apply_sp(model, dims.mesh["sp"], dims.tp)
    if compile:
        apply_compile(model)
    if dims.world_size > 1:
        apply_fsdp(model, dims.fsdp_mesh, param_dtype=param_dtype, offload=offload)


def iter_full_weights(model, bucket_bytes: int = 512 * 2**20, dtype=torch.bfloat16):
    """Yield lists of (HF name, full tensor) whose sizes add up to about bucket_bytes, gathered from the
    sharded model in a fixed order. Collective: every rank must iterate to the end. Extra memory: one bucket."""
    from torch.distributed.tensor import DTensor
    bucket, size = [], 0
    for name, p in model.named_parameters():
        t = p.detach().to(dtype)  # cast the shard, then gather: the all-gather moves dtype bytes, not fp32
        t = t.full_tensor() if isinstance(t, DTensor) else t
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Global grad-norm clipping over a mix of plain tensors and DTensors on different meshes (TP-sharded,
    FSDP-sharded, 2-D), which torch's foreach version refuses. Returns the norm before clipping."""
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norms = [g.detach().float().norm() for g in grads]
    norms = [(n.full_tensor() if isinstance(n, DTensor) else n).double() for n in norms]
    total = torch.stack(norms).square().sum().sqrt().item()  # one host sync for the whole model
    if math.isfinite(total) and total > max_norm:
        for g in grads:
            g.detach().mul_(max_norm / (total + 1e-6))
    return total


def all_reduce_max(value: int, dims: ParallelDims) -> int:
    if dims.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# -----------------------------------------------------------------------------
# distributed checkpoints: out_dir/checkpoints/step_N/{dcp/, trainer_state.pt, COMPLETE, + an HF export}


def save_checkpoint(path: str, model, optimizer, trainer_state: dict, dims: ParallelDims, export=None):
    """Model and optimizer shards through torch.distributed.checkpoint (reloadable at any world size), the
    trainer state and every rank's RNG from rank 0, and export(tmp_dir) (collective, e.g. HF safetensors).
    Written to path + ".tmp" and renamed once complete, so a crash never leaves a checkpoint that looks whole."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    tmp = path + ".tmp"
    if dims.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(dims)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp"),
             no_dist=not dist.is_initialized())
    rngs = all_gather_objects(rng_state(dims.device), dims)
    if export is not None:
        export(tmp)
    if dims.is_main:
        torch.save({**trainer_state, "rng": rngs}, os.path.join(tmp, "trainer_state.pt"))
        with open(os.path.join(tmp, "COMPLETE"), "w") as f:
            f.write("ok\n")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    barrier(dims)


def complete_checkpoints(root: str) -> list[str]:
    """step_N directories under root that have their COMPLETE marker, newest first."""
    if not os.path.isdir(root):
        return []
    done = [d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()
            and os.path.isfile(os.path.join(root, d, "COMPLETE"))]
    return [os.path.join(root, d) for d in sorted(done, key=lambda d: -int(d[5:]))]


def prune_checkpoints(root: str, keep_last: int, dims: ParallelDims):
    """Delete all but the newest keep_last complete checkpoints (call only after a new one is complete)."""
    import shutil
    if dims.is_main and keep_last > 0:
        for old in complete_checkpoints(root)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(dims)


def load_checkpoint(path: str, model, optimizer, dims: ParallelDims) -> dict:
    """Load shards saved at any world size into this run's sharding; returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    rngs = trainer_state.pop("rng")
    set_rng_state(rngs[dims.rank % len(rngs)], dims.device)
    return trainer_state


# -----------------------------------------------------------------------------
# memory planning for --dry_run: per-GPU bytes from the config and the model's shape, no GPU needed

GiB = 2**30
MEMORY_TERMS = {  # term -> (phase, label). resident: all run long; training / generation: one at a time
    "params": ("resident", "fp32 params (FSDP/TP shard)"),
    "grads": ("resident", "fp32 grads (shard)"),
    "optimizer": ("resident", "AdamW exp_avg + exp_avg_sq (shard)"),
    "ref_params": ("resident", "reference model fp32 params (shard)"),
    "engine_weights": ("resident", "rollout engine's full weight copy"),
    "runtime": ("resident", "CUDA context, NCCL, allocator slack"),
    "working": ("training", "unsharded compute-dtype weights"),
    "activations": ("training", "activations of one micro-batch"),
    "logprob_buffer": ("training", "fp32 logits of one logprob_chunk"),
    "kv_cache": ("generation", "KV cache of the built-in engine"),
    "vllm_asleep": ("resident", "vLLM asleep (graph pool, allocator)"),
    "vllm_awake": ("generation", "vLLM awake: utilization x GPU"),
    "sync_bucket": ("generation", "one weight-push bucket"),
}


def memory_plan(cfg, model_cfg, world_size: int, gpu_gib: float, runtime_gib: float = 3.0,
                engine: str = "torch") -> dict:
    """Estimate per-GPU memory of a run of train_dapo.train(cfg) on world_size GPUs of gpu_gib GiB each.

    cfg: a train_dapo.Config; model_cfg: a model.ModelConfig (both read by attribute only). Returns
    {"gib": {term: GiB per GPU}, "phase": {term: resident | training | generation}, "host_gib", "training_gib",
    "generation_gib", "peak_gib", "verdict": "fits" | "does not fit", "largest", "knob", "notes", ...}.
    peak = resident + max(training, generation): the KV cache is freed (engine.sleep) before the update starts.

    The terms (P = model_cfg.num_params(); tp = cfg.tp_size, sp = cfg.sp_size,
    dp = world_size / (tp * sp) replicas, FSDP over fsdp = dp * sp ranks; w = 2 bytes, 4 for float32):
    - params 4, grads 4, AdamW 8 bytes/param, sharded by FSDP over fsdp and, for the q/k/v/o/gate/up/down weights,
      by TP; embeddings, lm_head and norms are replicated over TP. param_offload or optimizer_offload moves all
      three to the host (FSDP2 offloads them together): counted in host_gib instead. World size 1 has no FSDP:
      full fp32 copies on the GPU, and offload does not apply.
    - ref_params: a second fp32 shard (same offload) when use_kl_loss or use_kl_in_reward.
    - engine_weights: world size > 1: the built-in engine generates from its own full copy of the weights
      (w bytes/param), which train() keeps on the GPU for the whole run. World size 1: it shares the trainer's.
    - working: FSDP all-gathers units in compute dtype: the root unit (embeddings, lm_head, final norm; kept
      unsharded through forward and backward) plus one decoder block at a time, x2 for the prefetched next unit
      and the unsharded gradients. World size 1: autocast's cached compute-dtype copy of every weight, w * P.
    - activations, for this GPU's tokens of one update micro-batch: the micro-batch's tokens / sp, as sequence
      parallelism gives each of its sp ranks 1/sp of them (attention's q, k, v: all tokens, 1/sp of the heads: the
      same bytes). A micro-batch is ppo_max_token_len_per_gpu * sp tokens with use_dynamic_bsz (verl's convention:
      the budget stays per GPU), else ppo_micro_batch_size_per_gpu * (max_prompt_length + max_response_length).
      One block saves, per token, in bf16 bytes: 2 RMSNorms x (fp32 input 4h + output 2h) + the q/k/v and
      gate/up inputs 2h + 2h, flash attention's q, k and v (k, v repeated to all heads) and output 8q, the MLP's
      gate, up, silu(gate) and product 8i, and with Qwen3's q/k norms 6q + 6kv: 16h + 8q + 8i (+ 6q + 6kv),
      h = hidden, q = heads x head_dim, kv = kv_heads x head_dim, i = intermediate; the q, kv and i parts are split
      by TP, the h parts are not. Measured on an H200 (packed bf16 forward + backward, flash varlen, no
      checkpointing): 108,870 bytes a token a layer for a Qwen2.5-1.5B shape (this: 108,544),
      ~3% more than this for a Qwen3-4B-like shape. gradient_checkpointing keeps each block's input
      (tokens * h * w per layer) plus one block's activations during its recompute (measured peaks were ~2 GiB
      below this + logprob_buffer: conservative); without it every block's activations stay.
    - logprob_buffer: the chunked fp32 log-prob/entropy: logprob_chunk tokens (or this GPU's tokens, if fewer)
      * vocab * 4 bytes * ~3 (logits, softmax, their gradient). The no-grad old/ref log-prob pass holds less than
      an update micro-batch and is not counted.
    - kv_cache: max(max_num_seqs, n) rows (with CUDA graphs the cache has max_num_seqs rows; a wave holds at least
      one whole group of n) x (max_prompt_length + max_response_length) positions x layers x 2 (k, v) x kv_heads x
      head_dim, in the compute dtype (world size 1 too: the engine generates under the trainer's autocast).
    - runtime: a flat runtime_gib for what the allocator does not see (CUDA context, NCCL buffers, fragmentation).
    engine="vllm" (rollout.VLLMEngine) replaces engine_weights and kv_cache: vllm_awake = gpu_memory_utilization
    x gpu_gib (vLLM takes exactly that while awake: its weights / gen_tp, KV cache, activations), vllm_asleep ~1
    GiB kept through training (measured 0.9 GiB on an H200: CUDA-graph pool), sync_bucket = one bucket of the
    weight push (weight_sync_bucket_mb, full tensors in compute dtype). Its KV capacity goes to the notes.
    """
    m = model_cfg
    tp, sp = cfg.tp_size, cfg.sp_size
    fsdp = world_size // tp
    dp = fsdp // sp
    w = 4 if cfg.dtype == "float32" else 2
    sharded = world_size > 1
    P = m.num_params()
    h, hd, L = m.hidden_size, m.head_dim, m.num_hidden_layers
    q, kv = m.num_attention_heads * hd, m.num_key_value_heads * hd
    block_tp = h * q + 2 * h * kv + q * h + (q + 2 * kv if m.attention_bias else 0) + 3 * h * m.intermediate_size
    block = block_tp + 2 * h + (2 * hd if m.qk_norm else 0)  # + norms, replicated over TP
    root = P - L * block  # embeddings, lm_head (untied), final norm
    per_gpu = (L * block_tp / (fsdp * tp) + (P - L * block_tp) / fsdp) if sharded else P  # params held by one GPU
    offload = sharded and (cfg.param_offload or cfg.optimizer_offload)
    use_ref = cfg.use_kl_loss or cfg.use_kl_in_reward

    state = {"params": 4 * per_gpu, "grads": 4 * per_gpu, "optimizer": 8 * per_gpu,
             "ref_params": 4 * per_gpu if use_ref else 0}
    gib = {k: 0.0 if offload else v / GiB for k, v in state.items()}
    host_gib = sum(state.values()) / GiB if offload else 0.0
    gib["engine_weights"] = w * P / GiB if sharded else 0.0
    gib["runtime"] = runtime_gib
    gib["working"] = (2 * w * (root + block_tp / tp + (block - block_tp)) if sharded else w * P) / GiB
    seq = cfg.max_prompt_length + cfg.max_response_length
    tokens = cfg.ppo_max_token_len_per_gpu * sp if cfg.use_dynamic_bsz else cfg.ppo_micro_batch_size_per_gpu * seq
    local = math.ceil(tokens / sp)  # this GPU's share under sequence parallelism
    split = 8 * q + 8 * m.intermediate_size + (6 * q + 6 * kv if m.qk_norm else 0)  # split by TP
    one_block = local * (16 * h + split / tp) * w / 2  # bytes counted for bf16 above; w / 2 scales them
    acts = local * h * w * L + one_block if cfg.gradient_checkpointing else L * one_block
    gib["activations"] = acts / GiB
    gib["logprob_buffer"] = min(cfg.logprob_chunk, local) * m.vocab_size * 4 * 3 / GiB
    rows = max(cfg.max_num_seqs, cfg.n)  # built-in engine
    kv_token = L * 2 * m.num_key_value_heads * hd * w  # bytes per token: k and v of every layer
    gib["kv_cache"] = rows * seq * kv_token / GiB
    vllm = engine == "vllm"
    gib["vllm_asleep"] = 1.0 if vllm else 0.0
    gib["vllm_awake"] = cfg.gpu_memory_utilization * gpu_gib if vllm else 0.0
    gib["sync_bucket"] = min(cfg.weight_sync_bucket_mb * 2**20, w * P) / GiB if vllm else 0.0
    if vllm:
        gib["engine_weights"] = gib["kv_cache"] = 0.0

    phase = {k: MEMORY_TERMS[k][0] for k in gib}
    total = {p: sum(v for k, v in gib.items() if phase[k] == p) for p in ("resident", "training", "generation")}
    peak_phase = "training" if total["training"] >= total["generation"] else "generation"
    peak = total["resident"] + total[peak_phase]
    fits = peak <= gpu_gib
    largest = max((k for k in gib if phase[k] in ("resident", peak_phase) and k != "runtime"), key=gib.get)

    notes = []
    if (cfg.param_offload or cfg.optimizer_offload) and not sharded:
        notes.append("param_offload/optimizer_offload act only under FSDP (world size > 1)")
    if vllm:
        gen_tp = cfg.gen_tp
        kv_gib = cfg.gpu_memory_utilization * gpu_gib * gen_tp - 2 * P / GiB - gen_tp  # ~1 GiB activations per GPU
        seqs = kv_gib * GiB / (kv_token * seq)
        notes.append(f"vLLM engine of TP {gen_tp}: {cfg.gpu_memory_utilization:g} x {gpu_gib:g} GiB x {gen_tp} GPUs "
                     f"- weights {2 * P / GiB:.1f} GiB leaves ~{kv_gib:.0f} GiB of KV cache = {seqs:.0f} sequences "
                     f"of max length ({seq} tokens) in flight" + ("" if seqs >= cfg.n else
                                                                 f": fewer than n={cfg.n}, raise "
                                                                 "gpu_memory_utilization or gen_tp"))
    else:
        room = ", ".join(f"TP {t}: {0.8 * gpu_gib * t - 2 * P / GiB:.0f}" for t in (1, 2, 4, 8))
        notes.append(f"with the vLLM engine (rollout_engine='vllm'), GiB left for KV per engine at "
                     f"gpu_memory_utilization 0.8 of {gpu_gib:g} GiB: {room}")
    return {"world_size": world_size, "dp": dp, "sp": sp, "tp": tp, "gpu_gib": gpu_gib, "num_params": P, "engine": engine,
            "tokens_per_micro_batch": tokens, "kv_rows": rows, "gib": gib, "phase": phase, "host_gib": host_gib,
            "resident_gib": total["resident"], "training_gib": total["training"],
            "generation_gib": total["generation"], "peak_gib": peak, "peak_phase": peak_phase,
            "verdict": "fits" if fits else "does not fit", "largest": largest,
            "knob": None if fits else _memory_knob(largest, cfg, sharded), "notes": notes}


def _memory_knob(term: str, cfg, sharded: bool) -> str:
    """What to turn when `term` is the largest part of a peak that does not fit."""
    if term in ("params", "grads", "optimizer", "ref_params"):
        if not sharded:
            return "more GPUs (FSDP shards params, grads and AdamW states over dp; offload needs world size > 1)"
        return "param_offload=True + optimizer_offload=True (states to the host), or more GPUs (smaller shards)"
    if term == "working":
        return "tp_size (splits the unsharded block weights), or more GPUs" if sharded else "more GPUs (FSDP)"
    if term == "engine_weights":
        return ("nothing in the built-in engine: every GPU holds a full copy; the vLLM engine with rollout TP "
                "(issue 7) splits it")
    if term == "activations":
        if not cfg.gradient_checkpointing:
            return "gradient_checkpointing=True"
        budget = "ppo_max_token_len_per_gpu" if cfg.use_dynamic_bsz else "ppo_micro_batch_size_per_gpu"
        return f"{budget}, or sp_size (sequence parallelism splits each micro-batch's tokens over sp_size GPUs)"
    if term == "logprob_buffer":
        return "logprob_chunk"
    if cfg.max_num_seqs > cfg.n:  # kv_cache
        return f"max_num_seqs (now {cfg.max_num_seqs}; a multiple of n={cfg.n})"
    return (f"max_response_length (max_num_seqs is at its floor, one group of n={cfg.n} rows), or the vLLM "
            f"engine's paged KV cache (issue 7)")


def format_memory_plan(plans: list[dict]) -> str:
    """A text table of plans from memory_plan, one column each (e.g. the same config at gpu_gib 80 and 141):
    every term, the phase totals, the peak, the verdict, and the knob to turn where a plan does not fit."""
    p0 = plans[0]
    head = [f"{p['gpu_gib']:g} GiB" for p in plans]
    width = max(14, *(len(x) + 2 for x in head))
    cols = lambda vals: "".join(f"{v:>{width}}" for v in vals)  # noqa: E731
    sp = f" x sp {p0['sp']}" if p0["sp"] > 1 else ""
    per_gpu = f" ({math.ceil(p0['tokens_per_micro_batch'] / p0['sp'])} per GPU)" if p0["sp"] > 1 else ""
    out = [f"memory per GPU (GiB): {p0['num_params'] / 1e9:.2f}B params, world {p0['world_size']} = "
           f"dp {p0['dp']}{sp} x tp {p0['tp']}, {p0['tokens_per_micro_batch']} tokens per update micro-batch"
           f"{per_gpu}, KV cache {p0['kv_rows']} rows",
           f"  {'':11}{'':38}" + cols(head)]
    for phase in ("resident", "training", "generation"):
        for i, (term, (ph, label)) in enumerate((t, v) for t, v in MEMORY_TERMS.items() if v[0] == phase):
            out.append(f"  {phase if i == 0 else '':11}{label:38}" + cols(f"{p['gib'][term]:.2f}" for p in plans))
    for key, label in (("host_gib", "host (offloaded states), per GPU"), ("resident_gib", "resident"),
                       ("training_gib", "training phase"), ("generation_gib", "generation phase"),
                       ("peak_gib", "peak = resident + max(phases)")):
        out.append(f"  {'':11}{label:38}" + cols(f"{p[key]:.2f}" for p in plans))
    out.append(f"  {'':11}{'verdict':38}" + cols(p["verdict"] for p in plans))
    for p in plans:
        if p["knob"]:
            out.append(f"  {p['gpu_gib']:g} GiB: does not fit by {p['peak_gib'] - p['gpu_gib']:.1f} GiB; largest "
                       f"term: {MEMORY_TERMS[p['largest']][1]} ({p['gib'][p['largest']]:.1f} GiB); turn: {p['knob']}")
    notes = list(dict.fromkeys(n for p in plans for n in p["notes"]))
    out += [f"  note: {n}" for n in notes]
    return "\n".join(out)
