"""The vLLM engine's bookkeeping on the CPU, through tests/helpers/fake_vllm.py (a stand-in backed by model.py):
prompt sharding over engines and the gather order, weight versions and stale-weight errors, the memory
cycle, request construction, the model's length limit, the trainer's wake -> push -> generate -> sleep
choreography, and bench/vllm_check.py end to end. What needs real vLLM (log-prob agreement in bf16, sleep/wake
on a GPU) is in tests/test_vllm_gpu.py, which runs bench/vllm_check.py on GPUs."""
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import fake_vllm
import config
import hf
import model as M
import parallel
import rollout as R
import train_dapo as T
from bench import vllm_check
from conftest import ROOT, make_model_dir, tiny_train_config
from fake_vllm import install


@pytest.mark.parametrize("num,world,gen_tp", [(10, 4, 2), (10, 4, 1), (3, 8, 2), (7, 2, 2), (0, 2, 1)])
def test_engine_share_covers_prompts_once_in_order(num, world, gen_tp):
    shares = [R.engine_share(num, world, gen_tp, r) for r in range(world)]
    for r, (e, lo, hi) in enumerate(shares):
        assert e == r // gen_tp
        assert shares[e * gen_tp][1:] == (lo, hi)  # every rank of an engine gets the engine's slice
    picked = R.engine_results(shares, gen_tp)  # TP rank 0 of each engine, in engine order
    assert [e for e, _, _ in picked] == list(range(world // gen_tp))
    assert [i for _, lo, hi in picked for i in range(lo, hi)] == list(range(num))


def test_iter_full_weights_yields_every_hf_tensor_once_in_bounded_deterministic_buckets(tmp_path):
    cfg = M.ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    m = M.Transformer(cfg).init_weights(seed=0)
    hf.save_pretrained(m, str(tmp_path))
    from safetensors import safe_open
    hf_keys = set()
    for f in hf.safetensors_files(str(tmp_path)):
        with safe_open(f, "pt") as sf:
            hf_keys |= set(sf.keys())
    largest = max(p.numel() * 2 for p in m.parameters())
    for bucket_bytes in (1, 5000, 20_000, 10**9):
        buckets = list(parallel.iter_full_weights(m, bucket_bytes, dtype=torch.bfloat16))
        names = [n for b in buckets for n, _ in b]
        assert len(names) == len(set(names)) and set(names) == hf_keys  # ours are HF names, each exactly once
        sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
        assert all(s < bucket_bytes + largest for s in sizes)
        assert all(s >= bucket_bytes for s in sizes[:-1])
        assert all(t.dtype == torch.bfloat16 for b in buckets for _, t in b)
        again = [n for b in parallel.iter_full_weights(m, bucket_bytes) for n, _ in b]
        assert again == names  # the same order on every call (and so on every rank)


def tiny(seed=0):
    cfg = M.ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=50, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return M.Transformer(cfg).init_weights(seed=seed, std=0.3).eval()


def test_builtin_engine_versions_and_stale_error():
    trainer, copy = tiny(0), tiny(1)
    eng = R.TorchEngine(copy, use_cuda_graph=False, shares_weights=False)
    params = R.SamplingParams(n=2, temperature=0, max_tokens=5)
    eng.generate([[1, 2, 3]], params, version=0)  # built with version 0
    with pytest.raises(R.StaleWeightsError, match="holds weights version 0 but the trainer is at 1"):
        eng.generate([[1, 2, 3]], params, version=1)
    nbytes = eng.load_weights(parallel.iter_full_weights(trainer, 1000, dtype=torch.float32), version=1)
    assert nbytes == sum(p.numel() * 4 for p in trainer.parameters()) and eng.weights_version == 1
    ref = R.TorchEngine(trainer, use_cuda_graph=False).generate([[1, 2, 3]], params)
    assert eng.generate([[1, 2, 3]], params, version=1)[0][0].token_ids == ref[0][0].token_ids


def test_vllm_engine_requests_versions_and_memory_cycle(monkeypatch, tmp_path):
    install(monkeypatch)
    path = make_model_dir(tmp_path / "m", seed=3)
    eng = R.VLLMEngine(str(path), max_model_len=128, max_num_seqs=16, seed=7, engine_kwargs={"max_num_seqs": 8})
    llm = eng.llm
    kw = llm.kwargs
    assert (kw["load_format"], kw["skip_tokenizer_init"], kw["enable_sleep_mode"], kw["logprobs_mode"]) == (
        "dummy", True, True, "processed_logprobs")
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["max_num_seqs"] == 8  # kwargs win
    assert llm.calls == [("sleep", 2)] and eng.weights_version is None  # asleep until the first rollout
    prompts = [[5, 6, 7], [8, 9]]
    params = R.SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=11, stop_token_ids=[2])
    with pytest.raises(R.StaleWeightsError):  # no weights pushed yet
        eng.generate(prompts, params, version=0)

    trainer = hf.from_pretrained(str(path), dtype=torch.float32)
    eng.wake_up(["weights"])
    nbytes = eng.load_weights(parallel.iter_full_weights(trainer, 4096, dtype=torch.float32), version=0)
    eng.wake_up(["kv_cache"])
    out = eng.generate(prompts, params, version=0)
    loads = [c[1] for c in llm.calls if c[0] == "load"]
    # one load_weights call streaming every bucket (raw load_weights: a dense model)
    assert len(loads) == 1 and sorted(loads[0]) == sorted(n for n, _ in trainer.named_parameters())
    assert ("reload",) not in llm.calls
    assert nbytes == sum(p.numel() * 4 for p in trainer.parameters())
    assert llm.calls[1] == ("wake_up", ("weights",)) and ("reset_prefix_cache",) in llm.calls
    assert llm.calls[-2:] == [("wake_up", ("kv_cache",)), ("generate", 6)]  # n=3 x 2 prompts, one request each

    # per prompt, n completions in order; each sample is request i*n+j with seed 11 + i*n + j
    ref = R.TorchEngine(trainer, use_cuda_graph=False)
    for i, comps in enumerate(out):
        assert len(comps) == 3
        for j, c in enumerate(comps):
            want = ref.generate([prompts[i]], R.SamplingParams(n=1, temperature=1.0, max_tokens=6,
                                                                 seed=11 + 3 * i + j, stop_token_ids=[2]))[0][0]
            assert (c.token_ids, c.finish_reason) == (want.token_ids, want.finish_reason)
            assert c.logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert len({tuple(c.token_ids) for c in out[0]}) > 1  # distinct seeds: distinct samples
    # log-probs as flat lists (no Logprob object per token), no detokenizing
    assert all(s.flat_logprobs and s.logprobs == 0 and s.detokenize is False for s in llm.last_sampling)
    none = eng.generate(prompts, R.SamplingParams(**{**params.__dict__, "logprobs": False}), version=0)
    assert all(s.logprobs is None for s in llm.last_sampling) and all(c.logprobs is None for g in none for c in g)
    assert [[c.token_ids for c in g] for g in none] == [[c.token_ids for c in g] for g in out]  # the same samples
    again = eng.generate(prompts, params, version=0)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in out]  # the seed rules
    other = eng.generate(prompts, R.SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=12, stop_token_ids=[2]),
                         version=0)
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in out]

    eng.sleep()  # level 2: the weights are gone, so the version is too
    assert llm.calls[-1] == ("sleep", 2) and eng.weights_version is None
    with pytest.raises(R.StaleWeightsError, match="holds weights version None"):
        eng.generate(prompts, params, version=0)


def test_vllm_engine_sizes_its_kv_pool_to_the_rollout(monkeypatch, tmp_path):
    """The KV pool holds max_num_seqs sequences of max_model_len tokens (each rounded up to 64-token blocks, plus
    one block), in each TP rank's share of the kv heads; vLLM sizes it from gpu_memory_utilization where that
    would not fit, and the user's own kv_cache_memory_bytes wins. By hand: the tiny model has 2 layers, 2 kv
    heads of 8 dims, bf16."""
    install(monkeypatch)
    path = str(make_model_dir(tmp_path / "m"))
    eng = R.VLLMEngine(path, max_model_len=128, max_num_seqs=16, engine_kwargs={"max_num_seqs": 8})
    per_token = 2 * 2 * 2 * 8 * 2  # layers x (k, v) x kv heads x head_dim x bf16
    assert eng.llm.kwargs["kv_cache_memory_bytes"] == eng.kv_cache_bytes == 8 * (2 + 1) * 64 * per_token
    tp2 = R.vllm_kv_cache_bytes(hf.load_config(path), max_model_len=129, max_num_seqs=8, gen_tp=2,
                                gpu_memory_utilization=0.5, gpu_bytes=80 * 2**30)
    assert tp2 == 8 * (3 + 1) * 64 * per_token // 2  # one kv head a rank
    fp32 = R.VLLMEngine(path, max_model_len=64, max_num_seqs=4, dtype="float32")
    assert fp32.kv_cache_bytes == 4 * (1 + 1) * 64 * per_token * 2
    mine = R.VLLMEngine(path, max_model_len=64, engine_kwargs={"kv_cache_memory_bytes": 12345})
    assert mine.llm.kwargs["kv_cache_memory_bytes"] == mine.kv_cache_bytes == 12345
    # 0.5 x 2 GiB less the weights and vLLM's 1 GiB of activations leaves nothing: vLLM sizes the pool itself
    monkeypatch.setattr(R, "device_memory_bytes", lambda: 2 * 2**30)
    small = R.VLLMEngine(path, max_model_len=64)
    assert small.llm.kwargs["kv_cache_memory_bytes"] is None and small.kv_cache_bytes is None


def test_vllm_engine_refuses_to_wake_without_room(monkeypatch, tmp_path):
    free = iter([1 * 2**30, 9 * 2**30, 2 * 2**30])  # before sleep, after sleep (8 GiB released), at wake
    install(monkeypatch, free_bytes=lambda: next(free))
    eng = R.VLLMEngine(str(make_model_dir(tmp_path / "m")), max_model_len=64)
    assert eng.awake_bytes == 8 * 2**30
    with pytest.raises(RuntimeError, match="needs ~8.0 GiB back .* only 2.0 GiB are free.*gpu_memory_utilization"):
        eng.wake_up(["weights"])


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_trainer_with_vllm_engine_pushes_every_rollout_and_agrees_on_logprobs(monkeypatch, tiny_dir, tmp_path,
                                                                              capsys, free_cache_engine):
    install(monkeypatch)
    T.train(tiny_train_config(tiny_dir, tmp_path, total_training_steps=2, rollout_engine="vllm", save_freq=-1,
                              test_freq=1, calculate_log_probs=free_cache_engine, free_cache_engine=free_cache_engine))
    assert "warning: rollout/logp_mismatch" not in capsys.readouterr().out
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    train_rows = [r for r in rows if "train/acc" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        if free_cache_engine:  # with calculate_log_probs: the engine generated with the trainer's current weights
            assert r["rollout/logp_mismatch"] < 1e-4
        else:  # no log-probs asked of vLLM, so no mismatch to report
            assert "rollout/logp_mismatch" not in r
        assert r["timing_s/sync"] > 0
    calls = fake_vllm.LLM.instances[0].calls
    gens = [i for i, c in enumerate(calls) if c[0] == "generate"]
    assert len(gens) >= 5  # val before training, >= 1 round per step, val after each step
    # validation scores answers only: it never asks for log-probs; the steps do when calculate_log_probs is on
    asked = fake_vllm.LLM.instances[0].logprobs_asked
    assert asked[0] is False and asked[-1] is False and any(asked) == free_cache_engine
    if free_cache_engine:  # every generate: wake weights -> pushes -> reset -> wake kv_cache, generate, sleep(2)
        for i in gens:
            assert calls[i + 1] == ("sleep", 2)
            assert calls[i - 1] == ("wake_up", ("kv_cache",)) and calls[i - 2] == ("reset_prefix_cache",)
            j = i - 3
            while calls[j][0] == "load":
                j -= 1
            assert j < i - 3 and calls[j] == ("wake_up", ("weights",))
    else:  # woken once, never put to sleep again; a push (and reset) only when the trainer's weights changed
        assert [c for c in calls if c[0] in ("sleep", "wake_up")] == [
            ("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
        pushes = [i for i, c in enumerate(calls) if c[0] == "load"]
        assert len(pushes) == 3  # the initial weights, then after each of the 2 steps
        assert all(calls[i + 1] == ("reset_prefix_cache",) for i in pushes)


def test_an_engine_with_other_weights_triggers_the_mismatch_warning(monkeypatch, tiny_dir, tmp_path, capsys):
    """Stale weights (here: every pushed tensor scaled by 1.6 inside the engine) make the engine's log-probs
    disagree with the trainer's by far more than bf16 noise: rollout/logp_mismatch is logged and warned about."""
    install(monkeypatch)
    load = fake_vllm.LLM._load
    monkeypatch.setattr(fake_vllm.LLM, "_load", lambda self, weights: load(self, ((n, t * 1.6) for n, t in weights)))
    T.train(tiny_train_config(tiny_dir, tmp_path, total_training_steps=1, rollout_engine="vllm", save_freq=-1,
                              test_freq=0, calculate_log_probs=True))
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    mismatch = [r["rollout/logp_mismatch"] for r in rows if "train/acc" in r]
    assert mismatch and mismatch[0] > 2 * T.Config().logp_mismatch_warn, mismatch
    assert "warning: rollout/logp_mismatch" in capsys.readouterr().out


def test_missing_vllm_is_a_config_error_before_any_work(tiny_dir, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(T.ConfigError, match="vllm is not installed"):
        T.train(tiny_train_config(tiny_dir, tmp_path, rollout_engine="vllm"))
    assert not (tmp_path / "config.json").exists()  # nothing written, nothing built


def test_vllm_config_checks():
    with pytest.raises(T.ConfigError, match="gen_tp=3 must divide the world size 4"):
        config.check_config(T.Config(gen_tp=3, ppo_mini_batch_size=32), world_size=4, check_files=False)
    with pytest.raises(T.ConfigError, match="gen_tp=2 needs rollout_engine='vllm'"):
        config.check_config(T.Config(gen_tp=2, rollout_engine="torch"), world_size=2, check_files=False)
    with pytest.raises(T.ConfigError, match=r"tis_imp_ratio_cap=0.5 must be -1 \(off\) or a cap >= 1"):
        config.check_config(T.Config(tis_imp_ratio_cap=0.5), check_files=False)
    assert R.resolve_engine("auto", "cpu") == "torch"
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match="vllm is not installed"):
            R.resolve_engine("vllm", "cuda")
    with pytest.raises(ValueError, match="rollout_engine='tpu'; use 'auto', 'torch' or 'vllm'"):
        R.resolve_engine("tpu", "cuda")


@pytest.mark.slow  # python / torchrun processes
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_a_single_rank_gets_a_process_group_for_vllm_without_hanging(launcher):
    """vLLM's external_launcher needs a process group and reads RANK and LOCAL_RANK from the environment: a plain
    process gets a group of one and those variables; under torchrun --nproc-per-node 1 the group joins torchrun's
    store (a tcp:// group waits on that store for ever, and this test then times out)."""
    code = ("import sys; sys.path.insert(0, %r); import rollout, torch.distributed as dist; "
            "rollout._ensure_process_group(); import os; print('world', dist.get_world_size(), "
            "*[os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')])" % ROOT)
    cmd = [sys.executable, "-c", code]
    if launcher == "torchrun":
        script = os.path.join(os.environ.get("TMPDIR", "/tmp"), "nanodapo_pg_check.py")
        with open(script, "w") as f:
            f.write(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", script]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "world 1 0 0 1" in r.stdout, r.stdout + r.stderr[-2000:]


def test_sampled_logprobs_from_flat_logprobs():
    """The sampled token's log-prob per position, from vLLM's FlatLogprobs (index ranges into flat lists, the
    sampled token first)."""
    from types import SimpleNamespace as NS
    flat = NS(start_indices=[0, 2, 3], end_indices=[2, 3, 5], token_ids=[7, 1, 8, 9, 4],
              logprobs=[-0.5, -0.1, -1.5, -2.0, -0.2])  # position 0 and 2 also carry a top-1 token
    assert R._sampled_logprobs(flat) == [-0.5, -1.5, -2.0]


def test_vllm_engine_refuses_a_max_model_len_above_the_models_limit(monkeypatch, tmp_path):
    """make_model_dir writes max_position_embeddings=512. vLLM refuses a longer max_model_len; the engine refuses
    it first, naming the trainer's knobs, and engine_kwargs cannot slip past."""
    install(monkeypatch)
    path = str(make_model_dir(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"max_model_len=513 \(max_prompt_length \+ max_response_length\) is above "
                                         r"max_position_embeddings=512 .*at most 512"):
        R.VLLMEngine(path, max_model_len=513)
    with pytest.raises(ValueError, match=r"max_model_len=600 \(max_prompt_length \+ max_response_length\) "
                                         r"is above max_position_embeddings=512"):
        R.VLLMEngine(path, max_model_len=128, engine_kwargs={"max_model_len": 600})
    assert fake_vllm.LLM.instances == []  # vLLM never started
    assert R.VLLMEngine(path, max_model_len=512).llm.kwargs["max_model_len"] == 512  # the limit itself is fine
    # the stand-in refuses as vLLM does, so a caller that skips the check fails on the CPU too
    with pytest.raises(ValueError, match=r"User-specified max_model_len \(513\) is greater than the derived "
                                         r"max_model_len \(max_position_embeddings=512"):
        fake_vllm.LLM(model=path, max_model_len=513)


def test_vllm_check_passes_on_the_demo_model_against_the_fake(monkeypatch, tmp_path, capsys):
    """bench/vllm_check.py end to end on the CPU. The demo model's max_position_embeddings is 256, below the
    script's default prompt length + max_tokens: the script builds its engine within the model's limit."""
    install(monkeypatch)
    out = tmp_path / "result.json"
    ok = vllm_check.main([os.path.join(ROOT, "demo", "model"), "--device", "cpu", "--num_prompts", "4",
                          "--max_tokens", "12", "--out", str(out)])
    results = json.loads(out.read_text())
    assert ok, capsys.readouterr().out
    assert results["figures"]["max_model_len"] == 256
    assert fake_vllm.LLM.instances[0].kwargs["max_model_len"] == 256
    assert sorted(k for k in results if k != "figures") == [
        "changed_weights_change_outputs", "greedy_vs_builtin", "logprobs_vs_trainer", "partial_rollout_stepped",
        "seed_reproduces_samples", "sleep_wake_push_same", "stale_version_raises"]


def test_rollout_logprobs_are_asked_for_only_when_something_needs_them():
    tok = SimpleNamespace(eos_token_ids=[2])
    assert T.train_params(T.Config(), tok, 0).logprobs is False  # they cost vLLM a quarter to a third of its speed
    for knobs in ({"calculate_log_probs": True}, {"tis_imp_ratio_cap": 2.0}, {"rollout_rs_threshold": 2.0}):
        assert T.train_params(T.Config(**knobs), tok, 0).logprobs is True
