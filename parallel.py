"""
Devices, in one place: which accelerator (cuda / npu / cpu), its process-group backend, autocast,
RNG state, synchronize and memory stats. Nothing else in nanodapo names a device type.

(Multi-GPU training — process groups, the device mesh, FSDP2, TP, sequence parallel — lands here too.)
"""
import contextlib
import random

import numpy as np
import torch

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
