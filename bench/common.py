"""What the bench/ scripts share: results JSON, device timing, a profile's kernel time by kind, the vLLM
environment, random-init models, the peak of a CUDA memory history by allocation site."""
import importlib.metadata
import json
import math
import os
import random
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf
import model as M
from demo.warmstart import write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# vLLM in the trainer's process: no engine subprocess, no FlashInfer sampler, NVLink multicast off, offline
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}

# 2 layers, 64 wide: the shape of every script's --tiny CPU run
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096)


def dump(res: dict, path: str):
    """Write the results so far (scripts call this after every stage: a killed run keeps what it measured)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


def out_path(arg: str | None, name: str) -> str:
    """--out if given, else $OUT/{name}.json, else ./bench_{name}.json."""
    if arg:
        return arg
    return os.path.join(os.environ["OUT"], f"{name}.json") if os.environ.get("OUT") else f"bench_{name}.json"


def versions() -> dict:
    """Python, torch and (where installed) transformers versions, for the results JSON."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        out["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


def sync(device: torch.device):
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def timed(fn, device: torch.device):
    """-> (seconds, fn()), the device idle at both ends."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def median_seconds(fn, device: torch.device, reps: int = 10) -> float:
    """Median seconds of one call after one warm-up: device events on an accelerator, the host clock on the CPU."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cpu":
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        else:
            events = torch.get_device_module(device.type).Event
            a, b = events(enable_timing=True), events(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def matmul_peak(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of a bf16 n^3 matmul on random data, median of reps: the MFU denominator, measured in the same run."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(4):
        torch.matmul(a, b, out=c)
    peak = 2 * n ** 3 / median_seconds(lambda: torch.matmul(a, b, out=c), device, reps)
    assert torch.isfinite(c).all()
    return peak


KERNEL_KINDS = (  # first match wins; names of CUDA kernels (cuBLAS/CUTLASS/nvjet GEMMs, flash attention, torch's own)
    ("attention", ("flash", "fmha", "attention", "sdpa")),  # before matmul: flash kernels name cutlass types
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "addmm", "aten::mm", "mmbackward")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy/cast", ("copy", "cast", "convert", "fill")),
    ("reduction (softmax, norms, sums)", ("reduce", "softmax", "norm", "logsumexp", "cross_entropy")),
    ("elementwise", ("elementwise", "vectorized", "index", "gather", "scatter")),
    ("communication", ("nccl",)),
)


def kernel_kind(name: str) -> str:
    n = name.lower().replace("nocast", "")  # torch's gpu_kernel_impl_nocast<...> is element-wise, not a cast
    return next((kind for kind, keys in KERNEL_KINDS if any(k in n for k in keys)), "other")


def profile_call(fn, device: torch.device) -> dict:
    """fn() once under torch.profiler: the wall time, the summed kernel time by kind (GPU: device kernels;
    CPU: operators' self time), the top 12 kernels and, on a GPU, the top 15 operators but matmuls (with their input
    shapes) by the device time of the kernels they launch. Kernel time below wall time = the GPU waited on the host."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=cuda) as prof:
        wall, _ = timed(fn, device)
    if cuda:
        evts = [e for e in prof.key_averages()  # not "## Call CompiledFxGraph ##": annotations span kernels
                if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("##")]
        us = [getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in evts]
    else:
        evts = list(prof.key_averages())
        us = [e.self_cpu_time_total for e in evts]
    total = sum(us) / 1e6
    kinds = {}
    for e, u in zip(evts, us):
        k = kernel_kind(e.key)
        kinds[k] = kinds.get(k, 0.0) + u / 1e6
    top = sorted(zip(evts, us), key=lambda x: -x[1])[:12]
    out = {"wall_s (profiled, slower)": round(wall, 4), "kernel_s": round(total, 4),
           "kernel_busy_fraction": round(total / wall, 3),
           "by_kind_s": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
           "top_kernels": [{"name": e.key[:160], "s": round(u / 1e6, 4), "calls": e.count, "kind": kernel_kind(e.key)}
                           for e, u in top]}
    if cuda:  # which operator launched them: the same kernel name hides e.g. a gradient sum and a residual add
        ops = [e for e in prof.key_averages(group_by_input_shape=True)  # the matmuls are known: the rest
               if e.device_type != torch.autograd.DeviceType.CUDA and e.key not in ("aten::mm", "aten::addmm")]
        out["top_ops"] = [{"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count,
                           "s": round(e.self_device_time_total / 1e6, 4)}
                          for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:15]]
        # the host's side: where the GPU waits on Python, these take the time
        host = [e for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CUDA]
        out["top_host_ops"] = [{"op": e.key[:160], "calls": e.count, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4)}
                               for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:12]]
    return out


def print_profile(out: dict):
    """profile_call's summary, a few lines."""
    wall, total = out["wall_s (profiled, slower)"], out["kernel_s"]
    print(f"  profile: wall {wall:.3f} s, kernels {total:.3f} s ({total / wall:.0%} busy); by kind: " +
          ", ".join(f"{k} {v:.3f}" for k, v in out["by_kind_s"].items()))
    for k in out["top_kernels"][:8]:
        print(f"    {k['s']:8.4f} s  x{k['calls']:<5d} [{k['kind']}] {k['name'][:110]}")
    for o in out.get("top_ops", [])[:10]:
        print(f"    op {o['s']:8.4f} s  x{o['calls']:<5d} {o['op']} {o['shapes'][:100]}")


def lognormal_length(rng: random.Random, median: float, sigma: float, floor: int, cap: int) -> int:
    """One response length as a DAPO run's are spread: lognormal around median (log-space sigma), clipped to
    [floor, cap]."""
    return max(floor, min(cap, round(math.exp(rng.gauss(math.log(median), sigma)))))


def update_flops(cfg: M.ModelConfig, seq_lens: list[int], resp_lens: list[int]) -> float:
    """Model FLOPs of one update over these sequences (prompt + response tokens each), one formula for every
    trainer: 6 * N_blocks * tokens for the non-embedding parameters (top-k experts), 6 * V*H * response tokens
    for the output head (an update needs no log-prob of a prompt token, so a trainer that computes them does
    work this does not count), and causal attention, 6 * L * heads * head_dim * sum(n_i^2). Recomputation
    (checkpointing) is not counted: MFU, not HFU."""
    head = cfg.vocab_size * cfg.hidden_size
    n_blocks = cfg.num_active_params() - head * (1 if cfg.tie_word_embeddings else 2)
    attn_fwd = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * sum(n * n for n in seq_lens)
    return 6 * n_blocks * sum(seq_lens) + 6 * head * sum(resp_lens) + 3 * attn_fwd


def model_config(shape: str, tiny: bool = False) -> M.ModelConfig:
    """A published shape from model.KNOWN_CONFIGS, or TINY for CPU runs."""
    return M.ModelConfig(**TINY) if tiny else M.ModelConfig.from_hf(hf.KNOWN_CONFIGS[shape])


def random_model(cfg: M.ModelConfig, device, dtype=torch.float32, seed: int = 0) -> M.Transformer:
    """Random weights drawn on the device (seconds on a GPU instead of a minute on the CPU), then cast."""
    with torch.device(device):
        m = M.Transformer(cfg)
    return m.init_weights(seed=seed).to(dtype)


def write_random_model(path: str, cfg: M.ModelConfig, device, seed: int = 0):
    """An HF model directory: config.json, bf16 safetensors, the demo's byte-level tokenizer and chat template
    (a few hundred ids, inside any real model's vocabulary and TINY's)."""
    hf.save_pretrained(random_model(cfg, device, torch.bfloat16, seed), path)
    write_tokenizer(path)


# -----------------------------------------------------------------------------
# what is live at the peak of a torch.cuda.memory._snapshot() history

OUR_FILES = ("model.py", "train_dapo.py", "parallel.py", "rollout.py")
RESIDENT = "resident before the step"
NO_FRAMES = "autograd engine (no Python frames: grads, saved activations)"
# the torch machinery a frame belongs to, by path fragment; frames run innermost first, the first match wins
TORCH_KINDS = (("torch/optim/", "optimizer"), ("torch/distributed/fsdp/", "fsdp"),
               ("torch/utils/checkpoint.py", "checkpoint"), ("torchinductor", "compiled"),
               ("torch/_inductor/", "compiled"), ("torch/_functorch/", "autograd"), ("torch/autograd/", "autograd"))
RECOMPUTE_FNS = ("recompute_fn", "unpack_hook", "unpack_hook_with_error_cb")  # checkpoint.py, inside backward


def allocation_label(frames: list[dict]) -> str:
    """Frames (innermost first, as torch records them) -> "file:function:line" of the innermost frame in this
    repo's files, tagged [kind] when torch machinery (TORCH_KINDS) is on the stack; else the kind alone."""
    ours = next((f for f in frames if os.path.dirname(os.path.abspath(f["filename"])) == ROOT
                 and os.path.basename(f["filename"]) in OUR_FILES), None)
    kind = None
    for f in frames:
        path = f["filename"].replace(os.sep, "/")
        kind = next((k for frag, k in TORCH_KINDS if frag in path), None)
        if kind is not None:
            break
    if kind == "checkpoint" and any(f["name"] in RECOMPUTE_FNS for f in frames if "checkpoint" in f["filename"]):
        kind = "checkpoint recompute"
    if ours is None:
        return kind or (NO_FRAMES if not frames else "other")
    site = f"{os.path.basename(ours['filename'])}:{ours['name']}:{ours['line']}"
    return f"{site} [{kind}]" if kind else site


def peak_breakdown(snapshot: dict, device: int = 0) -> dict:
    """A torch.cuda.memory._snapshot() taken after recording history over a step -> the moment of peak allocated
    bytes in the trace and what was live then, bytes by allocation_label; allocations that were live when recording
    began (freed in the trace before any alloc of theirs, or still live at the end and never allocated in it) go
    under RESIDENT. Memory counts as allocated from "alloc" until "free_completed" (a "free_requested" block may
    still be in use by another stream). -> {"peak_bytes", "resident_bytes", "peak_event", "events",
    "by_label": {label: bytes}, largest first}."""
    trace = snapshot["device_traces"][device]
    end_live = {b["address"]: b["size"] for seg in snapshot["segments"] if seg.get("device", device) == device
                for b in seg["blocks"] if b["state"] in ("active_allocated", "active_awaiting_free")}
    first = {}  # address -> its first alloc/free event in the trace
    for e in trace:
        if e["action"] in ("alloc", "free_requested", "free_completed"):
            first.setdefault(e["addr"], e)
    live = {a: (s, RESIDENT) for a, s in end_live.items() if a not in first}
    live.update({a: (e["size"], RESIDENT) for a, e in first.items() if e["action"] != "alloc"})
    total = peak = sum(s for s, _ in live.values())
    peak_i = -1  # -1: the peak is the resident state itself
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            total += e["size"]
            if total > peak:
                peak, peak_i = total, i
        elif e["action"] == "free_completed":
            total -= e["size"]
    for e in trace[:peak_i + 1]:  # replay again up to the peak, now keeping each allocation's label
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], allocation_label(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_label = {}
    for size, label in live.values():
        by_label[label] = by_label.get(label, 0) + size
    return {"peak_bytes": peak, "resident_bytes": by_label.get(RESIDENT, 0), "peak_event": peak_i,
            "events": len(trace), "by_label": dict(sorted(by_label.items(), key=lambda kv: -kv[1]))}
