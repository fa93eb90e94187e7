"""Partial rollout (rollout.generate_resumable, used by asynchronous mode's generators): newer weights stop a
generation between decode steps, and the unfinished responses go on with them. Checked on both engines (vLLM
through tests/helpers/fake_vllm.py and its stepped engine): every token's log-prob is the log-prob, under the weights of
the version it is tagged with, of that token given everything before it (so the continuation ran on the new
weights, with its KV computed again, not on the old cache), the versions switch exactly where the pause came, and
the responses are complete. Also the per-prompt token budgets a continuation uses, and the per-token staleness
metrics of the trainer."""
import copy
from types import SimpleNamespace

import pytest
import torch

import data
import hf
import model as M
import parallel
import rollout as R
import train_dapo as T
from conftest import make_model_dir
from fake_vllm import install

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [10, 11]]
TEMPERATURE = 1.3


class PauseAt:
    """generate_resumable's pause: requested() is True at the listed calls (the engines ask before every decode
    step), and resume() loads the next of `policies` into the engine as the next version."""

    def __init__(self, engine, policies, at_calls, version=0):
        self.engine, self.policies, self.at_calls, self.version = engine, list(policies), set(at_calls), version
        self.calls = 0

    def requested(self):
        self.calls += 1
        return self.calls in self.at_calls

    def resume(self):
        self.version += 1
        weights = parallel.iter_full_weights(self.policies.pop(0), 2**20, dtype=torch.float32)
        self.engine.load_weights(weights, self.version)
        return self.version


def token_logprobs(policy, prompt, tokens):
    """log p(token | prompt, earlier tokens) at TEMPERATURE under policy, by one forward of the whole sequence."""
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp, _ = policy(seq[:, :-1], target_ids=seq[:, 1:], temperature=TEMPERATURE)
    return logp[0, len(prompt) - 1:]


def check_tokens_come_from_their_versions(outs, versions, policies, params, prompts=PROMPTS):
    flat = [(p, c) for p, cs in zip(prompts, outs) for c in cs]
    assert len(outs) == len(prompts) and len(flat) == len(versions) == len(prompts) * params.n
    switched = 0
    for (prompt, c), v in zip(flat, versions):
        assert c.finish_reason in ("stop", "length") and 0 < len(c.token_ids) <= params.max_tokens
        assert c.finish_reason == "stop" or len(c.token_ids) == params.max_tokens  # run to the end
        assert len(v) == len(c.token_ids) and v == sorted(v)  # a version per token, never going back
        expected = torch.stack([token_logprobs(policies[version], prompt, c.token_ids)[i]
                                for i, version in enumerate(v)])
        assert (expected - torch.tensor(c.logprobs)).abs().max().item() < 1e-5
        switched += len(set(v)) > 1
    return switched


def policies_of(path, count):
    """The model at path, then count - 1 others (each a different random init): versions 0, 1, ..."""
    first = hf.from_pretrained(str(path), dtype=torch.float32).eval()
    others = []
    for seed in range(1, count):
        other = copy.deepcopy(first)
        other.init_weights(seed=seed, std=0.3)
        others.append(other)
    return [first, *others]


def test_the_built_in_engine_pauses_between_decode_steps_and_continues_on_the_new_weights(tmp_path):
    path = make_model_dir(tmp_path / "m", seed=5)
    policies = policies_of(path, 3)
    engine = R.TorchEngine(copy.deepcopy(policies[0]), use_cuda_graph=False, shares_weights=False)
    params = R.SamplingParams(n=3, temperature=TEMPERATURE, max_tokens=9, seed=4, ignore_eos=True)
    # the first generate asks before decode steps 0..: paused before step 3 (3 tokens kept); the continuation
    # pauses again before its step 2
    pause = PauseAt(engine, policies[1:], at_calls=[4, 4 + 3])
    outs, versions = R.generate_resumable(engine, PROMPTS, params, version=0, pause=pause)
    switched = check_tokens_come_from_their_versions(outs, versions, policies, params)
    assert switched == len(PROMPTS) * params.n
    assert all(v == [0] * 3 + [1] * 2 + [2] * 4 for v in versions)  # where the pauses came
    assert engine.weights_version == 2


def test_a_pause_leaves_the_waves_not_begun_to_the_new_weights(tmp_path):
    path = make_model_dir(tmp_path / "m", seed=5)
    policies = policies_of(path, 2)
    prompts = PROMPTS + [[20, 21, 22, 23]]
    # max_num_seqs 4 with n=2: two prompts a wave, two waves
    engine = R.TorchEngine(copy.deepcopy(policies[0]), max_num_seqs=4, use_cuda_graph=False, shares_weights=False)
    params = R.SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=6, seed=4, ignore_eos=True)
    pause = PauseAt(engine, policies[1:], at_calls=[3])  # in the first wave, before its decode step 2
    outs, versions = R.generate_resumable(engine, prompts, params, version=0, pause=pause)
    check_tokens_come_from_their_versions(outs, versions, policies, params, prompts)
    assert versions == [[0] * 2 + [1] * 4] * 4 + [[1] * 6] * 4  # the second wave: all on the new weights


def test_the_vllm_engine_aborts_between_steps_and_continues_on_the_new_weights(monkeypatch, tmp_path):
    install(monkeypatch)
    path = make_model_dir(tmp_path / "m", seed=5)
    policies = policies_of(path, 2)
    engine = R.VLLMEngine(str(path), max_model_len=64, max_num_seqs=16, seed=0)
    engine.wake_up()
    engine.load_weights(parallel.iter_full_weights(policies[0], 2**20, dtype=torch.float32), 0)
    params = R.SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=4, stop_token_ids=[7])
    pause = PauseAt(engine, policies[1:], at_calls=[3])  # before the third engine step: two tokens each
    outs, versions = R.generate_resumable(engine, PROMPTS, params, version=0, pause=pause)
    switched = check_tokens_come_from_their_versions(outs, versions, policies, params)
    assert switched == sum(len(v) > 2 for v in versions) > 0  # those still running at the pause
    assert all(v[:2] == [0] * min(2, len(v)) and set(v[2:]) <= {1} for v in versions)
    calls = engine.llm.calls
    assert ("abort", len(PROMPTS) * params.n - sum(len(v) <= 2 for v in versions)) in calls
    assert ("generate", len(PROMPTS) * params.n) not in calls  # stepped, never LLM.generate


def test_a_pause_that_never_comes_changes_nothing(monkeypatch, tmp_path):
    install(monkeypatch)
    path = make_model_dir(tmp_path / "m", seed=5)
    policy = hf.from_pretrained(str(path), dtype=torch.float32).eval()
    params = R.SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=4, stop_token_ids=[7])
    vllm = R.VLLMEngine(str(path), max_model_len=64, max_num_seqs=16, seed=0)
    vllm.wake_up()
    vllm.load_weights(parallel.iter_full_weights(policy, 2**20, dtype=torch.float32), 0)
    for engine in (R.TorchEngine(policy, use_cuda_graph=False), vllm):
        plain = engine.generate(PROMPTS, params, version=0)
        resumable, versions = R.generate_resumable(engine, PROMPTS, params, version=0,
                                                   pause=PauseAt(engine, [], at_calls=[]))
        assert [[(c.token_ids, c.finish_reason) for c in cs] for cs in resumable] == \
            [[(c.token_ids, c.finish_reason) for c in cs] for cs in plain]
        assert all(set(v) == {0} for v in versions)


def test_per_prompt_token_budgets():
    engine = R.TorchEngine(tiny_model(), use_cuda_graph=False)
    params = R.SamplingParams(n=2, max_tokens=50, seed=0, ignore_eos=True)
    outs = engine.generate(PROMPTS, params, max_tokens=[2, 5, 1])
    assert [[len(c.token_ids) for c in cs] for cs in outs] == [[2, 2], [5, 5], [1, 1]]
    assert all(c.finish_reason == "length" for cs in outs for c in cs)


def tiny_model():
    cfg = M.ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=50, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return M.Transformer(cfg).init_weights(seed=0, std=0.3).eval()


def test_staleness_is_measured_per_token_and_bounded():
    run = SimpleNamespace(rollouts=None, sampler=data.PromptSampler(10, seed=0))
    cfg = T.Config(rollout_gpus=1, max_staleness=2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    versions = torch.tensor([[3, 3, 4, 9], [4, 4, 9, 9]])  # padding (9) is not counted
    batch = SimpleNamespace(response_mask=mask, versions=versions)
    m = T.async_metrics(run, batch, 5, cfg)  # the policy is at version 5
    assert m["rollout/staleness_max"] == 2 and m["rollout/staleness_mean"] == pytest.approx((2 + 2 + 1 + 1 + 1) / 5)
    assert m["rollout/partial_frac"] == 0.5  # the first response switched versions
    with pytest.raises(T.RunError, match="tokens sampled 3 policy versions ago, more than max_staleness=2"):
        T.async_metrics(run, SimpleNamespace(response_mask=mask, versions=versions - 1), 5, cfg)
