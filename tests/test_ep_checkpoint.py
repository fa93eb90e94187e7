"""Distributed checkpoints of a tiny Qwen3-MoE trained under expert parallelism resume at another ep_size and world
size, on CPU (gloo): saved at world 2 with ep 2 and resumed in one process, at world 2 with FSDP only, at world 4
with ep 4 and with ep 2 (experts also FSDP-sharded over 2); saved in one process and resumed at world 2 with ep 2;
saved at world 4 with ep 2 and resumed in one process. A resume holds the saved parameters and AdamW states bit for
bit, and its next step gives the saver's next step."""
import os
import sys

import pytest
import torch

import hf

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import ep_ckpt_util  # noqa: E402
from conftest import max_diff, torchrun_script  # noqa: E402

pytest.importorskip("transformers")
from moe_util import EP_MOE, save_hf_moe  # noqa: E402

pytestmark = pytest.mark.slow  # torchrun: a module fixture runs every save and resume


def launch(nproc, model_dir, out, *jobs):
    torchrun_script(nproc, "ep_ckpt_util.py", model_dir, out, *jobs)
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every save and resume, by (world size, job) with the checkpoint named by its directory: two torchrun
    launches (world 2, world 4), the world-1 runs in this process, in the order the checkpoints need."""
    root = tmp_path_factory.mktemp("ep_ckpt")
    model_dir = str(root / "model")
    save_hf_moe(model_dir, **EP_MOE)
    ck = {name: str(root / name) for name in ("one", "ep2", "ep2_of_4")}
    records = [ep_ckpt_util.run_job(model_dir, f"save:1:{ck['one']}")]
    records += launch(2, model_dir, root / "w2.pt", f"save:2:{ck['ep2']}", f"load:1:{ck['ep2']}",
                      f"load:2:{ck['one']}")
    records += launch(4, model_dir, root / "w4.pt", f"load:4:{ck['ep2']}", f"load:2:{ck['ep2']}",
                      f"save:2:{ck['ep2_of_4']}")
    records += [ep_ckpt_util.run_job(model_dir, f"load:1:{ck[name]}") for name in ("ep2", "ep2_of_4")]
    by_key = {(r["world_size"], r["job"].replace(str(root) + os.sep, "")): r for r in records}
    return {"model_dir": model_dir, "ckpt": ck, **by_key}


def test_the_saved_state_is_trained_and_sharded_as_asked(runs):
    """The premises: the checkpoint at world 2 / ep 2 holds two real AdamW steps (one process without EP, the
    reference, gets the same parameters); one more step moves them far beyond the tolerance below; each run's
    expert stacks are split as its layout says (rank 0's slice of [8 experts, 2 x 16, 32]); the HF export beside
    the shards holds the saved weights."""
    one, ep2 = runs[1, "save:1:one"], runs[2, "save:2:ep2"]
    initial = dict(hf.from_pretrained(runs["model_dir"], dtype=torch.float32).named_parameters())
    assert max_diff(one["params"], initial) > 1e-3
    assert max_diff(one["params"], ep2["params"]) < 1e-4  # as tests/test_ep.py after AdamW steps
    assert max_diff(ep2["next_params"], ep2["params"]) > 1e-3
    layouts = {key: r["experts"] for key, r in runs.items() if isinstance(key, tuple)}
    assert layouts == {
        (1, "save:1:one"): ((8, 32, 32), None), (1, "load:1:ep2"): ((8, 32, 32), None),
        (1, "load:1:ep2_of_4"): ((8, 32, 32), None),
        (2, "save:2:ep2"): ((4, 32, 32), ("efsdp", "ep")), (2, "load:2:one"): ((4, 32, 32), ("efsdp", "ep")),
        (2, "load:1:ep2"): ((4, 32, 32), ("fsdp",)),
        (4, "load:4:ep2"): ((2, 32, 32), ("efsdp", "ep")), (4, "load:2:ep2"): ((4, 16, 32), ("efsdp", "ep")),
        (4, "save:2:ep2_of_4"): ((4, 16, 32), ("efsdp", "ep"))}
    exported = dict(hf.from_pretrained(runs["ckpt"]["ep2"], dtype=torch.float32).named_parameters())
    assert all(torch.equal(exported[k], v) for k, v in ep2["params"].items())


@pytest.mark.parametrize("saved,resumed", [
    ((2, "save:2:ep2"), (1, "load:1:ep2")),  # one process
    ((2, "save:2:ep2"), (2, "load:1:ep2")),  # FSDP only
    ((2, "save:2:ep2"), (4, "load:4:ep2")),
    ((2, "save:2:ep2"), (4, "load:2:ep2")),  # experts split over 2 ranks, FSDP-sharded over the other 2
    ((1, "save:1:one"), (2, "load:2:one")),
    ((4, "save:2:ep2_of_4"), (1, "load:1:ep2_of_4")),
])
def test_checkpoint_resumes_exactly_at_another_ep_size_and_world_size(runs, saved, resumed):
    s, r = runs[saved], runs[resumed]
    assert r["step"] == s["step"] == ep_ckpt_util.SAVE_AT
    assert s["params"].keys() == r["params"].keys() == s["optim"].keys() == r["optim"].keys()
    for name, p in s["params"].items():
        assert torch.equal(r["params"][name], p), name
        assert sorted(r["optim"][name]) == ["exp_avg", "exp_avg_sq", "step"], name
        for k, v in s["optim"][name].items():
            assert torch.equal(r["optim"][name][k], v), (name, k)
    # the same step from the same state, summed in another order over other ranks: fp32 rounding only
    assert max_diff(s["next_params"], r["next_params"]) < 1e-5
