"""Ulysses sequence parallelism on CPU: 2 (and 4, with TP) gloo processes against one process, on packed
documents whose total length is not a multiple of sp, with GQA down to one kv head; per-block torch.compile."""
import os
import sys

import pytest
import torch

import hf
import model as M
import parallel
import plan

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import dist_check  # noqa: E402
from conftest import (GiB, compile_unavailable, max_diff, plan_bytes, planner_cfg, planner_model,  # noqa: E402
                      torchrun_dist_check)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """kv heads -> a tiny Qwen3 checkpoint (4 query heads; q/k norms)"""
    root = tmp_path_factory.mktemp("sp")
    for kv in (2, 1):
        model = M.Transformer(dist_check.tiny_config(kv_heads=kv)).init_weights(seed=kv)
        hf.save_pretrained(model, str(root / f"kv{kv}"))
    return {kv: str(root / f"kv{kv}") for kv in (2, 1)}


def single_process(model_dir):
    dims = parallel.init_distributed("cpu")
    m = hf.from_pretrained(model_dir, dtype=torch.float32)
    result = dist_check.forward_backward(m, dims)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    result["losses"] = dist_check.train_steps(m, opt, dims)
    result["params"] = dict(m.named_parameters())
    return result


# kv=2, sp=2: one kv head per rank; kv=1, sp=2: the kv head is repeated; sp_tp: tp=2 then sp=2 splits the
# 4 query heads to 1 per rank and the 1 kv head per TP rank is repeated; sp4: 2 kv heads repeated to 4, in
# the order that keeps each query head on its own kv head; sp_compile: sp=2 with compiled blocks
@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("mode,nproc,kv", [("sp", 2, 2), ("sp", 2, 1), ("sp_tp", 4, 2), ("sp4", 4, 2),
                                           ("sp_compile", 2, 1)])
def test_sequence_parallel_matches_single_process(model_dirs, tmp_path, mode, nproc, kv):
    ref = single_process(model_dirs[kv])
    torchrun_dist_check(nproc, mode, model_dirs[kv], tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    T = sum(len(d) - 1 for d in dist_check.batch())
    assert T % 2 == 1 and got["logp"].shape == (1, T)  # 25 tokens: padded to 26 inside, dropped again
    for key in ("logp", "entropy", "logp_no_grad", "logits", "logp_ignored"):
        assert (got[key] - ref[key]).abs().max().item() < 1e-5, key
    assert (got["logp_ignored"][0, :14] == 0).all()  # ignored targets: not computed
    assert (got["logp_ignored"][0, 14:] - got["logp"][0, 14:]).abs().max().item() < 1e-5
    assert max_diff(ref["grads_ignored"], got["grads_ignored"]) < 1e-6
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    # FSDP sums gradients over the fsdp_size ranks: the SP ranks' partial gradients (each from its own tokens)
    # must add up to the single process's
    assert max(ref["grads"][k].abs().max().item() for k in ref["grads"]) > 1e-2  # large enough to see a 2x error
    assert max_diff(ref["grads"], got["grads"]) < 1e-6
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert max_diff(ref["params"], got["params"]) < 1e-4  # 3 AdamW steps, as test_parallel.py


def test_sp_size_must_divide_world_and_heads(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"sp_size=4 x tp_size=2 = 8 must divide the world size 4"):
        parallel.init_distributed("cpu", tp=2, sp=4)
    m = M.Transformer(dist_check.tiny_config())  # 4 query heads
    with pytest.raises(ValueError, match=r"num_attention_heads=4 must be divisible by tp_size x sp_size = 2 x 4"):
        parallel.apply_sp(m, type("Mesh", (), {"size": lambda self: 4})(), tp=2)


def test_parallel_dims_rank_layout():
    # world 8 = dp 2 x sp 2 x tp 2: rank 5 = (dp_rank 1 * 2 + sp_rank 0) * 2 + tp_rank 1
    d = parallel.ParallelDims(world_size=8, rank=5, local_rank=5, tp=2, device=torch.device("cpu"), sp=2)
    assert (d.dp, d.fsdp_size, d.dp_rank, d.sp_rank) == (2, 4, 1, 0)
    d1 = parallel.ParallelDims(world_size=8, rank=5, local_rank=5, tp=2, device=torch.device("cpu"))
    assert (d1.dp, d1.fsdp_size, d1.dp_rank, d1.sp_rank) == (4, 4, 2, 0)  # sp = 1: as before


@pytest.mark.slow  # torch.compile (Inductor)
@pytest.mark.parametrize("checkpointing", [True, False])  # without: the compiled head keeps its logits
def test_compiled_blocks_match_eager(checkpointing):
    reason = compile_unavailable()
    if reason:
        pytest.skip(f"torch.compile unusable on this CPU: {reason}")
    cfg = dist_check.tiny_config(kv_heads=1)
    eager, compiled = (M.Transformer(cfg).init_weights(seed=0) for _ in range(2))
    parallel.apply_compile(compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]  # HF names kept
    # two packed lengths (the second recompiles with a symbolic length), with activation checkpointing
    for docs in (dist_check.batch(0), dist_check.batch(1)[:3]):
        ids, pos, _ = M.pack_sequences([d[:-1] for d in docs])
        tgt = torch.tensor([t for d in docs for t in d[1:]])[None]
        out = {}
        for name, m in (("eager", eager), ("compiled", compiled)):
            m.zero_grad()
            m.gradient_checkpointing = checkpointing
            logp, ent = m(ids, pos, M.pack_sequences([d[:-1] for d in docs])[2], target_ids=tgt, with_entropy=True)
            (-logp.mean() - ent.mean()).backward()
            out[name] = logp.detach(), {n: p.grad for n, p in m.named_parameters()}
        assert (out["compiled"][0] - out["eager"][0]).abs().max().item() < 1e-5
        assert max_diff(out["compiled"][1], out["eager"][1]) < 1e-5
    assert all(b._compiled_call_impl is not None for b in compiled.model.layers)


def test_memory_plan_divides_activations_by_sp():
    """The memory planner's tiny model (conftest.planner_model, worked out in tests/test_plan.py) by hand, at
    world 8 = dp 2 x sp 2 x tp 2."""
    with_sp = lambda **kw: planner_cfg(**kw, sp_size=2)  # noqa: E731
    base = plan_bytes(plan.memory_plan(planner_cfg(), planner_model(), 8, 80, runtime_gib=0))
    p = plan.memory_plan(with_sp(), planner_model(), 8, 80, runtime_gib=0)
    b = plan_bytes(p)
    assert (p["dp"], p["sp"], p["tp"]) == (2, 2, 2)
    # FSDP shards over dp x sp = 4 ranks, as over dp = 4 without SP: 2*36,992/8 + 128,320/4 = 41,328 params a GPU
    assert b["params"] == base["params"] == 4 * 41_328
    assert b["working"] == base["working"] and b["kv_cache"] == base["kv_cache"]
    # 2 x 64 = 128 tokens a micro-batch, 64 on each SP rank: block inputs 64 * 64 * 2 bytes * 2 layers + 64 * 1,792
    assert b["activations"] == 16_384 + 64 * 1_792 == base["activations"] // 2
    assert b["logprob_buffer"] == base["logprob_buffer"] == 16 * 1000 * 12  # chunk 16 < 64 tokens
    p = plan.memory_plan(with_sp(logprob_chunk=100), planner_model(), 8, 80, runtime_gib=0)
    assert round(p["gib"]["logprob_buffer"] * GiB) == 64 * 1000 * 12  # a chunk holds only this GPU's 64 tokens
    # use_dynamic_bsz: the budget stays per GPU (verl's convention), so a micro-batch holds budget x sp tokens
    p = plan.memory_plan(with_sp(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=256), planner_model(), 8, 80,
                             runtime_gib=0)
    assert p["tokens_per_micro_batch"] == 512
    assert round(p["gib"]["activations"] * GiB) == 256 * 64 * 2 * 2 + 256 * 1_792
    text = plan.format_memory_plan([p])
    assert "world 8 = dp 2 x sp 2 x tp 2, 512 tokens per update micro-batch (256 per GPU)" in text
    assert "sp_size" in plan._memory_knob("activations", with_sp(), True)  # with checkpointing on
