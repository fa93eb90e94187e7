"""
Devices and multi-device training: the device type (cuda, npu or cpu) and its process-group backend,
autocast, RNG state; process groups from torchrun and the (dp, sp, tp) mesh; TP, Ulysses SP, EP, per-block
compile and FSDP2 (bf16 compute over fp32 master weights); full weights in buckets for the rollout engine;
objects and rows sent between ranks. Stops, waits and failures across ranks are in reliability.py.
"""
import contextlib
import datetime
import importlib
import math
import os
import pickle
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import model as M

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def device_type(requested: str = "auto") -> str:
    """'auto' -> the accelerator torch sees (cuda, or npu when torch_npu is installed), else cpu. An explicit
    'cuda' or 'npu' must be usable on this machine: ValueError naming the fix otherwise, before any work."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"device={requested!r}; choose one of auto, {', '.join(BACKENDS)}")
    try:  # optional; importing torch_npu registers torch.npu, which 'auto' then sees
        importlib.import_module("torch_npu")
        npu = True
    except ImportError:
        npu = False
    if requested == "auto":
        acc = torch.accelerator.current_accelerator()
        return acc.type if acc is not None and acc.type in BACKENDS else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device (torch.cuda.is_available() is False: a "
                         "CPU build of torch, or no driver); use device='auto' or device='cpu'")
    if requested == "npu" and not npu:
        raise ValueError("device='npu' but torch_npu is not installed; pip install torch_npu "
                         "(nanodapo[npu]), or use device='auto' or device='cpu'")
    if requested == "npu" and not torch.npu.is_available():
        raise ValueError("device='npu' but torch_npu sees no NPU (torch.npu.is_available() is False); "
                         "use device='auto' or device='cpu'")
    return requested


def process_group_backend(kind: str) -> str:
    """gloo on the CPU; on an accelerator its collective library, plus gloo for CPU tensors and objects."""
    if kind == "cpu":
        return BACKENDS["cpu"]
    return f"cpu:{BACKENDS['cpu']},{kind}:{BACKENDS[kind]}"


def get_device(requested: str = "auto") -> torch.device:
    kind = device_type(requested)
    return torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")


def max_memory_allocated_gib(device: torch.device) -> float:
    """The peak of torch's allocator on the device, in GiB; 0 on the CPU, which does not track it."""
    if device.type == "cpu":
        return 0.0
    return torch.get_device_module(device.type).max_memory_allocated() / 2**30


def host_memory_gib() -> float:
    """This machine's physical memory, in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


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
# process groups and the device mesh

def check_mesh(world_size: int, tp_size: int, sp_size: int, num_attention_heads: int | None = None,
               num_key_value_heads: int | None = None, ep_size: int = 1,
               num_experts: int | None = None) -> int:
    """The mesh arithmetic, in one place: world = dp x sp x tp; TP splits the query and key/value heads, SP
    each TP rank's query heads again; EP splits each MoE layer's experts over ep_size of the dp x sp ranks
    (tp_size 1). Returns dp; raises ValueError naming the knobs and the fix."""
    if tp_size < 1 or sp_size < 1 or ep_size < 1:
        raise ValueError(f"tp_size={tp_size}, sp_size={sp_size} and ep_size={ep_size} must be >= 1 (1 = off)")
    n = tp_size * sp_size
    if world_size % n:
        raise ValueError(f"sp_size={sp_size} x tp_size={tp_size} = {n} must divide the world size "
                         f"{world_size} (dp = world_size / (sp_size x tp_size) replicas); launch a multiple "
                         f"of {n} ranks or choose tp_size and sp_size whose product divides {world_size}")
    if num_attention_heads is not None and num_attention_heads % n:
        raise ValueError(f"num_attention_heads={num_attention_heads} must be divisible by tp_size x sp_size "
                         f"= {tp_size} x {sp_size}: TP splits the query heads and sequence parallelism "
                         f"splits each TP rank's heads again; choose tp_size x sp_size dividing "
                         f"{num_attention_heads}")
    if num_key_value_heads is not None and num_key_value_heads % tp_size:
        raise ValueError(f"num_key_value_heads={num_key_value_heads} must be divisible by tp_size={tp_size}: "
                         f"TP splits the key/value heads; choose a tp_size dividing {num_key_value_heads}")
    if ep_size > 1:
        if tp_size > 1:
            raise ValueError(f"ep_size={ep_size} with tp_size={tp_size}: expert parallelism runs without "
                             "tensor parallelism; set tp_size=1 (EP + FSDP + sp_size for long sequences)")
        if world_size % ep_size:  # tp_size 1: every rank is an FSDP rank
            raise ValueError(f"ep_size={ep_size} must divide the dp x sp = {world_size} ranks (experts are "
                             f"split over ep_size ranks, FSDP-sharded over the other {world_size} / "
                             f"ep_size); choose an ep_size dividing {world_size}")
        if num_experts is not None and (num_experts == 0 or num_experts % ep_size):
            raise ValueError(f"ep_size={ep_size} must divide num_experts={num_experts} (each rank holds "
                             f"num_experts / ep_size experts of every MoE layer; a dense model has none); "
                             "choose an ep_size dividing num_experts, or ep_size=1")
    return world_size // n


@dataclass
class ParallelDims:
    """world = dp x sp x tp ranks; rank = (dp_rank * sp + sp_rank) * tp + tp_rank (TP innermost, on one
    node). dp replicas see different data; the sp x tp ranks of one replica run the same micro-batches (TP
    splits heads and features, SP tokens). FSDP shards over, and sums gradients over, the fsdp_size = dp x sp
    ranks of one TP index. ep (tp = 1): groups of ep consecutive fsdp ranks split each MoE layer's experts,
    whose weights FSDP shards over the efsdp_size = fsdp_size / ep ranks of the same ep_rank. Asynchronous
    rollout: world_size counts the trainer ranks, the first of torchrun's; the ranks after them only generate
    (is_generator). Then each side has a process group of its own (async_process_groups), and trainer rank 0
    and the generators talk over `bridge`."""
    world_size: int
    rank: int
    local_rank: int
    tp: int
    device: torch.device
    sp: int = 1
    ep: int = 1
    mesh: object = None  # DeviceMesh ("dp", "sp", "tp") when sharded
    fsdp_mesh: object = None  # its ("dp", "sp") dimensions flattened: the ranks FSDP shards over
    expert_mesh: object = None  # DeviceMesh ("efsdp", "ep") over the same ranks, when ep > 1
    bridge: object = None  # asynchronous rollout: async_rollout.Bridge (trainer rank 0 + the generator ranks)
    engine_group: object = None  # asynchronous rollout, a generator rank: the ranks of its vLLM engine

    def __post_init__(self):
        check_mesh(self.world_size, self.tp, self.sp, ep_size=self.ep)

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
    def efsdp_size(self) -> int:
        return self.fsdp_size // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp % self.ep

    @property
    def sharded(self) -> bool:
        """The policy runs under FSDP2 (fp32 master weights, compute in bf16): several ranks, or one
        accelerator, which is a mesh of one; only a single CPU process trains a plain fp32 module."""
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_generator(self) -> bool:
        return self.rank >= self.world_size


def init_distributed(device: str = "auto", tp: int = 1, sp: int = 1, ep: int = 1, rollout: int = 0,
                     mesh_of_one: bool | None = None, timeout_s: float | None = None,
                     gen_tp: int = 1) -> ParallelDims:
    """This rank's ParallelDims from torchrun's environment (plain python: one rank), checked before any
    process group or device is set up. rollout > 0: the last rollout ranks only generate; the mesh spans the
    others (async_process_groups). mesh_of_one: whether one trainer rank gets a mesh (FSDP) too; None = on
    an accelerator, not on a CPU. timeout_s: how long a collective may wait for the other ranks (None:
    torch's default). gen_tp: ranks per generator engine (asynchronous rollout with vLLM).
    """
    total = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = total - rollout  # the trainer ranks
    kind = device_type(device)
    dev = torch.device("cpu") if kind == "cpu" else torch.device(kind, local_rank)
    dims = ParallelDims(world, rank, local_rank, tp, dev, sp=sp, ep=ep)
    if kind != "cpu":
        torch.get_device_module(kind).set_device(local_rank)
    if mesh_of_one is None:  # the default: a mesh on an accelerator, none on a CPU
        mesh_of_one = kind != "cpu"
    sharded = (world > 1 or mesh_of_one) and not dims.is_generator
    if rollout:
        async_process_groups(dims, rollout, gen_tp, kind, timeout_s)
    elif total > 1 or sharded:
        init_process_group(kind, timeout_s)
    if sharded:
        dims.mesh = DeviceMesh(kind, torch.arange(world).view(dims.dp, sp, tp),
                               mesh_dim_names=("dp", "sp", "tp"))
        dims.fsdp_mesh = dims.mesh["dp", "sp"]._flatten("fsdp")
        if ep > 1:
            dims.expert_mesh = DeviceMesh(kind, torch.arange(world).view(dims.efsdp_size, ep),
                                          mesh_dim_names=("efsdp", "ep"))
    return dims


def torchrun_rank() -> int:
    """This process's rank in torchrun's world (a generator's RANK is rewritten for vLLM:
    async_process_groups)."""
    return int(os.environ.get("NANODAPO_RANK", os.environ.get("RANK", "0")))


_shared_store = None  # asynchronous rollout: torchrun's store, which both sides' ranks reach


def shared_store():
    """torchrun's store, which every rank reaches (asynchronous rollout), or None."""
    return _shared_store


def async_process_groups(dims: ParallelDims, rollout: int, gen_tp: int, kind: str, timeout_s: float | None):
    """Asynchronous rollout: two worlds in one torchrun launch. The trainer ranks' process group is theirs
    alone, and so is the generators' (vLLM's external launcher builds its groups over every rank of the
    process group it finds, so it must find only generators; RANK and WORLD_SIZE are rewritten for it).
    Trainer rank 0 and the generators then form async_rollout.Bridge. All meet through torchrun's store
    (shared_store)."""
    global _shared_store
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError("rollout_gpus > 0 needs torchrun (it gives every rank MASTER_ADDR, MASTER_PORT, "
                           "RANK and WORLD_SIZE)")
    timeout = datetime.timedelta(seconds=timeout_s or 1800)
    # torchrun's agent hosts the store; without it (a launcher of one's own), global rank 0 does
    host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and dims.rank == 0
    _shared_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=host, timeout=timeout)
    if dims.is_generator:
        side, side_rank, side_size = "generators", dims.rank - dims.world_size, rollout
        # what vLLM reads; torchrun's RANK stays in NANODAPO_RANK (torchrun_rank)
        os.environ.update(NANODAPO_RANK=os.environ["RANK"], RANK=str(side_rank), WORLD_SIZE=str(side_size))
    else:
        side, side_rank, side_size = "trainers", dims.rank, dims.world_size
    store = dist.PrefixStore(f"nanodapo/{side}", _shared_store)
    dist.init_process_group(process_group_backend(kind), store=store, rank=side_rank, world_size=side_size,
                            timeout=timeout)
    if dims.is_generator and gen_tp > 1:  # every generator creates every engine's group, in order
        for first in range(0, rollout, gen_tp):
            group = dist.new_group(list(range(first, first + gen_tp)))
            if first <= side_rank < first + gen_tp:
                dims.engine_group = group


def init_process_group(kind: str, timeout_s: float | None = None):
    """torchrun's process group; a process started without torchrun gets a group of one on 127.0.0.1 and the
    variables torchrun would have set (vLLM's external launcher reads RANK and LOCAL_RANK)."""
    if dist.is_initialized():
        return
    if not ("MASTER_ADDR" in os.environ and "RANK" in os.environ):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=process_group_backend(kind), timeout=timeout)


_GLOO_ONLY_GROUP_DESTROYED = False  # set by shutdown(), read by exit_process()


def shutdown():
    """Destroy the process group, every rank together; whether it was gloo alone is kept for exit_process."""
    global _GLOO_ONLY_GROUP_DESTROYED
    if dist.is_initialized():
        gloo_only = dist.get_backend() == BACKENDS["cpu"]
        dist.barrier()  # without it a rank can abort at exit while another still talks
        dist.destroy_process_group()
        _GLOO_ONLY_GROUP_DESTROYED = gloo_only


def exit_process(code: int):
    """Leave the process with code once its run is over and everything it held is closed; output is flushed here.
    After a CPU run's shutdown() (gloo alone) the process skips interpreter teardown,
    where gloo's threads can abort a finished process ("terminate called without an active exception", SIGABRT)
    and torchrun then reports the whole run as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _GLOO_ONLY_GROUP_DESTROYED:
        os._exit(code)
    sys.exit(code)


def all_gather_objects(obj, dims: ParallelDims) -> list:
    """Every rank's obj, in rank order (picklable Python objects; small metadata and token lists)."""
    if dims.world_size == 1:
        return [obj]
    out = [None] * dims.world_size
    dist.all_gather_object(out, obj)
    return out


def sum_over_dp(values: dict, dims: ParallelDims) -> dict:
    """Sum of a dict of floats over the dp replicas only: the sp x tp ranks of a replica hold the same
    values."""
    if dims.dp == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=dims.mesh["dp"].get_group())
    return dict(zip(keys, t.tolist()))


def all_reduce_max(value: int, dims: ParallelDims) -> int:
    if dims.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier(dims: ParallelDims):
    if dims.world_size > 1:
        dist.barrier()


def send_object(obj, dst: int, group=None) -> list:
    """Send a picklable obj to rank dst without waiting -> the work handles (they hold the buffers: wait on
    them). group: a process-group object outside the default world (async_rollout.Bridge), dst its rank."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    if group is None:
        return [dist.isend(size, dst), dist.isend(data, dst)]
    return [group.send([size], dst, 0), group.send([data], dst, 0)]


class _Receiver(threading.Thread):
    """A blocking receive on a thread of its own, so that the caller can poll while it waits (a gloo receive
    is only complete once waited on)."""

    def __init__(self, receive):
        super().__init__(daemon=True)
        self.receive, self.result, self.error = receive, None, None
        self.start()

    def run(self):
        try:
            self.result = self.receive()
        except BaseException as e:  # handed to the caller's thread
            self.error = e


# (id(group), src) -> a _Receiver whose caller stopped waiting: the next receive takes its object
_receivers = {}
NOT_YET = object()  # what a receive with wait=False returns while nothing has arrived


def receive(key, receive_fn, poll=None, poll_s: float = 0.1, wait: bool = True):
    """receive_fn()'s object, on a _Receiver thread when the caller polls while waiting (poll() every poll_s
    seconds; it may raise to stop waiting) or does not wait (NOT_YET until it arrives). A receive left
    running is taken by the next call for the same key: none is lost or read twice."""
    if poll is None and wait and key not in _receivers:
        return receive_fn()
    if key not in _receivers:
        _receivers[key] = _Receiver(receive_fn)
    receiver = _receivers[key]
    while receiver.is_alive():
        if not wait:
            return NOT_YET
        if poll is not None:
            poll()
        receiver.join(poll_s)
    del _receivers[key]
    if receiver.error is not None:
        raise receiver.error
    return receiver.result


def recv_object(src: int, poll=None, poll_s: float = 0.1, group=None, wait: bool = True):
    """The next object that rank src sent with send_object (group as there); poll and wait as in receive."""
    return receive((id(group), src), lambda: _recv_object(src, group), poll, poll_s, wait)


def _recv_object(src: int, group=None):
    def recv(t):
        if group is None:
            dist.recv(t, src)
        else:
            group.recv([t], src, 0).wait()
    size = torch.zeros(1, dtype=torch.int64)
    recv(size)
    data = torch.empty(int(size), dtype=torch.uint8)
    recv(data)
    return pickle.loads(data.numpy().tobytes())


def exchange_rows(held: dict, owner: list[int], needed: list[int], dims: ParallelDims) -> tuple[dict, int]:
    """Rows of a table spread over the ranks, brought where they are used: this rank holds `held` (index ->
    tensor), owner[i] is the rank that holds row i, and this rank needs the rows `needed`. Collective: the
    ranks exchange the lists of indices they need (small), then each owner sends each rank only the rows it
    asked for. -> (the rows received, index -> tensor; the bytes received)."""
    wants = all_gather_objects(sorted(set(needed) - set(held)), dims)
    sends = []
    for rank, want in enumerate(wants):
        rows = {i: held[i] for i in want if owner[i] == dims.rank}
        if rank != dims.rank and rows:
            sends += send_object(rows, rank)
    received, nbytes = {}, 0
    for rank in sorted({owner[i] for i in wants[dims.rank]}):
        rows = recv_object(rank)
        received.update(rows)
        nbytes += sum(t.numel() * t.element_size() for t in rows.values())
    for w in sends:
        w.wait()
    return received, nbytes


# -----------------------------------------------------------------------------
# TP, SP, EP, compile and FSDP2, in torchtitan's order (activation checkpointing is a model flag)

# q/k/v/gate/up split their output features across TP ranks, o/down their input features: one all-reduce after
# attention and one after the MLP; norms and embeddings stay replicated.
TP_PLAN = {"self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel,
           "self_attn.v_proj": ColwiseParallel, "self_attn.o_proj": RowwiseParallel,
           "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel, "mlp.down_proj": RowwiseParallel}


def apply_tp(model, tp_mesh):
    """TP_PLAN on every block; a MoE block's router and experts (no mlp.*_proj) stay replicated over the TP
    ranks."""
    tp, cfg = tp_mesh.size(), model.config
    check_mesh(tp, tp, 1, cfg.num_attention_heads, cfg.num_key_value_heads)
    for block in model.model.layers:
        names = {name for name, _ in block.named_modules()}
        parallelize_module(block, tp_mesh, {k: style() for k, style in TP_PLAN.items() if k in names})
        if cfg.qk_norm:  # Qwen3's per-head q/k norms see only this rank's heads: sum their gradients
            group = tp_mesh.get_group()
            block.self_attn.q_norm.grad_sum_group = group
            block.self_attn.k_norm.grad_sum_group = group


def apply_sp(model, sp_mesh, tp: int = 1):
    """Ulysses sequence parallelism (model.py, split_for_sp): packed log-prob forwards split tokens over
    sp_mesh."""
    sp, cfg = sp_mesh.size(), model.config
    check_mesh(tp * sp, tp, sp, cfg.num_attention_heads, cfg.num_key_value_heads)
    model.sp_group = sp_mesh.get_group()


EXPERT_STACKS = ("gate_up_proj", "down_proj")  # a MoE layer's expert weights, stacked along dim 0 = expert


def expert_modules(model) -> list:
    """The modules that hold expert stacks (model.py's Experts, one per MoE layer)."""
    return [m for m in model.modules()
            if all(isinstance(getattr(m, n, None), nn.Parameter) for n in EXPERT_STACKS)]


def apply_ep(model, ep_mesh):
    """Expert parallelism (torchtitan's scheme): expert stacks become DTensors sharded along experts over
    ep_mesh; each Experts module sends its input rows (sorted by expert, cumulative counts `ends`) to the
    ranks holding those experts and the outputs back, by differentiable all-to-alls (the counts first, then
    the rows)."""
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    for experts in expert_modules(model):
        for name in EXPERT_STACKS:  # src_data_rank=None: every rank slices its own rows (works on meta too)
            shard = distribute_tensor(getattr(experts, name).data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard))
        state = {}  # what dispatch tells combine: the all-to-all splits and the row order

        def dispatch(module, args, state=state):
            """Forward pre-hook: the rows go to the ranks holding their experts -> (the rows this rank
            received, in the order of its experts; their cumulative counts per expert)."""
            x, ends = args
            # rows per [destination rank, its expert] here, per [source rank, my expert] in recv
            counts = torch.diff(ends, prepend=ends.new_zeros(1)).view(ep, -1)
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts.contiguous(), group=group)
            # rows sent to / received from each rank
            state["splits"] = counts.sum(1).tolist(), recv.sum(1).tolist()
            rows = all_to_all_single_autograd(x, state["splits"][1], state["splits"][0], group)
            local = torch.arange(recv.shape[1], device=x.device).repeat(ep).repeat_interleave(recv.flatten())
            state["order"] = local.argsort(stable=True)  # (source, expert) order -> expert order
            return rows[state["order"]], recv.sum(0).cumsum(0)

        def combine(module, args, y, state=state):
            """Forward hook: the outputs back in (source, expert) order, then back to the ranks they came
            from."""
            back = torch.empty_like(y).index_copy(0, state["order"], y)
            return all_to_all_single_autograd(back, state["splits"][0], state["splits"][1], group)

        experts.register_forward_pre_hook(dispatch)
        experts.register_forward_hook(combine)


def reduce_router_loads(router_loads: list, group) -> list:
    """Each MoE layer's router_load (model.py) summed over `group` (the dp x sp ranks) with this rank's
    gradient path only, so that the gradients FSDP sums add up to those of the aux loss over all the group's
    tokens."""
    if not router_loads or group is None or dist.get_world_size(group) == 1:
        return router_loads
    local = torch.stack(router_loads)
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return list((local + (total - local.detach())).unbind(0))


# Graphs dynamo may hold for one function before it leaves new shapes eager. Every block shares one cache:
# the trainer's (training, checkpointed, no-grad) and the built-in engine's (prefill, decode) need 7 of them
# on the CPU, the log-prob head 4 (tests/test_rollout.py counts them); twice that leaves room for variants
# the CPU does not see (sequence parallelism, MoE routing). Dynamo's default, 8, is too few.
RECOMPILE_LIMIT = 16


def apply_compile(model, dynamic: bool | None = None):
    """torch.compile each decoder block in place (nn.Module.compile keeps the parameter names, no _orig_mod
    prefix) and the log-prob head's chunk function. Blocks, as torchtitan: they are alike, so all share one
    graph and compile time is that of one block. dynamic=True: the blocks' shapes symbolic from the first call
    (the trainer's token counts, the built-in engine's decode); the head's rows are symbolic either way."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for block in model.model.layers:
        block.compile(dynamic=dynamic)
    model.logprob_chunk_fn = _compiled_logprob_head()


def _compiled_logprob_head():
    """The log-prob head's chunk function compiled with its row count symbolic from the first call: while
    every response has one length the chunks can all be one size, and the first batch of other lengths would
    compile it again in the middle of an update. Only the rows: dynamic=True made the temperature a graph
    input too, and with that graph the first update on an H200 took about 40 s longer, cache or not."""
    compiled = torch.compile(M._chunk_logprob_entropy)

    def chunk_fn(h, weight, targets, temperature, with_entropy):
        torch._dynamo.maybe_mark_dynamic(h, 0)
        torch._dynamo.maybe_mark_dynamic(targets, 0)
        return compiled(h, weight, targets, temperature, with_entropy)
    return chunk_fn


def compile_enabled(setting: bool | str, device_type: str) -> bool:
    """The compile knob on this device: "auto" = on a CUDA GPU (the policy is sharded there, a mesh of one on
    one GPU); eager on the CPU (the demo's blocks are too small to gain) and on other accelerators (untested
    with Inductor here)."""
    if setting == "auto":
        return device_type == "cuda"
    return setting


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a recompile adds one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _shard_dim_1(param) -> Shard:
    """FSDP's placement for an expert stack's parameter: along dim 1, as dim 0 (experts) is EP's."""
    return Shard(1)


def apply_fsdp(model, fsdp_mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
               offload: bool = False, expert_mesh=None):
    """fully_shard each decoder block, then the root: fp32 master parameters, compute in param_dtype,
    gradients reduced in fp32 and summed, not averaged (the trainer's loss carries the one denominator).
    Inputs are not cast: RoPE's cos/sin stay fp32, and a cast could give an activation-checkpoint recompute
    other dtypes. On a mesh of one nothing is resharded after forward (mesh_of_one)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    if fsdp_mesh.size() == 1:  # a gather is only a cast here: keep the weights it made (see accumulate_grads)
        kw["reshard_after_forward"] = False
    units = []
    if expert_mesh is not None:
        # the expert stacks first, over efsdp, on dim 1 (EP splits dim 0)
        for m in expert_modules(model):
            units.append(fully_shard(m, mesh=expert_mesh["efsdp"], shard_placement_fn=_shard_dim_1, **kw))
    for m in (*model.model.layers, model):  # the blocks, then the root
        units.append(fully_shard(m, mesh=fsdp_mesh, **kw))
    for module in units:  # plain SUM collectives (gloo has no pre-multiplied sum)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def mesh_of_one(dims: ParallelDims) -> bool:
    """FSDP over a single rank (one GPU, or TP alone): its all-gather is a cast of the fp32 shard to bf16 and
    its reduce-scatter a copy, so the trainer keeps what they make for as long as it can (apply_fsdp,
    accumulate_grads, reshard)."""
    return dims.sharded and dims.fsdp_mesh.size() == 1


def accumulate_grads(model, dims: ParallelDims, last: bool):
    """Call before each micro-batch of a mini-batch; last: the one before the optimizer step. On a mesh of one
    the bf16 weights stay gathered and the gradients accumulate unsharded in fp32 until the last backward: one
    gather and one reduction an optimizer step instead of two gathers and one reduction a micro-batch. The
    same sums in the same order (FSDP accumulates in reduce_dtype); elsewhere every backward reduces, so
    that no rank holds a full gradient."""
    if mesh_of_one(dims):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def reshard(model, dims: ParallelDims):
    """After no-grad forwards: on a mesh of one the gathered bf16 weights stayed (no backward frees them);
    free them, and make the next gather read the fp32 weights the optimizer will have changed."""
    if mesh_of_one(dims):
        for unit in model.modules():  # FSDPModule.reshard is not recursive
            if isinstance(unit, FSDPModule):
                unit.reshard()


def parallelize(model, dims: ParallelDims, param_dtype=torch.bfloat16, offload: bool = False,
                compile: bool = False):
    """Shard `model` for dims: TP, SP, EP, optionally compile each block, then FSDP2 (apply_fsdp)."""
    if dims.tp > 1:
        apply_tp(model, dims.mesh["tp"])
    if dims.sp > 1:
        apply_sp(model, dims.mesh["sp"], dims.tp)
    if dims.ep > 1:
        check_mesh(dims.world_size, dims.tp, dims.sp, ep_size=dims.ep, num_experts=model.config.num_experts)
        apply_ep(model, dims.expert_mesh["ep"])
    if compile:  # token counts differ from micro-batch to micro-batch: symbolic from the first call
        apply_compile(model, dynamic=True)
    if dims.sharded:
        apply_fsdp(model, dims.fsdp_mesh, param_dtype=param_dtype, offload=offload,
                   expert_mesh=dims.expert_mesh)


def iter_full_weights(model, bucket_bytes: int = 512 * 2**20, dtype=torch.bfloat16, rename=None):
    """Yield lists of (name, full tensor) of about bucket_bytes each, gathered from the sharded model in a
    fixed order. rename(name, full tensor) -> [(name, tensor)] maps a parameter to the engine's tensors
    (model.hf_tensors); None keeps the names. Collective: every rank iterates to the end. Extra memory: one
    bucket plus one parameter."""
    bucket, size = [], 0
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):  # cast the shard, then gather: the all-gather moves dtype bytes, not fp32
            mesh, local = p.device_mesh, p.to_local().detach()
            if local.device.type != mesh.device_type:  # param_offload keeps the shard on the host
                index = torch.get_device_module(mesh.device_type).current_device()
                local = local.to(torch.device(mesh.device_type, index))
            if mesh.size() == 1:  # the shard is the whole tensor: skip DTensor's dispatch (~0.1 ms each)
                t = local.to(dtype)
            else:
                t = DTensor.from_local(local.to(dtype), mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride()).full_tensor()
        else:
            t = p.detach().to(dtype)
        if rename is not None:
            pieces = rename(name, t)
        else:
            pieces = [(name, t)]
        for piece in pieces:
            bucket.append(piece)
            size += piece[1].numel() * piece[1].element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket


class OptimizerStateOffload:
    """optimizer_offload: the optimizer's states (AdamW's exp_avg and exp_avg_sq, 8 bytes a parameter) live in
    host memory between optimizer steps and on the accelerator only for the step, which runs there. The step's
    own hooks bring them in and send them back; a checkpoint holds them in with on_device(), and state_dict()
    or load_state_dict() bring them in until the next step. Each state tensor keeps its identity, so the
    optimizer's references stay valid: its bytes are copied to the host and its storage is resized to 0 bytes,
    then resized back and refilled before the next step (as FSDP2 frees and refills its unsharded parameters).
    The host side is one byte tape made of equal chunks of pinned memory (torch's pinned allocator rounds each
    allocation up to a power of two: one buffer per tensor could take twice the bytes)."""

    def __init__(self, optimizer: torch.optim.Optimizer, pin: bool, chunk_bytes: int = 2**30):
        self.optimizer, self.pin, self.chunk_bytes = optimizer, pin, chunk_bytes
        self.layout = None  # [(key, shape, dtype, storage bytes)] of the states the tape holds
        self.chunks = []  # the tape
        self.on_host = False
        self.held = 0  # on_device() depth: while held, a step leaves the states on the device
        self.seconds = 0.0  # spent moving the states, both ways, since the last pop_seconds()
        optimizer.register_step_pre_hook(lambda *_: self.to_device())
        optimizer.register_step_post_hook(lambda *_: self.to_host())
        # whoever reads or replaces the states gets them back on the device (until the next step ends)
        optimizer.register_state_dict_pre_hook(lambda *_: self.to_device())
        optimizer.register_load_state_dict_pre_hook(lambda *_: self.to_device())

    def states(self) -> list:
        """[((parameter index, state name), local tensor)] of every tensor state (a DTensor's local shard)."""
        out = []
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for i, p in enumerate(params):
            for name, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, DTensor):
                    value = value.to_local()  # shares the DTensor's storage
                if isinstance(value, torch.Tensor):
                    out.append(((i, name), value))
        return out

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _count(self, t0: float):
        """Add the time since t0 to self.seconds, the queued copies included."""
        if self.pin:  # an accelerator's copies run after this returns: wait for them
            torch.accelerator.synchronize()
        self.seconds += time.perf_counter() - t0

    def pieces(self, t: torch.Tensor, offset: int):
        """(t's bytes [a, b), the tape's chunk slice holding them) for t stored from tape byte `offset`."""
        flat = t.reshape(-1).view(torch.uint8)
        done = 0
        while done < flat.numel():
            chunk, start = divmod(offset + done, self.chunk_bytes)
            n = min(flat.numel() - done, self.chunk_bytes - start)
            yield flat[done:done + n], self.chunks[chunk][start:start + n]
            done += n

    def to_host(self):
        if self.on_host or self.held:
            return
        t0 = time.perf_counter()
        states = self.states()
        layout = [(key, t.shape, t.dtype, t.untyped_storage().nbytes()) for key, t in states]
        if layout != self.layout:  # the first step's new states (or a load's other ones): a tape to fit
            assert all(t.is_contiguous() and t.storage_offset() == 0 for _, t in states)
            total = sum(t.numel() * t.element_size() for _, t in states)
            sizes = [min(self.chunk_bytes, total - at) for at in range(0, total, self.chunk_bytes)]
            self.chunks = [torch.empty(n, dtype=torch.uint8, pin_memory=self.pin) for n in sizes]
            self.layout = layout
        with torch.no_grad():
            offset = 0
            for _, t in states:
                for device_bytes, host_bytes in self.pieces(t, offset):
                    host_bytes.copy_(device_bytes, non_blocking=self.pin)
                offset += t.numel() * t.element_size()
            for _, t in states:  # the copies are queued on this stream: whatever reuses the memory follows
                t.untyped_storage().resize_(0)
        self.on_host = bool(states)
        self._count(t0)

    def to_device(self):
        if not self.on_host:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            offset = 0
            for (_, t), (_, _, _, nbytes) in zip(self.states(), self.layout):
                t.untyped_storage().resize_(nbytes)
                for device_bytes, host_bytes in self.pieces(t, offset):
                    device_bytes.copy_(host_bytes, non_blocking=self.pin)
                offset += t.numel() * t.element_size()
        self.on_host = False
        self._count(t0)

    @contextlib.contextmanager
    def on_device(self):
        """The states on the device for the block (a checkpoint's save or load), and on the host after it;
        seconds counts the optimizer steps' moves only."""
        seconds = self.seconds
        self.to_device()
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            self.to_host()
            self.seconds = seconds


def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Global grad-norm clipping over a mix of plain tensors and DTensors on different meshes (TP-sharded,
    FSDP-sharded, 2-D), which torch's foreach version refuses. Returns the norm before clipping. Works on the
    local shards: one foreach norm and one all-reduce per kind of sharding, not a collective per parameter."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    groups = {}  # (device, mesh, the mesh dims sharding it) -> local gradients
    pending = []  # gradients with a pending sum (TP's Partial placement): DTensor ops reduce them
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            pending.append(g.detach())
        elif isinstance(g, DTensor):
            # Shard and _StridedShard (FSDP over TP; its is_shard() is False)
            sharded_dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
            local = g.to_local().detach()
            groups.setdefault((local.device, g.device_mesh, sharded_dims), []).append(local)
        else:
            groups.setdefault((g.device, None, ()), []).append(g.detach())
    squares = [g.float().norm().full_tensor().double().square().cpu() for g in pending]
    for (device, mesh, sharded_dims), tensors in groups.items():
        sq = torch.stack(torch._foreach_norm(tensors)).double().square().sum()
        for dim in sharded_dims:  # summed over the Shard dims: a Replicate dim holds copies
            dist.all_reduce(sq, group=mesh.get_group(dim))
        squares.append(sq.cpu())
    total = torch.stack(squares).sum().sqrt().item()
    if math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for tensors in [*groups.values(), pending]:
            if tensors:
                torch._foreach_mul_(tensors, scale)
    return total
