"""
What one decoder block keeps for backward, per token, measured: a packed training forward (bf16, the trainer's
log-prob head) of a model with `--layers-hi` blocks against the same with `--layers-lo`, so the embedding and
the head cancel; eager and compiled (each block torch.compile'd with dynamic shapes, as the trainer does on CUDA).
The planner's per-token term (plan.block_activation_bytes) is printed beside each measurement.

    python bench/activations.py --shapes qwen2.5-1.5b,qwen2.5-7b --variants --out activations.json

--variants adds shapes that change one dimension of the first (intermediate size, hidden size, KV heads), which
is what it takes to tell the terms of the formula apart.
"""
import argparse
import dataclasses
import gc
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import torch  # noqa: E402

import hf  # noqa: E402
import model as M  # noqa: E402
import parallel  # noqa: E402
import plan  # noqa: E402
from bench.common import dump, out_path, versions  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
p.add_argument("--variants", action="store_true", help="also the first shape with 2x intermediate, 2x hidden, 2x kv")
p.add_argument("--tokens", type=int, default=16384, help="tokens of the packed micro-batch")
p.add_argument("--doc-len", type=int, default=2048, help="tokens per packed sequence")
p.add_argument("--layers-lo", type=int, default=1)
p.add_argument("--layers-hi", type=int, default=3)
p.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny shape, few tokens")
p.add_argument("--out", default=None)
args = p.parse_args()

device = torch.device("cpu") if args.tiny else torch.device("cuda")
dtype = torch.float32 if args.tiny else torch.bfloat16


def allocated() -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def saved_bytes(cfg: M.ModelConfig, layers: int, compiled: bool) -> int:
    """Bytes a training forward leaves allocated (what backward needs, plus the outputs), then backward runs."""
    m = M.Transformer(dataclasses.replace(cfg, num_hidden_layers=layers)).to(device=device, dtype=dtype)
    if compiled:
        parallel.apply_compile(m, dynamic=True)
    seqs = [torch.randint(0, cfg.vocab_size, (args.doc_len,)).tolist()
            for _ in range(args.tokens // args.doc_len)]
    ids, pos, batch = M.pack_sequences(seqs, device)
    targets = torch.randint(0, cfg.vocab_size, ids.shape, device=device)
    for attempt in range(2):  # the first compiles (and warms the allocator); the second is measured
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
        before = allocated()
        logp, _ = m(ids, pos, batch, target_ids=targets, with_entropy="detached")
        after = allocated()
        logp.sum().backward()
        m.zero_grad(set_to_none=True)
        del logp
    del m
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return after - before


def shapes() -> list[tuple[str, M.ModelConfig]]:
    out = [(s, M.ModelConfig.from_hf(hf.KNOWN_CONFIGS[s])) for s in args.shapes.split(",")]
    if args.tiny:
        out = [("tiny", M.ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2))]
    if args.variants:
        name, c = out[0]
        out += [(f"{name} 2x intermediate", dataclasses.replace(c, intermediate_size=2 * c.intermediate_size)),
                (f"{name} 2x hidden and heads", dataclasses.replace(c, hidden_size=2 * c.hidden_size,
                                                                     num_attention_heads=2 * c.num_attention_heads)),
                (f"{name} 2x kv heads", dataclasses.replace(c, num_key_value_heads=2 * c.num_key_value_heads))]
    return out


RES = {"versions": versions(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
       "tokens": args.tokens, "doc_len": args.doc_len, "rows": []}
print(f"{'shape':<34} {'mode':<9} {'measured B/token/layer':>23} {'plan':>10} {'plan/measured':>14}")
for name, cfg in shapes():
    for compiled in (False, True):
        lo, hi = saved_bytes(cfg, args.layers_lo, compiled), saved_bytes(cfg, args.layers_hi, compiled)
        per_token = (hi - lo) / (args.layers_hi - args.layers_lo) / args.tokens
        planned = plan.block_activation_bytes(cfg, 0, tp=1, compiled=compiled)  # in bf16 bytes
        if dtype == torch.float32:
            planned *= 2
        mode = "compiled" if compiled else "eager"
        RES["rows"].append({"shape": name, "mode": mode, "hidden": cfg.hidden_size, "intermediate":
                            cfg.intermediate_size, "q": cfg.num_attention_heads * cfg.head_dim,
                            "kv": cfg.num_key_value_heads * cfg.head_dim, "measured": per_token, "plan": planned})
        ratio = f"{planned / per_token:>14.3f}" if per_token else "n/a (CPU)"  # the CPU has no allocator count
        print(f"{name:<34} {mode:<9} {per_token:>23,.0f} {planned:>10,.0f} {ratio:>14}", flush=True)
dump(RES, out_path(args.out, "activations.json"))
