"""Weight pushes of a Qwen3-MoE into the engines on the CPU: vLLM (tests/helpers/fake_vllm.py, which like vLLM takes HF
names only) receives every expert as its own HF tensor, a view of the trainer's stack, and then holds exactly the
trainer's weights; the built-in engine takes nanodapo's or HF's names; bench/vllm_check.py on a random MoE."""
import json
import os

import pytest
import torch

import fake_vllm
import hf
import parallel
import rollout as R
from bench import vllm_check

# a tiny Qwen3-MoE in the demo tokenizer's vocabulary (270 ids); 6 experts, top-2
TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=272, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256, num_experts=6,
                num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)
PROMPTS = [[10, 11, 12, 13], [40, 41], [100, 7, 8, 9, 200]]
GREEDY = R.SamplingParams(n=1, temperature=0, max_tokens=10)


def hf_expert_names(layers, experts):
    return {f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"
            for i in range(layers) for e in range(experts) for proj in ("gate_proj", "up_proj", "down_proj")}


def greedy(model):
    return [c[0].token_ids for c in R.TorchEngine(model, use_cuda_graph=False).generate(PROMPTS, GREEDY)]


def perturb_experts(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.add_(torch.randn_like(p) * p.std())


@pytest.fixture
def moe_dir(tmp_path, monkeypatch):
    monkeypatch.setitem(hf.KNOWN_CONFIGS, "qwen3-30b-a3b", TINY_MOE)
    path = str(tmp_path / "moe")
    vllm_check.write_random_moe(path, "cpu", seed=3)
    return path


def test_vllm_push_gives_the_engine_the_trainers_experts_as_hf_views(monkeypatch, moe_dir):
    fake_vllm.install(monkeypatch)
    received = []
    load = fake_vllm.LLM._load
    monkeypatch.setattr(fake_vllm.LLM, "_load", lambda self, w: load(self, (received.append(x) or x for x in w)))
    trainer = hf.from_pretrained(moe_dir, dtype=torch.float32).eval()
    engine = R.VLLMEngine(moe_dir, max_model_len=64)
    llm = engine.llm
    engine.load_weights(parallel.iter_full_weights(trainer, 4096, dtype=torch.float32), version=0)

    assert ("reload",) in llm.calls  # a MoE goes through vLLM's layerwise reload
    names = [n for n, _ in received]
    assert len(names) == len(set(names))
    assert {n for n in names if ".experts." in n} == hf_expert_names(2, 6)  # 2 layers x 6 experts x 3
    assert not any(n.endswith("gate_up_proj") for n in names)
    stack = trainer.model.layers[1].mlp.experts.gate_up_proj
    for e in range(6):  # expert e's gate rows, then its up rows, of the stack [E, 2I, H]; views, not copies
        gate, up = (dict(received)[f"model.layers.1.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(gate, stack[e, :24]) and torch.equal(up, stack[e, 24:])
        assert gate.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    ours = dict(llm.model.named_parameters())
    assert all(torch.equal(ours[n], p) for n, p in trainer.named_parameters())

    engine.wake_up(["kv_cache"])
    out = [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY, version=0)]
    assert out == greedy(trainer)

    perturb_experts(trainer)  # only the experts change: the outputs change only if they are pushed
    engine.sleep()
    engine.load_weights(parallel.iter_full_weights(trainer, 4096, dtype=torch.float32), version=1)
    engine.wake_up(["kv_cache"])
    changed = [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY, version=1)]
    assert changed != out and changed == greedy(trainer)


def test_fake_vllm_refuses_a_stacked_expert_name_as_vllm_has_no_such_tensor(monkeypatch, moe_dir):
    fake_vllm.install(monkeypatch)
    llm = fake_vllm.LLM(model=moe_dir)
    with pytest.raises(KeyError, match="experts.gate_up_proj' is not an HF tensor name"):
        llm._load([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(6, 48, 64))])


@pytest.mark.parametrize("rename", [None, hf.hf_tensors])
def test_builtin_engine_loads_moe_weights_by_model_or_hf_names(moe_dir, rename):
    trainer = hf.from_pretrained(moe_dir, dtype=torch.float32).eval()
    perturb_experts(trainer)
    copy = hf.from_pretrained(moe_dir, dtype=torch.float32).eval()
    engine = R.TorchEngine(copy, use_cuda_graph=False, shares_weights=False)
    buckets = [[(hf, t) for n, p in trainer.named_parameters()
                for hf, t in (rename(n, p.detach()) if rename else [(n, p.detach())])]]
    nbytes = engine.load_weights(buckets, version=1)
    assert nbytes == sum(p.numel() * 4 for p in trainer.parameters())
    assert all(torch.equal(q, p) for q, p in zip(copy.parameters(), trainer.parameters()))
    assert [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY, version=1)] == greedy(trainer)


def test_vllm_check_writes_and_passes_on_a_random_moe_against_the_fake(monkeypatch, tmp_path, capsys):
    """--random_moe N: a random model of qwen3-30b-a3b's config (here the tiny one) cut to N layers, written
    with the demo's tokenizer, then every check, against the fake."""
    monkeypatch.setitem(hf.KNOWN_CONFIGS, "qwen3-30b-a3b", TINY_MOE)
    fake_vllm.install(monkeypatch)
    path, out = str(tmp_path / "moe"), tmp_path / "result.json"
    ok = vllm_check.main([path, "--random_moe", "1", "--device", "cpu", "--num_prompts", "4", "--max_tokens", "12",
                          "--out", str(out)])
    assert ok, capsys.readouterr().out
    cfg = hf.check_weights(path)
    assert (cfg.num_hidden_layers, cfg.num_experts) == (1, 6)
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "model.safetensors",
                                        "tokenizer.json", "tokenizer_config.json"]
    results = json.loads(out.read_text())
    assert all(r["pass"] for k, r in results.items() if k != "figures") and len(results) == 8


def replay_traj(prompts, comps, routed):
    import train_dapo as T
    R_ = max(len(c.token_ids) for c in comps)
    mask = torch.zeros(len(comps), R_)
    for i, c in enumerate(comps):
        mask[i, :len(c.token_ids)] = 1
    return T.Trajectories(prompt_ids=prompts, response_ids=[c.token_ids for c in comps], group_ids=torch.zeros(1),
                          rollout_logp=None, response_mask=mask, finish_reasons=[], data_sources=[], acc=None,
                          score=None, seq_reward=None, routed_experts=routed)


def test_router_replay_routes_the_trainers_forward_as_the_engine_did(monkeypatch, moe_dir):
    """vLLM's routed_experts (one row per token fed to the model: prompt + response - 1) align with the packed
    inputs: replaying the engine's routing gives the log-probs of the engine's own forward (here one unpacked
    sequence at a time, whose rounding can flip a near-tie that the packed forward decides otherwise); another
    routing changes them; the router still gets gradients through the weights of the replayed experts."""
    import train_dapo as T
    fake_vllm.install(monkeypatch)
    trainer = hf.from_pretrained(moe_dir, dtype=torch.float32).eval()
    engine = R.VLLMEngine(moe_dir, max_model_len=64, engine_kwargs={"enable_return_routed_experts": True})
    assert engine.llm.kwargs["enable_return_routed_experts"] is True
    engine.load_weights(parallel.iter_full_weights(trainer, 4096, dtype=torch.float32), version=0)
    params = R.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5)
    out = engine.generate(PROMPTS, params, version=0)
    prompts = [p for p in PROMPTS for _ in range(2)]
    comps = [c for cs in out for c in cs]
    for p, c in zip(prompts, comps):
        assert c.routed_experts.dtype == torch.uint8 and c.routed_experts.shape == (len(p) + len(c.token_ids) - 1, 2, 2)
    cfg = T.Config(max_response_length=8, temperature=1.0)
    idx = list(range(len(comps)))
    plain, _ = T.sequence_logprobs(trainer, replay_traj(prompts, comps, None), idx, cfg, with_entropy=False)
    routed = [c.routed_experts for c in comps]
    replayed, _ = T.sequence_logprobs(trainer, replay_traj(prompts, comps, routed), idx, cfg, with_entropy=False)
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, comps)):  # the engine's forward: this sequence alone, padded path
            seq = torch.tensor([p + c.token_ids])
            want = torch.log_softmax(trainer(seq[:, :-1])[0], -1)[len(p) - 1:].gather(-1, seq[0, len(p):, None])[:, 0]
            assert torch.allclose(replayed[i, :len(c.token_ids)], want, atol=1e-5)
    other = [(r.long() + 1) % 6 for r in routed]  # still two distinct experts per token
    changed, _ = T.sequence_logprobs(trainer, replay_traj(prompts, comps, other), idx, cfg, with_entropy=False)
    assert (changed - plain).abs().max() > 1e-3
    trainer.train()
    logp, _ = T.sequence_logprobs(trainer, replay_traj(prompts, comps, other), idx, cfg, with_entropy=False)
    logp.sum().backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in trainer.model.layers)
    with pytest.raises(RuntimeError, match="3 routed tokens for"):  # rows that do not cover the inputs
        T.sequence_logprobs(trainer, replay_traj(prompts[:1], comps[:1], [routed[0][:3]]), [0], cfg, False)


def test_the_trainer_replays_the_routing_it_generated(monkeypatch, moe_dir, tiny_dir, tmp_path):
    """The loop with router_replay: the routing vLLM returned stays with the rank that generated it and reaches
    every forward that trains or scores those trajectories (one process here; tests/test_parallel.py checks the
    exchange over ranks)."""
    import train_dapo as T
    from conftest import tiny_train_config
    fake_vllm.install(monkeypatch)
    seen = []
    forward = T.sequence_logprobs

    def recording(model, traj, idx, cfg, with_entropy, router_loads=None, device=None):
        seen.append(all(traj.routed_experts[i] is not None for i in idx))
        return forward(model, traj, idx, cfg, with_entropy, router_loads, device)

    monkeypatch.setattr(T, "sequence_logprobs", recording)
    T.train(tiny_train_config(tiny_dir, tmp_path / "run", model_path=moe_dir, rollout_engine="vllm",
                              router_replay=True, total_training_steps=2, save_freq=-1, val_files=[],
                              filter_groups=False))  # a random model never answers: keep every group
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert len(seen) >= 4 and all(seen)  # old log-probs and updates of both steps, each with its routing
