"""Qwen3-MoE in model.py against transformers' Qwen3MoeForCausalLM (the reference, test-only): logits, gradients,
the load-balancing loss, checkpoints both ways; the expert computation's two paths; sharded loading."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import hf
import model as M

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from moe_util import TINY_MOE, save_hf_moe  # noqa: E402

CASES = {  # transformers config overrides
    "top2_norm_untied": dict(norm_topk_prob=True, tie_word_embeddings=False),
    "top2_tied": dict(norm_topk_prob=False, tie_word_embeddings=True),
    "top1": dict(num_experts_per_tok=1, norm_topk_prob=False),
    "top1_norm": dict(num_experts_per_tok=1, norm_topk_prob=True),  # every weight is 1
    "dense_layers_mixed_in": dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True),
}
DENSE_MIXED_IN = ["MLP", "MoE", "MLP", "MLP", "MLP", "MoE"]  # (i + 1) % 2 == 0 and i != 3


@pytest.fixture(params=sorted(CASES))
def hf_dir(request, tmp_path):
    ref = save_hf_moe(tmp_path, **CASES[request.param])
    return ref, tmp_path


def test_loads_transformers_checkpoint_with_the_same_logits(hf_dir):
    ref, path = hf_dir
    assert (path / "model.safetensors.index.json").exists()  # sharded
    ours = hf.from_pretrained(str(path), dtype=torch.float32)
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == (DENSE_MIXED_IN if ref.config.num_hidden_layers == 6 else ["MoE", "MoE"])
    ids = torch.randint(0, TINY_MOE["vocab_size"], (3, 40))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def test_packed_logprobs_match_transformers_per_document(hf_dir):
    ref, path = hf_dir
    ours = hf.from_pretrained(str(path), dtype=torch.float32)
    docs = [torch.randint(0, 61, (n,)).tolist() for n in (7, 19, 1, 12)]
    ids, pos, batch = M.pack_sequences(docs)
    targets = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        logp, _ = ours(ids, pos, batch, target_ids=targets, temperature=0.7, logprob_chunk=8)
        ref_logits = torch.cat([ref(torch.tensor([d])).logits[0] for d in docs])
    expected = torch.log_softmax(ref_logits.double() / 0.7, -1).gather(-1, targets[0, :, None])[:, 0]
    assert (logp[0].double() - expected).abs().max().item() <= 1e-4


def test_save_pretrained_is_read_by_transformers(hf_dir, tmp_path_factory):
    ref, path = hf_dir
    ours = hf.from_pretrained(str(path), dtype=torch.float32)
    out = tmp_path_factory.mktemp("saved")
    hf.save_pretrained(ours, str(out), max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    hf_index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(hf_index)  # HF's per-expert names: model.layers.N.mlp.experts.E.gate_proj.weight, ...
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts"]) == ("qwen3_moe", TINY_MOE["num_experts"])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        assert (back(ids).logits - ref(ids).logits).abs().max().item() <= 1e-5
    again = hf.from_pretrained(str(out), dtype=torch.float32)
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_gradients_and_aux_loss_match_transformers(tmp_path):
    """Enough tokens that every expert is routed to: every expert's slice of the stacks and the router get the
    gradient transformers computes, with and without activation checkpointing; the aux loss is transformers'."""
    ref = save_hf_moe(tmp_path, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]).train()
    ours = hf.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 61, (2, 48))
    probe = torch.randn(2, 48, 61)
    out = ref(ids, output_router_logits=True)
    ((out.logits * probe).sum() + 3.0 * out.aux_loss).backward()
    expected = dict(ref.named_parameters())
    for ckpt in (False, True):
        ours.zero_grad()
        ours.gradient_checkpointing = ckpt
        loads = []
        logits = ours(ids, router_loads=loads)
        aux = M.load_balancing_loss(loads, TINY_MOE["num_experts_per_tok"])
        assert len(loads) == 2 and aux.item() == pytest.approx(out.aux_loss.item(), abs=1e-6)
        ((logits * probe).sum() + 3.0 * aux).backward()
        for name, p in ours.named_parameters():
            assert torch.allclose(p.grad, expected[name].grad, atol=1e-5), name
        for layer in (0, 2):
            mlp = ours.model.layers[layer].mlp
            assert mlp.gate.weight.grad.abs().sum(1).min() > 0  # every expert's router row
            for stack in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                assert stack.grad.flatten(1).abs().sum(1).min() > 0  # every expert


def test_load_balancing_loss_equals_transformers_function():
    torch.manual_seed(0)
    E, k = 6, 3
    logits = [torch.randn(37, E) * 2, torch.randn(37, E)]
    loads = []
    for lg in logits:
        probs = torch.softmax(lg, -1)
        loads.append(M.router_load(probs, probs.topk(k, -1).indices))
    expected = load_balancing_loss_func(tuple(logits), E, k)
    assert M.load_balancing_loss(loads, k).item() == pytest.approx(expected.item(), rel=1e-6)
    # by hand: a router that is uniform over the experts gives E * sum_e (k / E) * (1 / E) = k
    uniform = torch.full((10, E), 1.0 / E)
    assert M.load_balancing_loss([M.router_load(uniform, torch.arange(k).expand(10, k))], k).item() == \
        pytest.approx(k)


def cpu_grouped_mm_problem() -> str | None:
    """Why this torch cannot run torch._grouped_mm on the CPU, or None: asked of the op itself, with inputs of
    the types it takes (fp32, int32 offsets), before any code under test runs."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    try:
        torch._grouped_mm(torch.ones(4, 8), torch.ones(2, 8, 4), offs=torch.tensor([1, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._grouped_mm does not run on the CPU in this torch: {e}"
    return None


def test_grouped_mm_path_equals_per_expert_loop(monkeypatch):
    """The CUDA path (torch._grouped_mm over tokens sorted by expert) against the loop, run on the CPU where this
    torch has a reference _grouped_mm; expert 1 gets no token. Skipped only where the op itself cannot run; an
    error from the path (a wrong offsets dtype, say) fails."""
    problem = cpu_grouped_mm_problem()
    if problem:
        pytest.skip(problem)
    cfg = M.ModelConfig(architecture="Qwen3MoeForCausalLM", **{k: v for k, v in TINY_MOE.items()
                                                              if k not in ("vocab_size", "max_position_embeddings")})
    experts = M.Experts(cfg)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x = torch.randn(11, 32)
    ends = torch.tensor([3, 3, 7, 10, 11])
    loop = experts(x, ends)
    monkeypatch.setattr(M, "_grouped_mm_dtype", lambda t: t.dtype)
    grouped = experts(x, ends)
    by_hand = [experts.down_proj[e] @ (torch.nn.functional.silu(experts.gate_up_proj[e, :16] @ x[i]) *
                                       (experts.gate_up_proj[e, 16:] @ x[i])) for i, e in
               enumerate([0, 0, 0, 2, 2, 2, 2, 3, 3, 3, 4])]
    assert torch.allclose(loop, torch.stack(by_hand), atol=1e-4)
    assert torch.allclose(grouped, loop, atol=1e-4)


def test_check_weights_names_a_missing_expert(tmp_path):
    save_hf_moe(tmp_path, max_shard_size="10GB")
    f = tmp_path / "model.safetensors"
    tensors = safetensors.torch.load_file(str(f))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    safetensors.torch.save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        hf.check_weights(str(tmp_path))


def test_config_counts_and_published_shapes():
    big = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen3-235b-a22b"])
    assert round(big.num_params() / 1e9, 1) == 235.1 and round(big.num_active_params() / 1e9, 1) == 22.2
    small = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen3-30b-a3b"])
    assert round(small.num_params() / 1e9, 1) == 30.5 and round(small.num_active_params() / 1e9, 1) == 3.4
    dense = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen3-8b"])
    assert dense.num_active_params() == dense.num_params()
    for overrides in ({}, dict(CASES["dense_layers_mixed_in"], tie_word_embeddings=True)):
        ref = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides}))
        cfg = M.ModelConfig.from_hf(ref.config.to_dict())
        assert cfg.num_params() == sum(p.numel() for p in ref.parameters())  # parameters() counts a tied one once
        back = M.ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf(torch.bfloat16))))  # as config.json
        assert dataclasses.replace(back, hf_config={}) == dataclasses.replace(cfg, hf_config={})


@pytest.mark.slow  # torchrun
def test_fsdp_sharded_expert_stacks_load_their_rows(tmp_path):
    """2 CPU processes, FSDP over 5 experts (3 + 2 rows): each rank copies only its experts' rows."""
    save_hf_moe(tmp_path / "model")
    here = os.path.dirname(__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(here)}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(here, "helpers", "moe_util.py"), str(tmp_path / "model"), str(tmp_path / "out.pt")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    ref = hf.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
    for name, p in ref.named_parameters():
        assert torch.equal(got["full"][name], p.detach()), name
    assert torch.equal(got["local_rank0"]["model.layers.0.mlp.experts.down_proj"],
                       ref.model.layers[0].mlp.experts.down_proj.detach()[:3])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_replay_uses_the_given_experts_weighted_by_this_router(norm_topk_prob):
    """A MoE layer told each token's experts computes sum_j w_j expert_{e_j}(x), w = softmax(router logits)[e_j]
    (renormalised over the k when norm_topk_prob), by hand in float64; its own top-k reproduces the forward."""
    # its own seed: the router's probabilities are fp32, so for about 1 draw in 30 two experts' terms cancel enough
    # to leave allclose's rtol; the global RNG's state depends on which tests ran before (the tiers differ)
    torch.manual_seed(0)
    cfg = M.ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=8, intermediate_size=16,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=6, norm_topk_prob=norm_topk_prob)
    moe = M.MoE(cfg).double()
    torch.nn.init.normal_(moe.experts.gate_up_proj, std=0.5)
    torch.nn.init.normal_(moe.experts.down_proj, std=0.5)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    routed = torch.tensor([[[3, 0], [1, 2], [2, 1], [0, 3], [3, 1]]], dtype=torch.uint8)
    got = moe(x, routed=routed)[0]
    probs = torch.softmax(x[0] @ moe.gate.weight.t(), -1)
    w13, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
    for t in range(5):
        es = routed[0, t].long()
        w = probs[t, es] / (probs[t, es].sum() if norm_topk_prob else 1)
        want = sum(w[j] * w2[e] @ (torch.nn.functional.silu(w13[e, :6] @ x[0, t]) * (w13[e, 6:] @ x[0, t]))
                   for j, e in enumerate(es))
        assert torch.allclose(got[t], want, atol=1e-12)
    own = torch.softmax(moe.gate(x).float(), -1).topk(2).indices
    assert torch.allclose(moe(x, routed=own), moe(x), atol=1e-12)
