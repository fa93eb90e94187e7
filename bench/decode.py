"""
The built-in engine's decode path: its default against variants, in the same run (one GPU). A random
Qwen2.5-1.5B shape, 16 prompts of 200-305 tokens x 8 samples, 512 tokens each (the trainer's groups, as in
bench/step.py). Sides:
  default           the engine as the trainer builds it (its own copy, compiled)
  check_every_step  the host looks for finished rows after every decode step (a sync each), not every 8
  unfused_mlp       gate and up as two matmuls on the engine's copy
  before            the trainer's own module (no fused q/k/v or gate/up), SDPA with a mask for decode
                    attention, the eager sampler
Each side's first call (compiles, captures graphs) is untimed; then the sides take turns, so a drift of the
machine reaches all of them. Also: decode attention alone against fp32, the sampler alone, the decode step's
matmuls alone (cuBLAS's time and bandwidth per kind: how far they are from reading the weights at full speed),
and with --profile the kernel time and launches of one decode step by kind (the default side, decode steps
without CUDA graphs, the prefill subtracted).

    python bench/decode.py --out decode.json [--profile]
    python bench/decode.py --tiny            # a tiny model on the CPU: a smoke test of this script
"""
import argparse
import os
import statistics
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import model as M  # noqa: E402
import rollout as R  # noqa: E402
from bench.common import dump, median_seconds, model_config, random_model, timed, versions  # noqa: E402

SIDES = ("default", "check_every_step", "unfused_mlp", "before")
p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--sides", default=",".join(SIDES), help=f"comma list of {', '.join(SIDES)}")
p.add_argument("--profile", action="store_true", help="kernel time per decode step by kind (default side)")
p.add_argument("--tiny", action="store_true", help="tiny model, 8 new tokens, on the CPU")
p.add_argument("--out", default="decode.json")
args = p.parse_args()
sides = args.sides.split(",")
assert set(sides) <= set(SIDES), f"unknown side in {sides}"
if args.tiny:
    dev, dtype = torch.device("cpu"), torch.float32
elif torch.cuda.is_available():
    dev, dtype = torch.device("cuda"), torch.bfloat16
else:
    sys.exit("bench/decode.py measures the CUDA decode path: it needs a CUDA GPU (or --tiny on the CPU)")
cfg = model_config("qwen2.5-1.5b", tiny=args.tiny)
RES = {"versions": versions(), "device": str(dev), "decode_kernel": M.decode_kernel(dev.type, dtype)}
if dev.type == "cuda":
    RES["gpu"] = torch.cuda.get_device_name()


def with_kernel(kernel, fn):
    """fn() with the decode kernel forced (AttnBatch reads it when a decode step or a graph capture builds
    one)."""
    chosen = M.decode_kernel
    M.decode_kernel = lambda device_type, dtype: kernel
    try:
        return fn()
    finally:
        M.decode_kernel = chosen


def us(fn) -> float:
    return round(median_seconds(fn, dev, reps=50) * 1e6, 2)


# decode attention alone: 128 rows at lengths 100..700, GQA 12 / 2 heads of 128, against fp32
g = torch.Generator(device=dev).manual_seed(0)
rows, kv_heads, group, D = 128, 2, 6, 128
if args.tiny:
    rows, kv_heads, group, D = 8, 2, 2, 16
k_cache, v_cache = (torch.randn(rows, kv_heads, 769, D, device=dev, generator=g).to(dtype) for _ in range(2))
q = torch.randn(rows, 1, kv_heads * group, D, device=dev, generator=g).to(dtype)
lengths = torch.randint(100, 700, (rows,), device=dev, generator=g)
for span in (512, 768):
    pos = lengths.clamp(max=span - 1)
    ref = with_kernel("sdpa", lambda: M.decode_attention(
        q.double(), k_cache.double(), v_cache.double(),
        M.AttnBatch(kv_cache=[(k_cache.double(), v_cache.double())], cache_pos=pos, cache_len=span)))
    for kernel in sorted({"sdpa", M.decode_kernel(dev.type, dtype)}):
        batch = with_kernel(kernel, lambda: M.AttnBatch(kv_cache=[(k_cache, v_cache)], cache_pos=pos,
                                                        cache_len=span))
        out = M.decode_attention(q, k_cache, v_cache, batch)
        RES[f"attn_{kernel}_{span}_max_err_vs_fp64"] = (out.double() - ref).abs().max().item()
        RES[f"attn_{kernel}_{span}_us_eager"] = us(lambda: M.decode_attention(q, k_cache, v_cache, batch))
print(RES, flush=True)

# the sampler alone, 128 rows of the full vocabulary
logits = torch.randn(rows, cfg.vocab_size, device=dev, dtype=dtype)
compiled_pick = torch.compile(R.gumbel_pick, dynamic=True)
RES["sample_us_eager"] = us(lambda: R.sample_tokens(logits, 1.0, 1.0, -1, g))
RES["sample_us_compiled"] = us(lambda: R.sample_tokens(logits, 1.0, 1.0, -1, g, compiled_pick))
dump(RES, args.out)


def matmul_floor(rows: int) -> dict:
    """The decode step's matmuls alone, as torch runs them (cuBLAS on a GPU): per kind, microseconds per call
    and the weight bytes read per second, each kind over every layer's own weights (so nothing is served from
    the L2 cache), inside one CUDA graph on a GPU."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shapes = {"qkv": (H, qkv), "o": (cfg.num_attention_heads * cfg.head_dim, H), "gate_up": (H, 2 * inter),
              "down": (inter, H), "head": (H, cfg.vocab_size)}
    out = {}
    for name, (k, n) in shapes.items():
        count = 1 if name == "head" else cfg.num_hidden_layers
        ws = [torch.randn(n, k, device=dev, generator=g).to(dtype) for _ in range(count)]
        x = torch.randn(rows, k, device=dev, generator=g).to(dtype)

        def every_layer():
            for w in ws:
                torch.nn.functional.linear(x, w)
        fn = every_layer
        if dev.type == "cuda":
            every_layer()  # cuBLAS picks and loads its kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                every_layer()
            fn = graph.replay
        t = us(fn) / count
        out[name] = {"us": round(t, 2), "GB_per_s": round(n * k * x.element_size() / t / 1e3)}
    return out


RES[f"matmul_{rows}_rows"] = matmul_floor(rows)
print(RES[f"matmul_{rows}_rows"], flush=True)
dump(RES, args.out)


def build(side: str) -> tuple[R.TorchEngine, str]:
    """-> (the side's engine on fresh random weights, the decode kernel it runs with)."""
    model = random_model(cfg, dev, dtype).eval()
    kernel = M.decode_kernel(dev.type, dtype)
    fuse = M.MLP.fuse_gate_up
    if side == "unfused_mlp":
        M.MLP.fuse_gate_up = lambda self: None
    try:
        eng = R.TorchEngine(model, max_num_seqs=256, shares_weights=side != "before", compile=True)
    finally:
        M.MLP.fuse_gate_up = fuse
    if side == "check_every_step":
        eng.finished_check_every = 1
    if side == "before":
        eng.pick, kernel = None, "sdpa"
    return eng, kernel


# the engine: the trainer's groups
gen = torch.Generator().manual_seed(0)
prompts = torch.randint(100, cfg.vocab_size - 100, (16, 305), generator=gen).tolist()
prompts = [p[:200 + 7 * i] for i, p in enumerate(prompts)]
max_tokens = 8 if args.tiny else 512
sp = R.SamplingParams(n=8, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=3)
engines = {side: build(side) for side in sides}
weights = [list(engines[sides[0]][0].model.named_parameters())]
for side in sides[1:]:  # every side on the same weights: greedy tokens can be compared
    engines[side][0].load_weights(weights, version=0)


def generate(side: str, params: R.SamplingParams):
    eng, kernel = engines[side]
    return with_kernel(kernel, lambda: eng.generate(prompts, params))


for side in sides:
    RES[f"{side}_first_call_s"] = round(timed(lambda: generate(side, sp), dev)[0], 3)
for _ in range(args.repeats):
    for side in sides:
        RES.setdefault(f"{side}_generate_s", []).append(round(timed(lambda: generate(side, sp), dev)[0], 3))
for side in sides:
    RES[f"{side}_generate_median_s"] = statistics.median(RES[f"{side}_generate_s"])
    print(side, RES[f"{side}_generate_s"], flush=True)
greedy = R.SamplingParams(n=1, temperature=0, max_tokens=8 if args.tiny else 64, ignore_eos=True)
outs = {side: generate(side, greedy) for side in sides}
for side in sides[1:]:
    pairs = [(a, b) for x, y in zip(outs[sides[0]], outs[side]) for a, b in zip(x, y)]
    RES[f"greedy_{side}_equal_rows_vs_{sides[0]}"] = f"{sum(a.token_ids == b.token_ids for a, b in pairs)} / " \
                                                   f"{len(pairs)}"
dump(RES, args.out)


def kernel_kind(name: str) -> str:
    """A GPU kernel's name -> what it does in a decode step."""
    if any(s in name for s in ("argmax", "logsumexp", "exponential", "distribution")):
        return "sampling"
    if name.startswith("triton_"):  # Inductor's, named after the ops they fuse (an attention's inputs too)
        return "fused elementwise (Inductor)"
    if "flash" in name or "attention" in name:
        return "attention"
    if name.startswith("nvjet") or any(s in name for s in ("gemm", "cublas", "cutlass", "splitK")):
        return "matmul"
    return "other"


def kernel_time_by_kind(eng: R.TorchEngine, new_tokens: int) -> tuple[dict, dict]:
    """-> (device time (us), kernel launches) of one generate of the trainer's groups, per kernel kind."""
    params = R.SamplingParams(n=8, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=3)
    eng.generate(prompts, params)  # warm
    activity = ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        eng.generate(prompts, params)
    kinds, counts = {}, {}
    for e in prof.key_averages():
        if dev.type == "cuda":
            t = e.device_time_total
        else:
            t = e.self_cpu_time_total
        if t <= 0:  # a runtime call (a launch, a sync), not a kernel
            continue
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + t
        counts[kind] = counts.get(kind, 0) + e.count
    return kinds, counts


if args.profile and "default" in engines:
    # decode steps without CUDA graphs (the profiler sees each kernel; the kernels are the same); the prefill and
    # the first token's sampling are a generate of one token, subtracted
    eng = engines["default"][0]
    eng.use_cuda_graph = False
    eng.sleep()
    steps = 8 if args.tiny else 64
    prefill, prefill_n = kernel_time_by_kind(eng, 1)
    both, both_n = kernel_time_by_kind(eng, steps + 1)
    per_step = {k: round((both[k] - prefill.get(k, 0.0)) / steps, 1) for k in both}
    RES["profile_us_per_decode_step"] = dict(sorted(per_step.items(), key=lambda kv: -kv[1]))
    RES["profile_launches_per_decode_step"] = {k: round((both_n[k] - prefill_n.get(k, 0)) / steps, 1)
                                               for k in both_n}
    RES["profile_prefill_us"] = {k: round(v, 1) for k, v in prefill.items()}
    print(RES["profile_us_per_decode_step"], flush=True)
dump(RES, args.out)
print(RES)
