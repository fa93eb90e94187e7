"""
Weight push: seconds to gather the trainer's weights and push them into the rollout engine, as
train_dapo.sync_weights does, for several bucket sizes, against a bytes-over-bandwidth floor measured in the
same run. One process holds a plain fp32 model; under torchrun the model is FSDP2-sharded and the gather counts.

    torchrun --nproc-per-node 2 bench/sync.py --engine vllm --out sync.json
"""
import argparse
import os
import statistics
import sys
import time
import traceback

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import hf  # noqa: E402
import model as M  # noqa: E402
import parallel  # noqa: E402
import rollout as R  # noqa: E402
from bench.common import (ROOT, VLLM_ENV, dump, median_seconds, model_config, out_path, random_model,  # noqa: E402
                          sync, timed, write_random_model)

p = argparse.ArgumentParser()
p.add_argument("--engine", default="torch", choices=["torch", "vllm"])
p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(hf.KNOWN_CONFIGS))
p.add_argument("--buckets", default="64,256,512,1024", help="bucket sizes in MB (2**20 bytes), comma list")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--tiny", action="store_true", help="tiny model on the CPU: a smoke test of this script")
p.add_argument("--vllm-gpu-mem", type=float, default=0.5, help="VLLMEngine gpu_memory_utilization (trainer default)")
p.add_argument("--vllm-dir", default="/tmp/nanodapo_sync_model", help="model directory for the vLLM engine (written once)")
p.add_argument("--fake-vllm", action="store_true", help="CPU test of the vLLM path with tests/helpers/fake_vllm.py")
p.add_argument("--out", default=None)
args = p.parse_args()
if args.tiny:
    args.buckets = "0.004,0.016,0.032,1"  # 4 KiB .. 1 MiB: several buckets for a ~0.1 MB model
    args.repeats = 3
    if args.vllm_dir == "/tmp/nanodapo_sync_model":
        args.vllm_dir += "_tiny"

dims = parallel.init_distributed("cpu" if args.tiny else "auto")
device, W, main = dims.device, dims.world_size, dims.is_main
cuda = device.type == "cuda"
log = print if main else (lambda *a, **k: None)
OUT = out_path(args.out, "sync")
RES = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "world_size": W, "engine": args.engine,
       "versions": {"torch": torch.__version__}, "device": torch.cuda.get_device_name() if cuda else "cpu",
       "rows": {}, "errors": {}}


def save():
    if main:
        dump(RES, OUT)


def barrier():
    if W > 1:
        dist.barrier()


def max_over_ranks(x: float) -> float:
    if W == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # gloo (cpu) group: parallel.init_distributed makes one
    return t.item()


def timed_all_ranks(fn) -> float:
    """Seconds of fn, the ranks started together, the slowest rank's."""
    sync(device)
    barrier()
    return max_over_ranks(timed(fn, device)[0])


def install_fake_vllm():
    """CPU runs of the vLLM path: `import vllm` gets tests/helpers/fake_vllm.py's stand-ins, as in the unit tests."""
    import pytest  # the fake installs itself with pytest's monkeypatch; a test-only dependency, as the fake is
    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    import fake_vllm
    fake_vllm.install(pytest.MonkeyPatch())


# -----------------------------------------------------------------------------
# the engine for vLLM first (it sizes its KV cache from the memory free now, as in the trainer); its arguments
# are train_dapo's Config defaults; it starts from dummy weights, from a whole random checkpoint all the same

cfg = model_config(args.shape, args.tiny)
N = cfg.num_params()
RES["n_params"] = N
engine = None
if args.engine == "vllm":
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    if args.fake_vllm:
        install_fake_vllm()
    t0 = time.perf_counter()
    if main and not os.path.isfile(os.path.join(args.vllm_dir, "model.safetensors")):
        write_random_model(args.vllm_dir, cfg, device)
    barrier()
    engine = R.VLLMEngine(args.vllm_dir, gen_tp=1, gpu_memory_utilization=args.vllm_gpu_mem,
                          max_model_len=512 + 1024, max_num_seqs=256, enforce_eager=False,
                          enable_chunked_prefill=True, max_num_batched_tokens=None, seed=0, dtype="bfloat16")
    RES["engine_init_s"] = round(time.perf_counter() - t0, 1)
    log(f"vLLM engine ready in {RES['engine_init_s']} s (asleep)")

# the trainer's model: fp32 master weights, plain (1 process) or FSDP2-sharded (torchrun)
t0 = time.perf_counter()
if W == 1:
    model = random_model(cfg, device)
else:
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
# floors: read every fp32 master weight and write its bf16 copy at the copy bandwidth (6 bytes a parameter);
# under torchrun also the all-gather of bf16 shards (and of fp32 ones: what gathering before the cast costs)

src = torch.randn(2**29 if cuda else 2**23, device=device).to(torch.bfloat16)  # 1 GiB on the GPU, 16 MiB on the CPU
dst = torch.empty_like(src)
copy_bw = 2 * src.numel() * 2 / median_seconds(lambda: dst.copy_(src), device)
RES["copy_bw_GBps"] = round(copy_bw / 1e9, 1)
RES["floor_s"] = (fp32_bytes + bf16_bytes) / copy_bw
if W > 1:
    gathered = torch.empty(src.numel() * W, device=device, dtype=torch.bfloat16)
    t = median_seconds(lambda: dist.all_gather_into_tensor(gathered, src), device, reps=5)
    gather_bw = gathered.numel() * 2 * (W - 1) / W / t  # bus bandwidth
    RES["gather_bw_GBps"] = round(gather_bw / 1e9, 1)
    RES["gather_floor_s"] = fp32_bytes * (W - 1) / W / gather_bw
    RES["gather_floor_bf16_s"] = bf16_bytes * (W - 1) / W / gather_bw
    del gathered
del src, dst
if cuda:
    torch.cuda.empty_cache()
log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write): floor {RES['floor_s'] * 1e3:.2f} ms"
    + (f"; all-gather bus bandwidth {RES['gather_bw_GBps']:.0f} GB/s: gather floor fp32 "
       f"{RES['gather_floor_s'] * 1e3:.2f} ms, bf16 {RES['gather_floor_bf16_s'] * 1e3:.2f} ms" if W > 1 else ""))
save()

# -----------------------------------------------------------------------------
# the sweep: per bucket size, the gather + cast alone, then the trainer's cycle wake -> push -> sleep, each
# timed apart; median of --repeats after one warm-up


def iterate_only(bucket_bytes):
    nb = 0
    for bucket in parallel.iter_full_weights(model, bucket_bytes, dtype=torch.bfloat16):
        nb += sum(t.numel() * t.element_size() for _, t in bucket)
    assert nb == bf16_bytes, (nb, bf16_bytes)


def push(bucket_bytes, version):
    nb = engine.load_weights(parallel.iter_full_weights(model, bucket_bytes, dtype=torch.bfloat16), version)
    assert nb == bf16_bytes, (nb, bf16_bytes)


version = 0
for mb in [float(x) for x in args.buckets.split(",")]:
    bucket_bytes = int(mb * 2**20)
    name = f"{mb:g}MB"
    row = {"bucket_MB": mb, "buckets": sum(1 for _ in parallel.iter_full_weights(model, bucket_bytes))}
    try:
        iterate_only(bucket_bytes)  # warm-up
        row["iterate_s"] = [timed_all_ranks(lambda: iterate_only(bucket_bytes)) for _ in range(args.repeats)]
        wake, push_s, sleep_s = [], [], []
        for i in range(args.repeats + 1):  # the first is a warm-up
            version += 1
            wake.append(timed_all_ranks(lambda: engine.wake_up(["weights"])))
            push_s.append(timed_all_ranks(lambda: push(bucket_bytes, version)))
            sleep_s.append(timed_all_ranks(engine.sleep))
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
        traceback.print_exc()
        row["error"] = repr(e)[:1000]
        RES["errors"][name] = row["error"]
    RES["rows"][name] = row
    save()

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
    save()
if args.engine == "vllm" and W > 1:
    barrier()
parallel.shutdown()
