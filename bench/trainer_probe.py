"""
train_dapo.py as shipped, with each policy update observed from outside: its wall time (the device idle at both
ends), its tokens, the allocator's retries and device allocations, the graphs torch.compile made during it, and
with --profile-update N the Nth update under torch.profiler (kernel time by kind, top kernels, top host operators).
Written to --probe-out after every update; the run itself (config, metrics.jsonl, checkpoints) is train_dapo.py's.

    python bench/trainer_probe.py --probe-out probe.json --profile-update 3 CONFIG [--key=value ...]

bench/step.py runs its nanodapo sides through this.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # the repo root, not bench/

import torch  # noqa: E402

import parallel  # noqa: E402
import train_dapo  # noqa: E402
from bench.common import dump, print_profile, profile_call, timed  # noqa: E402

p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
p.add_argument("--probe-out", required=True, help="JSON: one record per update")
p.add_argument("--profile-update", type=int, default=0, help="profile the Nth update (from 1; 0: none)")
args, trainer_argv = p.parse_known_args()

ALLOCATOR_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free")
RES = {"argv": trainer_argv, "profile_update": args.profile_update, "updates": []}
inner = train_dapo.update_policy


def allocator_stats(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ALLOCATOR_STATS}


def update_policy(model, optimizer, scheduler, traj, cfg, dims):
    n = len(RES["updates"]) + 1
    before, graphs = allocator_stats(dims.device), parallel.compiled_graphs()
    result = {}

    def call():
        result["metrics"] = inner(model, optimizer, scheduler, traj, cfg, dims)
    record = {"update": n, "trajectories": len(traj),
              "tokens": sum(len(a) + len(b) for a, b in zip(traj.prompt_ids, traj.response_ids))}
    if n == args.profile_update:
        prof = profile_call(call, dims.device)
        print(f"update {n} profiled:")
        print_profile(prof)
        record.update(wall_s=prof["wall_s (profiled, slower)"], profile=prof)
    else:
        record["wall_s"] = round(timed(call, dims.device)[0], 4)
    after = allocator_stats(dims.device)
    record.update({k: after[k] - before[k] for k in after})
    record["compiled_graphs"] = parallel.compiled_graphs() - graphs
    print(f"update {n}: {record['wall_s']:.2f} s, {record['tokens']} tokens, "
          + ", ".join(f"{k} {record[k]}" for k in (*after, "compiled_graphs")), flush=True)
    RES["updates"].append(record)
    dump(RES, args.probe_out)
    return result["metrics"]


train_dapo.update_policy = update_policy  # train_step calls it by its module name
if __name__ == "__main__":
    sys.exit(train_dapo.main(trainer_argv))
