"""
Correctness checks of the built-in engine and the packed forward on CUDA (one PASS/FAIL line each), then the
packed forward+backward tokens/s and MFU of a Qwen2.5-1.5B-shaped model; --tiny runs the script on the CPU.

    python bench/check_gpu.py --parts i,ii,iii
"""
import argparse
import contextlib
import inspect
import os
import random
import statistics
import sys
import time
import traceback

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import torch  # noqa: E402

import model as M  # noqa: E402
import parallel  # noqa: E402
import rollout as R  # noqa: E402
from bench.common import dump, matmul_peak, model_config, random_model, sync, timed  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true",
               help="CPU smoke test: small model in (iii); in (i) the graph path with emulated CUDA graphs")
p.add_argument("--tokens", type=int, default=16384, help="packed tokens per step in (iii)")
p.add_argument("--parts", default="i,ii,iii", help="comma list of the parts to run: i, ii, iii")
args = p.parse_args()
dev = parallel.get_device()
cuda = dev.type == "cuda"
torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks in true fp32
torch.backends.cudnn.allow_tf32 = False
OUT = os.environ.get("OUT")
RES = {"checks": {}, "info": {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}}


def check(name, ok, detail=""):
    RES["checks"][name] = {"pass": bool(ok), "detail": detail}
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def small_cfg(**kw):
    d = dict(architecture="Qwen2ForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    d.update(kw)
    return M.ModelConfig(**d)


print(RES["info"], "varlen available:", M._varlen_available(dev.type), flush=True)
if cuda:
    try:
        from torch.nn.attention.varlen import varlen_attn
        RES["info"]["varlen_signature"] = str(inspect.signature(varlen_attn))
        print("varlen_attn", RES["info"]["varlen_signature"])
    except ImportError:
        pass

# -----------------------------------------------------------------------------
# (i) rollout.TorchEngine, no graphs and CUDA graphs, == a naive full-recompute loop (tokens, finish reasons,
# log-probs) on a small fp32 model: rows of different lengths, one crossing a cache span, several waves; then
# sampling, graphs vs no graphs, and a bf16 model against the packed trainer forward


def emulate_cuda_graphs():
    """CPU only: replace torch.cuda's streams and graphs so that TorchEngine's graph path runs; a "graph"
    re-runs the decode step called during its capture (rollout._decode_step is wrapped to record it)."""
    state = {"capturing": False}

    class Graph:
        def pool(self):
            return None

        def replay(self):
            self.step()

    @contextlib.contextmanager
    def graph(g, pool=None):
        state["capturing"] = True
        yield
        state["capturing"] = False
        g.step = state.pop("step")

    class Stream:
        def wait_stream(self, s):
            pass

    torch.cuda.Stream, torch.cuda.current_stream = Stream, Stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.CUDAGraph, torch.cuda.graph = Graph, graph
    step, capture = R._decode_step, R.TorchEngine._capture

    def recording_capture(self, *a):
        state["engine"] = self
        return capture(self, *a)

    def recording_step(model, tokens, cache_pos, kv, cache_len):
        if state["capturing"]:  # what a replay must redo: the step into the graphs' shared logits buffer
            logits = state["engine"]._io[2][:tokens.shape[0]]
            state["step"] = lambda: logits.copy_(step(model, tokens, cache_pos, kv, cache_len))
        return step(model, tokens, cache_pos, kv, cache_len)

    R._decode_step, R.TorchEngine._capture = recording_step, recording_capture


def naive_greedy(m, prompt, max_tokens, stop):
    """Full recompute of the whole sequence per token; -> (tokens, log-probs at T=1)."""
    seq, lps = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = m(torch.tensor([seq], device=dev))[0, -1].double()
        t = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        seq.append(t)
        if t in stop:
            break
    return seq[len(prompt):], lps


def tokens_of(out):
    return [[c.token_ids for c in cs] for cs in out]


def check_engine():
    graphs = cuda or args.tiny  # on the CPU only as an emulation
    if graphs and not cuda:
        emulate_cuda_graphs()
    cfg = small_cfg(vocab_size=64)
    m = M.Transformer(cfg).init_weights(seed=2, std=0.3).to(dev).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 11, 12], [10], [30, 31, 32, 33],
               [random.Random(0).randrange(64) for _ in range(41)]]
    T = 300  # the long row crosses the first cache span (256 positions)
    free = [naive_greedy(m, q, T, ())[0] for q in prompts]
    long_row = set(free[4])  # stop tokens: early tokens of the other rows that the last row never emits
    stop = {t for f in free[:4] for t in f[:30] if t not in long_row}
    ref = [naive_greedy(m, q, T, stop) for q in prompts]
    lens = [len(t) for t, _ in ref]
    print(f"     naive loop: response lengths {lens} with stop tokens {sorted(stop)}", flush=True)
    check("(i) the test makes rows of different lengths, one crossing a cache span",
          len(set(lens)) > 2 and max(lens) + len(prompts[4]) > 256, f"lengths {lens}")
    paths = [("no graphs", False)] + ([("eager graphs", True)] if graphs else [])
    for name, graph in paths:
        for mns in (16, 5):
            for n in (1, 3):
                t0 = time.perf_counter()
                eng = R.TorchEngine(m, max_num_seqs=mns, use_cuda_graph=graph)
                sp = R.SamplingParams(n=n, temperature=0, max_tokens=T, stop_token_ids=list(stop))
                out = eng.generate(prompts, sp)
                tok_ok = all(c.token_ids == t for (t, _), cs in zip(ref, out) for c in cs) and \
                    all(len(cs) == n for cs in out)
                fin_ok = all(c.finish_reason == ("stop" if t[-1] in stop else "length")
                             for (t, _), cs in zip(ref, out) for c in cs)
                lp_err = max(abs(a - b) for (_, lp), cs in zip(ref, out) for c in cs for a, b in zip(c.logprobs, lp))
                spans = sorted({s for _, s in eng._graphs}) if graph else "-"
                check(f"(i) greedy {name} max_num_seqs={mns} n={n} == naive loop",
                      tok_ok and fin_ok and lp_err < 1e-4,
                      f"tokens equal {tok_ok}, finish reasons {fin_ok}, max |logp - naive| {lp_err:.1e}, "
                      f"spans {spans}, {time.perf_counter() - t0:.1f} s")
    if not cuda:
        return
    sp = R.SamplingParams(n=3, temperature=1.0, max_tokens=T, stop_token_ids=list(stop), seed=7)
    a = R.TorchEngine(m, max_num_seqs=16).generate(prompts, sp)
    b = R.TorchEngine(m, max_num_seqs=16, use_cuda_graph=False).generate(prompts, sp)
    lp_err = max(abs(x - y) for ca, cb in zip(a, b) for u, v in zip(ca, cb) for x, y in zip(u.logprobs, v.logprobs))
    check("(i) sampled T=1 seed=7 n=3 eager graphs == no graphs", tokens_of(a) == tokens_of(b),
          f"max |logp diff| {lp_err:.1e}")
    # the engine's sampled log-probs are the trainer's (T=1): one forward over prompt + response
    errs = []
    for q, cs in zip(prompts, a):
        for c in cs:
            seq = torch.tensor([q + c.token_ids], device=dev)
            with torch.no_grad():
                lp, _ = m(seq[:, :-1], target_ids=seq[:, 1:])
            errs.append((lp[0, len(q) - 1:].cpu() - torch.tensor(c.logprobs)).abs().max().item())
    check("(i) eager graph engine sampled log-probs == trainer log-probs", max(errs) < 1e-4, f"max err {max(errs):.1e}")
    # bf16, as in production: varlen prefill, graph decode; sampled log-probs against the packed trainer
    # forward. bf16 logits of this random model reach |16..32|, where one bf16 step is 0.125,
    # so the bar is the no-graph engine's own error (same prompts, seed), not a fixed number.
    mb = M.Transformer(cfg).init_weights(seed=2, std=0.3).to(dev, torch.bfloat16).eval()
    sp = R.SamplingParams(n=3, temperature=1.0, max_tokens=T, stop_token_ids=list(stop), seed=3)

    def err_vs_trainer(out):
        seqs = [q + c.token_ids for q, cs in zip(prompts, out) for c in cs]
        ids, pos, batch = M.pack_sequences([s_[:-1] for s_ in seqs], dev)
        tgt = torch.tensor([t for s_ in seqs for t in s_[1:]], device=dev)[None]
        with torch.no_grad():
            lp = mb(ids, pos, batch, target_ids=tgt)[0][0].cpu()
        errs, o = [], 0
        for q, cs in zip(prompts, out):
            for c in cs:
                n_ = len(q) + len(c.token_ids) - 1
                errs.append((lp[o + len(q) - 1:o + n_] - torch.tensor(c.logprobs)).abs().max().item())
                o += n_
        return max(errs)

    ref = R.TorchEngine(mb, max_num_seqs=16, use_cuda_graph=False).generate(prompts, sp)
    e_ref = err_vs_trainer(ref)
    out = R.TorchEngine(mb, max_num_seqs=16).generate(prompts, sp)
    ta, tb = [c.token_ids for cs in out for c in cs], [c.token_ids for cs in ref for c in cs]
    agree = sum(x == y for x, y in zip(ta, tb)) / len(ta)
    e = err_vs_trainer(out)
    check("(i) bf16 eager graphs (varlen prefill): sampled log-probs vs packed trainer within 2x the no-graph "
          "engine's error (or 5e-2)", e <= max(5e-2, 2 * e_ref),
          f"max |logp err| {e:.1e}, no-graph engine {e_ref:.1e}; identical sequences vs no graphs {agree:.0%}; "
          f"response lengths {sorted(len(t) for t in ta)}")


# -----------------------------------------------------------------------------
# (ii) the packed forward (varlen attention where available) == the per-document forward: logits and
# log-prob gradients in fp32 and bf16, each against a float64 CPU reference


def check_packed_forward():
    cfg = small_cfg(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                    num_key_value_heads=2)
    docs_len = [37, 128, 5, 300, 1, 64]
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in docs_len]
    tgts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in docs_len]

    def per_doc(m, device):
        logits = torch.cat([m(torch.tensor([d], device=device))[0] for d in docs])
        m.zero_grad(set_to_none=True)
        loss = sum(-m(torch.tensor([d], device=device), target_ids=torch.tensor([t], device=device))[0].sum()
                   for d, t in zip(docs, tgts))
        loss.backward()
        return logits.detach(), torch.cat([p.grad.flatten() for p in m.parameters()])

    def packed(m, device):
        ids, pos, batch = M.pack_sequences(docs, device)
        logits = m(ids, pos, batch)[0]
        m.zero_grad(set_to_none=True)
        ids, pos, batch = M.pack_sequences(docs, device)
        tgt = torch.tensor([t for ts in tgts for t in ts], device=device)[None]
        (-m(ids, pos, batch, target_ids=tgt)[0].sum()).backward()
        return logits.detach(), torch.cat([p.grad.flatten() for p in m.parameters()])

    ref_logits, ref_grad = per_doc(M.Transformer(cfg).init_weights(seed=1, std=0.05).double(), "cpu")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        m = M.Transformer(cfg).init_weights(seed=1, std=0.05).to(dev, dtype)
        d_logits, d_grad = per_doc(m, dev)
        try:
            p_logits, p_grad = packed(m, dev)
        except Exception as e:
            traceback.print_exc()
            check(f"(ii) packed forward {dtype} on {dev}", False, f"raised {type(e).__name__}: {str(e)[:300]}")
            continue
        el_p, el_d = rel(p_logits, ref_logits), rel(d_logits, ref_logits)
        eg_p, eg_d = rel(p_grad, ref_grad), rel(d_grad, ref_grad)
        check(f"(ii) packed logits {dtype} == per-document",
              el_p < tol and el_p <= 3 * el_d + 1e-5,
              f"rel err vs fp64: packed {el_p:.1e}, per-doc {el_d:.1e}; packed vs per-doc {rel(p_logits, d_logits):.1e}")
        check(f"(ii) packed log-prob grads {dtype} == per-document",
              eg_p < 2 * tol and eg_p <= 3 * eg_d + 1e-5,
              f"rel err vs fp64: packed {eg_p:.1e}, per-doc {eg_d:.1e}")


# -----------------------------------------------------------------------------
# (iii) Qwen2.5-1.5B-shaped random bf16 model: packed forward + backward with gradient checkpointing and
# target_ids (loss = -logp.mean()) over documents of mixed lengths; median of 5 steps after 2


def check_fwd_bwd():
    peak = None
    if cuda:
        peak = matmul_peak(dev)
        RES["info"]["bf16_matmul_TFLOPs"] = round(peak / 1e12, 1)
        print(f"bf16 matmul 8192^3: {peak / 1e12:.0f} TFLOP/s")
    m = random_model(model_config("qwen2.5-1.5b", args.tiny), dev, torch.bfloat16).train()
    m.gradient_checkpointing = True
    cfg = m.config
    n_params = sum(p.numel() for p in m.parameters())
    rng = random.Random(0)
    total = args.tokens if not args.tiny else 512
    lens = []  # documents of 64 .. 4096 tokens filling args.tokens
    while sum(lens) < total:
        lens.append(min(rng.randint(64, 4096 if not args.tiny else 128), total - sum(lens)))
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    ids, pos, batch = M.pack_sequences(docs, dev)
    tgt = torch.randint(0, cfg.vocab_size, ids.shape, generator=g).to(dev)
    print(f"(iii) {n_params / 1e9:.3f} B params bf16, {len(lens)} documents, {sum(lens)} tokens, lengths {lens}")

    def step():
        m.zero_grad(set_to_none=True)
        logp, _ = m(ids, pos, batch, target_ids=tgt)
        loss = -logp.mean()
        loss.backward()
        return loss

    for _ in range(2):
        step()
    sync(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for _ in range(5 if not args.tiny else 2):
        dt, loss = timed(step, dev)
        times.append(dt)
    dt = statistics.median(times)
    ntok = sum(lens)
    attn_flops = sum(6 * n * n * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers for n in lens)
    flops = 6 * n_params * ntok + attn_flops  # the model's fwd+bwd (recomputation for checkpointing not counted)
    r = {"tokens": ntok, "docs": len(lens), "step_s": [round(x, 4) for x in times], "tok_per_s": round(ntok / dt, 1),
         "loss": round(loss.item(), 4), "finite_grads": all(torch.isfinite(p.grad).all().item() for p in m.parameters())}
    if cuda:
        r["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        r["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        r["MFU_6N"] = round(flops / dt / peak, 3)
    RES["fwd_bwd"] = r
    print(f"(iii) packed fwd+bwd: {r}")
    check("(iii) 1.5B packed fwd+bwd (checkpointing, target_ids) runs, finite loss and grads",
          r["finite_grads"] and torch.isfinite(loss).item(),
          f"{r['tok_per_s']:.0f} tokens/s, peak {r.get('peak_alloc_GiB')} GiB allocated "
          f"({r.get('peak_reserved_GiB')} reserved), MFU {r.get('MFU_6N')}")


# -----------------------------------------------------------------------------
# run the parts asked for; an exception is a FAIL line with the error, and the script goes on

for part, name, fn in (("i", "(i) engine", check_engine), ("ii", "(ii) packed forward", check_packed_forward),
                       ("iii", "(iii) 1.5B packed fwd+bwd", check_fwd_bwd)):
    if part in args.parts.split(","):
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            check(name, False, f"raised {type(e).__name__}: {str(e)[:300]}")
n_fail = sum(not c["pass"] for c in RES["checks"].values())
print(f"\n{len(RES['checks']) - n_fail} PASS, {n_fail} FAIL")
if OUT:
    dump(RES, os.path.join(OUT, "check_gpu.json"))
