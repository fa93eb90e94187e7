"""
One full DAPO training step, nanodapo (train_dapo.py as shipped) against TRL's GRPOTrainer configured as DAPO,
on the same random-init model, prompts, hash reward, group size and batch sizes; TRL runs in a child process.

    python bench/step.py --sides nanodapo_torch,nanodapo_vllm,trl,trl_vllm --out step.json
    python bench/step.py --sides nanodapo_vllm,trl_vllm --response-len 4096,8192 --prompts 4 --n 4 \
        --micro-batch-tokens 8704 --steps 3 --trl-steps 2     # long responses: each length runs every side

At each length the table gives the step and its phases, the update's model FLOPs utilization (MFU, against a bf16
matmul measured on this GPU in a child process) and, for nanodapo, the peak of torch's allocator in each phase
next to what the memory plan (plan.memory_plan, the figure --dry_run prints) says for the same config on this GPU.
nanodapo runs through bench/trainer_probe.py (train_dapo.py as shipped, each update timed and its compiles counted);
its medians leave out step 1 and the steps in which torch.compile made graphs (a run compiles each kind of
micro-batch once, in its first steps), TRL's leave out step 1.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # the repo root, not bench/

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

import data  # noqa: E402
import hf  # noqa: E402
import plan  # noqa: E402
import train_dapo  # noqa: E402
from config import parse_args  # noqa: E402
from bench.common import (VLLM_ENV, dump, model_config, out_path, sync, timed, update_flops,  # noqa: E402
                          write_random_model)
from bench.hash_reward import trl_reward  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true", help="tiny model, short responses, 2 steps, on the CPU")
p.add_argument("--sides", default="nanodapo_torch,trl",
               help="comma list, run in this order: nanodapo_torch, nanodapo_vllm, nanodapo_vllm_awake (vLLM kept "
                    "awake: free_cache_engine=False), trl, trl_bf16, trl_vllm")
p.add_argument("--work", default="/tmp/nanodapo_step", help="model, prompts, configs, logs, run outputs")
p.add_argument("--shape", default="qwen2.5-1.5b")
p.add_argument("--layers", type=int, default=None, help="the shape cut to its first N decoder layers")
p.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
p.add_argument("--n", type=int, default=8, help="responses per prompt (G)")
p.add_argument("--prompt-len", type=int, default=256)
p.add_argument("--response-len", default="512",
               help="max response tokens; a comma list runs every side at each length (a random model rarely samples "
                    "EOS, so responses run to it)")
p.add_argument("--micro-batch", type=int, default=16, help="trajectories per forward/backward, both sides")
p.add_argument("--micro-batch-tokens", type=int, default=0,
               help="instead of --micro-batch: at each length, as many trajectories per forward/backward as fit this "
                    "many tokens (at least one, and a divisor of a step's trajectories), both sides")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--trl-steps", type=int, default=0, help="steps of the TRL sides (0: --steps); both take medians of 2..")
p.add_argument("--profile-update", type=int, default=0,
               help="nanodapo sides: profile the Nth policy update (torch.profiler; 0: none), left out of the medians, as "
                    "are steps in which torch.compile made graphs; "
                    "every update's wall time, allocator retries and compiles are recorded either way "
                    "(bench/trainer_probe.py)")
p.add_argument("--lr", type=float, default=1e-6)
p.add_argument("--timeout", type=int, default=480, help="seconds per side at most")
p.add_argument("--budget", type=int, default=570,
               help="seconds for the whole script: a side gets what is left")
p.add_argument("--nanodapo-args", default="",
               help='extra --key=value overrides for train_dapo.py, space-separated; give them with "=", as in '
                    '--nanodapo-args="--compile=True --gradient_checkpointing=auto"')
p.add_argument("--trl-vllm-gpu-mem", type=float, default=0.3, help="TRL vllm_gpu_memory_utilization (TRL's default)")
p.add_argument("--trl-dtype", default="float32", help="TRL model dtype (float32 = fp32 master + bf16 autocast)")
p.add_argument("--merge", nargs="*", default=[], help="earlier --out JSON files whose sides join this table")
p.add_argument("--out", default=None)
p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: run TRL, write this JSON
p.add_argument("--use-vllm", type=int, default=0, help=argparse.SUPPRESS)
args = p.parse_args()
if args.tiny:
    args.prompts, args.n, args.prompt_len = 4, 4, 32
    if args.response_len == "512":
        args.response_len = "16"
    args.micro_batch, args.steps = 8, 2
    if args.work == "/tmp/nanodapo_step":
        args.work = "/tmp/nanodapo_step_tiny"
RESPONSE_LENS = [int(r) for r in args.response_len.split(",")]
TRL_STEPS = args.trl_steps or args.steps
MODEL = os.path.join(args.work, "model")
PROMPTS = os.path.join(args.work, "prompts.parquet")
CHILD_ENV = {**VLLM_ENV, "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true",
             "PYTHONUNBUFFERED": "1"}


def steady_medians(per_step: dict, left_out=()) -> tuple[list[int], dict]:
    """The steps the medians are taken over, numbered from 1: from step 2 on (step 1 compiles and warms up),
    without left_out where other steps remain -> (those steps, each phase's median over them)."""
    n = max((len(v) for v in per_step.values()), default=0)
    steps = [i for i in range(2, n + 1) if i not in left_out] or list(range(2, n + 1)) or list(range(1, n + 1))

    def median(v):
        xs = [v[i - 1] for i in steps if i <= len(v) and v[i - 1] is not None]
        return statistics.median(xs) if xs else None
    return steps, {ph: median(v) for ph, v in per_step.items()}


# =============================================================================
# the TRL side, a child process (python bench/step.py --trl-worker RESULT.json ...): GRPOTrainer with DAPO's
# loss and clip-higher, no KL, one generation round per step; step time = wall time between on_step_end calls,
# "gen" = _generate_and_score_completions (generation, reward, and what TRL computes with them)


def trl_worker():
    import datasets
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    res = {"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                        "datasets": datasets.__version__, "torch": torch.__version__}, "use_vllm": bool(args.use_vllm)}
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.use_vllm:
        import vllm
        res["versions"]["vllm"] = vllm.__version__
    rows = pq.read_table(PROMPTS).to_pylist()
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    # the same prompt token ids as nanodapo's tokenizer + chat template
    tok = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    ours = data.Tokenizer.from_pretrained(MODEL)
    theirs = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows[:8]]
    theirs = [t["input_ids"] if hasattr(t, "keys") else t for t in theirs]
    mine = [ours.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows[:8]]
    res["prompt_ids_equal"] = [list(a) for a in theirs] == [list(b) for b in mine]
    res["prompt_len"] = [len(t) for t in theirs]
    print(f"TRL {trl.__version__}: prompt ids equal to nanodapo's: {res['prompt_ids_equal']} (lengths {res['prompt_len'][:4]})",
          flush=True)

    G, P, mb, R = args.n, args.prompts, args.micro_batch, RESPONSE_LENS[0]  # the driver passes one length
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    # transformers renames gradient_checkpointing to activation_checkpointing: use the name this version has
    ckpt = "activation_checkpointing" if "activation_checkpointing" in known else "gradient_checkpointing"
    want = dict(
        output_dir=os.path.join(args.work, f"trl{'_vllm' if args.use_vllm else ''}_out_{R}"),
        per_device_train_batch_size=mb, gradient_accumulation_steps=P * G // mb, num_generations=G,
        max_completion_length=R, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", num_iterations=1,
        mask_truncated_completions=False, temperature=1.0, top_p=1.0,
        bf16=cuda, use_cpu=not cuda, **{ckpt: True, f"{ckpt}_kwargs": {"use_reentrant": False}},
        model_init_kwargs={"dtype": args.trl_dtype, "attn_implementation": "sdpa"},
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        seed=0, dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
        use_vllm=bool(args.use_vllm), vllm_mode="colocate", vllm_gpu_memory_utilization=args.trl_vllm_gpu_mem,
        vllm_max_model_length=args.prompt_len + R + 8,
    )
    if args.use_vllm:  # TRL reads token ids only; vLLM need not detokenize ids a random model samples
        want["generation_kwargs"] = {"detokenize": False}
    res["config_dropped"] = sorted(k for k in want if k not in known)
    if res["config_dropped"]:
        print(f"GRPOConfig has no {res['config_dropped']}: left out", flush=True)
    config = GRPOConfig(**{k: v for k, v in want.items() if k in known})
    res["config"] = {k: str(getattr(config, k)) for k in want if k in known}
    for k in ("generation_batch_size", "steps_per_generation"):
        res["config"][k] = str(getattr(config, k, None))

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_s, self.logs, self.last = [], [], None

        def on_train_begin(self, a, state, control, **kw):
            sync(device)
            self.last = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync(device)
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

    def recording_seconds(fn, out):
        def wrapper(*a, **k):
            dt, r = timed(lambda: fn(*a, **k), device)
            out.append(dt)
            return r
        return wrapper
    if hasattr(trainer, "_generate_and_score_completions"):
        trainer._generate_and_score_completions = recording_seconds(trainer._generate_and_score_completions, gen_s)
    vg = getattr(trainer, "vllm_generation", None)
    if vg is not None and hasattr(vg, "sync_weights"):
        vg.sync_weights = recording_seconds(vg.sync_weights, sync_s)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    res["model_dtype"] = str(next(trainer.model.parameters()).dtype)

    def save(complete: bool):
        res.update(complete=complete, step_s=[round(x, 4) for x in timer.step_s], gen_s=[round(x, 4) for x in gen_s],
                   sync_s=[round(x, 4) for x in sync_s], logs=timer.logs)
        if cuda:
            res["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        dump(res, args.trl_worker + ".tmp")
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

OUT = out_path(args.out, "step")
RES = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "sides": {}, "errors": {}}
T_START = time.time()


def side_timeout():
    return max(10, min(args.timeout, int(args.budget - (time.time() - T_START))))


os.makedirs(args.work, exist_ok=True)


def save():
    dump(RES, OUT)


def host_state() -> dict:
    """What else loads the machine as a side starts: the load average and the processes on the GPUs (runs of
    the same code have differed by a third between leases; this says whether something else was running)."""
    state = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        state["gpu_apps"] = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired) as e:
        state["gpu_apps"] = repr(e)
    return state


def run(cmd, log_path, env=None, timeout=None):
    """Run a child (its own process group), output to log_path and to our stdout (prefixed); on timeout its
    group is killed. -> (rc, seconds, last lines)"""
    print(f"$ {' '.join(cmd)}", flush=True)
    RES.setdefault("host_before", {})[os.path.basename(log_path)] = host_state()
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
    if not os.path.isfile(os.path.join(MODEL, "config.json")):
        if args.tiny:
            write_random_model(MODEL, model_config(args.shape, tiny=True), "cpu")
        else:  # a child process: the GPU is the trainers' alone
            cmd = [sys.executable, "bench/make_random_model.py", args.work, "--shape", args.shape]
            if args.layers:
                cmd += ["--layers", str(args.layers)]
            rc, dt, tail = run(cmd, os.path.join(args.work, "make_model.log"), timeout=side_timeout())
            if rc != 0:
                raise RuntimeError("make_random_model failed:\n" + "\n".join(tail))
    tok = data.Tokenizer.from_pretrained(MODEL)
    overhead = len(tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True))
    rng = random.Random(0)
    rows = []
    for i in range(args.prompts * (max(args.steps, TRL_STEPS) + 2)):
        content = "".join(rng.choice("0123456789") for _ in range(args.prompt_len - overhead))
        msgs = [{"role": "user", "content": content}]
        n = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        assert n == args.prompt_len, (n, args.prompt_len)  # one token per digit in the demo tokenizer
        rows.append({"data_source": "hash", "prompt": msgs, "ability": "bench",
                     "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": i}})
    data.write_parquet(rows, PROMPTS)
    RES["prompts"] = {"rows": len(rows), "prompt_len": args.prompt_len, "template_overhead": overhead}
    print(f"prompts: {len(rows)} x {args.prompt_len} tokens -> {PROMPTS}", flush=True)


def micro_batch(R: int) -> int:
    """Trajectories per forward/backward at response length R, both sides: with --micro-batch-tokens the most
    that fit that many tokens (at least one) and divide a step's trajectories, as both trainers require."""
    if not args.micro_batch_tokens:
        return args.micro_batch
    k = max(1, args.micro_batch_tokens // (args.prompt_len + R))
    while (args.prompts * args.n) % k:
        k -= 1
    return k


def gpu_gib() -> float | None:
    """The GPU's memory as the trainer reads it (what its memory plan is made for), from nvidia-smi: the driver
    leaves CUDA alone, the GPU is the sides'."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(out[0]) / 1024 if out else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def planned(cfg_path: str, engine: str) -> dict | None:
    """What plan.memory_plan says of this config on this GPU (the --dry_run figures): GiB per phase, resident
    included (as are its runtime_gib of CUDA context and slack, which torch's allocator does not count)."""
    gib = gpu_gib()
    if gib is None:
        return None
    cfg, _ = parse_args(train_dapo.Config, [cfg_path] + args.nanodapo_args.split())
    mp = plan.memory_plan(cfg, hf.load_config(MODEL), 1, gib, engine=engine)
    return {"gpu_gib": round(gib, 1), "peak": round(mp["peak_gib"], 2), "verdict": mp["verdict"],
            "resident": round(mp["resident_gib"], 2), "runtime": mp["gib"]["runtime"],
            "training": round(mp["resident_gib"] + mp["training_gib"], 2),
            "generation": round(mp["resident_gib"] + mp["generation_gib"], 2),
            "gradient_checkpointing": mp["gradient_checkpointing"], "knob": mp["knob"]}


def nanodapo_side(name, engine, R):
    """train_dapo.py on a config written here: DAPO's clip-higher and token-mean, no KL, filter_groups off (one
    generation round per step, as TRL); phase times and peaks from its metrics.jsonl."""
    out_dir = os.path.join(args.work, f"{name}_out")
    cfg_path = os.path.join(args.work, f"{name}.py")
    P, G, mb = args.prompts, args.n, micro_batch(R)
    cfg = dict(model_path=MODEL, train_files=[PROMPTS], val_files=[], max_prompt_length=args.prompt_len,
               max_response_length=R, train_batch_size=P, gen_batch_size=P, n=G,
               ppo_mini_batch_size=P, ppo_micro_batch_size_per_gpu=mb, use_dynamic_bsz=False,
               log_prob_micro_batch_size_per_gpu=mb, ppo_epochs=1,
               clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", entropy_coeff=0.0,
               use_kl_loss=False, use_kl_in_reward=False, filter_groups=False, overlong_buffer=False,
               reward_fn=os.path.join(ROOT, "bench", "hash_reward.py") + ":compute_score", reward_num_workers=2,
               lr=args.lr, lr_warmup_steps=0, weight_decay=0.0, grad_clip=1.0,
               temperature=1.0, top_p=1.0, top_k=-1, max_num_seqs=P * G, rollout_engine=engine,
               total_training_steps=args.steps, save_freq=-1, test_freq=0, val_before_train=False,
               resume="disable", out_dir=out_dir, logger=["console", "jsonl"], seed=0)
    if name.endswith("_awake"):  # the engine kept awake between rollouts (no wake/sleep)
        cfg["free_cache_engine"] = False
    if args.tiny:
        cfg.update(device="cpu", cpu_threads=1, reward_num_workers=1)
    with open(cfg_path, "w") as f:
        f.write("# written by bench/step.py\n" + "".join(f"{k} = {v!r}\n" for k, v in cfg.items()))
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        os.remove(metrics)
    probe = os.path.join(args.work, f"{name}_probe.json")
    if os.path.isfile(probe):
        os.remove(probe)
    cmd = [sys.executable, os.path.join(ROOT, "bench", "trainer_probe.py"), "--probe-out", probe,
           "--profile-update", str(args.profile_update), cfg_path] + args.nanodapo_args.split()
    rc, wall, tail = run(cmd, os.path.join(args.work, f"{name}.log"), env=CHILD_ENV, timeout=side_timeout())
    side = {"impl": "nanodapo", "engine": engine, "rc": rc, "process_wall_s": round(wall, 1), "config": cfg}
    rows = [json.loads(line) for line in open(metrics)] if os.path.isfile(metrics) else []
    rows = [r for r in rows if "timing_s/step" in r]
    if rc != 0 or len(rows) < args.steps:
        side["error"] = f"rc {rc}, {len(rows)} steps logged; log tail:\n" + "\n".join(tail[-25:])
        RES["errors"][name] = side["error"]
    phases = {"step": "step", "gen": "gen", "reward": "reward", "old_logp": "old_log_prob", "ref": "ref",
              "update": "update_actor", "sync": "sync", "wake_sleep": "wake_sleep", "other": "other"}  # -> metric
    side["per_step"] = {ph: [round(r.get(f"timing_s/{key}", 0.0), 4) for r in rows] for ph, key in phases.items()}
    # steady state: the profiled step (the profiler's own time lands in it) and the steps in which torch.compile
    # made graphs (a micro-batch of a new kind or size range compiles once, in the first steps of a run) are left
    # out of the medians where other steps remain
    side["compiled_graphs"] = [r.get("perf/compiled_graphs") for r in rows]
    side["left_out_of_medians"] = sorted({args.profile_update} - {0} | {
        i + 1 for i, g in enumerate(side["compiled_graphs"]) if i > 0 and g})
    side["median_steps"], side["median"] = steady_medians(side["per_step"], side["left_out_of_medians"])
    side["response_length_mean"] = [r.get("response_length/mean") for r in rows]
    side["clip_ratio"] = [r.get("response_length/clip_ratio") for r in rows]
    peaks = [r["perf/max_memory_allocated_gib"] for r in rows if "perf/max_memory_allocated_gib" in r]  # GPU only
    side["peak_alloc_GiB"] = max(peaks, default=None)
    key = "perf/max_memory_allocated_gib/"  # each phase's peak, the largest over the steps
    side["phase_peak_GiB"] = {k[len(key):]: round(max(r[k] for r in rows if k in r), 2)
                              for k in sorted({k for r in rows for k in r if k.startswith(key)})}
    try:
        side["plan"] = planned(cfg_path, engine) if not args.tiny else None
    except Exception as e:  # the plan is a comparison: its failure must not lose the measured side
        RES["errors"][f"{name}_plan"] = repr(e)
    side["micro_batch"] = mb
    side["reward_mean"] = [r.get("train/score_mean") for r in rows]
    # the engine's log-probs against the trainer's (None where the engine gave none: vLLM by default)
    side["logp_mismatch"] = [r.get("rollout/logp_mismatch") for r in rows]
    if os.path.isfile(probe):  # each update seen from outside: wall (device synced), allocator retries, compiles
        side["update_probe"] = json.load(open(probe))["updates"]
    return side


def trl_side(name, use_vllm, dtype, R):
    result = os.path.join(args.work, f"{name}_result.json")
    if os.path.isfile(result):
        os.remove(result)
    cmd = [sys.executable, __file__, "--trl-worker", result, "--use-vllm", str(int(use_vllm)),
           "--work", args.work, "--prompts", str(args.prompts), "--n", str(args.n), "--prompt-len", str(args.prompt_len),
           "--response-len", str(R), "--micro-batch", str(micro_batch(R)), "--steps", str(TRL_STEPS),
           "--lr", str(args.lr), "--trl-vllm-gpu-mem", str(args.trl_vllm_gpu_mem), "--trl-dtype", dtype]
    if args.tiny:
        cmd.append("--tiny")
    rc, wall, tail = run(cmd, os.path.join(args.work, f"{name}.log"), env=CHILD_ENV, timeout=side_timeout())
    side = {"impl": "trl", "engine": ("vllm colocate" if use_vllm else "transformers generate") + f", {dtype}", "rc": rc,
            "process_wall_s": round(wall, 1)}
    r = json.load(open(result)) if os.path.isfile(result) else None  # written after every step: a timeout keeps them
    if rc != 0 or r is None:
        # a worker can be killed on its way out, its steps all saved: its figures stand, the error says so
        done = f" after all {len(r['step_s'])} steps were saved (figures complete)" if r and r.get("complete") else ""
        side["error"] = f"rc {rc}{done}; log tail:\n" + "\n".join(tail[-25:])
        RES["errors"][name] = side["error"]
        if r is None:
            return side
    side.update(r)
    steps, gens = r["step_s"], r["gen_s"]
    side["per_step"] = {"step": steps, "gen": gens, "update": [round(s - g, 4) for s, g in zip(steps, gens)],
                        "sync": r.get("sync_s", [])}
    side["median_steps"], side["median"] = steady_medians(side["per_step"])
    logs = [lg for lg in r["logs"] if "completions/mean_length" in lg or "loss" in lg]
    side["response_length_mean"] = [lg.get("completions/mean_length") for lg in logs]
    side["micro_batch"] = micro_batch(R)
    side["clip_ratio"] = [lg.get("completions/clipped_ratio") for lg in logs]
    side["reward_mean"] = [lg.get("reward") for lg in logs]
    side["trl_logged_step_time"] = [lg.get("step_time") for lg in logs]  # TRL's own per-step timer, for reference
    if not r.get("prompt_ids_equal", False):
        RES["errors"][f"{name}_prompts"] = "TRL's prompt token ids differ from nanodapo's (see prompt_len)"
    return side


have_vllm = importlib.util.find_spec("vllm") is not None
sides = [s for s in args.sides.split(",") if s]
unknown = set(sides) - {"nanodapo_torch", "nanodapo_vllm", "nanodapo_vllm_awake", "trl", "trl_bf16", "trl_vllm"}
if unknown:
    sys.exit(f"unknown sides {sorted(unknown)}")


def side_key(side: str, R: int) -> str:
    return side if len(RESPONSE_LENS) == 1 else f"{side}_{R}"  # also a file name: no odd characters


def matmul_peak_flops() -> float | None:
    """bench.common.matmul_peak on this GPU, in a child process (the driver leaves CUDA alone): MFU's
    denominator, measured in this run."""
    if args.tiny:
        return None
    code = "import torch; from bench.common import matmul_peak; print(matmul_peak(torch.device('cuda')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    try:
        return float(out.stdout.split()[-1])
    except (IndexError, ValueError):
        RES["errors"]["matmul_peak"] = out.stderr[-500:]
        return None


prepare()
PEAK_FLOPS = matmul_peak_flops()
RES["peak_bf16_matmul_TFLOPs"] = PEAK_FLOPS and round(PEAK_FLOPS / 1e12, 1)
save()
for R in RESPONSE_LENS:
    for s in sides:
        key = side_key(s, R)
        if "vllm" in s and not have_vllm:
            RES["sides"][key] = {"skipped": "vllm not importable"}
            print(f"{key}: skipped (vllm not importable)", flush=True)
            continue
        try:
            if s.startswith("nanodapo"):
                RES["sides"][key] = nanodapo_side(key, "vllm" if "vllm" in s else "torch", R)
            else:
                dtype = "bfloat16" if s == "trl_bf16" else args.trl_dtype
                RES["sides"][key] = trl_side(key, s.endswith("vllm"), dtype, R)
            RES["sides"][key]["response_len"] = R
        except Exception as e:
            traceback.print_exc()
            RES["errors"][key] = repr(e)
        save()
for path in args.merge:
    try:
        for k, v in json.load(open(path))["sides"].items():
            if k not in RES["sides"] and "median" in v:
                RES["sides"][k] = {**v, "merged_from": path}
    except Exception as e:
        RES["errors"][f"merge {path}"] = repr(e)

# -----------------------------------------------------------------------------
# the update's MFU; table; headline last

MODEL_CFG = hf.load_config(MODEL)
for s in RES["sides"].values():
    lens = s.get("response_length_mean", [])
    lens = [lens[i - 1] for i in s.get("median_steps", []) if i <= len(lens) and lens[i - 1] is not None]
    if lens:
        s["median_response_len"] = statistics.mean(lens)
    if lens and "median" in s and s["median"].get("update") and PEAK_FLOPS:
        # the steps of the median, every response at their mean length: exact when all run to the cap
        resp = s["median_response_len"]
        nseq = args.prompts * args.n
        flops = update_flops(MODEL_CFG, [args.prompt_len + round(resp)] * nseq, [round(resp)] * nseq)
        s["update_mfu"] = round(flops / s["median"]["update"] / PEAK_FLOPS, 3)
        s["update_tokens_per_s"] = round(nseq * (args.prompt_len + resp) / s["median"]["update"])


def f(x, spec="8.2f"):
    return format(x, spec) if isinstance(x, (int, float)) else format("-", ">" + spec.split(".")[0])


P, G = args.prompts, args.n
print(f"\n=== one DAPO step: {P} prompts x {G} responses, prompt {args.prompt_len} + response <= "
      f"{args.response_len} tokens, {args.steps} steps (TRL {TRL_STEPS}), medians of steps 2.. (s)"
      f"; nanodapo: steps that compiled{f' and step {args.profile_update} (profiled)' if args.profile_update else ''} "
      f"left out where others remain; bf16 matmul "
      f"{RES['peak_bf16_matmul_TFLOPs']} TFLOP/s ===")
print(f"{'side':22s} {'engine':28s} {'step':>8s} {'gen':>8s} {'update':>8s} {'sync':>7s} {'mb':>3s} {'MFU':>6s} "
      f"{'resp len':>8s} {'1st step':>8s} {'peak GiB':>8s} {'plan GiB':>8s}")
for name, s in RES["sides"].items():
    if "median" not in s:
        print(f"{name:22s} {s.get('skipped') or 'failed: ' + str(s.get('error', ''))[:80]}")
        continue
    m = s["median"]
    print(f"{name:22s} {s['engine'][:28]:28s} {f(m.get('step'))} {f(m.get('gen'))} {f(m.get('update'))} "
          f"{f(m.get('sync'), '7.3f')} {f(s.get('micro_batch'), '3d')} {f(s.get('update_mfu'), '6.3f')} "
          f"{f(s.get('median_response_len'), '8.1f')} {f((s['per_step']['step'] or [None])[0])} "
          f"{f(s.get('peak_alloc_GiB'))} {f((s.get('plan') or {}).get('peak'))}")
    if s.get("phase_peak_GiB"):
        print(f"{'':22s} phase peaks (allocator) {s['phase_peak_GiB']}; plan (resident + phase, runtime "
              f"included) {s.get('plan')}")
    if s.get("update_probe"):
        ups = s["update_probe"]
        print(f"{'':22s} steps left out of the medians: {s.get('left_out_of_medians')}; updates, device synced: " + "; ".join(
            f"{u['wall_s']:.2f} s ({u['tokens'] / u['wall_s']:,.0f} tok/s, {u['compiled_graphs']} graphs, "
            f"{u.get('num_alloc_retries', '-')} alloc retries){' profiled' if 'profile' in u else ''}" for u in ups))
print("(nanodapo gen = generation only, reward apart; TRL gen = generation + reward + what TRL does with them; "
      "MFU = model FLOPs of the update / its seconds / the bf16 matmul peak)")
print("errors:", {k: v[:200] for k, v in RES["errors"].items()} or "none")
heads = []
for R in RESPONSE_LENS:
    for trl_name, nano_name in (("trl", "nanodapo_torch"), ("trl_bf16", "nanodapo_torch"),
                                ("trl_vllm", "nanodapo_vllm"), ("trl_vllm", "nanodapo_vllm_awake"),
                                ("trl_vllm", "nanodapo_torch")):
        a = RES["sides"].get(side_key(trl_name, R), {}).get("median", {})
        b = RES["sides"].get(side_key(nano_name, R), {}).get("median", {})
        if a.get("step") and b.get("step"):
            tag = side_key(f"{trl_name} / {nano_name}", R)
            update = f", update {b['update'] / a['update']:.2f}x TRL's" if a.get("update") and b.get("update") else ""
            heads.append(f"{tag} = {a['step'] / b['step']:.2f}x{update}")
            RES.setdefault("headline", {})[side_key(f"{trl_name}_over_{nano_name}", R)] = round(a["step"] / b["step"], 3)
save()
print("HEADLINE step time, TRL / nanodapo: " + ("; ".join(heads) if heads else "not available (see errors)"))
