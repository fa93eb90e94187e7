"""Expert parallelism on CPU (gloo): a tiny random Qwen3-MoE trained over 2 and 4 ranks, alone and with FSDP over
the remaining ranks, against one process: log-probs, loss with the router aux loss, gradients, parameters after
AdamW steps, and the full weights pushed in HF per-expert names; TP with MoE; the mesh rules."""
import os
import sys

import pytest
import torch

import hf
import model as M
import parallel

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import dist_check  # noqa: E402
from conftest import max_diff, torchrun_dist_check  # noqa: E402

pytest.importorskip("transformers")
from moe_util import EP_MOE, save_hf_moe  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep") / "model"
    save_hf_moe(path, **EP_MOE)
    return str(path)


@pytest.fixture(scope="module")
def reference(moe_dir):
    """One process: the whole batch in one forward, the same loss, steps and push as dist_check.moe_run."""
    dims = parallel.init_distributed("cpu")
    m = hf.from_pretrained(moe_dir, dtype=torch.float32)
    routed = []  # per MoE layer, the number of rows each expert receives from each document
    count = lambda mod, args: routed.append(torch.diff(args[1], prepend=args[1].new_zeros(1)))  # noqa: E731
    hooks = [layer.mlp.experts.register_forward_pre_hook(count) for layer in m.model.layers]
    docs = dist_check.batch()
    with torch.no_grad():
        for d in docs:
            m(*M.pack_sequences([d[:-1]]), target_ids=torch.tensor([d[1:]]))
    for h in hooks:
        h.remove()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    out = dist_check.moe_run(m, opt, dims)
    out["params"] = dict(m.named_parameters())
    out["routed"] = torch.stack(routed).view(len(docs), len(m.model.layers), -1)  # [doc, layer, expert]
    return out


def test_the_batch_reaches_every_expert_and_leaves_some_rank_without_tokens(reference):
    """The premise of the cases below: every expert of every layer gets tokens (so every gradient slice is
    checked), and at 4 ranks (one document each) some rank sends no token to some expert (empty splits)."""
    routed = reference["routed"]
    assert routed.sum(0).min() > 0
    assert (routed == 0).any()


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("mode,nproc", [("ep2", 2), ("ep4", 4), ("ep2_fsdp", 4), ("moe_fsdp", 2), ("moe_tp", 2),
                                       ("ep2_compile", 2)])
def test_moe_training_matches_single_process(moe_dir, reference, tmp_path, mode, nproc):
    torchrun_dist_check(nproc, mode, moe_dir, tmp_path / "out.pt")
    got, ref = torch.load(tmp_path / "out.pt"), reference
    assert sorted(got["logp"]) == list(range(len(dist_check.batch())))
    for i, lp in ref["logp"].items():
        assert (got["logp"][i] - lp).abs().max().item() < 1e-5, i
    # the router statistics are summed over the ranks: every rank's aux loss is the one over all tokens
    assert got["aux"] == pytest.approx(ref["aux"], abs=1e-6) and got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert max(ref["grads"][k].abs().max().item() for k in ref["grads"]) > 1e-2  # large enough to see a 2x error
    assert max_diff(ref["grads"], got["grads"]) < 1e-6
    assert max_diff(ref["params"], got["params"]) < 1e-4  # 3 AdamW steps, as test_parallel.py
    # the push: HF per-expert names, the trained weights, buckets of 4096 bytes + at most one tensor
    expected = {k: v for n, p in ref["params"].items() for k, v in hf.hf_tensors(n, p.detach())}
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in got["hf"] and got["hf"].keys() == expected.keys()
    assert max_diff(expected, got["hf"]) < 1e-4
    assert max(got["bucket_bytes"][:-1]) < 4096 + max(v.numel() * 4 for v in expected.values())


def test_aux_loss_without_reduction_differs():
    """The reduction matters: the mean of per-rank aux losses (each over its own tokens) is not the aux loss over
    all tokens; reduce_router_loads on one rank (no group) returns the loads unchanged."""
    torch.manual_seed(0)
    E, k = 4, 2
    probs = [torch.softmax(torch.randn(n, E) * 2, -1) for n in (3, 9)]
    loads = [M.router_load(p, p.topk(k, -1).indices) for p in probs]
    whole = M.load_balancing_loss([loads[0] + loads[1]], k)
    allp = torch.cat(probs)
    by_hand = M.load_balancing_loss([M.router_load(allp, allp.topk(k, -1).indices)], k)
    assert whole.item() == pytest.approx(by_hand.item())
    assert abs(sum(M.load_balancing_loss([x], k).item() for x in loads) / 2 - whole.item()) > 1e-3
    assert parallel.reduce_router_loads(loads, None) is loads


@pytest.mark.parametrize("args,message", [
    (dict(world_size=8, tp_size=2, sp_size=1, ep_size=2), r"ep_size=2 with tp_size=2: .* set tp_size=1"),
    (dict(world_size=6, tp_size=1, sp_size=1, ep_size=4), r"ep_size=4 must divide the dp x sp = 6 ranks"),
    (dict(world_size=8, tp_size=1, sp_size=2, ep_size=8, num_experts=12), r"ep_size=8 must divide num_experts=12"),
    (dict(world_size=8, tp_size=1, sp_size=1, ep_size=2, num_experts=0), r"ep_size=2 must divide num_experts=0"),
    (dict(world_size=8, tp_size=1, sp_size=1, ep_size=0), r"ep_size=0 must be >= 1"),
])
def test_check_mesh_refuses_ep_combinations(args, message):
    with pytest.raises(ValueError, match=message):
        parallel.check_mesh(**args)


@pytest.mark.parametrize("world,sp,ep,experts", [(8, 1, 8, 128), (8, 2, 4, 128), (16, 8, 16, 128), (4, 1, 2, 8)])
def test_check_mesh_allows_ep_over_the_dp_and_sp_ranks(world, sp, ep, experts):
    assert parallel.check_mesh(world, 1, sp, ep_size=ep, num_experts=experts) == world // sp


def test_parallel_dims_ep_layout():
    # world 8 = dp 4 x sp 2, ep 4: fsdp index of rank 6 = 6, ep_rank 6 % 4 = 2; experts FSDP-sharded over 8 / 4
    d = parallel.ParallelDims(world_size=8, rank=6, local_rank=6, tp=1, device=torch.device("cpu"), sp=2, ep=4)
    assert (d.dp, d.fsdp_size, d.efsdp_size, d.ep_rank, d.dp_rank, d.sp_rank) == (4, 8, 2, 2, 3, 0)


@pytest.mark.slow  # torchrun
def test_router_replay_under_sequence_parallelism_matches_one_process(moe_dir, tmp_path):
    """The replayed routing is split with the tokens (2 SP ranks, 4 odd-length documents, so the row is padded):
    log-probs and gradients equal one process replaying the same routing, which differs from the router's own."""
    torchrun_dist_check(2, "sp_replay", moe_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    m = hf.from_pretrained(moe_dir, dtype=torch.float32)
    want = dist_check.replay_forward_backward(m)
    assert (got["logp"] - want["logp"]).abs().max().item() < 1e-5
    assert max(g.abs().max().item() for g in want["grads"].values()) > 1.0  # a sum over ~30 tokens: fp32 rounding
    assert max_diff(want["grads"], got["grads"]) < 1e-5  # in the 6th digit
    docs = dist_check.batch()
    with torch.no_grad():
        tgt = torch.tensor([[t for d in docs for t in d[1:]]])
        own, _ = m(*M.pack_sequences([d[:-1] for d in docs]), target_ids=tgt)
    assert (own - want["logp"]).abs().max().item() > 1e-3  # the replayed routing is not the router's own
