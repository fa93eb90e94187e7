"""
Causal attention forward + backward of one packed micro-batch at long lengths, model.attention's two CUDA kernels
(torch's flash varlen, the keys repeated for GQA; SDPA on a [docs, length] view, which the trainer takes where
every document has one length: model.equal_lengths) and SDPA called per document (what transformers runs for
one unpadded sequence). Attention FLOP/s against the bf16 matmul peak.

    python bench/attention.py --lengths 4352,8448,16640 --docs 1
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import model as M  # noqa: E402
from bench.common import dump, matmul_peak, median_seconds, model_config, out_path  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen2.5-1.5b")
p.add_argument("--lengths", default="4352,8448,16640", help="tokens of each document")
p.add_argument("--docs", type=int, default=1, help="documents packed into the micro-batch")
p.add_argument("--reps", type=int, default=5)
p.add_argument("--out", default=None)
args = p.parse_args()
cfg = model_config(args.shape)
H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
dev = torch.device("cuda")
peak = matmul_peak(dev)
res = {"shape": args.shape, "heads": H, "kv_heads": KVH, "head_dim": D, "peak_TFLOPs": round(peak / 1e12, 1),
       "rows": {}}


def fwd_bwd(fn, q, k, v):
    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).float().square().mean().backward()
    return step


for L in map(int, args.lengths.split(",")):
    T = L * args.docs
    q = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, T, KVH, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, T, KVH, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
    varlen = M.AttnBatch(cu_seqlens=cu, cu_seqlens_list=cu.tolist(), max_seqlen=L, equal_docs=False)
    view = M.AttnBatch(cu_seqlens=cu, cu_seqlens_list=cu.tolist(), max_seqlen=L, equal_docs=True)

    def per_doc_sdpa(q, k, v):
        outs = [F.scaled_dot_product_attention(q[:, s:s + L].transpose(1, 2), k[:, s:s + L].transpose(1, 2),
                                               v[:, s:s + L].transpose(1, 2), is_causal=True, enable_gqa=True)
                for s in range(0, T, L)]
        return torch.cat(outs, dim=2).transpose(1, 2)
    flops = 3 * 2 * 2 * H * D * args.docs * L * L / 2  # causal: half of QK^T and PV, forward x 3 for backward
    row = {}
    for name, fn in (("model.attention, varlen", lambda q, k, v: M.attention(q, k, v, varlen)),
                     ("model.attention, SDPA view", lambda q, k, v: M.attention(q, k, v, view)),
                     ("sdpa per document", per_doc_sdpa)):
        s = median_seconds(fwd_bwd(fn, q, k, v), dev, args.reps)
        row[name] = {"s": round(s, 5), "TFLOPs": round(flops / s / 1e12, 1), "of_peak": round(flops / s / peak, 3)}
        print(f"T {L} x {args.docs}: {name:30s} {s * 1e3:8.2f} ms  {flops / s / 1e12:6.1f} TFLOP/s "
              f"({flops / s / peak:.0%} of the matmul peak)", flush=True)
    res["rows"][str(L)] = row
dump(res, out_path(args.out, "attention"))
