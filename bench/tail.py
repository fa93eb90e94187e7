"""
The long tail of a rollout: responses of mixed lengths, as in a DAPO run (lognormal, capped at
max_response_length), generated in one call of the trainer's vLLM engine (rollout.VLLMEngine, as the colocated
step calls it), with each engine step's time and the responses still decoding after it. Reports the fraction of
generation time in which fewer than --tail-below of the responses are still decoding (the GPU working on a few
long ones while the step waits), and what the same tokens cost in responses of one length.

    python bench/tail.py --prompts 16 --n 8 --max-response 16384 --resp-median 3000 --resp-sigma 0.8
    python bench/tail.py --tiny     # on the CPU: the statistics on a made-up trace (no vLLM there)

Each response gets its own budget (vLLM's per-request max_tokens, ignore_eos): the lengths are exactly the drawn
ones, the same on every run with the same --seed.
"""
import argparse
import os
import random
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import bench.common as C  # noqa: E402
from rollout import SamplingParams  # noqa: E402


def lognormal_lengths(count: int, median: float, sigma: float, cap: int, seed: int, floor: int = 16) -> list[int]:
    """count response lengths, lognormal around median with log-space sigma, clipped to [floor, cap]."""
    rng = random.Random(seed)
    return [C.lognormal_length(rng, median, sigma, floor, cap) for _ in range(count)]


def tail_stats(trace: list[tuple[float, int]], total: int, below: float = 0.1) -> dict:
    """trace: (seconds since the call started, responses still decoding) after each engine step, in order;
    total: the responses of the call. -> the call's seconds, the seconds and the fraction of them in which
    fewer than below x total were decoding (a step counts whole, by the count it started with), and when
    half and 90% of the responses had finished."""
    if not trace:
        return {"gen_s": 0.0, "tail_s": 0.0, "tail_fraction": 0.0}
    tail_s, before, t_prev = 0.0, total, 0.0
    done_at = {}
    for t, active in trace:
        if before < below * total:
            tail_s += t - t_prev
        for q in (0.5, 0.9):
            if q not in done_at and total - active >= q * total:
                done_at[q] = t
        before, t_prev = active, t
    gen_s = trace[-1][0]
    return {"gen_s": round(gen_s, 3), "tail_s": round(tail_s, 3), "tail_fraction": round(tail_s / gen_s, 4),
            "half_done_s": round(done_at.get(0.5, gen_s), 3), "p90_done_s": round(done_at.get(0.9, gen_s), 3),
            "steps": len(trace)}


def traced_generate(eng, prompts: list[list[int]], budgets: list[int], seed: int) -> tuple[list, list]:
    """One VLLMEngine.generate call through its step loop (the stepwise path partial rollout uses), each
    engine step's end time and the responses still decoding recorded -> (completions, trace)."""
    engine = eng.llm.llm_engine
    step, trace, active = engine.step, [], len(prompts)
    t0 = time.perf_counter()

    def traced_step():
        nonlocal active
        outs = step()
        active -= sum(o.finished for o in outs)
        trace.append((time.perf_counter() - t0, active))
        return outs
    engine.step = traced_step
    try:
        params = SamplingParams(n=1, temperature=1.0, ignore_eos=True, seed=seed, logprobs=False)
        outs = eng.generate(prompts, params, should_pause=lambda: False, max_tokens=budgets)
    finally:
        engine.step = step
    return outs, trace


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true", help="CPU: the statistics on a made-up trace")
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-response", type=int, default=16384)
    p.add_argument("--resp-median", type=float, default=3000)
    p.add_argument("--resp-sigma", type=float, default=0.8)
    p.add_argument("--tail-below", type=float, default=0.1, help="the tail: fewer than this share still decoding")
    p.add_argument("--gpu-mem-util", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/nanodapo_step", help="the model directory is WORK/model (made if missing)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    count = args.prompts * args.n
    lengths = lognormal_lengths(count, args.resp_median, args.resp_sigma, args.max_response, args.seed)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "versions": C.versions(),
           "lengths": {"mean": round(statistics.mean(lengths), 1), "median": statistics.median(lengths),
                       "max": max(lengths), "at_cap": sum(n == args.max_response for n in lengths)}}
    out = C.out_path(args.out, "tail")
    if args.tiny:  # one step a token, all responses decoding at once: the trace of a perfectly batched engine
        trace = [(float(t), sum(n > t for n in lengths)) for t in range(1, max(lengths) + 1)]
        res["mixed"] = tail_stats(trace, count, args.tail_below)
        print(res)
        C.dump(res, out)
        return

    import rollout as R
    model_dir = os.path.join(args.work, "model")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):  # bench/step.py's model, when its --work
        C.write_random_model(model_dir, C.model_config(args.shape), "cuda")
    t0 = time.perf_counter()
    eng = R.VLLMEngine(model_dir, gpu_memory_utilization=args.gpu_mem_util,
                       max_model_len=args.prompt_len + args.max_response, max_num_seqs=count, seed=0)
    eng.wake_up()
    res["engine_init_s"] = round(time.perf_counter() - t0, 1)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000) for _ in range(args.prompt_len)] for _ in range(count)]
    traced_generate(eng, prompts[:8], [64] * 8, args.seed)  # warm-up: the first call's compile and graphs

    for name, budgets in (("mixed", lengths), ("uniform", [round(statistics.mean(lengths))] * count)):
        outs, trace = traced_generate(eng, prompts, budgets, args.seed)
        got = [len(c.token_ids) for cs in outs for c in cs]
        assert got == budgets, "vLLM did not generate each request's budget"
        res[name] = {**tail_stats(trace, count, args.tail_below), "tokens": sum(got),
                     "tokens_per_s": round(sum(got) / trace[-1][0]),
                     "active_every_64_steps": [(round(t, 2), a) for t, a in trace[::64]]}
        print(f"{name}: {res[name]['gen_s']} s, {res[name]['tokens_per_s']} tok/s, tail (< {args.tail_below:g} of "
              f"{count} decoding) {res[name]['tail_s']} s = {res[name]['tail_fraction']:.1%}; half done at "
              f"{res[name]['half_done_s']} s, 90% at {res[name]['p90_done_s']} s", flush=True)
        C.dump(res, out)
    res["mixed_over_uniform"] = round(res["mixed"]["gen_s"] / res["uniform"]["gen_s"], 3)
    print(f"lengths {res['lengths']}; the mixed call takes {res['mixed_over_uniform']}x the uniform one's time "
          "for the same tokens")
    C.dump(res, out)


if __name__ == "__main__":
    main()
