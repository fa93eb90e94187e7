"""
The built-in engine's decode path, this tree's against the previous one in the same run (one GPU): a
random Qwen2.5-1.5B shape, 16 prompts of 200-305 tokens x 8 samples, 512 tokens each (the trainer's groups,
as in bench/step.py). "before" is the same engine with SDPA and a mask for decode attention, separate q/k/v
matmuls and the eager sampler; "after" is the default (flash varlen decode, fused q/k/v on the engine's own
copy, the compiled sampler). Also: decode attention alone against fp32, and the sampler alone.

    python bench/decode.py --out decode.json
"""
import argparse
import os
import statistics
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root

import torch  # noqa: E402

import model as M  # noqa: E402
import rollout as R  # noqa: E402
from bench.common import dump, model_config, random_model, timed, versions  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--out", default="decode.json")
args = p.parse_args()
if not torch.cuda.is_available():
    sys.exit("bench/decode.py measures the CUDA decode path: it needs a CUDA GPU")
dev = torch.device("cuda")
RES = {"versions": versions(), "gpu": torch.cuda.get_device_name(),
       "decode_kernel": M.decode_kernel("cuda", torch.bfloat16)}


def event_us(fn, reps=50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / reps * 1e3, 2)


def with_kernel(kernel, fn):
    """fn() with the decode kernel forced (AttnBatch reads it when a decode step or a graph capture builds
    one)."""
    chosen = M.decode_kernel
    M.decode_kernel = lambda device_type, dtype: kernel
    try:
        return fn()
    finally:
        M.decode_kernel = chosen


# decode attention alone: 128 rows at lengths 100..700, GQA 12 / 2 heads of 128, against fp32
g = torch.Generator(device=dev).manual_seed(0)
rows, kv_heads, group, D = 128, 2, 6, 128
k_cache, v_cache = (torch.randn(rows, kv_heads, 769, D, device=dev, generator=g).bfloat16() for _ in range(2))
q = torch.randn(rows, 1, kv_heads * group, D, device=dev, generator=g).bfloat16()
lengths = torch.randint(100, 700, (rows,), device=dev, generator=g)
for span in (512, 768):
    pos = lengths.clamp(max=span - 1)
    ref = with_kernel("sdpa", lambda: M.decode_attention(
        q.float(), k_cache.float(), v_cache.float(),
        M.AttnBatch(kv_cache=[(k_cache.float(), v_cache.float())], cache_pos=pos, cache_len=span)))
    for kernel in ("varlen", "sdpa"):
        batch = with_kernel(kernel, lambda: M.AttnBatch(kv_cache=[(k_cache, v_cache)], cache_pos=pos,
                                                        cache_len=span))
        out = M.decode_attention(q, k_cache, v_cache, batch)
        RES[f"attn_{kernel}_{span}_max_err_vs_fp32"] = (out.float() - ref).abs().max().item()
        RES[f"attn_{kernel}_{span}_us_eager"] = event_us(
            lambda: M.decode_attention(q, k_cache, v_cache, batch))
print(RES, flush=True)

# the sampler alone, 128 rows of the full vocabulary
cfg = model_config("qwen2.5-1.5b")
logits = torch.randn(rows, cfg.vocab_size, device=dev, dtype=torch.bfloat16)
compiled_pick = torch.compile(R.gumbel_pick, dynamic=True)
RES["sample_us_eager"] = event_us(lambda: R.sample_tokens(logits, 1.0, 1.0, -1, g))
RES["sample_us_compiled"] = event_us(lambda: R.sample_tokens(logits, 1.0, 1.0, -1, g, compiled_pick))

# the engine: the trainer's groups, each side's first call (compiles, captures graphs) untimed
gen = torch.Generator().manual_seed(0)
prompts = torch.randint(100, cfg.vocab_size - 100, (16, 305), generator=gen).tolist()
prompts = [p[:200 + 7 * i] for i, p in enumerate(prompts)]
sp = R.SamplingParams(n=8, temperature=1.0, max_tokens=512, ignore_eos=True, seed=3)
greedy = R.SamplingParams(n=1, temperature=0, max_tokens=64, ignore_eos=True)
outs = {}
for side in ("after", "before"):
    model = random_model(cfg, dev, torch.bfloat16).eval()
    if side == "after":
        eng = R.TorchEngine(model, max_num_seqs=256, shares_weights=False, compile=True)
        kernel = M.decode_kernel("cuda", torch.bfloat16)
    else:  # the trainer's own module (no fused copy), SDPA with a mask, the eager sampler
        eng = R.TorchEngine(model, max_num_seqs=256, shares_weights=True, compile=True)
        eng.pick, kernel = None, "sdpa"
    times = []
    for _ in range(args.repeats + 1):
        dt, out = with_kernel(kernel, lambda: timed(lambda: eng.generate(prompts, sp), dev))
        times.append(round(dt, 3))
    RES[f"{side}_generate_s"] = times
    RES[f"{side}_generate_median_s"] = statistics.median(times[1:])
    outs[side] = with_kernel(kernel, lambda: eng.generate(prompts, greedy))
    eng.sleep()
    eng = model = None
    print(side, times, flush=True)
pairs = [(a, b) for x, y in zip(outs["after"], outs["before"]) for a, b in zip(x, y)]
RES["greedy_64_tokens_equal_rows"] = f"{sum(a.token_ids == b.token_ids for a, b in pairs)} / {len(pairs)}"
RES["greedy_first_difference"] = [
    next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t), None) for a, b in pairs]
dump(RES, args.out)
print(RES)
