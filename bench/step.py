"""
One full DAPO training step, nanodapo (train_dapo.py as shipped) against TRL's GRPOTrainer configured as
DAPO, on the same random-init model directory, the same prompts, the same group size and batch sizes.

GPU (1xH200; device call with carry=[".whl"]). TRL 1.16.0 + datasets 5.2.0 + dill 0.4.1 + multiprocess 0.70.19
travel as wheels in .whl/ (1.8 MiB); everything else TRL needs is on the machine. One command (~5 min):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 bench/step.py --sides nanodapo_torch,trl --out $OUT/step.json

  With vLLM (after shared/VLLM_ON_DEVICE.md's install on the same warm machine; its env vars, which this script
  also sets for its children; ~6 min):

    export PYTHONPATH=/root/site:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1; python3 bench/step.py --sides nanodapo_vllm,trl_vllm --out $OUT/step_vllm.json

  (add `--merge step.json` with a copy of the first run's JSON to get all four sides in one table; /tmp/nanodapo_step
  holds the model and prompts between calls on a warm machine, and each side's log.)
CPU smoke test (tiny model, 2 steps, both trainers end to end):

    python3 bench/step.py --tiny --sides nanodapo_torch,trl --out /tmp/step_tiny.json

What runs (defaults; all are flags):
  model     bench/make_random_model.py --shape qwen2.5-1.5b -> WORK/model (random bf16 weights, the demo's
            byte-level tokenizer + chat template; a random model almost never samples EOS, so responses run
            to max length in both trainers; the tables show the mean response length to confirm it)
  prompts   WORK/prompts.parquet in verl's schema: a user message of random digits whose chat-templated prompt
            is exactly --prompt-len (256) tokens (checked with nanodapo's tokenizer, and in the TRL process
            with transformers' apply_chat_template: the ids must be equal)
  reward    bench/hash_reward.py: sha256(response text) -> {0, 1}, same function on both sides
  batch     --prompts P=16 prompts x --n G=8 responses of --response-len R=512 tokens per step = one optimizer
            step (one mini-batch); micro-batches of --micro-batch 16 trajectories (TRL: per_device_train_batch_size
            16, gradient_accumulation_steps P*G/16, generation_batch_size P*G); lr 1e-6, constant; no weight decay;
            grad clip 1.0; bf16 compute over fp32 master weights (TRL: model dtype float32 + bf16=True);
            gradient checkpointing on; temperature 1, top-p 1.
  nanodapo  python3 train_dapo.py WORK/nanodapo.py [--rollout_engine torch|vllm]: DAPO clip-higher 0.2/0.28,
            token-mean, no KL, filter_groups=False (one generation round per step, as TRL), no overlong shaping,
            on-policy single pass (no old-log-prob forward). Times from out_dir/metrics.jsonl: timing/step and
            the phases timing/gen, reward, old_logp, update, sync.
  TRL       GRPOTrainer + GRPOConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, num_generations=G,
            max_completion_length=R, scale_rewards="group", num_iterations=1) in a child process;
            trl      use_vllm=False: transformers generate (sdpa); fp32 weights + bf16 autocast (accelerate's
                     bf16 wraps forward in autocast, generation included), as nanodapo on one GPU;
            trl_bf16 the same with the model loaded in bf16 (pure bf16 weights and AdamW, common in TRL recipes);
            trl_vllm use_vllm=True, vllm_mode="colocate" (TRL's defaults otherwise: vllm_gpu_memory_utilization 0.3,
                     importance-sampling correction on, which adds one old-log-prob forward per step).
            Step time = wall time between consecutive on_step_end callbacks (torch.cuda.synchronize() first);
            "gen" = wall time of _generate_and_score_completions (generation, reward, and whatever TRL computes
            with it: weight sync to vLLM, old log-probs).
Every side: --steps (4) optimizer steps; the table gives the median of the steps after the first (the first
includes compilation / CUDA-graph capture / allocator growth). Headline (last line): TRL step time over
nanodapo step time, for the matched pairs that ran (trl / nanodapo_torch, trl_vllm / nanodapo_vllm).
Writes everything to --out (JSON; default $OUT/step.json, or ./bench_step.json). Child logs: WORK/*.log.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # the repo root, not bench/
HERE = os.path.join(ROOT, "bench")

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true", help="tiny model, short responses, 2 steps, on the CPU")
p.add_argument("--sides", default="nanodapo_torch,trl",
               help="comma list, run in this order: nanodapo_torch, nanodapo_vllm, trl, trl_bf16, trl_vllm")
p.add_argument("--work", default="/tmp/nanodapo_step", help="model, prompts, configs, logs, run outputs")
p.add_argument("--shape", default="qwen2.5-1.5b")
p.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
p.add_argument("--n", type=int, default=8, help="responses per prompt (G)")
p.add_argument("--prompt-len", type=int, default=256)
p.add_argument("--response-len", type=int, default=512)
p.add_argument("--micro-batch", type=int, default=16, help="trajectories per forward/backward, both sides")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-6)
p.add_argument("--timeout", type=int, default=480, help="seconds per side at most")
p.add_argument("--budget", type=int, default=570,
               help="seconds for the whole script (a device call is cut at 600 s): a side gets what is left")
p.add_argument("--nanodapo-args", default="", help="extra --key=value overrides for train_dapo.py, space-separated")
p.add_argument("--trl-vllm-gpu-mem", type=float, default=0.3, help="TRL vllm_gpu_memory_utilization (TRL's default)")
p.add_argument("--trl-dtype", default="float32", help="TRL model dtype (float32 = fp32 master + bf16 autocast)")
p.add_argument("--merge", nargs="*", default=[], help="earlier --out JSON files whose sides join this table")
p.add_argument("--out", default=None)
p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: run TRL, write this JSON
p.add_argument("--use-vllm", type=int, default=0, help=argparse.SUPPRESS)
args = p.parse_args()
if args.tiny:
    args.prompts, args.n, args.prompt_len, args.response_len = 4, 4, 32, 16
    args.micro_batch, args.steps = 8, 2
    if args.work == "/tmp/nanodapo_step":
        args.work = "/tmp/nanodapo_step_tiny"
MODEL = os.path.join(args.work, "model")
PROMPTS = os.path.join(args.work, "prompts.parquet")
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "WANDB_DISABLED": "true", "PYTHONUNBUFFERED": "1"}


def median_after_first(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs[1:]) if len(xs) > 1 else (xs[0] if xs else None)


# =============================================================================
# the TRL side (a child process: python3 bench/step.py --trl-worker RESULT.json --use-vllm 0|1 ...)


def trl_worker():
    import dataclasses

    import pyarrow.parquet as pq
    import torch
    import transformers
    from transformers import AutoTokenizer, TrainerCallback

    import datasets
    import trl
    from trl import GRPOConfig, GRPOTrainer
    import importlib.util  # bench/ stays off sys.path: its train.py / step.py / sync.py would shadow real modules
    spec = importlib.util.spec_from_file_location("hash_reward", os.path.join(HERE, "hash_reward.py"))
    hash_reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hash_reward)
    trl_reward = hash_reward.trl_reward

    import model as M
    res = {"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                        "datasets": datasets.__version__, "torch": torch.__version__}, "use_vllm": bool(args.use_vllm)}
    cuda = torch.cuda.is_available() and not args.tiny
    if args.use_vllm:
        import vllm
        res["versions"]["vllm"] = vllm.__version__
    rows = pq.read_table(PROMPTS).to_pylist()
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    # the same prompt token ids as nanodapo's tokenizer + chat template
    tok = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    ours = M.Tokenizer.from_pretrained(MODEL)
    theirs = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows[:8]]
    theirs = [t["input_ids"] if hasattr(t, "keys") else t for t in theirs]
    mine = [ours.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows[:8]]
    res["prompt_ids_equal"] = [list(a) for a in theirs] == [list(b) for b in mine]
    res["prompt_len"] = [len(t) for t in theirs]
    print(f"TRL {trl.__version__}: prompt ids equal to nanodapo's: {res['prompt_ids_equal']} (lengths {res['prompt_len'][:4]})",
          flush=True)

    G, P, mb = args.n, args.prompts, args.micro_batch
    want = dict(
        output_dir=os.path.join(args.work, "trl_vllm_out" if args.use_vllm else "trl_out"),
        per_device_train_batch_size=mb, gradient_accumulation_steps=P * G // mb, num_generations=G,
        max_completion_length=args.response_len, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", num_iterations=1,
        mask_truncated_completions=False, temperature=1.0, top_p=1.0,
        bf16=cuda, use_cpu=not cuda, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": args.trl_dtype, "attn_implementation": "sdpa"},
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        seed=0, dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
        use_vllm=bool(args.use_vllm), vllm_mode="colocate", vllm_gpu_memory_utilization=args.trl_vllm_gpu_mem,
        vllm_max_model_length=args.prompt_len + args.response_len + 8,
    )
    if args.use_vllm:  # TRL reads token ids only; vLLM need not detokenize ids a random model samples
        want["generation_kwargs"] = {"detokenize": False}
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    res["config_dropped"] = sorted(k for k in want if k not in known)
    if res["config_dropped"]:
        print(f"GRPOConfig has no {res['config_dropped']}: left out", flush=True)
    config = GRPOConfig(**{k: v for k, v in want.items() if k in known})
    res["config"] = {k: str(getattr(config, k)) for k in want if k in known}
    for k in ("generation_batch_size", "steps_per_generation"):
        res["config"][k] = str(getattr(config, k, None))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_s, self.logs, self.last = [], [], None

        def on_train_begin(self, a, state, control, **kw):
            sync()
            self.last = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync()
            t = time.perf_counter()
            self.step_s.append(t - self.last)
            self.last = t
            print(f"TRL step {state.global_step}: {self.step_s[-1]:.3f} s", flush=True)
            save(complete=False)  # what a timeout would otherwise lose

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    timer = Timer()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=MODEL, reward_funcs=[trl_reward], args=config, train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    res["init_s"] = round(time.perf_counter() - t0, 2)
    gen_s, sync_s = [], []

    def timed(fn, out):
        def wrapper(*a, **k):
            sync()
            t = time.perf_counter()
            r = fn(*a, **k)
            sync()
            out.append(time.perf_counter() - t)
            return r
        return wrapper
    if hasattr(trainer, "_generate_and_score_completions"):
        trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, gen_s)
    vg = getattr(trainer, "vllm_generation", None)
    if vg is not None and hasattr(vg, "sync_weights"):
        vg.sync_weights = timed(vg.sync_weights, sync_s)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    res["model_dtype"] = str(next(trainer.model.parameters()).dtype)

    def save(complete: bool):
        res.update(complete=complete, step_s=[round(x, 4) for x in timer.step_s], gen_s=[round(x, 4) for x in gen_s],
                   sync_s=[round(x, 4) for x in sync_s], logs=timer.logs)
        if cuda:
            res["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        with open(args.trl_worker + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(args.trl_worker + ".tmp", args.trl_worker)
    trainer.train()
    res["train_s"] = round(time.perf_counter() - t0, 2)
    save(complete=True)
    print(f"TRL done: steps {res['step_s']}, gen {res['gen_s']}", flush=True)


if args.trl_worker:
    trl_worker()
    sys.exit(0)

# =============================================================================
# the driver

OUT = args.out or os.path.join(os.environ.get("OUT") or ".", "step.json" if os.environ.get("OUT") else "bench_step.json")
RES = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "sides": {}, "errors": {}}
T_START = time.time()


def side_timeout():
    return max(10, min(args.timeout, int(args.budget - (time.time() - T_START))))


os.makedirs(args.work, exist_ok=True)


def dump():
    os.makedirs(os.path.dirname(os.path.abspath(OUT)), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(RES, f, indent=1, default=str)


def run(cmd, log_path, env=None, timeout=None):
    """Run a child (its own process group), output to log_path and to our stdout (prefixed); on timeout its
    group is killed. -> (rc, seconds, last lines)"""
    import signal
    import threading
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    tail = []
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)

    def pump():
        for line in proc.stdout:
            log.write(line)
            tail.append(line.rstrip())
            del tail[:-40]
            print("  | " + line.rstrip()[:300], flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  | timeout after {timeout} s: killing process group {proc.pid}", flush=True)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = 124
    reader.join(timeout=10)
    log.close()
    return rc, time.perf_counter() - t0, list(tail)


def prepare():
    """The model directory and the prompt parquet, made once per WORK directory."""
    import model as M
    import data
    if not os.path.isfile(os.path.join(MODEL, "config.json")):
        if args.tiny:
            import torch
            from demo.warmstart import write_tokenizer
            cfg = M.ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                rope_theta=1e6, max_position_embeddings=4096)
            m = M.Transformer(cfg).init_weights(seed=0)
            M.save_pretrained(m.to(torch.bfloat16), MODEL)
            write_tokenizer(MODEL)
        else:
            rc, dt, tail = run([sys.executable, "bench/make_random_model.py", args.work, "--shape", args.shape],
                               os.path.join(args.work, "make_model.log"), timeout=side_timeout())
            if rc != 0:
                raise RuntimeError("make_random_model failed:\n" + "\n".join(tail))
    tok = M.Tokenizer.from_pretrained(MODEL)
    overhead = len(tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True))
    rng = random.Random(0)
    rows = []
    for i in range(args.prompts * (args.steps + 2)):
        content = "".join(rng.choice("0123456789") for _ in range(args.prompt_len - overhead))
        msgs = [{"role": "user", "content": content}]
        n = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        assert n == args.prompt_len, (n, args.prompt_len)  # one token per digit in the demo tokenizer
        rows.append({"data_source": "hash", "prompt": msgs, "ability": "bench",
                     "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": i}})
    data.write_parquet(rows, PROMPTS)
    RES["prompts"] = {"rows": len(rows), "prompt_len": args.prompt_len, "template_overhead": overhead}
    print(f"prompts: {len(rows)} x {args.prompt_len} tokens -> {PROMPTS}", flush=True)


def nanodapo_side(name, engine):
    out_dir = os.path.join(args.work, f"{name}_out")
    cfg_path = os.path.join(args.work, f"{name}.py")
    P, G = args.prompts, args.n
    cfg = dict(model_path=MODEL, train_files=[PROMPTS], val_files=[], max_prompt_length=args.prompt_len,
               max_response_length=args.response_len, train_batch_size=P, gen_batch_size=P, n=G,
               ppo_mini_batch_size=P, ppo_micro_batch_size_per_gpu=args.micro_batch, use_dynamic_bsz=False,
               log_prob_micro_batch_size_per_gpu=args.micro_batch, ppo_epochs=1,
               clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", entropy_coeff=0.0,
               use_kl_loss=False, use_kl_in_reward=False, filter_groups=False, overlong_buffer=False,
               reward_fn=os.path.join(HERE, "hash_reward.py") + ":compute_score", reward_num_workers=2,
               lr=args.lr, lr_warmup_steps=0, weight_decay=0.0, grad_clip=1.0, gradient_checkpointing=True,
               temperature=1.0, top_p=1.0, top_k=-1, max_num_seqs=P * G, rollout_engine=engine,
               total_training_steps=args.steps, save_freq=-1, test_freq=0, val_before_train=False,
               resume="disable", out_dir=out_dir, logger=["console", "jsonl"], seed=0)
    if args.tiny:
        cfg.update(device="cpu", cpu_threads=1, reward_num_workers=1)
    with open(cfg_path, "w") as f:
        f.write("# written by bench/step.py\n" + "".join(f"{k} = {v!r}\n" for k, v in cfg.items()))
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "train_dapo.py", cfg_path] + args.nanodapo_args.split()
    rc, wall, tail = run(cmd, os.path.join(args.work, f"{name}.log"), env=VLLM_ENV, timeout=side_timeout())
    side = {"impl": "nanodapo", "engine": engine, "rc": rc, "process_wall_s": round(wall, 1), "config": cfg}
    rows = [json.loads(line) for line in open(metrics)] if os.path.isfile(metrics) else []
    rows = [r for r in rows if "timing/step" in r]
    if rc != 0 or len(rows) < args.steps:
        side["error"] = f"rc {rc}, {len(rows)} steps logged; log tail:\n" + "\n".join(tail[-25:])
        RES["errors"][name] = side["error"]
    phases = ("step", "gen", "reward", "old_logp", "ref", "update", "sync")
    side["per_step"] = {ph: [round(r.get(f"timing/{ph}", 0.0), 4) for r in rows] for ph in phases}
    side["median"] = {ph: median_after_first(v) for ph, v in side["per_step"].items()}
    side["response_length_mean"] = [r.get("response_length/mean") for r in rows]
    side["clip_ratio"] = [r.get("response_length/clip_ratio") for r in rows]
    side["peak_alloc_GiB"] = max((r.get("perf/max_memory_allocated_gib", 0) for r in rows), default=None)
    side["reward_mean"] = [r.get("train/score_mean") for r in rows]
    return side


def trl_side(name, use_vllm, dtype):
    result = os.path.join(args.work, f"{name}_result.json")
    if os.path.isfile(result):
        os.remove(result)
    cmd = [sys.executable, os.path.join(HERE, "step.py"), "--trl-worker", result, "--use-vllm", str(int(use_vllm)),
           "--work", args.work, "--prompts", str(args.prompts), "--n", str(args.n), "--prompt-len", str(args.prompt_len),
           "--response-len", str(args.response_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
           "--lr", str(args.lr), "--trl-vllm-gpu-mem", str(args.trl_vllm_gpu_mem), "--trl-dtype", dtype]
    if args.tiny:
        cmd.append("--tiny")
    rc, wall, tail = run(cmd, os.path.join(args.work, f"{name}.log"), env=VLLM_ENV, timeout=side_timeout())
    side = {"impl": "trl", "engine": ("vllm colocate" if use_vllm else "transformers generate") + f", {dtype}", "rc": rc,
            "process_wall_s": round(wall, 1)}
    if rc != 0 or not os.path.isfile(result):
        side["error"] = f"rc {rc}; log tail:\n" + "\n".join(tail[-25:])
        RES["errors"][name] = side["error"]
        if not os.path.isfile(result):
            return side
    r = json.load(open(result))  # written after every step: a timeout keeps the steps done
    side.update(r)
    steps, gens = r["step_s"], r["gen_s"]
    side["per_step"] = {"step": steps, "gen": gens, "update": [round(s - g, 4) for s, g in zip(steps, gens)],
                        "sync": r.get("sync_s", [])}
    side["median"] = {k: median_after_first(v) for k, v in side["per_step"].items()}
    logs = [lg for lg in r["logs"] if "completions/mean_length" in lg or "loss" in lg]
    side["response_length_mean"] = [lg.get("completions/mean_length") for lg in logs]
    side["clip_ratio"] = [lg.get("completions/clipped_ratio") for lg in logs]
    side["reward_mean"] = [lg.get("reward") for lg in logs]
    side["trl_logged_step_time"] = [lg.get("step_time") for lg in logs]  # TRL's own per-step timer, for reference
    if not r.get("prompt_ids_equal", False):
        RES["errors"][f"{name}_prompts"] = "TRL's prompt token ids differ from nanodapo's (see prompt_len)"
    return side


have_vllm = False
try:
    import importlib.util
    have_vllm = importlib.util.find_spec("vllm") is not None
except Exception:
    pass
sides = [s for s in args.sides.split(",") if s]
unknown = set(sides) - {"nanodapo_torch", "nanodapo_vllm", "trl", "trl_bf16", "trl_vllm"}
if unknown:
    sys.exit(f"unknown sides {sorted(unknown)}")
prepare()
dump()
for s in sides:
    if s.endswith("vllm") and not have_vllm:
        RES["sides"][s] = {"skipped": "vllm not importable"}
        print(f"{s}: skipped (vllm not importable)", flush=True)
        continue
    try:
        if s.startswith("nanodapo"):
            RES["sides"][s] = nanodapo_side(s, "vllm" if s.endswith("vllm") else "torch")
        else:
            RES["sides"][s] = trl_side(s, s.endswith("vllm"), "bfloat16" if s == "trl_bf16" else args.trl_dtype)
    except Exception as e:
        import traceback
        traceback.print_exc()
        RES["errors"][s] = repr(e)
    dump()
for path in args.merge:
    try:
        for k, v in json.load(open(path))["sides"].items():
            if k not in RES["sides"] and "median" in v:
                RES["sides"][k] = {**v, "merged_from": path}
    except Exception as e:
        RES["errors"][f"merge {path}"] = repr(e)

# -----------------------------------------------------------------------------
# table; headline last


def f(x, spec="8.2f"):
    return format(x, spec) if isinstance(x, (int, float)) else format("-", ">" + spec.split(".")[0])


P, G, Rl = args.prompts, args.n, args.response_len
print(f"\n=== one DAPO step: {P} prompts x {G} responses, prompt {args.prompt_len} + response <= {Rl} tokens, "
      f"micro-batch {args.micro_batch}, {args.steps} steps, median of steps 2..{args.steps} (s) ===")
print(f"{'side':16s} {'engine':34s} {'step':>8s} {'gen':>8s} {'update':>8s} {'sync':>8s} {'resp len':>8s} "
      f"{'1st step':>8s} {'peak GiB':>8s}")
for name, s in RES["sides"].items():
    if "median" not in s:
        print(f"{name:16s} {s.get('skipped') or 'failed: ' + str(s.get('error', ''))[:80]}")
        continue
    m = s["median"]
    lens = [x for x in s.get("response_length_mean", []) if x is not None]
    print(f"{name:16s} {s['engine']:34s} {f(m.get('step'))} {f(m.get('gen'))} {f(m.get('update'))} "
          f"{f(m.get('sync'), '8.3f')} {f(statistics.mean(lens) if lens else None, '8.1f')} "
          f"{f((s['per_step']['step'] or [None])[0])} {f(s.get('peak_alloc_GiB'))}")
print("(nanodapo gen = generation only, reward apart; TRL gen = generation + reward + what TRL does with them)")
print("errors:", {k: v[:200] for k, v in RES["errors"].items()} or "none")
heads = []
for trl_name, nano_name in (("trl", "nanodapo_torch"), ("trl_bf16", "nanodapo_torch"), ("trl_vllm", "nanodapo_vllm"),
                            ("trl_vllm", "nanodapo_torch")):
    a, b = RES["sides"].get(trl_name, {}).get("median", {}), RES["sides"].get(nano_name, {}).get("median", {})
    if a.get("step") and b.get("step"):
        heads.append(f"{trl_name} / {nano_name} = {a['step'] / b['step']:.2f}x")
        RES.setdefault("headline", {})[f"{trl_name}_over_{nano_name}"] = round(a["step"] / b["step"], 3)
dump()
print("HEADLINE step time, TRL / nanodapo: " + ("; ".join(heads) if heads else "not available (see errors)"))
