"""
Checkpoints: save, all-or-nothing resume, the HF export, and the out_dir lock.

A checkpoint is the directory out_dir/checkpoints/step_N/ holding
    dcp/                 the model and optimizer shards
                         (torch.distributed.checkpoint: reloadable at any world size)
    trainer_state.pt     step, lr scheduler, prompt sampler and every rank's RNG state; whether the step's
                         validation is still to run (a stop cut it short)
    config.json, *.safetensors, tokenizer files
                         an HF model directory of the policy (usable as a model_path, by transformers or vLLM)
    COMPLETE             written last
It is written in step_N.tmp and renamed once complete, so a crash mid-write leaves the older checkpoints as
they were. A resume checks every file of a checkpoint before it loads anything, and falls back to the previous
one when the newest is unusable.
"""
import errno
import fcntl
import json
import os
import shutil
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import parallel
from hf import load_config, save_pretrained
from model import ModelConfig

TRAINER_STATE_KEYS = ("step", "scheduler", "sampler", "rng")  # write_checkpoint adds rng
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json", "vocab.json", "merges.txt")


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or is not fit to resume from.
    reason: one line, naming the file."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = path, reason


class CheckpointInputError(ValueError):
    """What the run was given and cannot use, found before any training: a resume path that is not a usable
    checkpoint, checkpoints of which none is usable, an out_dir another run holds. Bad input, like a bad
    config (the run stops with the input exit code)."""


# -----------------------------------------------------------------------------
# the out_dir lock

def lock_out_dir(out_dir: str):
    """An exclusive lock on out_dir/.lock for the life of the process: two runs never share an out_dir.
    -> the open lock file (keep it referenced)."""
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        raise CheckpointInputError(f"out_dir={out_dir!r} is in use by pid {holder} (another nanodapo run); "
                          "wait for it or stop it, or choose another out_dir") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


# -----------------------------------------------------------------------------
# save

def save_step(out_dir: str, step: int, model, optimizer, trainer_state: dict, dims, *, dtype: torch.dtype,
              model_path: str, keep_last: int = 0):
    """Write out_dir/checkpoints/step_{step} (nothing when it is already complete), then keep only the newest
    keep_last checkpoints (0 = all)."""
    root = os.path.join(out_dir, "checkpoints")
    path = os.path.join(root, f"step_{step}")
    if os.path.isfile(os.path.join(path, "COMPLETE")):
        return

    def export(tmp):  # runs between the sharded write and the COMPLETE marker
        export_hf(model, tmp, dims, dtype, source_dir=model_path)
        fault_point("checkpoint", step)

    write_checkpoint(path, model, optimizer, trainer_state, dims, export)
    prune_checkpoints(root, keep_last, dims)


def write_checkpoint(path: str, model, optimizer, trainer_state: dict, dims, export=None):
    """DCP model and optimizer shards, the trainer state and every rank's RNG, and export(tmp_dir)
    (collective: the HF export), in path + ".tmp", renamed once complete. A failed write removes the .tmp
    directory and raises CheckpointError on every rank; older checkpoints are not touched."""
    missing = [k for k in TRAINER_STATE_KEYS if k != "rng" and k not in trainer_state]
    if missing:
        raise ValueError(f"trainer_state lacks {', '.join(missing)}: "
                         f"a resume reads {', '.join(TRAINER_STATE_KEYS)}")
    tmp, problem = path + ".tmp", None
    if dims.is_main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            problem = _write_problem(e, tmp)
    problem = _first_problem(problem, dims)
    if problem is None:
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp"),
                     no_dist=not dist.is_initialized())
            rngs = parallel.all_gather_objects(parallel.rng_state(dims.device), dims)
            if export is not None:
                export(tmp)
            if dims.is_main:
                torch.save({**trainer_state, "rng": rngs}, os.path.join(tmp, "trainer_state.pt"))
                with open(os.path.join(tmp, "COMPLETE"), "w") as f:
                    f.write("ok\n")
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)
        except (OSError, CheckpointException) as e:
            problem = _write_problem(e, tmp)
    problem = _first_problem(problem, dims)
    if problem is not None:
        if dims.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        parallel.barrier(dims)
        raise CheckpointError(path, problem)


def export_hf(model, path: str, dims, dtype, source_dir: str | None = None):
    """Full weights gathered bucket by bucket, written by rank 0 as an HF model directory
    (transformers/vLLM), with the tokenizer and generation files of source_dir, so the export works as a
    model_path."""
    full = {}
    for bucket in parallel.iter_full_weights(model, dtype=dtype):
        if dims.is_main:
            full.update((k, v.cpu()) for k, v in bucket)
    if not dims.is_main:
        return
    save_pretrained(model, path, state_dict=full)
    if source_dir is None:
        return
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(source_dir, name)):
            shutil.copy2(os.path.join(source_dir, name), os.path.join(path, name))


def complete_checkpoints(root: str) -> list[str]:
    """step_N directories under root that have their COMPLETE marker, newest first."""
    if not os.path.isdir(root):
        return []
    done = [d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()
            and os.path.isfile(os.path.join(root, d, "COMPLETE"))]
    return [os.path.join(root, d) for d in sorted(done, key=lambda d: -int(d[5:]))]


def prune_checkpoints(root: str, keep_last: int, dims):
    """Delete all but the newest keep_last complete checkpoints (call only after a new one is complete), and
    the step_N.tmp directories that a killed run left half written (this run holds out_dir's lock: no other
    writes there)."""
    if dims.is_main:
        for name in os.listdir(root):
            if name.startswith("step_") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if keep_last > 0:
            for old in complete_checkpoints(root)[keep_last:]:
                shutil.rmtree(old, ignore_errors=True)
    parallel.barrier(dims)


# -----------------------------------------------------------------------------
# resume

def resume_state(resume_from: str, out_dir: str, model, optimizer, dims, log) -> dict | None:
    """Load the newest usable checkpoint (resume_from='auto'), the given one (a path), or none ('disable')
    -> its trainer state (step, scheduler, sampler), or None for a fresh start.
    All or nothing: a checkpoint is checked completely before anything is loaded from it. With 'auto' an
    unusable one is reported and the previous one tried; if checkpoints exist but none is usable, the run
    stops."""
    root = os.path.join(out_dir, "checkpoints")
    if resume_from == "auto":
        candidates = complete_checkpoints(root)  # newest first
    elif resume_from == "disable":
        candidates = []
    else:
        candidates = [resume_from]
    tried = []
    for path in candidates:
        problem = checkpoint_problem(path) or different_model(path, model.config)
        if problem is None:
            try:
                state = load_checkpoint(path, model, optimizer, dims)
            except CheckpointError as e:  # shards half loaded: only a complete older one may replace them
                problem = f"{e.reason} (loading stopped part way)"
            else:
                log(f"resumed from {path} at step {state['step']}")
                return state
        if resume_from != "auto":
            raise CheckpointInputError(f"cannot resume from {path}: {problem}")
        log(f"warning: checkpoint {path} is unusable ({problem}); trying the previous one")
        tried.append(f"{path}: {problem}")
    if tried:
        raise CheckpointInputError("no usable checkpoint to resume from; tried:\n  " + "\n  ".join(tried) +
                          f"\nmove the broken ones out of {root}, or start over in a new out_dir")
    return None


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint at path is not fit to resume from, in one line naming the first file that fails,
    or None. Checks every file without loading a model: COMPLETE, the trainer state's keys, the DCP metadata
    and each shard it names (present, not shorter than its recorded items), the HF export's config.json."""
    if not os.path.isdir(path):
        return "no such directory"
    if not os.path.isfile(os.path.join(path, "COMPLETE")):
        return "COMPLETE is missing (the write did not finish)"
    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(state_file):
        return "trainer_state.pt is missing"
    try:
        # written by write_checkpoint: RNG states need pickle
        state = torch.load(state_file, weights_only=False)
    except Exception as e:
        return f"trainer_state.pt: {_one_line(e)}"
    missing = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        return f"trainer_state.pt lacks {', '.join(missing)}"
    shards = os.path.join(path, "dcp")
    if not os.path.isfile(os.path.join(shards, ".metadata")):
        return "dcp/.metadata is missing"
    try:
        metadata = dcp.FileSystemReader(shards).read_metadata()
        needed = {}  # shard file -> bytes its recorded items reach
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:
        return f"dcp/.metadata: {_one_line(e)}"
    for name, size in sorted(needed.items()):
        f = os.path.join(shards, name)
        if not os.path.isfile(f):
            return f"dcp/{name} is missing"
        if os.path.getsize(f) < size:
            return f"dcp/{name} is truncated ({os.path.getsize(f)} of {size} bytes)"
    try:
        with open(os.path.join(path, "config.json")) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"config.json: {_one_line(e)}"
    return None


def different_model(path: str, current: ModelConfig) -> str | None:
    """Why the checkpoint's model is not this run's, or None."""
    saved = load_config(path)
    fields = ("architecture", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    diff = [f"{f}: checkpoint {getattr(saved, f)} vs model_path {getattr(current, f)}" for f in fields
            if getattr(saved, f) != getattr(current, f)]
    if not diff:
        return None
    return f"it holds a different model ({'; '.join(diff)})"


def load_checkpoint(path: str, model, optimizer, dims) -> dict:
    """Load shards saved at any world size into this run's sharding, and this rank's RNG state -> the
    trainer state. Every file is checked first, so a bad one raises CheckpointError before the model or
    optimizer changes. Should DCP still fail (bytes corrupted in place), the shards are partly loaded: load
    another checkpoint, never train on."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(path, problem)
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sharded = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(sharded, checkpoint_id=os.path.join(path, "dcp"), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(path, f"dcp: {_one_line(e)}") from e
    set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optim"])
    rngs = state.pop("rng")
    parallel.set_rng_state(rngs[dims.rank % len(rngs)], dims.device)
    return state


def apply_optimizer_knobs(cfg, optimizer, scheduler, log):
    """After a resume, this run's lr, betas and weight decay replace the checkpoint's (said when they
    differ); the schedule's shape comes from the config, its position from the checkpoint."""
    group = optimizer.param_groups[0]
    saved = {"lr": scheduler.base_lrs[0], "betas": tuple(group["betas"]),
             "weight_decay": group["weight_decay"]}
    for k, old in saved.items():
        if old != getattr(cfg, k):
            log(f"resume: {k}={getattr(cfg, k)} replaces the checkpoint's {old}")
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group.update(lr=cfg.lr * factor, initial_lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


# -----------------------------------------------------------------------------
# errors in one line, and the crash tests' hook

def _cause(e: BaseException) -> BaseException:
    """The first failed rank's exception behind DCP's CheckpointException (a BaseException); else e itself."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        if isinstance(first, tuple):
            return first[0]
        return first
    return e


def _one_line(e: BaseException) -> str:
    e = _cause(e)
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[0]}"


def _write_problem(e: BaseException, tmp: str) -> str:
    cause = _cause(e)
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return (f"No space left on device while writing {tmp}; removed it, older checkpoints are intact; "
                "free disk space or point out_dir at a larger disk")
    return f"writing {tmp} failed ({_one_line(e)}); removed it, older checkpoints are intact"


def _first_problem(problem: str | None, dims) -> str | None:
    """The first rank's problem, on every rank (collective: every rank calls it at the same point)."""
    return next((p for p in parallel.all_gather_objects(problem, dims) if p), None)


def fault_point(name: str, step: int):
    """Fault-injection hook for the crash tests: NANODAPO_FAULT=name:step kills this process with SIGKILL."""
    if os.environ.get("NANODAPO_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
