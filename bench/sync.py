"""
Weight push: seconds to gather the trainer's weights and push them into the rollout engine, as
train_dapo.sync_weights does (parallel.iter_full_weights(model, bucket_bytes, bf16) -> engine.load_weights),
for several bucket sizes, against a bytes-over-bandwidth floor measured in the same run.

    PYTHONUNBUFFERED=1 python3 bench/sync.py --out $OUT/sync_1p.json                                    # 1xH200, ~1 min
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
    torchrun --nproc-per-node 2 bench/sync.py --out $OUT/sync_fsdp2.json                                # 2xH200, FSDP2
    # vLLM engine (after the install of shared/VLLM_ON_DEVICE.md, with its environment; + ~70 s engine start):
    python3 bench/sync.py --engine vllm --out $OUT/sync_vllm_1p.json
    torchrun --nproc-per-node 2 bench/sync.py --engine vllm --out $OUT/sync_vllm_fsdp2.json
CPU smoke tests (tiny model; buckets in KiB-sized fractions of a MB):

    python3 bench/sync.py --tiny
    torchrun --nproc-per-node 2 bench/sync.py --tiny
    python3 bench/sync.py --tiny --engine vllm --fake-vllm       # the vLLM path through tests/fake_vllm.py

Setups. One process (no torchrun): the trainer's model is a plain fp32 module on the GPU (master weights, as
the trainer keeps them). torchrun: parallel.init_distributed + parallel.parallelize (FSDP2 over all ranks,
fp32 shards, bf16 compute), so iter_full_weights all-gathers each parameter (its shard cast to bf16, then
DTensor.full_tensor) and the gather is part of the time; every rank pushes into its own engine.
Engines. --engine torch: rollout.TorchEngine(shares_weights=False) on a separate bf16 copy of the model, as
train_dapo.py builds it when sharded. --engine vllm: rollout.VLLMEngine (see make_vllm_engine below: the
arguments are the trainer's, and it is built before the trainer's model, as the trainer does); per push the
trainer's cycle: wake_up(["weights"]) -> load_weights(buckets) -> (generate) -> sleep(), with wake and sleep
timed apart from the push.
Measured per bucket size (--buckets, MB: 64, 256, 512, 1024): "push" = engine.load_weights(
parallel.iter_full_weights(model, bucket, bf16), version) with torch.cuda.synchronize() and (torchrun) a barrier
before the clock starts and a synchronize after; the max over ranks of each push; median of --repeats (5)
after one warm-up push. Also "iterate" = the same loop without the engine (gather + cast only).
Floors, from bandwidths measured in this run (median of CUDA-event timed repeats):
  copy_bw   device-to-device copy of a 1 GiB bf16 tensor, (bytes read + bytes written) / time
  floor     (4 N + 2 N) / copy_bw: read every fp32 master weight once and write its bf16 copy once, N = parameters
            (the tied output head counted once, as the engine receives it)
  torchrun: gather_bw = all_gather_into_tensor of 1 GiB (bf16) per rank, bus bandwidth = bytes * (w-1)/w / time;
            gather_floor_bf16 = 2 N * (w-1)/w / gather_bw (bf16 shards, as iter_full_weights gathers them), and
            gather_floor = the same for fp32 shards (4 N): what gathering before the cast would cost.
Headline (last line): push seconds at 512 MB, and push / floor (torchrun: also push / (floor + gather_floor_bf16)).
Writes --out (JSON; default $OUT/sync.json or ./bench_sync.json), rank 0 only.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import torch
import torch.distributed as dist

import model as M
import parallel
import rollout as R

p = argparse.ArgumentParser()
p.add_argument("--engine", default="torch", choices=["torch", "vllm"])
p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(M.KNOWN_CONFIGS))
p.add_argument("--buckets", default="64,256,512,1024", help="bucket sizes in MB (2**20 bytes), comma list")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--tiny", action="store_true", help="tiny model on the CPU: a smoke test of this script")
p.add_argument("--vllm-gpu-mem", type=float, default=0.5, help="VLLMEngine gpu_memory_utilization (trainer default)")
p.add_argument("--vllm-dir", default="/tmp/nanodapo_sync_model", help="model directory for the vLLM engine (written once)")
p.add_argument("--fake-vllm", action="store_true", help="CPU test of the vLLM path with tests/fake_vllm.py")
p.add_argument("--out", default=None)
args = p.parse_args()
if args.tiny:
    args.buckets = "0.004,0.016,0.032,1"  # 4 KiB .. 1 MiB: several buckets for a ~0.1 MB model
    args.repeats = 3

dims = parallel.init_distributed("cpu" if args.tiny else "auto")
device, W, main = dims.device, dims.world_size, dims.is_main
cuda = device.type == "cuda"
log = print if main else (lambda *a, **k: None)
OUT = args.out or os.path.join(os.environ.get("OUT") or ".", "sync.json" if os.environ.get("OUT") else "bench_sync.json")
RES = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "world_size": W, "engine": args.engine,
       "versions": {"torch": torch.__version__}, "device": torch.cuda.get_device_name() if cuda else "cpu",
       "rows": {}, "errors": {}}


def dump():
    if main:
        os.makedirs(os.path.dirname(os.path.abspath(OUT)), exist_ok=True)
        with open(OUT, "w") as f:
            json.dump(RES, f, indent=1, default=str)


def sync():
    if cuda:
        torch.cuda.synchronize()


def barrier():
    if W > 1:
        dist.barrier()


def max_over_ranks(x: float) -> float:
    if W == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # gloo (cpu) group: parallel.init_distributed makes one
    return t.item()


def event_median(fn, reps=10):
    fn()
    sync()
    ts = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# -----------------------------------------------------------------------------
# the model shape, the engine for vLLM first (it sizes its KV cache from the memory free now, as in the trainer)

if args.tiny:
    cfg = M.ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
                        max_position_embeddings=4096)
else:
    cfg = M.ModelConfig.from_hf(M.KNOWN_CONFIGS[args.shape])
N = cfg.num_params()
RES["n_params"] = N


def make_vllm_engine(model_dir: str):
    """The vLLM engine as train_dapo.train builds it (rollout.VLLMEngine; train_dapo's Config defaults: gen_tp 1,
    gpu_memory_utilization 0.5, max_model_len = max_prompt_length + max_response_length, max_num_seqs 256,
    CUDA graphs on, chunked prefill on, seed 0, bf16). It starts from dummy weights (load_format="dummy"); the directory
    is a whole random checkpoint all the same (written once to --vllm-dir), like the trainer's model_path.
    Assumed API (rollout.py of commit 0639fcf): VLLMEngine(path, gen_tp=, gpu_memory_utilization=, max_model_len=,
    max_num_seqs=, enforce_eager=, enable_chunked_prefill=, max_num_batched_tokens=, seed=, dtype=, engine_kwargs=),
    .wake_up(tags), .load_weights(buckets, version) -> bytes, .sleep(). Adapt here if that changes."""
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "NCCL_NVLS_ENABLE": "0",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "VLLM_NO_USAGE_STATS": "1",
                 "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    if main and not args.fake_vllm:  # a whole HF directory (random bf16 weights), as the trainer's model_path is
        if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            with torch.device(device):
                m = M.Transformer(cfg).to(torch.bfloat16)
            M.save_pretrained(m.init_weights(seed=0), model_dir)
            del m
    elif main:  # the fake engine reads config.json only
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg.to_hf(torch.bfloat16), f, indent=2)
    barrier()
    return R.VLLMEngine(model_dir, gen_tp=1, gpu_memory_utilization=args.vllm_gpu_mem,
                        max_model_len=512 + 1024, max_num_seqs=256, enforce_eager=False,
                        enable_chunked_prefill=True, max_num_batched_tokens=None, seed=0, dtype="bfloat16")


def install_fake_vllm():
    """CPU test hook: tests/fake_vllm.py stands in for vllm (as the unit tests use it)."""
    import importlib.machinery
    import types
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import fake_vllm
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = fake_vllm.LLM, fake_vllm.SamplingParams
    sys.modules["vllm"] = module
    R.free_device_memory = lambda: 8 * 2**30


engine = None
if args.engine == "vllm":
    if args.fake_vllm:
        install_fake_vllm()
    t0 = time.perf_counter()
    engine = make_vllm_engine(args.vllm_dir)
    RES["engine_init_s"] = round(time.perf_counter() - t0, 1)
    log(f"vLLM engine ready in {RES['engine_init_s']} s (asleep)")

# the trainer's model: fp32 master weights, plain (1 process) or FSDP2-sharded (torchrun)
t0 = time.perf_counter()
if W == 1:
    with torch.device(device):
        model = M.Transformer(cfg)
    model.init_weights(seed=0)
else:
    from torch.distributed.tensor import DTensor
    with torch.device("meta"):
        model = M.Transformer(cfg)
    parallel.parallelize(model, dims, param_dtype=torch.bfloat16)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(dims.rank)
    with torch.no_grad():
        for q in model.parameters():  # values do not matter for the timing, only that they are not zeros
            (q.to_local() if isinstance(q, DTensor) else q).normal_(0.0, 0.02, generator=g)
RES["model_build_s"] = round(time.perf_counter() - t0, 1)
if engine is None:  # the built-in engine on its own bf16 copy, as train_dapo builds it when sharded
    with torch.device(device):
        gen_model = M.Transformer(cfg).to(torch.bfloat16)
    engine = R.TorchEngine(gen_model, shares_weights=False)
fp32_bytes = 4 * N
bf16_bytes = 2 * N
log(f"model {N / 1e9:.3f} B params ({bf16_bytes / 2**30:.2f} GiB bf16), world size {W}, engine {args.engine}, "
    f"device {RES['device']}")

# -----------------------------------------------------------------------------
# bandwidths and floors

n = (2**29 if cuda else 2**23)  # bf16 elements: 1 GiB on the GPU, 16 MiB on the CPU
src = torch.randn(n, device=device).to(torch.bfloat16)
dst = torch.empty_like(src)
copy_bw = 2 * src.numel() * 2 / event_median(lambda: dst.copy_(src))
RES["copy_bw_GBps"] = round(copy_bw / 1e9, 1)
RES["floor_s"] = (fp32_bytes + bf16_bytes) / copy_bw
if W > 1:
    out = torch.empty(n * W, device=device, dtype=torch.bfloat16)
    t = event_median(lambda: dist.all_gather_into_tensor(out, src), reps=5)
    gather_bw = out.numel() * 2 * (W - 1) / W / t  # bus bandwidth
    RES["gather_bw_GBps"] = round(gather_bw / 1e9, 1)
    RES["gather_floor_s"] = fp32_bytes * (W - 1) / W / gather_bw
    RES["gather_floor_bf16_s"] = bf16_bytes * (W - 1) / W / gather_bw
    del out
del src, dst
if cuda:
    torch.cuda.empty_cache()
log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write): floor {RES['floor_s'] * 1e3:.2f} ms"
    + (f"; all-gather bus bandwidth {RES['gather_bw_GBps']:.0f} GB/s: gather floor fp32 "
       f"{RES['gather_floor_s'] * 1e3:.2f} ms, bf16 {RES['gather_floor_bf16_s'] * 1e3:.2f} ms" if W > 1 else ""))
dump()

# -----------------------------------------------------------------------------
# the sweep

version = [0]


def timed(fn) -> float:
    sync()
    barrier()
    t = time.perf_counter()
    fn()
    sync()
    return max_over_ranks(time.perf_counter() - t)


def iterate_only(bucket_bytes):
    nb = 0
    for bucket in parallel.iter_full_weights(model, bucket_bytes, dtype=torch.bfloat16):
        nb += sum(t.numel() * t.element_size() for _, t in bucket)
    assert nb == bf16_bytes, (nb, bf16_bytes)


def push(bucket_bytes):
    version[0] += 1
    nb = engine.load_weights(parallel.iter_full_weights(model, bucket_bytes, dtype=torch.bfloat16), version[0])
    assert nb == bf16_bytes, (nb, bf16_bytes)


for mb in [float(x) for x in args.buckets.split(",")]:
    bucket_bytes = int(mb * 2**20)
    name = f"{mb:g}MB"
    row = {"bucket_MB": mb, "buckets": sum(1 for _ in parallel.iter_full_weights(model, bucket_bytes))}
    try:
        iterate_only(bucket_bytes)  # warm-up
        row["iterate_s"] = [timed(lambda: iterate_only(bucket_bytes)) for _ in range(args.repeats)]
        wake, push_s, sleep_s = [], [], []
        for i in range(args.repeats + 1):  # the first is a warm-up
            wake.append(timed(lambda: engine.wake_up(["weights"])))
            push_s.append(timed(lambda: push(bucket_bytes)))
            sleep_s.append(timed(engine.sleep))
        row.update(push_s=push_s[1:], wake_weights_s=wake[1:], sleep_s=sleep_s[1:], first_push_s=push_s[0])
        row["push_median_s"] = statistics.median(row["push_s"])
        row["iterate_median_s"] = statistics.median(row["iterate_s"])
        row["push_over_floor"] = row["push_median_s"] / RES["floor_s"]
        if W > 1:
            row["push_over_floor_with_gather"] = row["push_median_s"] / (RES["floor_s"] + RES["gather_floor_bf16_s"])
        log(f"bucket {name:>8s} ({row['buckets']} buckets): push {row['push_median_s'] * 1e3:9.2f} ms "
            f"(iterate only {row['iterate_median_s'] * 1e3:9.2f} ms, wake {statistics.median(row['wake_weights_s']) * 1e3:.2f} "
            f"ms, sleep {statistics.median(row['sleep_s']) * 1e3:.2f} ms) = {row['push_over_floor']:.1f}x floor", flush=True)
    except Exception as e:
        import traceback
        traceback.print_exc()
        row["error"] = repr(e)[:1000]
        RES["errors"][name] = row["error"]
    RES["rows"][name] = row
    dump()

# -----------------------------------------------------------------------------
# table; headline last

if main:
    print(f"\n=== weight push into the {args.engine} engine, {N / 1e9:.2f} B params, {'1 process, plain fp32 model' if W == 1 else f'{W} ranks, FSDP2 fp32 shards'}"
          f", {RES['device']}; median of {args.repeats} pushes after 1 (max over ranks) ===")
    extra = f", all-gather {RES['gather_bw_GBps']:.0f} GB/s -> gather floor {RES['gather_floor_s'] * 1e3:.1f} ms fp32 / " \
            f"{RES['gather_floor_bf16_s'] * 1e3:.1f} ms bf16" if W > 1 else ""
    print(f"copy {RES['copy_bw_GBps']:.0f} GB/s -> floor {RES['floor_s'] * 1e3:.2f} ms (6 bytes/param){extra}")
    print(f"{'bucket MB':>9s} {'buckets':>7s} {'push ms':>9s} {'iterate ms':>10s} {'wake ms':>8s} {'sleep ms':>8s} "
          f"{'1st push':>9s} {'push/floor':>10s}" + (f" {'/(floor+gather)':>15s}" if W > 1 else ""))
    for row in RES["rows"].values():
        if "push_median_s" not in row:
            print(f"{row['bucket_MB']:>9g} failed: {row.get('error', '')[:100]}")
            continue
        print(f"{row['bucket_MB']:>9g} {row['buckets']:>7d} {row['push_median_s'] * 1e3:9.2f} "
              f"{row['iterate_median_s'] * 1e3:10.2f} {statistics.median(row['wake_weights_s']) * 1e3:8.2f} "
              f"{statistics.median(row['sleep_s']) * 1e3:8.2f} {row['first_push_s'] * 1e3:9.2f} "
              f"{row['push_over_floor']:10.2f}" + (f" {row['push_over_floor_with_gather']:15.2f}" if W > 1 else ""))
    print("errors:", RES["errors"] or "none")
    head = RES["rows"].get("512MB") or next((r for r in RES["rows"].values() if "push_median_s" in r), None)
    if head and "push_median_s" in head:
        RES["headline"] = {"bucket_MB": head["bucket_MB"], "push_s": head["push_median_s"],
                           "floor_s": RES["floor_s"], "push_over_floor": head["push_over_floor"]}
        g = (f", {head['push_over_floor_with_gather']:.1f}x (floor + bf16 gather floor "
             f"{(RES['floor_s'] + RES['gather_floor_bf16_s']) * 1e3:.2f} ms)") if W > 1 else ""
        print(f"HEADLINE push at {head['bucket_MB']:g} MB: {head['push_median_s']:.4f} s = "
              f"{head['push_over_floor']:.1f}x the floor {RES['floor_s'] * 1e3:.2f} ms{g} "
              f"({args.engine} engine, {'1 process' if W == 1 else f'FSDP2 x {W}'})")
    else:
        print("HEADLINE not available (see errors)")
    dump()
if args.engine == "vllm" and W > 1:
    barrier()
parallel.shutdown()
