"""Distributed checkpoints of a tiny Qwen3-MoE across expert-parallel layouts, for tests/test_ep_checkpoint.py. Run
under torchrun (CPU processes, gloo) it runs its jobs in order, each on a fresh model loaded from MODEL_DIR:
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/ep_ckpt_util.py MODEL_DIR OUT.pt \
        save:2:CKPT load:1:OTHER_CKPT
  save:EP:PATH  SAVE_AT AdamW steps at ep_size EP (FSDP over all ranks), then checkpoint.write_checkpoint to PATH
  load:EP:PATH  checkpoint.load_checkpoint from PATH at ep_size EP
and after each records the full parameters and AdamW states, takes one more step and records the parameters again;
rank 0 saves the list of records. In one process (tests) run_job gives the same record at world size 1."""
import os
import sys

import torch
from torch.distributed.tensor import DTensor

import checkpoint
import hf
import parallel

sys.path.insert(0, os.path.dirname(__file__))
import dist_check  # noqa: E402

SAVE_AT = 2  # steps before the checkpoint: the AdamW moments hold two gradients and the step count is not 1
LR, WEIGHT_DECAY = 1e-2, 0.1


def adamw_steps(model, opt, dims, steps):
    """dist_check's MoE loss (log-probs of this rank's documents + the router aux loss over all ranks' tokens)."""
    for _ in range(steps):
        opt.zero_grad()
        dist_check.moe_loss(model, dims, dist_check.batch())[0].backward()
        parallel.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model, opt) -> dict:
    """Every parameter and its AdamW state (step, exp_avg, exp_avg_sq), gathered, by parameter name (collective)."""
    params = dict(model.named_parameters())
    return {"params": {n: full(p) for n, p in params.items()},
            "optim": {n: {k: full(v) for k, v in sorted(opt.state[p].items())} for n, p in params.items()}}


def expert_layout(model) -> tuple:
    """This rank's slice of the first expert stack: (local shape, the names of the mesh it is sharded over)."""
    p = parallel.expert_modules(model)[0].gate_up_proj
    if isinstance(p, DTensor):
        return tuple(p.to_local().shape), p.device_mesh.mesh_dim_names
    return tuple(p.shape), None


def run_job(model_dir: str, job: str) -> dict:
    """One job ('save:EP:PATH' or 'load:EP:PATH') on a fresh model at this launch's world size -> its record."""
    action, ep, path = job.split(":", 2)
    dims = parallel.init_distributed("cpu", ep=int(ep))  # the process group is made once; a new mesh per job
    shard = (lambda m: parallel.parallelize(m, dims, param_dtype=torch.float32)) if dims.sharded else None
    model = hf.from_pretrained(model_dir, dtype=torch.float32, parallelize=shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    if action == "save":
        adamw_steps(model, opt, dims, SAVE_AT)
        state = {"step": SAVE_AT, "scheduler": {}, "sampler": {}}
        export = lambda tmp: checkpoint.export_hf(model, tmp, dims, torch.float32)  # noqa: E731  (as train_dapo.save)
        checkpoint.write_checkpoint(path, model, opt, state, dims, export)
    elif action == "load":
        state = checkpoint.load_checkpoint(path, model, opt, dims)
    else:
        raise ValueError(f"job {job!r}: the action must be save or load")
    record = {"job": job, "world_size": dims.world_size, "step": state["step"], "experts": expert_layout(model),
              **full_state(model, opt)}
    adamw_steps(model, opt, dims, 1)
    record["next_params"] = full_state(model, opt)["params"]
    return record


def main(model_dir, out, *jobs):
    records = [run_job(model_dir, job) for job in jobs]
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(records, out)
    parallel.shutdown()


if __name__ == "__main__":  # with the repository root on PYTHONPATH
    main(*sys.argv[1:])
    parallel.exit_process(0)  # results written, process group destroyed: no teardown, where gloo can abort
