"""checkpoint.py's checkpoints in one process on the CPU: a saved checkpoint checks out and resumes exactly; each kind
of damage (truncated shard, missing or corrupt file) is named by checkpoint_problem and stops load_checkpoint
before it touches the model; a full disk leaves no partial directory and older checkpoints intact."""
import errno
import json
import os
import sys

import pytest
import torch

import checkpoint
import hf
import model as M
import parallel

import dist_check  # noqa: E402

STATE = {"step": 3, "scheduler": {"last_epoch": 5}, "sampler": {"epoch": 1, "index": 7}}
DIMS = parallel.ParallelDims(world_size=1, rank=0, local_rank=0, tp=1, device=torch.device("cpu"))


def trained(seed=0):
    """A tiny Qwen3 after one AdamW step (so the optimizer has moments to save)."""
    model = M.Transformer(dist_check.tiny_config()).init_weights(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dist_check.train_steps(model, opt, DIMS, steps=1)
    return model, opt


def save(path, model, opt, state=STATE):
    checkpoint.write_checkpoint(str(path), model, opt, state, DIMS, export=lambda tmp: hf.save_pretrained(model, tmp))


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def ckpt(tmp_path):
    model, opt = trained()
    save(tmp_path / "step_3", model, opt)
    return tmp_path / "step_3"


def test_saved_checkpoint_checks_out_and_resumes_exactly(tmp_path):
    model, opt = trained()
    ckpt = tmp_path / "step_3"
    torch.manual_seed(123)
    save(ckpt, model, opt)
    expected_draw = torch.rand(4)  # what the generator gives right after the save
    assert checkpoint.checkpoint_problem(str(ckpt)) is None
    assert sorted(os.listdir(ckpt)) == ["COMPLETE", "config.json", "dcp", "model.safetensors", "trainer_state.pt"]
    fresh, fresh_opt = trained(seed=1)
    torch.manual_seed(0)
    state = checkpoint.load_checkpoint(str(ckpt), fresh, fresh_opt, DIMS)
    assert state == STATE
    assert torch.equal(torch.rand(4), expected_draw)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for p, q in zip(model.parameters(), fresh.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], fresh_opt.state[q][k])


def truncate_shard(path):
    f = path / "dcp" / "__0_0.distcp"
    full = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(full // 2)
    return f"dcp/__0_0.distcp is truncated ({full // 2} of {full} bytes)"


def write(path, name, content: bytes, reason: str):
    (path / name).write_bytes(content)
    return reason


DAMAGE = {  # what is done to a good checkpoint -> the exact reason, or its start
    "truncated shard": truncate_shard,
    "missing shard": lambda p: os.remove(p / "dcp" / "__0_0.distcp") or "dcp/__0_0.distcp is missing",
    "missing metadata": lambda p: os.remove(p / "dcp" / ".metadata") or "dcp/.metadata is missing",
    "corrupt metadata": lambda p: write(p, "dcp/.metadata", b"\x80\x04garbage", "dcp/.metadata: UnpicklingError"),
    "missing trainer state": lambda p: os.remove(p / "trainer_state.pt") or "trainer_state.pt is missing",
    "corrupt trainer state": lambda p: write(p, "trainer_state.pt", b"not a pickle",
                                             "trainer_state.pt: UnpicklingError: invalid load key"),
    "trainer state without rng": lambda p: torch.save({"step": 3, "scheduler": {}}, p / "trainer_state.pt")
    or "trainer_state.pt lacks sampler, rng",
    "missing COMPLETE": lambda p: os.remove(p / "COMPLETE") or "COMPLETE is missing (the write did not finish)",
    "corrupt config.json": lambda p: write(p, "config.json", b'{"hidden_size": ', "config.json: JSONDecodeError"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_checkpoint_problem_names_the_damage(ckpt, damage):
    reason = DAMAGE[damage](ckpt)
    problem = checkpoint.checkpoint_problem(str(ckpt))
    assert problem is not None and problem.startswith(reason), problem
    assert "\n" not in problem


@pytest.mark.parametrize("damage", ["truncated shard", "corrupt trainer state", "missing COMPLETE"])
def test_failed_load_leaves_model_and_optimizer_unchanged(ckpt, damage):
    reason = DAMAGE[damage](ckpt)
    model, opt = trained(seed=1)
    before, opt_before = snapshot(model), {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint {ckpt}: ") as e:
        checkpoint.load_checkpoint(str(ckpt), model, opt, DIMS)
    assert e.value.reason.startswith(reason)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, s in opt.state.items():
        assert all(torch.equal(v, opt_before[id(p)][k]) for k, v in s.items())


def test_shard_bytes_corrupted_in_place_raise_checkpoint_error(ckpt):
    """Bytes zeroed in place pass the size checks; DCP's CheckpointException (a BaseException) while reading
    becomes a CheckpointError with a one-line cause."""
    f = ckpt / "dcp" / "__0_0.distcp"
    f.write_bytes(bytes(os.path.getsize(f)))
    assert checkpoint.checkpoint_problem(str(ckpt)) is None
    model, opt = trained(seed=1)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_checkpoint(str(ckpt), model, opt, DIMS)
    assert e.value.reason.startswith("dcp: UnpicklingError") and "\n" not in e.value.reason


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["dcp shards", "export"])
def test_full_disk_removes_the_partial_checkpoint_and_keeps_older_ones(ckpt, monkeypatch, where):
    root = ckpt.parent
    model, opt = trained()
    if where == "dcp shards":  # torch.distributed.checkpoint writes each tensor with torch.save
        monkeypatch.setattr(torch, "save", enospc)
        export = None
    else:
        export = enospc
    new = root / "step_4"
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.write_checkpoint(str(new), model, opt, {**STATE, "step": 4}, DIMS, export=export)
    assert "No space left on device" in str(e.value) and str(new) in str(e.value)
    assert sorted(os.listdir(root)) == ["step_3"]  # no step_4, no step_4.tmp
    monkeypatch.undo()
    assert checkpoint.checkpoint_problem(str(ckpt)) is None
    assert checkpoint.complete_checkpoints(str(root)) == [str(ckpt)]


def test_other_write_errors_are_named_too(tmp_path):
    model, opt = trained()

    def export(tmp):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    with pytest.raises(checkpoint.CheckpointError, match=r"writing .*step_1.tmp failed \(OSError: \[Errno 5\]"):
        checkpoint.write_checkpoint(str(tmp_path / "step_1"), model, opt, STATE, DIMS, export=export)
    assert os.listdir(tmp_path) == []


def test_save_refuses_a_trainer_state_a_resume_could_not_use(tmp_path):
    model, opt = trained()
    with pytest.raises(ValueError, match="trainer_state lacks sampler"):
        checkpoint.write_checkpoint(str(tmp_path / "step_1"), model, opt, {"step": 1, "scheduler": {}}, DIMS)
    assert os.listdir(tmp_path) == []


def test_complete_checkpoints_newest_first_and_pruning(tmp_path):
    model, opt = trained()
    for step in (1, 2, 10):
        save(tmp_path / f"step_{step}", model, opt, {**STATE, "step": step})
    (tmp_path / "step_11.tmp").mkdir()  # an interrupted write
    (tmp_path / "step_12").mkdir()  # no COMPLETE marker
    assert checkpoint.complete_checkpoints(str(tmp_path)) == [str(tmp_path / f"step_{s}") for s in (10, 2, 1)]
    checkpoint.prune_checkpoints(str(tmp_path), keep_last=2, dims=DIMS)
    assert sorted(os.listdir(tmp_path)) == ["step_10", "step_12", "step_2"]  # the interrupted write is gone too
    assert json.loads((tmp_path / "step_10" / "config.json").read_text())["hidden_size"] == 32
