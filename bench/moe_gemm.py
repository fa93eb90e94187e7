"""
model.MoE on CUDA: the grouped-GEMM path (torch._grouped_mm) against the per-expert loop on the same weights and
inputs (Qwen3-30B-A3B expert shapes, one expert without tokens), forward + backward, with an fp32 loop as reference.

    python3 bench/moe_gemm.py 4096      # tokens; prints a JSON of differences and median step times
"""
import json
import os
import sys
import time

import torch

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/
import hf  # noqa: E402
import model as M  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
cfg = M.ModelConfig.from_hf({**hf.KNOWN_CONFIGS["qwen3-30b-a3b"], "num_hidden_layers": 1})
torch.manual_seed(0)
dev = torch.device("cuda")
ref = M.MoE(cfg).to(dev)
with torch.no_grad():
    ref.gate.weight.normal_(0, 0.02)
    ref.experts.gate_up_proj.normal_(0, 0.02)
    ref.experts.down_proj.normal_(0, 0.02)
    ref.gate.weight[0] = -0.05  # inputs have mean 1 per feature: expert 0's logit ~ -100, never in a top-8
x0 = torch.randn(N, cfg.hidden_size, device=dev) + 1.0
dy = torch.randn(N, cfg.hidden_size, device=dev)
grouped_mm_dtype = M._grouped_mm_dtype


def make(dtype):
    m = M.MoE(cfg).to(dev, dtype)
    m.load_state_dict(ref.state_dict())
    return m


def step(m, dtype, grouped: bool, autocast: bool):
    """-> (out, {grad name: grad}) of one forward + backward; params in `dtype` (bf16: what FSDP computes with)."""
    M._grouped_mm_dtype = grouped_mm_dtype if grouped else (lambda x: None)
    m.zero_grad(set_to_none=True)
    x = x0.to(dtype).clone().requires_grad_()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        y = m(x)
    y.backward(dy.to(y.dtype))
    return y, {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


def run(dtype, grouped, autocast):
    return step(make(dtype), dtype, grouped, autocast)


def timed(dtype, grouped, autocast, reps=10):
    m, ts = make(dtype), []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(m, dtype, grouped, autocast)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts[2:])[reps // 2]


with torch.no_grad():
    probs = torch.softmax(ref.gate(x0).float(), -1)
    picks = torch.bincount(probs.topk(cfg.num_experts_per_tok, -1).indices.flatten(), minlength=cfg.num_experts)
res = {"tokens": N, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "hidden": cfg.hidden_size,
       "moe_intermediate": cfg.moe_intermediate_size, "tokens_of_expert0": int(picks[0]),
       "experts_without_tokens": int((picks == 0).sum()), "max_tokens_per_expert": int(picks.max()),
       "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
y32, g32 = run(torch.float32, grouped=False, autocast=False)
for mode, dtype, autocast in (("bf16 params", torch.bfloat16, False), ("fp32 params + bf16 autocast", torch.float32, True)):
    yg, gg = run(dtype, True, autocast)
    yl, gl = run(dtype, False, autocast)
    d = lambda a, b: float((a.detach().float() - b.detach().float()).abs().max())  # noqa: E731
    res[mode] = {
        "out max|grouped-loop|": d(yg, yl), "out max|grouped-fp32|": d(yg, y32), "out max|loop-fp32|": d(yl, y32),
        "out max|fp32|": float(y32.detach().abs().max()),
        "grad max|grouped-loop|": {k: d(gg[k], gl[k]) for k in gg},
        "grad max|grouped-fp32|": {k: d(gg[k], g32[k]) for k in gg},
        "grad max|loop-fp32|": {k: d(gl[k], g32[k]) for k in gg},
        "grad max|fp32|": {k: float(g32[k].abs().max()) for k in gg},
        "expert0 grads zero (grouped, loop)": [float(gg["experts.gate_up_proj"][0].abs().max()),
                                               float(gl["experts.gate_up_proj"][0].abs().max())],
        "fwd+bwd median s (grouped, loop)": [timed(dtype, True, autocast), timed(dtype, False, autocast)]}
print(json.dumps(res, indent=1))
