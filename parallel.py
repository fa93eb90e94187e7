"""
Devices, in one place: which accelerator (cuda / npu / cpu), its process-group backend, autocast,
RNG state, synchronize and memory stats. Nothing else in nanodapo names a device type.

And multi-device training: process groups from torchrun, a (dp, tp) device mesh, tensor parallelism
(DTensor plans), FSDP2 sharding with bf16 compute over fp32 master weights, and full weights gathered
in buckets for the rollout engine.
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


def synchronize(device: torch.device):
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


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
    world_size: int
    rank: int
    local_rank: int
    tp: int
    device: torch.device
    mesh: object = None  # DeviceMesh ("dp", "tp") when world_size > 1

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", tp: int = 1) -> ParallelDims:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if tp < 1 or world % tp:
        raise ValueError(f"tp_size={tp} must divide the world size {world} (dp = world_size / tp_size)")
    kind = device_type(device)
    dev = torch.device("cpu")
    if kind != "cpu":
        torch.get_device_module(kind).set_device(local_rank)
        dev = torch.device(kind, local_rank)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        if not dist.is_initialized():
            backend = BACKENDS[kind] if kind == "cpu" else f"cpu:gloo,{kind}:{BACKENDS[kind]}"
            dist.init_process_group(backend=backend)
        mesh = init_device_mesh(kind, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return ParallelDims(world, rank, local_rank, tp, dev, mesh)


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
# tensor parallel and FSDP2, applied in torchtitan's order: TP, activation checkpointing (model flag), FSDP

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


def apply_fsdp(model, dp_mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, offload: bool = False):
    """fully_shard each decoder block, then the root (embeddings, final norm, output layer). Parameters stay
    fp32 (the master copy, sharded, as are AdamW's states); compute runs in param_dtype, gradients reduce in fp32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    kw = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
              offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def parallelize(model, dims: ParallelDims, param_dtype=torch.bfloat16, offload: bool = False):
    if dims.tp > 1:
        apply_tp(model, dims.mesh["tp"])
    if dims.world_size > 1:
        apply_fsdp(model, dims.mesh["dp"], param_dtype=param_dtype, offload=offload)


def iter_full_weights(model, bucket_bytes: int = 512 * 2**20, dtype=torch.bfloat16):
    """Yield lists of (HF name, full tensor) whose sizes add up to about bucket_bytes, gathered from the
    sharded model in a fixed order. Collective: every rank must iterate to the end. Extra memory: one bucket."""
    from torch.distributed.tensor import DTensor
    bucket, size = [], 0
    for name, p in model.named_parameters():
        t = p.detach()
        t = (t.full_tensor() if isinstance(t, DTensor) else t).to(dtype)
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
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        n = g.detach().float().norm()
        sq += (n.full_tensor() if isinstance(n, DTensor) else n).double().cpu() ** 2
    total = sq.sqrt().item()
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


def latest_checkpoint(root: str) -> str | None:
    """The newest step_N under root that has its COMPLETE marker."""
    if not os.path.isdir(root):
        return None
    done = [d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()
            and os.path.isfile(os.path.join(root, d, "COMPLETE"))]
    return os.path.join(root, max(done, key=lambda d: int(d[5:]))) if done else None


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
