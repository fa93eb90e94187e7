"""
Rollout tokens/s on a random-init Qwen2.5-1.5B-shaped model: the built-in rollout.TorchEngine against
transformers' generate, vLLM (bare, and through rollout.VLLMEngine) and the memory-bound decode limit.
The vLLM variants between bare llm.generate and rollout.VLLMEngine.generate split the wrapper's cost: per-request
seeds, sampled log-probs, both, the wrapper's own requests, the conversion to Completions, Python's gc.

    python bench/rollout.py --engines torch,hf,vllm --batch 64,256 --max-tokens 512,2048
    python bench/rollout.py --engines vllm --batch 256 --max-tokens 512 --vllm-variants seed,logp,both,nd,convert
"""
import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root (rollout.py, not this)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hf  # noqa: E402
import parallel  # noqa: E402
import rollout as R  # noqa: E402
from bench.common import VLLM_ENV, dump, median_seconds, model_config, random_model, timed, versions  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true", help="tiny model, small sizes: a CPU smoke test of this script")
p.add_argument("--engines", default="torch,hf,vllm",
               help="comma list, run in this order: torch (the built-in engine), torch_compiled (the same with "
                    "compile=True: its blocks compiled in place, so after torch), hf, vllm (only if importable)")
p.add_argument("--batch", default="64,256")
p.add_argument("--max-tokens", default="512,2048")
# each timed against bare llm.generate in the same run, interleaved; results key: <key>_tok_s, <key>_wall_s
VLLM_VARIANTS = {
    "seed": "vllmseed",  # llm.generate, one SamplingParams per request with seed = its index
    "logp": "vllmlogp",  # llm.generate, one shared SamplingParams with logprobs=0, flat_logprobs
    "both": "vllmboth",  # per-request seeds + log-probs (the requests the wrapper built per sample)
    "req": "vllmreq",  # llm.generate of rollout.VLLMEngine.requests
    "nd": "ndvllm",  # rollout.VLLMEngine.generate: the requests, then the conversion to Completions
    "ndnolp": "ndvllm_nolp",  # rollout.VLLMEngine.generate without log-probs
    "grp": "vllmgrp",  # bare llm.generate of B // 8 prompts x 8 samples each (the trainer's groups)
    "ndgrp": "ndvllm_grp",  # rollout.VLLMEngine.generate of those groups, no log-probs (the trainer's default)
    "nogc": "ndvllm_nogc",  # rollout.VLLMEngine.generate with Python's gc disabled during the call
    "convert": "convert",  # the conversion alone of one "req" call's outputs into Completions: convert_s
}
KEYS = {"bare": "vllm", **VLLM_VARIANTS}  # bare llm.generate: vllm_tok_s
p.add_argument("--vllm-variants", default=",".join(VLLM_VARIANTS),
               help=f"comma list of the vLLM variants timed next to bare llm.generate: {', '.join(VLLM_VARIANTS)}")
p.add_argument("--prompt-len", type=int, default=256)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--repeats-long", type=int, default=2, help="timed calls for max_tokens > 512")
p.add_argument("--vllm-warmup-rounds", type=int, default=1,
               help="untimed rounds of every vLLM variant per (B, max_tokens) first: the first call of each variant "
                    "at a new size took up to 1.6x the next")
p.add_argument("--hf-repeats", type=int, default=1)
p.add_argument("--hf-max-tokens", type=int, default=512, help="run transformers only for max_tokens <= this")
p.add_argument("--gpu-mem-util", type=float, default=0.5,
               help="vLLM gpu_memory_utilization (our model stays on the GPU)")
p.add_argument("--ckpt-dir", default="/tmp/nanodapo_bench_model")
args = p.parse_args()
if args.tiny:
    args.batch, args.max_tokens, args.prompt_len = "4,8", "16,32", 16
Bs = [int(x) for x in args.batch.split(",")]
Ts = [int(x) for x in args.max_tokens.split(",")]
P = args.prompt_len
engines = args.engines.split(",")
variants = [v for v in args.vllm_variants.split(",") if v]
if set(variants) - set(VLLM_VARIANTS):
    p.error(f"--vllm-variants {args.vllm_variants}: unknown {sorted(set(variants) - set(VLLM_VARIANTS))}; "
            f"choose from {','.join(VLLM_VARIANTS)}")
device = parallel.get_device()
cuda = device.type == "cuda"
OUT = os.path.join(os.environ["OUT"], "rollout.json") if os.environ.get("OUT") else None
RES = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": {}, "diagnostics": {}, "errors": {}}


def save():
    if OUT:
        dump(RES, OUT)


def row(B, T):
    return RES["rows"].setdefault(f"B{B}_T{T}", {"B": B, "max_tokens": T, "prompt_len": P})


def repeats(T):
    return args.repeats if T <= 512 else args.repeats_long


# -----------------------------------------------------------------------------
# environment and model

RES["versions"] = versions()
if cuda:
    RES["gpu"] = torch.cuda.get_device_name()
    try:
        RES["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit",
             "--format=csv"], capture_output=True, text=True, timeout=30).stdout.strip()
        print(RES["nvidia_smi"])
    except Exception as e:
        RES["nvidia_smi"] = repr(e)
print(f"versions: {RES['versions']}, device {RES.get('gpu', device)}")

cfg = model_config("qwen2.5-1.5b", args.tiny)
t0 = time.perf_counter()
model = random_model(cfg, device, torch.bfloat16).eval()
RES["n_params"] = sum(p.numel() for p in model.parameters())
RES["build_s"] = round(time.perf_counter() - t0, 2)
print(f"model: {RES['n_params'] / 1e9:.3f} B params, built in {RES['build_s']} s")

gen = torch.Generator().manual_seed(0)
PROMPTS = {B: torch.randint(100, cfg.vocab_size - 100, (B, P), generator=gen).tolist() for B in Bs}
if any(e in engines for e in ("hf", "vllm")):
    t0 = time.perf_counter()
    hf.save_pretrained(model, args.ckpt_dir)
    print(f"saved checkpoint to {args.ckpt_dir} in {time.perf_counter() - t0:.1f} s")

# -----------------------------------------------------------------------------
# the memory-bound decode limit: a step reads every weight once plus the live KV cache, at the copy bandwidth


def copy_bandwidth(reps=20) -> float:
    """Bytes read + written per second by a device copy of 1 GiB (64 MiB on the CPU)."""
    src = torch.randn(2**28 if cuda else 2**24, device=device)  # fp32
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    dt, _ = timed(lambda: [dst.copy_(src) for _ in range(reps)], device)
    return 2 * src.numel() * src.element_size() * reps / dt


copy_bw = copy_bandwidth()
RES["copy_bw_GBps"] = round(copy_bw / 1e9, 1)
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16
RES["weight_bytes"], RES["kv_bytes_per_token"] = weight_bytes, kv_per_token
print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); weights {weight_bytes / 1e9:.2f} GB; "
      f"KV {kv_per_token / 1024:.0f} KiB/token")
for B in Bs:
    for T in Ts:
        kv = B * (P + T / 2) * kv_per_token  # average live KV read per decode step
        floor = (weight_bytes + kv) / copy_bw
        r = row(B, T)
        r["limit_step_ms"] = round(floor * 1e3, 3)
        r["limit_tok_s"] = round(B / floor, 1)
        r["limit_kv_GB_per_step"] = round(kv / 1e9, 3)
save()

# -----------------------------------------------------------------------------
# the built-in engine (CUDA graphs on CUDA); the first timed call of a size includes its graph captures


def bench_torch(name="torch", compile=False):
    eng = R.TorchEngine(model, max_num_seqs=max(Bs), compile=compile)
    warm = R.SamplingParams(n=1, temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=True)
    t, _ = timed(lambda: eng.generate(PROMPTS[Bs[0]][:4], warm), device)
    RES[f"{name}_warmup_s"] = round(t, 2)
    print(f"{name} warm-up: {t:.2f} s")
    for T in Ts:
        for B in Bs:
            sp = R.SamplingParams(n=1, temperature=1.0, max_tokens=T, ignore_eos=True)
            times = []
            for _ in range(repeats(T)):
                dt, out = timed(lambda: eng.generate(PROMPTS[B], sp), device)
                ntok = sum(len(c.token_ids) for cs in out for c in cs)
                assert ntok == B * T, (ntok, B * T)
                times.append(dt)
            r = row(B, T)
            r[f"{name}_wall_s"] = [round(x, 3) for x in times]
            r[f"{name}_tok_s"] = round(B * T / statistics.median(times), 1)
            r[f"{name}_first_call_tok_s"] = round(B * T / times[0], 1)
            print(f"{name:6s} B={B:4d} T={T:5d}: {r[f'{name}_tok_s']:10.0f} tok/s  (calls {r[f'{name}_wall_s']} s)")
            save()
            if cuda:
                try:
                    diagnose(eng, name, B, T, statistics.median(times))
                except Exception as e:  # diagnostics must not cost the table
                    RES["errors"][f"diag_{name}_B{B}_T{T}"] = repr(e)
                    print("diagnostics failed:", repr(e))
                save()
    eng.sleep()  # free the KV cache and graphs before the next engine


def diagnose(eng, name, B, T, wall):
    """Split the built-in engine's time: prefill, loop per step, graph replays, sampling (reads engine internals)."""
    d = RES["diagnostics"].setdefault(f"{name}_B{B}_T{T}", {"engine": name, "B": B, "max_tokens": T})
    sp = R.SamplingParams(n=1, temperature=1.0, max_tokens=T, ignore_eos=True)
    with torch.no_grad():
        prefill = median_seconds(lambda: eng._prefill(PROMPTS[B], sp, eng._cache, None), device, reps=3)
    d["prefill_ms"] = round(prefill * 1e3, 2)
    d["loop_ms_per_step"] = round((wall * 1e3 - d["prefill_ms"]) / (T - 1), 3)

    def replay_ms(span, graph):  # positions as at capture: every row writes slot span - 1, inside the graph's span
        eng._io[1].fill_(span - 1)
        return round(median_seconds(graph.replay, device, reps=30) * 1e3, 3)
    # the graphs the timed calls replayed: bucket B, one per cache span
    d["graph_ms_by_span"] = {s: replay_ms(s, g) for (b, s), g in sorted(eng._graphs.items()) if b == B}
    logits = torch.randn(B, cfg.vocab_size, device=device, dtype=torch.bfloat16)
    d["sample_ms"] = round(median_seconds(lambda: R.sample_tokens(logits, 1.0, 1.0, -1), device, reps=20) * 1e3, 3)
    d["floor_ms_per_step"] = row(B, T)["limit_step_ms"]
    # a graph replay hides its kernels from the profiler: count them on the same step run eagerly
    span = max((s for b, s in eng._graphs if b == B), default=P + T)
    step = eager_decode_step(eng, B, span)
    try:
        d["eager_step_ms"] = round(median_seconds(step, device, reps=10) * 1e3, 3)
        d["kernels_per_step"] = kernels_per_call(step)
        d["kernels_per_sample"] = kernels_per_call(lambda: R.sample_tokens(logits, 1.0, 1.0, -1))
    except Exception as e:  # the profiler needs CUPTI; the timings above stand without it
        d["kernels_error"] = repr(e)
    print(f"       diag {name} B={B} T={T}: {d}")


def eager_decode_step(eng, B, span):
    """-> a call of the engine's decode step for B rows over `span` cache positions, without its CUDA graph
    (writes slot span - 1 of rows :B, which the timed calls no longer need)."""
    tokens = torch.zeros(B, dtype=torch.long, device=device)
    cache_pos = torch.full((B,), span - 1, dtype=torch.long, device=device)

    @torch.no_grad()
    def step():
        return R._decode_step(eng.model, tokens, cache_pos, eng._cache, span)
    return step


def kernels_per_call(fn) -> int:
    """Device kernels (memcpy and memset included) one call of fn launches, as torch.profiler records them."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


# -----------------------------------------------------------------------------
# transformers generate on the same weights (bf16, sdpa, min_new_tokens = max_new_tokens)


def bench_hf():
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(args.ckpt_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    time_hf(hf.to(device).eval())
    del hf
    if cuda:
        torch.cuda.empty_cache()


def time_hf(hf):
    ids = torch.tensor(PROMPTS[Bs[0]][:2], device=device)[:, :64]
    with torch.no_grad():
        ref, got = model(ids).float(), hf(ids).logits.float()
    RES["hf_vs_ours_logits_rel_err"] = rel = round(((got - ref).norm() / ref.norm()).item(), 5)
    print(f"transformers vs nanodapo logits, relative error {rel} (bf16)")

    def generate(prompts, T):
        x = torch.tensor(prompts, device=device)
        with torch.no_grad():
            return hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=T, min_new_tokens=T,
                               do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    t, _ = timed(lambda: generate(PROMPTS[Bs[0]][:4], 8), device)
    print(f"transformers warm-up: {t:.2f} s")
    for T in [t for t in Ts if t <= args.hf_max_tokens]:
        for B in Bs:
            times = []
            for _ in range(args.hf_repeats):
                dt, out = timed(lambda: generate(PROMPTS[B], T), device)
                assert out.shape == (B, P + T), out.shape
                times.append(dt)
            r = row(B, T)
            r["hf_wall_s"] = [round(x, 3) for x in times]
            r["hf_tok_s"] = round(B * T / statistics.median(times), 1)
            print(f"hf     B={B:4d} T={T:5d}: {r['hf_tok_s']:10.0f} tok/s  (calls {r['hf_wall_s']} s)")
            save()


# -----------------------------------------------------------------------------
# vLLM in this process, as the trainer hosts it


def bench_vllm(vllm):
    """One rollout.VLLMEngine (weights pushed from the benchmark model); per (B, T), bare llm.generate (no seeds,
    no log-probs) and each selected variant (VLLM_VARIANTS), interleaved call by call."""
    SamplingParams = vllm.SamplingParams
    RES["versions"]["vllm"] = vllm.__version__
    t0 = time.perf_counter()
    eng = R.VLLMEngine(args.ckpt_dir, gpu_memory_utilization=args.gpu_mem_util, max_model_len=P + max(Ts) + 64,
                       max_num_seqs=max(Bs), seed=0)
    RES["vllm_init_s"] = round(time.perf_counter() - t0, 1)
    print(f"vLLM {vllm.__version__} engine init {RES['vllm_init_s']} s")
    eng.wake_up(["weights"])
    pushes = []
    for _ in range(4):  # the trainer's sync: bucketed full tensors into load_weights
        dt, nbytes = timed(lambda: eng.load_weights(parallel.iter_full_weights(model, 512 * 2**20), version=0), device)
        pushes.append(dt)
    RES["vllm_push_s"], RES["vllm_push_GB"] = [round(x, 4) for x in pushes], round(nbytes / 1e9, 3)
    print(f"weight push {nbytes / 1e9:.2f} GB: {RES['vllm_push_s']} s (first, then warm)")
    eng.wake_up(["kv_cache"])
    warm = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False)
    eng.llm.generate([{"prompt_token_ids": p} for p in PROMPTS[Bs[0]][:4]], warm, use_tqdm=False)

    def requests(prompts, T, seeds: bool, logprobs: bool):
        """vLLM requests, one sample each: seeds -> one SamplingParams per request, seed = its index, else one
        shared; logprobs -> the sampled token's log-prob, as flat lists."""
        def sampling(seed):
            return SamplingParams(n=1, temperature=1.0, max_tokens=T, ignore_eos=True, detokenize=False, seed=seed,
                                  logprobs=0 if logprobs else None, flat_logprobs=logprobs)
        ps = [{"prompt_token_ids": p} for p in prompts]
        return ps, [sampling(i) for i in range(len(prompts))] if seeds else sampling(None)

    def without_gc(fn):
        gc.disable()
        try:
            return fn()
        finally:
            gc.enable()

    RES["vllm_convert_fn"] = "rollout.vllm_completions"
    timed_variants = ["bare"] + [v for v in VLLM_VARIANTS if v in variants and v != "convert"]
    for T in Ts:
        for B in Bs:
            ours = R.SamplingParams(n=1, temperature=1.0, max_tokens=T, ignore_eos=True, seed=0)
            nolp, G = R.SamplingParams(**{**ours.__dict__, "logprobs": False}), 8 if B % 8 == 0 else 1
            grouped = R.SamplingParams(**{**ours.__dict__, "n": G, "logprobs": False})
            groups = PROMPTS[B][:B // G]
            calls = {
                "bare": lambda: eng.llm.generate(*requests(PROMPTS[B], T, False, False), use_tqdm=False),
                "seed": lambda: eng.llm.generate(*requests(PROMPTS[B], T, True, False), use_tqdm=False),
                "logp": lambda: eng.llm.generate(*requests(PROMPTS[B], T, False, True), use_tqdm=False),
                "both": lambda: eng.llm.generate(*requests(PROMPTS[B], T, True, True), use_tqdm=False),
                "req": lambda: eng.llm.generate(*eng.requests(PROMPTS[B], ours), use_tqdm=False),
                "nd": lambda: eng.generate(PROMPTS[B], ours, version=0),
                "ndnolp": lambda: eng.generate(PROMPTS[B], nolp, version=0),
                "grp": lambda: eng.llm.generate(*requests([p for p in groups for _ in range(G)], T, False, False),
                                                use_tqdm=False),
                "ndgrp": lambda: eng.generate(groups, grouped, version=0),
                "nogc": lambda: without_gc(lambda: eng.generate(PROMPTS[B], ours, version=0)),
            }
            times, last = {v: [] for v in timed_variants}, {}
            for _ in range(args.vllm_warmup_rounds):
                for v in timed_variants:
                    calls[v]()
            for _ in range(repeats(T)):
                for v in timed_variants:
                    dt, outs = timed(calls[v], device)
                    completions = v in ("nd", "nogc", "ndnolp", "ndgrp")
                    ntok = sum(len(c.token_ids) for o in outs for c in o) if completions else \
                        sum(len(o.outputs[0].token_ids) for o in outs)
                    assert ntok == B * T, (v, ntok, B * T)
                    if v in ("logp", "both", "req"):
                        assert outs[0].outputs[0].logprobs is not None, f"{v}: vLLM returned no log-probs"
                    times[v].append(dt)
                    last[v] = outs
            r = row(B, T)
            for v, ts in times.items():
                key = KEYS[v]
                r[f"{key}_wall_s"] = [round(x, 3) for x in ts]
                r[f"{key}_tok_s"] = round(B * T / statistics.median(ts), 1)
            if "convert" in variants:  # the outputs of one call of the wrapper's requests (or the same built here)
                outs = last.get("req") or last.get("both") or calls["both"]()
                conv = []
                for _ in range(repeats(T)):
                    dt, cs = timed(lambda: R.vllm_completions(outs, ours), device)
                    assert sum(len(c[0].token_ids) for c in cs) == B * T and cs[0][0].logprobs is not None
                    conv.append(dt)
                r["convert_wall_s"] = [round(x, 4) for x in conv]
                r["convert_s"] = round(statistics.median(conv), 4)
            print(f"vllm   B={B:4d} T={T:5d}: " + ", ".join(f"{v} {r[KEYS[v] + '_tok_s']:.0f}" for v in timed_variants)
                  + " tok/s" + (f", convert {r['convert_s'] * 1e3:.1f} ms" if "convert_s" in r else ""))
            print("       calls (s): " + ", ".join(f"{v} {r[KEYS[v] + '_wall_s']}" for v in timed_variants))
            save()
    eng.sleep()


# -----------------------------------------------------------------------------
# run, then the table

if "torch" in engines:
    bench_torch()
if "torch_compiled" in engines:
    bench_torch("torch_compiled", compile=True)
if "hf" in engines:
    try:
        bench_hf()
    except Exception as e:
        RES["errors"]["hf"] = repr(e)
        print("transformers failed:", repr(e))
if "vllm" in engines:
    for k, v in VLLM_ENV.items():  # read when vLLM is imported
        os.environ.setdefault(k, v)
    try:
        import vllm
    except ImportError as e:
        RES["errors"]["vllm"] = f"not importable: {e}"
        print(f"vLLM not importable ({e}); skipped")
    else:
        try:
            bench_vllm(vllm)
        except Exception as e:
            traceback.print_exc()
            RES["errors"]["vllm"] = repr(e)
save()


def fmt(x, spec="10.0f"):
    return format(x, spec) if x is not None else " " * (int(spec.split(".")[0]) - 1) + "-"


def ratio(a, b):
    return a / b if a is not None and b else None  # b: None (not measured) or 0 (rounded away)


print(f"\n=== rollout tokens/s: built-in = rollout.TorchEngine (CUDA graphs); {RES.get('gpu', device)}, "
      f"{RES['n_params'] / 1e9:.2f} B params bf16, prompt {P}, n=1, T=1.0, ignore_eos; median of {args.repeats} calls, "
      f"{args.repeats_long} for max_tokens > 512 (transformers: {args.hf_repeats}) ===")
print(f"copy bandwidth {RES['copy_bw_GBps']:.0f} GB/s (read+write), weights {weight_bytes / 1e9:.2f} GB, "
      f"KV {kv_per_token // 1024} KiB/token")
hdr = (f"{'B':>4} {'max_tok':>7} | {'built-in':>9} {'1st call':>9} {'compiled':>9} {'transf.':>9} {'vLLM':>9} "
       f"{'nd-vLLM':>9} {'limit':>9} | {'b/HF':>6} {'b/vLLM':>6} {'c/vLLM':>6} {'nd/vLLM':>7} {'b/limit':>7}")
print(hdr)
print("-" * len(hdr))
for r in RES["rows"].values():
    b, c, h, v, nd, lim = (r.get(k) for k in ("torch_tok_s", "torch_compiled_tok_s", "hf_tok_s", "vllm_tok_s",
                                               "ndvllm_tok_s", "limit_tok_s"))
    print(f"{r['B']:>4} {r['max_tokens']:>7} | {fmt(b, '9.0f')} {fmt(r.get('torch_first_call_tok_s'), '9.0f')} "
          f"{fmt(c, '9.0f')} {fmt(h, '9.0f')} {fmt(v, '9.0f')} {fmt(nd, '9.0f')} {fmt(lim, '9.0f')} | "
          f"{fmt(ratio(b, h), '6.2f')} {fmt(ratio(b, v), '6.2f')} {fmt(ratio(c, v), '6.2f')} {fmt(ratio(nd, v), '7.2f')} "
          f"{fmt(ratio(b, lim), '7.2f')}")
if RES["diagnostics"]:
    print("\nbuilt-in engine, ms per decode step (graph = one CUDA-graph replay of the model step, per cache span)")
    for d in RES["diagnostics"].values():
        print(f"{d['engine']:12s} B={d['B']:4d} max_tok={d['max_tokens']:5d} | prefill {d['prefill_ms']:7.1f} "
              f"loop {d['loop_ms_per_step']:6.3f} graph {d['graph_ms_by_span']} sample {d['sample_ms']:6.3f} "
              f"floor {d['floor_ms_per_step']:6.3f} | eager step {fmt(d.get('eager_step_ms'), '6.3f')} ms, "
              f"kernels: step {d.get('kernels_per_step', '-')} sample {d.get('kernels_per_sample', '-')}")
if any("vllm_tok_s" in r for r in RES["rows"].values()):
    print("\nvLLM variants, tokens/s relative to bare llm.generate in the same run "
          f"(convert: {RES['vllm_convert_fn']})")
    names = [v for v in VLLM_VARIANTS if v != "convert"]
    hdr = (f"{'B':>4} {'max_tok':>7} | {'bare':>9} | " + " ".join(f"{v:>6}" for v in names)
           + f" | {'convert ms':>10} {'conv/nd':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in RES["rows"].values():
        if "vllm_tok_s" not in r:
            continue
        nd_wall = statistics.median(r["ndvllm_wall_s"]) if "ndvllm_wall_s" in r else None
        conv = r.get("convert_s")
        print(f"{r['B']:>4} {r['max_tokens']:>7} | {fmt(r['vllm_tok_s'], '9.0f')} | "
              + " ".join(fmt(ratio(r.get(KEYS[v] + "_tok_s"), r["vllm_tok_s"]), "6.3f") for v in names)
              + f" | {fmt(None if conv is None else conv * 1e3, '10.1f')} {fmt(ratio(conv, nd_wall), '7.3f')}")
print("errors:", RES["errors"] or "none")
head = RES["rows"].get(f"B{max(Bs)}_T{min(Ts)}", {})
hb, hc, hv, hn, hnn = (head.get(k) for k in ("torch_tok_s", "torch_compiled_tok_s", "vllm_tok_s", "ndvllm_tok_s",
                                             "ndvllm_nolp_tok_s"))
print(f"headline B={max(Bs)} max_tokens={min(Ts)}: built-in / bare vLLM = {fmt(ratio(hb, hv), '5.2f')}, compiled "
      f"{fmt(ratio(hc, hv), '5.2f')} (goal >= 0.75); rollout.VLLMEngine / bare vLLM = {fmt(ratio(hn, hv), '5.2f')}, "
      f"without log-probs {fmt(ratio(hnn, hv), '5.2f')} (goal >= 0.95)")
if "vllm" in RES["versions"] and dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
