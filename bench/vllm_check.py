"""
The vLLM engine against the trainer and the built-in engine, on GPUs (needs CUDA and vllm). Run by
tests/test_vllm_gpu.py (and on the CPU, against tests/helpers/fake_vllm.py, by tests/test_vllm_engine.py), or directly:

    torchrun --nproc-per-node 1 bench/vllm_check.py MODEL_DIR [--gen_tp 1] [--out result.json]
    torchrun --nproc-per-node 2 bench/vllm_check.py MODEL_DIR --gen_tp 2     # one engine over 2 GPUs
    torchrun --nproc-per-node 2 bench/vllm_check.py MODEL_DIR --gen_tp 1     # two engines
    torchrun --nproc-per-node 1 bench/vllm_check.py MODEL_DIR --random_moe 4  # writes MODEL_DIR first

--random_moe N writes a random Qwen3-30B-A3B-shaped model cut to N layers (write_random_moe: model.py's classes,
save_pretrained, the demo's tokenizer files) into MODEL_DIR before the checks, so no download is needed.

Prompts: the chat-templated prompts of a parquet file (default: the demo's validation set), cut from the left
to --max_prompt_length, or to what --max_tokens leaves of the model's max_position_embeddings where that is
less; the engine's max_model_len is that prompt length + max_tokens (the trainer's: max_prompt_length +
max_response_length). Every rank holds the trainer's model as it computes (bf16 weights: what FSDP gathers
from the fp32 master weights on a GPU) and its share of world_size / gen_tp engines; prompts are split over engines as the trainer splits them.
Checks, each a line "PASS|FAIL name: figures", and a JSON of the figures:
 1. after a push, the trainer's teacher-forced log-probs of vLLM's samples (T=1) vs vLLM's own:
    mean |difference| < 0.02
 1b. each sample is a request seeded from the call's seed: the same seed again gives the same samples
    (>= 90%), another seed other samples (<= 50% equal), and the n samples of a group differ (T=2)
 2. greedy: vLLM's first 8 tokens == the built-in engine's (bf16 copy) for most prompts (fraction reported)
 3. sleep(2) -> wake -> push of the same weights: greedy outputs == those before sleep, exactly
 4. push of changed weights (an MoE's experts only): greedy outputs change
 5. generating with a stale version raises StaleWeightsError; bytes and seconds of a push
 6. partial rollout on vLLM's stepped engine (generate with should_pause): never paused, the samples equal check 1's
    (>= 90%); paused halfway, the weights pushed again (as version 1) and the rest generated as new prompts: every
    response complete, tokens tagged 0 then 1, teacher-forced log-probs within 0.02 or within 1.2x check 1's
    difference; the seconds a pause costs
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import data  # noqa: E402
import hf  # noqa: E402
import model as M  # noqa: E402
import parallel  # noqa: E402
import rollout as R  # noqa: E402
import train_dapo as T  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_random_moe(path: str, device, seed: int = 0, **overrides) -> M.ModelConfig:
    """A random bf16 Qwen3-MoE model directory: qwen3-30b-a3b's config with overrides (e.g. num_hidden_layers=4),
    drawn on `device` by model.py, written by save_pretrained in HF's per-expert names, with the demo's tokenizer
    files (a few hundred ids, inside the vocabulary)."""
    cfg = M.ModelConfig.from_hf({**hf.KNOWN_CONFIGS["qwen3-30b-a3b"], **overrides})
    with torch.device(device):
        model = M.Transformer(cfg).init_weights(seed=seed).to(torch.bfloat16)
    hf.save_pretrained(model, path)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(ROOT, "demo", "model", f), path)
    return cfg


def main(argv=None) -> bool:
    """-> whether every check passed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--gen_tp", type=int, default=1)
    ap.add_argument("--data", default=os.path.join(ROOT, "demo", "data", "val.parquet"))  # prompts, verl schema
    ap.add_argument("--random_moe", type=int, default=0)  # > 0: write a random MoE of this many layers first
    ap.add_argument("--num_prompts", type=int, default=64)
    ap.add_argument("--max_prompt_length", type=int, default=512)  # at most; less where the model's limit says so
    ap.add_argument("--max_tokens", type=int, default=128)
    ap.add_argument("--enforce_eager", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")  # cpu: only against tests/helpers/fake_vllm.py
    a = ap.parse_args(argv)
    dims = parallel.init_distributed(a.device)
    if a.random_moe > 0:
        if dims.is_main:
            write_random_moe(a.model_dir, dims.device, num_hidden_layers=a.random_moe)
        parallel.barrier(dims)
    limit = hf.load_config(a.model_dir).max_position_embeddings
    if a.max_tokens >= limit:
        ap.error(f"--max_tokens {a.max_tokens} leaves no room for a prompt in max_position_embeddings={limit}")
    max_prompt_length = min(a.max_prompt_length, limit - a.max_tokens)
    max_model_len = max_prompt_length + a.max_tokens
    log = print if dims.is_main else (lambda *x, **k: None)
    t0 = time.perf_counter()
    engine = R.VLLMEngine(a.model_dir, gen_tp=a.gen_tp, gpu_memory_utilization=0.3,
                          max_model_len=max_model_len, max_num_seqs=256,
                          enforce_eager=bool(a.enforce_eager), seed=0)
    fig = {"engine_start_s": time.perf_counter() - t0, "world_size": dims.world_size, "gen_tp": a.gen_tp,
           "max_model_len": max_model_len}
    model = hf.from_pretrained(a.model_dir, dtype=torch.float32 if dims.device.type == "cpu" else torch.bfloat16,
                              device=dims.device)
    tok = data.Tokenizer.from_pretrained(a.model_dir)
    prompts = [p["prompt_ids"] for p in data.load_prompts(a.data, tok, max_prompt_length=max_prompt_length,
                                                           truncation="left", max_samples=a.num_prompts)]
    _, lo, hi = R.engine_share(len(prompts), dims.world_size, a.gen_tp, dims.rank)
    mine = prompts[lo:hi]
    results = {}

    def check(name, ok, **figures):
        oks = parallel.all_gather_objects(bool(ok), dims)
        results[name] = {"pass": all(oks), **figures}
        log(f"{'PASS' if all(oks) else 'FAIL'} {name}: {json.dumps(figures)}")

    def push(version, m=model):
        engine.wake_up(["weights"])
        t = time.perf_counter()
        nbytes = engine.load_weights(parallel.iter_full_weights(m, 512 * 2**20, dtype=torch.bfloat16), version)
        torch.get_device_module(dims.device.type).synchronize()
        dt = time.perf_counter() - t
        engine.wake_up(["kv_cache"])
        return nbytes, dt

    greedy = R.SamplingParams(n=1, temperature=0, max_tokens=a.max_tokens, stop_token_ids=tok.eos_token_ids)
    nbytes, dt = push(0)
    pushes = [push(0)[1] for _ in range(3)]  # warm pushes (the first one also wakes the allocator)
    fig.update(push_gib=nbytes / 2**30, push_s_first=dt, push_s_median=sorted(pushes)[1])

    # 1. teacher-forced log-probs of vLLM's samples
    sampled = engine.generate(mine, R.SamplingParams(n=4, temperature=1.0, max_tokens=a.max_tokens, seed=1,
                                                     stop_token_ids=tok.eos_token_ids), version=0)
    comps = [(p, c) for p, cs in zip(mine, sampled) for c in cs]
    traj = T.Trajectories(prompt_ids=[p for p, _ in comps], response_ids=[c.token_ids for _, c in comps],
                          group_ids=torch.zeros(len(comps)), rollout_logp=None,
                          response_mask=torch.zeros(len(comps), a.max_tokens), finish_reasons=[],
                          data_sources=[], acc=None, score=None, seq_reward=None)
    rollout_logp = torch.zeros(len(comps), a.max_tokens)
    for i, (_, c) in enumerate(comps):
        traj.response_mask[i, :len(c.token_ids)] = 1
        rollout_logp[i, :len(c.token_ids)] = torch.tensor(c.logprobs)
    cfg = T.Config(temperature=1.0, logprob_chunk=1024)
    diffs = []
    with torch.no_grad():
        for s in range(0, len(comps), 32):
            idx = list(range(s, min(s + 32, len(comps))))
            logp, _ = T.sequence_logprobs(model, traj, idx, cfg, with_entropy=False)
            m = traj.response_mask[idx]
            diffs.append(((logp.float().cpu() - rollout_logp[idx]).abs() * m).sum() / m.sum())
    mad = float(sum(diffs) / len(diffs))
    check("logprobs_vs_trainer", mad < 0.02, mean_abs_diff=mad, mean_logp=float(
        (rollout_logp * traj.response_mask).sum() / traj.response_mask.sum()))

    # 1b. each sample is a request with its own seed (the call's seed + its index): the same seed gives the same
    # samples (up to rare bf16 near-ties: the prompts are prefix-cached now), another seed other samples, and a
    # group's n samples differ from each other (temperature 2: a trained model's samples at T=1 can be nearly
    # deterministic)
    def sample(seed):
        out = engine.generate(mine, R.SamplingParams(n=4, temperature=2.0, max_tokens=a.max_tokens, seed=seed,
                                                     stop_token_ids=tok.eos_token_ids), version=0)
        return [[c.token_ids for c in cs] for cs in out]
    first, again, other = sample(1), sample(1), sample(2)
    flat = lambda groups: [x for g in groups for x in g]  # noqa: E731
    same_frac = sum(x == y for x, y in zip(flat(first), flat(again))) / len(flat(first))
    other_frac = sum(x == y for x, y in zip(flat(first), flat(other))) / len(flat(first))
    groups_distinct = sum(len({tuple(x) for x in g}) == len(g) for g in first) / len(first)
    check("seed_reproduces_samples", same_frac >= 0.9 and other_frac <= 0.5 and groups_distinct >= 0.5,
          same_seed_equal=same_frac, other_seed_equal=other_frac, groups_all_distinct=groups_distinct)

    # 6. partial rollout: the stepped engine without a pause samples what LLM.generate samples; with one pause
    # halfway (the same weights pushed again as version 1) the responses continue from their tokens
    params = R.SamplingParams(n=4, temperature=1.0, max_tokens=a.max_tokens, seed=1,
                              stop_token_ids=tok.eos_token_ids)
    t = time.perf_counter()
    engine.generate(mine, params, version=0)
    plain_s = time.perf_counter() - t
    t = time.perf_counter()
    stepped = engine.generate(mine, params, version=0, should_pause=lambda: False)
    stepped_s = time.perf_counter() - t
    same = sum(x.token_ids == y.token_ids for xs, ys in zip(stepped, sampled) for x, y in zip(xs, ys))
    calls = []
    # halfway through the median response, so that most are unfinished (the demo model answers in ~11 tokens)
    halfway = max(1, sorted(len(c.token_ids) for cs in stepped for c in cs)[len(mine) * 2] // 2)

    class Pause:
        def requested(self):
            calls.append(1)
            return len(calls) == halfway

        def resume(self):
            push(1)  # the same weights, as version 1: the continuation must still match the trainer
            return 1
    t = time.perf_counter()
    resumed, versions = R.generate_resumable(engine, mine, params, version=0, pause=Pause())
    resumed_s = time.perf_counter() - t
    flat_resumed = [c for cs in resumed for c in cs]
    complete = all(c.finish_reason == "stop" or len(c.token_ids) == a.max_tokens for c in flat_resumed)
    switched = sum(len(set(v)) > 1 for v in versions)
    rtraj = T.Trajectories(prompt_ids=[p for p in mine for _ in range(4)],
                           response_ids=[c.token_ids for c in flat_resumed], group_ids=torch.zeros(len(flat_resumed)),
                           rollout_logp=None, response_mask=torch.zeros(len(flat_resumed), a.max_tokens),
                           finish_reasons=[], data_sources=[], acc=None, score=None, seq_reward=None)
    rlogp = torch.zeros(len(flat_resumed), a.max_tokens)
    for i, c in enumerate(flat_resumed):
        rtraj.response_mask[i, :len(c.token_ids)] = 1
        rlogp[i, :len(c.token_ids)] = torch.tensor(c.logprobs)
    with torch.no_grad():
        logp, _ = T.sequence_logprobs(model, rtraj, list(range(len(flat_resumed))), cfg, with_entropy=False)
    rmad = float(((logp.float().cpu() - rlogp).abs() * rtraj.response_mask).sum() / rtraj.response_mask.sum())
    # as close to the trainer as the unpaused samples of check 1 (a model can sit above check 1's 0.02 there)
    check("partial_rollout_stepped", same >= 0.9 * len(comps) and complete and switched > 0
          and rmad < max(0.02, 1.2 * mad),
          unpaused_equal_fraction=same / len(comps), switched=switched, of=len(flat_resumed),
          mean_abs_diff_after_pause=rmad, llm_generate_s=plain_s, stepped_s=stepped_s, paused_once_s=resumed_s)
    push(0)

    # 2. greedy vs the built-in engine on a bf16 copy
    before = [c[0].token_ids for c in engine.generate(mine, greedy, version=0)]
    builtin = R.TorchEngine(hf.from_pretrained(a.model_dir, dtype=torch.bfloat16, device=dims.device))
    ref = [c[0].token_ids for c in builtin.generate(mine, greedy)]
    del builtin
    same8 = sum(x[:8] == y[:8] for x, y in zip(before, ref))
    agree = parallel.all_gather_objects((same8, len(mine)), dims)
    frac = sum(s for s, _ in agree[::a.gen_tp]) / max(1, sum(n for _, n in agree[::a.gen_tp]))
    prefix = sum(next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(before, ref))
    check("greedy_vs_builtin", frac > 0.5, first8_equal_fraction=frac, mean_common_prefix=prefix / len(mine))

    # 3. sleep -> wake -> push the same weights: identical greedy outputs
    engine.sleep()
    try:
        engine.generate(mine, greedy, version=0)
        stale_raised = False
    except R.StaleWeightsError:
        stale_raised = True
    push(0)
    after = [c[0].token_ids for c in engine.generate(mine, greedy, version=0)]
    check("sleep_wake_push_same", after == before, equal=sum(x == y for x, y in zip(after, before)), of=len(mine))

    # 4. changed weights change the outputs (of an MoE, only its experts change: they must reach the engine)
    with torch.no_grad():
        for p in [p for n, p in model.named_parameters() if ".experts." in n] or list(model.parameters()):
            p.add_(torch.randn_like(p) * p.float().std().clamp(min=1e-3))
    push(1)
    changed = [c[0].token_ids for c in engine.generate(mine, greedy, version=1)]
    n_changed = sum(x != y for x, y in zip(changed, before))
    check("changed_weights_change_outputs", n_changed > len(mine) // 2, changed=n_changed, of=len(mine))

    # 5. a stale engine refuses to generate
    try:
        engine.generate(mine, greedy, version=2)
        raised = False
    except R.StaleWeightsError:
        raised = True
    check("stale_version_raises", raised and stale_raised, after_sleep=stale_raised, behind=raised)
    engine.sleep()
    results["figures"] = fig
    log(json.dumps(fig))
    if dims.is_main and a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    parallel.shutdown()
    return all(r["pass"] for k, r in results.items() if k != "figures")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
