"""
Actor-update tokens/s and MFU: train_dapo.update_policy, the bare packed model and transformers, on the same
sequences and weights of a random-init Qwen2.5-1.5B-shaped model; MFU against a bf16 matmul measured in the run.

    python bench/train.py --rows update,bare,hf --out train.json
    python bench/train.py --rows update_compiled,update_compiled_ckpt14 --memory   # + what is live at the peak
"""
import argparse
import contextlib
import copy
import gc
import os
import pickle
import random
import re
import statistics
import sys
import time
import traceback

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import torch  # noqa: E402

import data  # noqa: E402
import hf  # noqa: E402
import model as M  # noqa: E402
import parallel  # noqa: E402
import train_dapo as T  # noqa: E402
from bench.common import (dump, lognormal_length, matmul_peak, model_config, out_path,  # noqa: E402
                          peak_breakdown, print_profile, profile_call, random_model, sync, timed,
                          update_flops, versions)

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true", help="tiny model and sizes on the CPU: a smoke test of this script")
p.add_argument("--device", default=None, help="cuda | cpu (default: the accelerator when available)")
p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(hf.KNOWN_CONFIGS))
p.add_argument("--layers", type=int, default=0, help="keep only this many decoder layers (0 = all): a MoE that fits")
p.add_argument("--prompt-len", type=int, default=256)
p.add_argument("--max-response", type=int, default=2048)
p.add_argument("--resp-median", type=float, default=768.0)
p.add_argument("--resp-sigma", type=float, default=0.9)
p.add_argument("--step-tokens", type=int, default=98304, help="tokens per optimizer step (all micro-batches)")
p.add_argument("--token-budget", type=int, default=16384, help="tokens per micro-batch (ppo_max_token_len_per_gpu)")
p.add_argument("--logprob-chunk", type=int, default=1024)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--repeats", type=int, default=4)
p.add_argument("--rows", default="update,update_autocast,bare,bare_bf16,hf,hf_bf16",
               help="comma list: update (nanodapo update_policy as the trainer's defaults run it: FSDP2 on a mesh "
                    "of one, bf16 compute, every block checkpointed, but foreach AdamW: the trainer uses fused on "
                    "CUDA, add _fused), "
                    "update[_compiled][_ckpt<N>|_nockpt][_eager_head][_fused] (_compiled: each block and the log-prob "
                    "head torch.compile'd; _ckpt<N>: only the first N decoder blocks checkpointed, _nockpt: none; "
                    "_eager_head: compiled blocks, eager log-prob head; _fused: AdamW fused=True), update_autocast (a "
                    "plain fp32 module under bf16 autocast), bare (nanodapo, autocast), bare_bf16, hf (transformers, "
                    "autocast), hf_bf16")
p.add_argument("--peak-n", type=int, default=8192, help="matmul size for the measured peak")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--profile", action="store_true",
               help="after timing, profile one more step of each row (torch.profiler): kernel time by kind, top kernels")
p.add_argument("--memory", action="store_true",
               help="after timing, record the CUDA memory history of one more step of each row: what is live at its "
                    "peak, by allocation site (peak_breakdown in the row)")
p.add_argument("--memory-entries", type=int, default=200_000, help="--memory: the history's ring-buffer size")
p.add_argument("--memory-pickle", action="store_true",
               help="--memory: also write each row's snapshot next to --out (memory_<row>.pickle, for "
                    "pytorch.org/memory_viz)")
p.add_argument("--out", default=None)
args = p.parse_args()
args.rows = args.rows.replace("update_fused_adam", "update_fused")  # the row's earlier name
UPDATE_ROW = re.compile(r"update(?P<compiled>_compiled)?(?:_ckpt(?P<ckpt>\d+)|(?P<nockpt>_nockpt))?"
                        r"(?P<eager_head>_eager_head)?(?P<fused>_fused)?")
OTHER_ROWS = ("update_autocast", "bare", "bare_bf16", "hf", "hf_bf16")
for r in args.rows.split(","):
    v = UPDATE_ROW.fullmatch(r)
    if r not in OTHER_ROWS and v is None:
        p.error(f"--rows: unknown row {r!r}; see --help for the names")
    if v is not None and v["eager_head"] and not v["compiled"]:
        p.error(f"--rows: {r!r}: _eager_head needs _compiled (the uncompiled head is always eager)")
if args.tiny:
    args.prompt_len, args.max_response, args.resp_median = 16, 64, 24.0
    args.step_tokens, args.token_budget, args.logprob_chunk = 1024, 256, 64
    args.warmup, args.repeats, args.peak_n = 1, 2, 512
DIMS = parallel.init_distributed(args.device or "auto")  # the trainer's: on a GPU, a process group and mesh of one
device = DIMS.device
cuda = device.type == "cuda"
OUT = out_path(args.out, "train")
RES = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "rows": {}, "errors": {}}


def save():
    dump(RES, OUT)


# -----------------------------------------------------------------------------
# environment and the measured bf16 matmul peak

RES["versions"] = versions()
RES["device"] = torch.cuda.get_device_name() if cuda else "cpu"
print(f"versions {RES['versions']}, device {RES['device']}")


PEAK = matmul_peak(device, args.peak_n, reps=20 if cuda else 3)
RES["peak_bf16_matmul_TFLOPs"] = round(PEAK / 1e12, 2)
print(f"bf16 matmul {args.peak_n}^3: {PEAK / 1e12:.1f} TFLOP/s (median)")

# -----------------------------------------------------------------------------
# the workload: prompts + lognormal responses of random tokens until --step-tokens; one optimizer step = all of
# them, in the trainer's use_dynamic_bsz micro-batches, gradient checkpointing on; median of --repeats steps

cfg = model_config(args.shape, args.tiny)
if args.layers:
    cfg = M.ModelConfig.from_hf({**cfg.to_hf(torch.float32), "num_hidden_layers": args.layers})
rng = random.Random(args.seed)
resp_lens = []
while sum(args.prompt_len + r for r in resp_lens) < args.step_tokens:
    resp_lens.append(lognormal_length(rng, args.resp_median, args.resp_sigma, floor=32 if not args.tiny else 4,
                                      cap=args.max_response))
g = torch.Generator().manual_seed(args.seed)
prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in resp_lens]
responses = [torch.randint(0, cfg.vocab_size, (r,), generator=g).tolist() for r in resp_lens]
seq_lens = [args.prompt_len + r for r in resp_lens]
NTOK = sum(seq_lens)
RESP_TOK = sum(resp_lens)
MBS = data.balanced_micro_batches(seq_lens, args.token_budget)  # the trainer's use_dynamic_bsz split
R = max(resp_lens)
RES["workload"] = {"sequences": len(seq_lens), "tokens": NTOK, "response_tokens": RESP_TOK,
                   "micro_batches": len(MBS), "micro_batch_tokens": [sum(seq_lens[i] for i in mb) for mb in MBS],
                   "response_len_median": statistics.median(resp_lens), "response_len_mean": RESP_TOK / len(resp_lens),
                   "response_len_max": R, "clipped_at_max": sum(r == args.max_response for r in resp_lens)}
print(f"workload: {RES['workload']}")

# model FLOPs, one formula for every row, on real tokens: 6 * N_blocks * tokens for the non-embedding parameters,
# 6 * V*H * response tokens for the output head (a matmul even when tied; an update needs no log-prob of a prompt
# token, so a row that computes them does work this does not count), plus causal attention, 6 * L * heads *
# head_dim * sum(n_i^2); MFU_nonemb leaves the head out; HFU adds what checkpointing recomputes (blocks, head,
# attention)
H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
HEAD = V * H
N_BLOCKS = cfg.num_active_params() - V * H * (1 if cfg.tie_word_embeddings else 2)  # blocks (top-k experts) + norm
ATTN_FWD = 2 * L * cfg.num_attention_heads * cfg.head_dim * sum(n * n for n in seq_lens)  # causal, forward
FLOPS_MODEL = update_flops(cfg, seq_lens, resp_lens)  # = 6 * N_BLOCKS * NTOK + 6 * HEAD * RESP_TOK + 3 * ATTN_FWD
FLOPS_NONEMB = 6 * N_BLOCKS * NTOK + 3 * ATTN_FWD


def flops_hw_nano(n_ckpt: int) -> float:
    """Model FLOPs + what the backward recomputes: n_ckpt of the L blocks' forwards and the log-prob head's."""
    return FLOPS_MODEL + n_ckpt / L * (2 * N_BLOCKS * NTOK + ATTN_FWD) + 2 * HEAD * RESP_TOK


RES["flops"] = {"N_blocks": N_BLOCKS, "head_VH": HEAD, "model_per_step": FLOPS_MODEL,
                "nonemb_per_step": FLOPS_NONEMB, "hardware_nanodapo_per_step": flops_hw_nano(L),
                "formula": "6*N_blocks*tokens + 6*V*H*response_tokens + 6*L*heads*head_dim*sum(n_i^2)"}


def update_variant(row: str) -> dict:
    """An update row's name -> its row name in the results, compile, checkpointed blocks, eager head, fused AdamW."""
    v = UPDATE_ROW.fullmatch(row)
    n_ckpt = 0 if v["nockpt"] else L if v["ckpt"] is None else int(v["ckpt"])
    if n_ckpt > L:
        p.error(f"--rows: {row!r} checkpoints {n_ckpt} blocks of the model's {L}; use N <= {L}")
    parts = ["nanodapo update" + (" compiled" if v["compiled"] else "")]
    parts += ["no ckpt"] if n_ckpt == 0 else [] if n_ckpt == L else [f"ckpt {n_ckpt}/{L}"]
    parts += ["eager head"] if v["eager_head"] else []
    parts += ["fused AdamW"] if v["fused"] else []
    name = ", ".join(parts) if len(parts) > 1 or v["compiled"] else "nanodapo update_policy"
    return {"name": name, "compile": bool(v["compiled"]), "n_ckpt": n_ckpt, "eager_head": bool(v["eager_head"]),
            "fused": True if v["fused"] else None}


# a bad N is an error here, before any work
UPDATE_VARIANTS = {r: update_variant(r) for r in args.rows.split(",") if UPDATE_ROW.fullmatch(r)}
print(f"params: blocks {N_BLOCKS / 1e9:.3f} B + head {HEAD / 1e9:.3f} B; model FLOPs/step {FLOPS_MODEL / 1e12:.1f} T")
save()


def build_traj():
    """The workload as train_dapo.Trajectories, n = 1 (one sequence per group): what update_policy consumes."""
    Tn = len(resp_lens)
    mask = torch.zeros(Tn, R)
    for i, r in enumerate(resp_lens):
        mask[i, :r] = 1
    adv = torch.randn(Tn, generator=torch.Generator().manual_seed(args.seed + 1))
    z = torch.zeros(Tn)
    return T.Trajectories(prompt_ids=prompts, response_ids=responses, group_ids=torch.arange(Tn),
                          rollout_logp=torch.zeros(Tn, R), response_mask=mask, finish_reasons=["length"] * Tn,
                          data_sources=["bench"] * Tn, acc=z, score=z, seq_reward=z, seq_final_reward=z, adv=adv)


def trainer_cfg():
    Tn = len(resp_lens)
    return T.Config(n=1, train_batch_size=Tn, gen_batch_size=Tn, ppo_mini_batch_size=Tn, use_dynamic_bsz=True,
                    ppo_max_token_len_per_gpu=args.token_budget, max_prompt_length=args.prompt_len,
                    max_response_length=args.max_response, logprob_chunk=args.logprob_chunk, lr=1e-6,
                    weight_decay=0.1, grad_clip=1.0, gradient_checkpointing=True, temperature=1.0)


def nano_packed():
    """Per micro-batch, on the device: packed inputs, targets (a prompt's own skipped) and the response-token mask
    (as sequence_logprobs)."""
    out = []
    for mb in MBS:
        seqs = [prompts[i] + responses[i] for i in mb]
        ids, pos, batch = M.pack_sequences([s[:-1] for s in seqs], device)
        tgt = torch.tensor([t for i in mb for t in [M.IGNORE_INDEX] * (args.prompt_len - 1) + responses[i]],
                           device=device)[None]
        m = torch.zeros(ids.shape[1], device=device)
        for j, i in enumerate(mb):  # response token k of doc j is target (prompt_len - 1 + k)
            s = int(batch.cu_seqlens[j]) + args.prompt_len - 1
            m[s:s + resp_lens[i]] = 1
        out.append((ids, pos, batch, tgt, m[None]))
    return out


def hf_padded():
    """Per micro-batch: right-padded input ids, attention mask, labels (response tokens, -100 elsewhere)."""
    out, padded = [], 0
    for mb in MBS:
        Lmax = max(seq_lens[i] for i in mb)
        ids = torch.zeros(len(mb), Lmax, dtype=torch.long)
        am = torch.zeros(len(mb), Lmax, dtype=torch.long)
        lab = torch.full((len(mb), Lmax), -100, dtype=torch.long)
        for j, i in enumerate(mb):
            s = prompts[i] + responses[i]
            ids[j, :len(s)] = torch.tensor(s)
            am[j, :len(s)] = 1
            lab[j, args.prompt_len:len(s)] = torch.tensor(responses[i])
        padded += len(mb) * Lmax
        out.append((ids.to(device), am.to(device), lab.to(device), int((lab != -100).sum())))
    return out, padded


# -----------------------------------------------------------------------------
# timing


def profile_step(step_fn) -> dict:
    """One step under torch.profiler (bench.common.profile_call), printed."""
    out = profile_call(step_fn, device)
    print_profile(out)
    return out


def gib(nbytes: int) -> float:
    return round(nbytes / 2**30, 3)


def memory_step(name, step_fn) -> dict:
    """One step under the CUDA memory history (Python stacks): peak_breakdown of it, its top 15 sites in GiB."""
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                             max_entries=args.memory_entries, clear_history=True)
    try:
        step_fn()
        sync(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    b = peak_breakdown(snap, torch.cuda.current_device())
    top = list(b["by_label"].items())[:15]
    out = {"peak_GiB": gib(b["peak_bytes"]), "max_memory_allocated_GiB": gib(torch.cuda.max_memory_allocated()),
           "resident_before_step_GiB": gib(b["resident_bytes"]), "events": b["events"],
           "truncated": b["events"] >= args.memory_entries, "top_GiB": {k: gib(v) for k, v in top},
           "rest_GiB": gib(b["peak_bytes"] - sum(v for _, v in top)), "labels": len(b["by_label"])}
    print(f"  memory at the peak: {out['peak_GiB']} GiB (max_memory_allocated {out['max_memory_allocated_GiB']}), "
          f"{out['resident_before_step_GiB']} GiB resident before the step; {out['events']} events")
    if out["truncated"]:
        print(f"  WARNING: the history filled its {args.memory_entries} entries; raise --memory-entries (the "
              "resident share is wrong when the step's start was overwritten)")
    for k, v in out["top_GiB"].items():
        print(f"    {v:8.3f} GiB  {k}")
    print(f"    {out['rest_GiB']:8.3f} GiB  the other {max(0, out['labels'] - len(top))} sites")
    if args.memory_pickle:
        stem = re.sub(r"[^\w.-]+", "_", name)
        path = os.path.join(os.path.dirname(os.path.abspath(OUT)), f"memory_{stem}.pickle")
        with open(path, "wb") as f:
            pickle.dump(snap, f)
        out["pickle"] = path
    return out


def time_steps(name, step_fn, model_params, extra=None):
    """warmup + repeats optimizer steps; record the row."""
    row = {"name": name, **(extra or {})}
    try:
        for _ in range(args.warmup):
            step_fn()
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            dt, loss = timed(step_fn, device)
            times.append(dt)
        dt = statistics.median(times)
        row.update(step_s=[round(x, 4) for x in times], median_step_s=round(dt, 4), tokens_per_s=round(NTOK / dt, 1),
                   MFU=round(FLOPS_MODEL / dt / PEAK, 4), MFU_nonemb=round(FLOPS_NONEMB / dt / PEAK, 4),
                   loss=float(loss), finite_params=all(torch.isfinite(q).all().item() for q in model_params))
        if cuda:
            row["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            row["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        print(f"{name:40s} step {dt:7.3f} s  {row['tokens_per_s']:10.0f} tok/s  MFU {row['MFU']:.3f}  "
              f"(steps {row['step_s']}, peak {row.get('peak_alloc_GiB')} GiB, loss {row['loss']:.4f})", flush=True)
        if args.profile:
            row["profile"] = profile_step(step_fn)
        if args.memory and cuda:
            row["peak_breakdown"] = memory_step(name, step_fn)
        elif args.memory:
            print("  --memory: skipped, the memory history needs CUDA")
    except Exception as e:  # an OOM or a failure costs one row, not the table
        traceback.print_exc()
        RES["errors"][name] = repr(e)[:2000]
        row["error"] = repr(e)[:500]
    RES["rows"][name] = row
    save()
    return row


def free():
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# -----------------------------------------------------------------------------
# nanodapo rows

ctx_auto = torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()  # the CPU runs fp32
t0 = time.perf_counter()
nano = random_model(cfg, device, seed=args.seed)
nano.gradient_checkpointing = True
RES["build_s"] = round(time.perf_counter() - t0, 1)
print(f"nanodapo model: {sum(q.numel() for q in nano.parameters()) / 1e9:.3f} B params fp32 in {RES['build_s']} s")
state0 = {k: v.detach().to("cpu", copy=True) for k, v in nano.state_dict().items()}  # the same weights for all rows
rows = args.rows.split(",")


def reset_weights(m):
    with torch.no_grad():
        for k, v in m.state_dict().items():
            v.copy_(state0[k])


def bare_step_fn(m, opt, packed, ctx):
    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids, pos, batch, tgt, mask in packed:
            with ctx:
                logp, _ = m(ids, pos, batch, target_ids=tgt, logprob_chunk=args.logprob_chunk)
            loss = -(logp.float() * mask).sum() / RESP_TOK
            loss.backward()
            total += loss.detach()
        opt.step()
        return total
    return step


def update_row(name, precision, m, ctx=contextlib.nullcontext(), fused=None, n_ckpt=L):
    traj, tcfg = build_traj(), trainer_cfg()
    opt = torch.optim.AdamW(m.parameters(), lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay,
                            fused=fused)
    sched = T.make_scheduler(opt, tcfg, 10**6)
    last = {}

    def update_step():
        with ctx:
            last.update(T.update_policy(m, opt, sched, traj, tcfg, DIMS))  # no old_logp: fresh data
        return last.get("actor/pg_loss", float("nan"))
    t0 = time.perf_counter()
    r = time_steps(name, update_step, list(m.parameters()),
                   {"impl": "nanodapo", "loop": "train_dapo.update_policy", "precision": precision})
    r["row_wall_s"] = round(time.perf_counter() - t0, 1)
    r["HFU"] = round(flops_hw_nano(n_ckpt) / r["median_step_s"] / PEAK, 4) if "median_step_s" in r else None
    r["checkpointed_blocks"] = n_ckpt
    r["metrics_last_step"] = {k: v for k, v in last.items() if isinstance(v, (int, float))}
    m.zero_grad(set_to_none=True)  # the optimizer's states go with this function's scope
    free()


def trainer_model(compile=False):
    """A copy of the weights as train_dapo.setup builds the policy: FSDP2 over DIMS (bf16 compute, fp32 master)."""
    m = copy.deepcopy(nano).to(device)
    if DIMS.sharded:
        parallel.parallelize(m, DIMS, param_dtype=torch.bfloat16, compile=compile)
    elif compile:
        parallel.apply_compile(m)
    return m


nano.cpu()  # on the device, the reference weights would count in every trainer row's memory
for kw in UPDATE_VARIANTS.values():
    if kw["compile"] and not cuda:  # inductor's CPU backend compiles C++ for minutes: not a smoke test
        print(f"{kw['name']}: skipped, torch.compile rows need an accelerator")
        RES.setdefault("skipped", {})[kw["name"]] = "torch.compile rows need an accelerator"
        continue
    m = trainer_model(compile=kw["compile"])
    m.gradient_checkpointing = kw["n_ckpt"]  # the first n_ckpt decoder blocks
    if kw["eager_head"]:
        m.logprob_chunk_fn = None
    precision = "FSDP2 bf16 compute, fp32 master" + (", compiled" if kw["compile"] else "") + (
        " (eager head)" if kw["eager_head"] else "")
    update_row(kw["name"], precision, m, fused=kw["fused"], n_ckpt=kw["n_ckpt"])
    del m
    free()
nano.to(device)

if "update_autocast" in rows:
    update_row("nanodapo update autocast", "fp32 master + bf16 autocast", nano, ctx_auto)
    reset_weights(nano)

if "bare" in rows:
    opt = torch.optim.AdamW(nano.parameters(), lr=1e-6, weight_decay=0.1)
    r = time_steps("nanodapo bare", bare_step_fn(nano, opt, nano_packed(), ctx_auto), list(nano.parameters()),
                   {"impl": "nanodapo", "loop": "forward(target_ids) + token-mean -logp + backward + AdamW",
                    "precision": "fp32 master + bf16 autocast"})
    r["HFU"] = round(flops_hw_nano(L) / r["median_step_s"] / PEAK, 4) if "median_step_s" in r else None
    del opt
    nano.zero_grad(set_to_none=True)
    reset_weights(nano)
    free()

if "bare_bf16" in rows:
    nb = copy.deepcopy(nano).to(torch.bfloat16)
    nb.gradient_checkpointing = True
    opt = torch.optim.AdamW(nb.parameters(), lr=1e-6, weight_decay=0.1)
    r = time_steps("nanodapo bare bf16", bare_step_fn(nb, opt, nano_packed(), contextlib.nullcontext()),
                   list(nb.parameters()), {"impl": "nanodapo", "loop": "bare", "precision": "pure bf16"})
    r["HFU"] = round(flops_hw_nano(L) / r["median_step_s"] / PEAK, 4) if "median_step_s" in r else None
    del opt, nb
    free()

# -----------------------------------------------------------------------------
# transformers rows


def build_hf():
    from transformers import AutoConfig, AutoModelForCausalLM
    d = cfg.to_hf(torch.float32)
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    hf_cfg.use_cache = False
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(nano.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if "lm_head.weight" in missing:  # tied: must be the embedding itself
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    return hf.train()


def same_function_check(hf):
    """fp32, no autocast: nanodapo's packed per-token log-probs vs transformers' padded logits -> log_softmax."""
    n_seq = min(3, len(prompts))
    seqs = [(prompts[i] + responses[i])[:min(seq_lens[i], 300)] for i in range(n_seq)]
    with torch.no_grad():
        ids, pos, batch = M.pack_sequences([s[:-1] for s in seqs], device)
        tgt = torch.tensor([t for s in seqs for t in s[1:]], device=device)[None]
        ours, _ = nano(ids, pos, batch, target_ids=tgt)
        theirs = []
        for s in seqs:
            x = torch.tensor(s, device=device)[None]
            lg = hf(input_ids=x, use_cache=False).logits.float()[0, :-1]
            theirs.append(torch.log_softmax(lg, -1).gather(-1, x[0, 1:, None])[:, 0])
        theirs = torch.cat(theirs)
    rel = ((ours[0] - theirs).norm() / theirs.norm()).item()
    RES["same_function_rel_err_fp32"] = rel
    print(f"same weights, fp32: nanodapo packed log-probs vs transformers, relative L2 difference {rel:.2e} "
          f"({tgt.shape[1]} tokens)")
    return rel


def hf_step_fn(hf, opt, batches, ctx):
    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids, am, lab, n_lab in batches:
            with ctx:
                out = hf(input_ids=ids, attention_mask=am, labels=lab, use_cache=False)
            loss = out.loss.float() * (n_lab / RESP_TOK)  # out.loss: mean over this micro-batch's labels
            loss.backward()
            total += loss.detach()
            del out
        opt.step()
        return total
    return step


if any(r in rows for r in ("hf", "hf_bf16")):
    hf = None
    try:
        cuda_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        hf = build_hf()
        same_function_check(hf)
        torch.backends.cuda.matmul.allow_tf32 = cuda_tf32
    except Exception as e:
        traceback.print_exc()
        RES["errors"]["hf_build"] = repr(e)[:2000]
    del nano
    free()
    if hf is not None:
        batches, padded = hf_padded()
        pad_info = {"padded_tokens": padded, "padding_fraction": round(1 - NTOK / padded, 4)}
        RES["hf_padding"] = pad_info
        print(f"transformers micro-batches: {padded} padded tokens for {NTOK} real ({pad_info['padding_fraction']:.1%} "
              "padding)")
        if "hf" in rows:
            opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, weight_decay=0.1)
            time_steps("transformers", hf_step_fn(hf, opt, batches, ctx_auto), list(hf.parameters()),
                       {"impl": "transformers", "loop": "padded forward(labels) + backward + AdamW",
                        "precision": "fp32 master + bf16 autocast", "attn": "sdpa", **pad_info})
            del opt
            hf.zero_grad(set_to_none=True)
            free()
        if "hf_bf16" in rows:
            hf = hf.to(torch.bfloat16)
            opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, weight_decay=0.1)
            time_steps("transformers bf16", hf_step_fn(hf, opt, batches, contextlib.nullcontext()),
                       list(hf.parameters()), {"impl": "transformers", "loop": "padded", "precision": "pure bf16",
                                               "attn": "sdpa", **pad_info})
            del opt
        del hf
        free()
else:
    del nano
    free()

# -----------------------------------------------------------------------------
# the table; the headline last

print(f"\n=== actor update, {RES['device']}, {cfg.num_params() / 1e9:.2f} B params, {len(seq_lens)} sequences / "
      f"{NTOK} tokens per optimizer step in {len(MBS)} micro-batches of <= {args.token_budget} tokens, gradient "
      f"checkpointing; median of {args.repeats} steps after {args.warmup}; peak {PEAK / 1e12:.0f} TFLOP/s bf16 "
      f"matmul (measured) ===")
print(f"{'row':40s} {'precision':44s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>6s} {'MFU nonemb':>10s} {'HFU':>6s} "
      f"{'peak GiB':>8s}")
for r in RES["rows"].values():
    if "median_step_s" not in r:
        print(f"{r['name']:40s} failed: {r.get('error', '')[:80]}")
        continue
    hfu = f"{r['HFU']:.3f}" if r.get("HFU") is not None else "-"
    print(f"{r['name']:40s} {r.get('precision', ''):44s} {r['median_step_s']:8.3f} {r['tokens_per_s']:10.0f} "
          f"{r['MFU']:6.3f} {r['MFU_nonemb']:10.3f} {hfu:>6s} {str(r.get('peak_alloc_GiB', '-')):>8s}")
print("errors:", RES["errors"] or "none")
a, b = RES["rows"].get("nanodapo update_policy", {}), RES["rows"].get("transformers", {})
if "tokens_per_s" in a and "tokens_per_s" in b:
    RES["headline"] = {"update_over_transformers": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
                       "nanodapo_MFU": a["MFU"], "transformers_MFU": b["MFU"]}
    save()
    print(f"HEADLINE nanodapo update_policy / transformers (fp32 master, bf16 compute) = "
          f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s; MFU nanodapo {a['MFU']:.3f}, transformers "
          f"{b['MFU']:.3f} (goal >= 0.5)")
else:
    save()
    print("HEADLINE not available (it needs the update and hf rows, both measured; see errors)")
parallel.shutdown()  # the process group of one made by init_distributed on a GPU
