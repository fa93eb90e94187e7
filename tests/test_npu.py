"""The NPU attention path without an NPU: which kernel runs packed documents for each device type and dtype, and
torch_npu.npu_fusion_attention replaced by a recording fake (float64 attention per document, written here) to
check the arguments model.py passes (TND layout, cumulative lengths, scale, causal mode) and the model output."""
import sys
import types

import torch

import model as M

HALF = (torch.float16, torch.bfloat16)


def test_packed_kernel_by_device_type_and_dtype(monkeypatch):
    for dtype in (*HALF, torch.float32):
        assert M.packed_kernel("npu", dtype) == "npu"  # torch_npu's fused kernel takes fp16, bf16 and fp32
        assert M.packed_kernel("cpu", dtype) == "gather"
    assert M.packed_kernel("cuda", torch.float32) == "gather"  # flash kernels: half precision only
    monkeypatch.setattr(M, "_varlen_available", lambda device_type: device_type == "cuda")
    assert all(M.packed_kernel("cuda", dtype) == "varlen" for dtype in HALF)
    # documents of one length go to SDPA as a [docs, length] view, whose kernel is the faster; an NPU keeps
    # its own
    for device_type in ("cuda", "cpu"):
        assert all(M.packed_kernel(device_type, dtype, equal_docs=True) == "sdpa" for dtype in (*HALF, torch.float32))
    assert M.packed_kernel("npu", torch.bfloat16, equal_docs=True) == "npu"
    monkeypatch.setattr(M, "_varlen_available", lambda device_type: False)  # torch without varlen_attn
    assert all(M.packed_kernel("cuda", dtype) == "gather" for dtype in HALF)


def reference_attention(q, k, v, ends, scale):
    """q [T, H, D], k/v [T, KVH, D], documents ending at `ends` -> [T, H, D], causal within each, in float64."""
    H, kvh = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, e in zip([0] + ends[:-1], ends):
        qd, kd, vd = (t[s:e].double() for t in (q, k, v))
        kd, vd = (t.repeat_interleave(H // kvh, dim=1) for t in (kd, vd))  # query head h reads kv head h // (H/KVH)
        scores = torch.einsum("ihd,jhd->hij", qd, kd) * scale
        scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out[s:e] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vd)
    return out


def test_npu_fusion_attention_gets_tnd_layout_and_matches_the_cpu_path(monkeypatch):
    calls = []

    def npu_fusion_attention(query, key, value, head_num, input_layout, *, atten_mask, scale, sparse_mode,
                             actual_seq_qlen, actual_seq_kvlen):
        calls.append(dict(q=tuple(query.shape), k=tuple(key.shape), v=tuple(value.shape), head_num=head_num,
                          layout=input_layout, mask=atten_mask, scale=scale, sparse_mode=sparse_mode,
                          qlen=list(actual_seq_qlen), kvlen=list(actual_seq_kvlen)))
        out = reference_attention(query, key, value, list(actual_seq_qlen), scale).to(query.dtype)
        return out, None, None, None, 0, 0, 0  # torch_npu returns 7 outputs, the attention first

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention))
    cfg = M.ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=50, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    m = M.Transformer(cfg).init_weights(seed=0)
    docs = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 1, 9)]
    ids, pos, _ = M.pack_sequences(docs)
    with torch.no_grad():
        cpu = m(ids, pos, M.pack_sequences(docs)[2])  # the gather path
        real = M.packed_kernel
        monkeypatch.setattr(M, "packed_kernel", lambda device_type, dtype, equal_docs: real("npu", dtype))  # as on an NPU
        npu = m(ids, pos, M.pack_sequences(docs)[2])
        assert len(calls) == 2  # one per layer
        m(ids)  # the padded path (no documents) stays on SDPA
    assert len(calls) == 2
    assert (npu - cpu).abs().max().item() < 1e-5
    c = calls[0]
    assert (c["layout"], c["head_num"], c["q"], c["k"], c["v"]) == ("TND", 4, (32, 4, 16), (32, 2, 16), (32, 2, 16))
    assert c["qlen"] == c["kvlen"] == [5, 22, 23, 32]  # cumulative ends, no leading 0
    assert c["scale"] == 16 ** -0.5
    # sparse_mode 3 (rightDownCausal; per document Sq = Skv, so plain causal) with the compressed 2048 x 2048 mask
    assert c["sparse_mode"] == 3 and c["mask"].dtype == torch.bool and c["mask"].shape == (2048, 2048)
    assert torch.equal(c["mask"], torch.ones(2048, 2048, dtype=torch.bool).triu(1))
