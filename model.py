"""
The policy model: Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Llama-3 decoders in plain torch, a packed ("remove
padding") forward, and chunked token log-probs + entropy. hf.py reads and writes HF model directories for it;
the tokenizer is in data.py.

Parameter names equal the HF names (model.layers.N.self_attn.q_proj.weight, ...), except that a MoE layer
holds its experts stacked (mlp.experts.gate_up_proj [E, 2 * I, H], mlp.experts.down_proj [E, H, I]) where
checkpoints and vLLM hold one tensor per expert (hf.hf_tensors maps between the two).
"""
import functools
import inspect
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor

# torch's flash varlen attention (CUDA), if this torch has it. How to ask it for causal attention depends on
# the release: torch <= 2.10 takes is_causal=True, later releases window_size=(-1, 0).
try:
    from torch.nn.attention.varlen import varlen_attn
    if "is_causal" in inspect.signature(varlen_attn).parameters:
        _VARLEN_CAUSAL = {"is_causal": True}
    else:
        _VARLEN_CAUSAL = {"window_size": (-1, 0)}
except ImportError:
    varlen_attn = None
# the flash varlen op of releases that take each sequence's count of live keys (seqused_k): the decode step
# then needs no mask
try:
    _FLASH_SEQUSED_K = "seqused_k" in str(torch.ops.aten._flash_attention_forward.default._schema)
except (AttributeError, RuntimeError):
    _FLASH_SEQUSED_K = False

IGNORE_INDEX = -100  # a target the log-prob head skips (as in torch's cross_entropy): a prompt's own tokens
MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
               "LlamaForCausalLM": "llama"}  # the supported architectures -> config.json's model_type

# -----------------------------------------------------------------------------
# config

_PARAM_COUNTS = {}  # repr(ModelConfig) -> its parameter count (the memory planner asks many times)

@dataclass
class ModelConfig:
    architecture: str = "Qwen2ForCausalLM"
    vocab_size: int = 151936
    hidden_size: int = 1536
    intermediate_size: int = 8960
    num_hidden_layers: int = 28
    num_attention_heads: int = 12
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only {"rope_type": "llama3", ...} is supported
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # q/k/v biases; None = the architecture's default (Qwen2: yes)
    qk_norm: bool = False  # per-head RMSNorm on q and k: set for Qwen3, by the architecture
    max_position_embeddings: int = 32768  # the context limit: prompt + response must fit in it
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    # mixture of experts (Qwen3MoeForCausalLM; 0 experts = dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # width of each expert's SwiGLU
    norm_topk_prob: bool = False  # renormalize the top-k router probabilities to sum to 1
    # layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (the layers
    # listed there have a dense MLP of intermediate_size)
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    # the checkpoint's load-balancing loss weight (transformers' default 0.001)
    router_aux_loss_coef: float = 0.0
    hf_config: dict = field(default_factory=dict, repr=False)  # the original config.json, for saving

    def __post_init__(self):
        if self.architecture not in MODEL_TYPES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; nanodapo supports "
                             f"{', '.join(MODEL_TYPES)}")
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = self.architecture == "Qwen2ForCausalLM"
        self.qk_norm = self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        # experts: Qwen3-MoE always has them, and no other architecture does
        moe_architecture = self.architecture == "Qwen3MoeForCausalLM"
        moe_fields_valid = (1 <= self.num_experts_per_tok <= self.num_experts
                            and self.moe_intermediate_size > 0 and self.decoder_sparse_step > 0)
        if moe_architecture != (self.num_experts > 0) or (self.num_experts and not moe_fields_valid):
            raise ValueError(f"{self.architecture} with num_experts={self.num_experts}, "
                             f"num_experts_per_tok={self.num_experts_per_tok}, "
                             f"moe_intermediate_size={self.moe_intermediate_size}, "
                             f"decoder_sparse_step={self.decoder_sparse_step}: Qwen3MoeForCausalLM, and only "
                             "it, needs num_experts >= num_experts_per_tok >= 1, moe_intermediate_size and "
                             "decoder_sparse_step >= 1; fix config.json")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}: grouped-query attention "
                             "shares each kv head among an equal number of query heads; fix config.json")

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Read an HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters`)."""
        arch = (d.get("architectures") or [None])[0]
        if arch is None:  # a config saved without a model: fall back on model_type
            arch = {t: a for a, t in MODEL_TYPES.items()}.get(d.get("model_type"), d.get("model_type"))
        if arch not in MODEL_TYPES:  # before any other key is read
            raise ValueError(f"unsupported architecture {arch!r} in config.json; nanodapo supports "
                             f"{', '.join(MODEL_TYPES)}")
        if d.get("hidden_act", "silu") != "silu" or d.get("mlp_bias", False):
            raise ValueError(f"unsupported MLP (hidden_act={d.get('hidden_act')}, "
                             f"mlp_bias={d.get('mlp_bias')}); nanodapo implements SwiGLU with silu and no "
                             "MLP bias")
        if d.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported; nanodapo uses full attention in "
                             "every layer")
        # transformers 5 keeps rope_theta, and the scaling fields if any, in rope_parameters
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if not scaling:  # no transformers 4 rope_scaling: rope_parameters says whether there is scaling
            scaling = None
            if rope.get("rope_type", "default") != "default":
                scaling = rope
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"unsupported rope scaling {kind!r}; nanodapo supports none or 'llama3'")
        moe = {}
        if arch == "Qwen3MoeForCausalLM":  # defaults: transformers' Qwen3MoeConfig
            # the expert count is num_experts in the published configs, num_local_experts in transformers 5
            if "num_local_experts" in d:
                num_experts = d["num_local_experts"]
            else:
                num_experts = d["num_experts"]
            moe = dict(num_experts=num_experts, num_experts_per_tok=d["num_experts_per_tok"],
                       moe_intermediate_size=d["moe_intermediate_size"],
                       norm_topk_prob=d.get("norm_topk_prob", False),
                       decoder_sparse_step=d.get("decoder_sparse_step", 1),
                       mlp_only_layers=list(d.get("mlp_only_layers") or []),
                       router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001))
        return cls(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta, rope_scaling=scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or d.get("attention_bias", False),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"), hf_config=dict(d), **moe)

    def to_hf(self, dtype: torch.dtype) -> dict:
        """An HF config.json dict that transformers and vLLM load."""
        # the fields written from this config, named as in config.json
        keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id"]
        d = dict(self.hf_config)
        d.pop("rope_parameters", None)  # rope_theta/rope_scaling are read by transformers 4 and 5
        if self.architecture != "Qwen2ForCausalLM":
            keys.append("attention_bias")
        if self.num_experts:
            # written as num_experts, as in the published configs (transformers 5 reads it as
            # num_local_experts)
            d.pop("num_local_experts", None)
            keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                     "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"]
        d.update(architectures=[self.architecture], model_type=MODEL_TYPES[self.architecture],
                 hidden_act="silu", torch_dtype=str(dtype).removeprefix("torch."),
                 **{k: getattr(self, k) for k in keys})
        return d

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has the sparse MLP (the rule of transformers' Qwen3MoeDecoderLayer)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def num_params(self, experts_per_token: int | None = None) -> int:
        """All parameters (counted on the meta device); with experts_per_token = k, those one token uses (k
        experts of each MoE layer)."""
        key = repr(self)  # every field but hf_config; building a large model, even on meta, takes a while
        if key not in _PARAM_COUNTS:
            with torch.device("meta"):
                _PARAM_COUNTS[key] = sum(p.numel() for p in Transformer(self).parameters())
        n = _PARAM_COUNTS[key]
        unused = 0 if experts_per_token is None else self.num_experts - experts_per_token
        moe_layers = sum(map(self.is_moe_layer, range(self.num_hidden_layers)))
        return n - unused * moe_layers * 3 * self.hidden_size * self.moe_intermediate_size

    def num_active_params(self) -> int:
        """Parameters used per token: num_params() for a dense model, top-k experts per MoE layer
        otherwise."""
        return self.num_params(experts_per_token=self.num_experts_per_tok)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies in fp32, with Llama-3 frequency-dependent scaling when configured."""
    # device="cpu": the model may be built under torch.device("meta"), and these must be real numbers
    exponents = torch.arange(0, cfg.head_dim, 2, device="cpu").double() / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** exponents
    s = cfg.rope_scaling
    if s is not None:  # llama3: keep high frequencies, divide low ones by factor, interpolate between
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D]; cos/sin [..., T, 1, D/2] (HF's rotate-half convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


# -----------------------------------------------------------------------------
# attention: the one place that chooses a kernel

@dataclass
class AttnBatch:
    """How the tokens of one forward attend to each other; built once, shared by every layer:
    padded  ([B, T], nothing set): causal within each row.
    packed  (cu_seqlens): one flat row of documents, causal within each document only.
    decode  (kv_cache + cache_pos): one new token per row, attending to that row's cache up to cache_pos.
    sequence parallel (cu_seqlens + sp_group): packed, each rank of sp_group holding 1/sp of the tokens."""
    cu_seqlens: torch.Tensor | None = None  # int32 [docs + 1] document boundaries of a packed row
    cu_seqlens_list: list | None = None  # the same on the host (torch_npu's kernel takes host lengths)
    max_seqlen: int = 0
    # packed, documents of one length (a micro-batch of one sequence, say): attend with SDPA on them as a
    # [docs, length] batch, a view of the row, instead of flash varlen (set when packing: equal_lengths)
    equal_docs: bool = False
    kv_cache: list | None = None  # per layer (k, v), each [>= rows, kv_heads, >= cache_len, head_dim]
    cache_pos: torch.Tensor | None = None  # [rows] position the new token is written at
    cache_len: int = 0  # attend over cache[:, :, :cache_len]
    collect_kv: list | None = None  # prefill: per layer (k, v) [tokens, kv_heads, head_dim] is appended here
    sp_group: object = None  # process group of a sequence-parallel packed forward (see split_for_sp)
    # decode, built here once for all layers: row r sees its cache positions <= cache_pos[r], through
    # SDPA's [rows, 1, 1, cache_len] mask, or (flash varlen, see decode_attention) sequences
    # 0..rows * kv_heads, their offsets in the cache and their counts of live keys
    decode_mask: torch.Tensor | None = field(default=None, repr=False)
    decode_seqs: torch.Tensor | None = field(default=None, repr=False)
    decode_cu_k: torch.Tensor | None = field(default=None, repr=False)
    decode_lens: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.cache_pos is None:
            return
        k_cache, device = self.kv_cache[0][0], self.cache_pos.device
        if decode_kernel(device.type, k_cache.dtype) == "varlen":
            rows, (kv_heads, positions) = self.cache_pos.shape[0], k_cache.shape[1:3]
            self.decode_seqs = torch.arange(rows * kv_heads + 1, dtype=torch.int32, device=device)
            self.decode_cu_k = self.decode_seqs * positions
            self.decode_lens = (self.cache_pos + 1).to(torch.int32).repeat_interleave(kv_heads)
        else:
            pos = torch.arange(self.cache_len, device=device)
            self.decode_mask = pos.view(1, 1, 1, -1) <= self.cache_pos.view(-1, 1, 1, 1)


def _varlen_available(device_type: str) -> bool:
    return device_type == "cuda" and varlen_attn is not None


def equal_lengths(lens: list[int]) -> bool:
    """Documents of one length: SDPA takes them as a batch, a view of the packed row. On one H100 and one H200,
    SDPA's kernel ran a 16k document's forward + backward 1.6-1.9x as fast as flash varlen with the keys
    repeated for GQA (bench/attention.py)."""
    return len(set(lens)) == 1


def packed_kernel(device_type: str, dtype: torch.dtype, equal_docs: bool = False) -> str:
    """The kernel for packed documents: "npu" (torch_npu's fused attention, which takes fp16, bf16 and
    fp32), "sdpa" (documents of one length, as a [docs, length] batch), "varlen" (torch's flash varlen on
    CUDA, half precision only), else "gather" (SDPA on the documents gathered into a padded batch: any
    device, any dtype)."""
    if device_type == "npu":
        return "npu"
    if equal_docs:
        return "sdpa"
    if dtype in (torch.float16, torch.bfloat16) and _varlen_available(device_type):
        return "varlen"
    return "gather"


def decode_kernel(device_type: str, dtype: torch.dtype) -> str:
    """The kernel for the decode step: "varlen" (torch's flash varlen with per-sequence key counts: CUDA, half
    precision, a torch that takes seqused_k), else "sdpa" (SDPA with a mask)."""
    if dtype in (torch.float16, torch.bfloat16) and device_type == "cuda" and _FLASH_SEQUSED_K:
        return "varlen"
    return "sdpa"


def flash_varlen_decode(q, k, v, cu_q, cu_k, max_q: int, max_k: int, seqused_k):
    """torch's flash varlen forward, not causal: the queries of sequence i, q[cu_q[i]:cu_q[i + 1]], attend to
    its first seqused_k[i] keys from cu_k[i] on."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
                                                   seqused_k=seqused_k)[0]


@functools.lru_cache
def _npu_causal_mask(device: torch.device) -> torch.Tensor:
    # sparse_mode=3 takes this fixed, compressed 2048 x 2048 mask (True = masked) for any sequence length
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)


def attention(q, k, v, batch: AttnBatch) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, KVH, D] -> [B, T, H, D]."""
    B, T, H, D = q.shape
    # a Python bool, as SDPA takes. Where a compiled block's head counts are symbolic (FSDP's unsharded
    # parameters are graph inputs), H != KVH is a SymBool, which SDPA refuses: the graph broke there. The branch
    # makes torch.compile decide it (a guard on the head counts) and pass a constant
    gqa = True if H != k.shape[2] else False
    if batch.cu_seqlens is None:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2)
    kernel = packed_kernel(q.device.type, q.dtype, batch.equal_docs)  # packed documents (B == 1)
    if kernel == "sdpa":  # documents of one length: the [docs, length] batch is a view (no gather or scatter)
        docs, L = batch.cu_seqlens.shape[0] - 1, batch.max_seqlen
        q_docs, k_docs, v_docs = (t[0].view(docs, L, *t.shape[2:]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_docs, k_docs, v_docs, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(1, T, H, D)
    if kernel == "varlen":
        if gqa:  # varlen_attn wants equal heads
            k, v = (t.repeat_interleave(H // k.shape[2], dim=2) for t in (k, v))
        cu = batch.cu_seqlens.to(torch.int32)
        out = varlen_attn(q[0], k[0], v[0], cu, cu, batch.max_seqlen, batch.max_seqlen, **_VARLEN_CAUSAL)
        return out.unsqueeze(0)
    if kernel == "npu":  # TND layout, GQA native, lengths as cumulative ends ([2, 4, 6] for 2, 2, 2)
        import torch_npu
        ends = batch.cu_seqlens_list[1:]
        out = torch_npu.npu_fusion_attention(
            q[0], k[0], v[0], H, "TND", atten_mask=_npu_causal_mask(q.device), scale=D ** -0.5, sparse_mode=3,
            actual_seq_qlen=ends, actual_seq_kvlen=ends)[0]
        return out.unsqueeze(0)
    # no varlen kernel (CPU, fp32): SDPA on the documents gathered into a right-padded [docs, max_len] batch
    # (causal, so no real token sees the padding); index maps without boolean masks, so a compiled block has a
    # static graph
    cu, L = batch.cu_seqlens.long().to(q.device), batch.max_seqlen
    tok = torch.arange(T, device=q.device)
    doc = torch.bucketize(tok, cu[1:], right=True)  # each token's document
    idx = (cu[:-1, None] + torch.arange(L, device=q.device)).clamp(max=T - 1)  # token in each [docs, L] slot
    back = doc * L + tok - cu[doc]  # slot of each token
    q_docs, k_docs, v_docs = (t[0][idx].transpose(1, 2) for t in (q, k, v))  # [docs, heads, L, D]
    out = F.scaled_dot_product_attention(q_docs, k_docs, v_docs, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(0, 1)[back].unsqueeze(0)


def decode_attention(q, k_cache, v_cache, batch: AttnBatch) -> torch.Tensor:
    """q [B, 1, H, D], one new token per row, against that row's cache positions <= cache_pos. The cache
    comes whole and is sliced here (rows :B, positions :cache_len): a compiled block then sees no views of
    it."""
    B, _, H, D = q.shape
    L, kv_heads = batch.cache_len, k_cache.shape[1]
    group = H // kv_heads  # the query heads that share a kv head
    if batch.decode_lens is not None:
        # flash varlen, each (row, kv head) one sequence: its group's heads are the sequence's queries, and
        # the cache, [rows, kv_heads, positions, D] and contiguous, already lays out their keys one after
        # another; decode_lens keys of each are live. No mask to read, no copy of the cache, and GQA's shared
        # keys are read once per group.
        n, positions = B * kv_heads, k_cache.shape[2]
        out = flash_varlen_decode(q.reshape(n * group, 1, D), k_cache[:B].view(n * positions, 1, D),
                                  v_cache[:B].view(n * positions, 1, D), batch.decode_seqs * group,
                                  batch.decode_cu_k, group, L, batch.decode_lens)
        return out.view(B, 1, H, D)
    # GQA without copying the cache: the heads sharing a kv head become that head's query rows
    q = q.view(B, kv_heads, group, D)
    out = F.scaled_dot_product_attention(q, k_cache[:B, :, :L], v_cache[:B, :, :L],
                                         attn_mask=batch.decode_mask)
    return out.reshape(B, 1, H, D)


# -----------------------------------------------------------------------------
# sequence parallelism (DeepSpeed-Ulysses, as verl's): each rank of an SP group embeds and runs norms, MLP
# and projections on a contiguous 1/sp of the packed tokens; around attention, all-to-alls trade that for all
# tokens and 1/sp of the heads, so the packed kernels above run unchanged. The query heads of a TP rank must
# divide by sp.

def split_for_sp(input_ids, position_ids, target_ids, routed_experts, batch: AttnBatch, group):
    """The full packed row (the same on every SP rank) -> this rank's contiguous slice of each [1, T, ...]
    tensor, and an AttnBatch for the whole row padded to a multiple of sp. The padding is one extra document,
    so it attends only to itself and real tokens never see it; its outputs are dropped after the gather."""
    sp, rank, T = group.size(), torch.distributed.get_rank(group), input_ids.shape[1]
    pad = -T % sp
    cu, cu_list = batch.cu_seqlens, batch.cu_seqlens_list
    if pad:
        input_ids, target_ids = F.pad(input_ids, (0, pad)), F.pad(target_ids, (0, pad), value=IGNORE_INDEX)
        if routed_experts is not None:  # [1, T, layers, k]
            routed_experts = F.pad(routed_experts, (0, 0, 0, 0, 0, pad))
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
        cu, cu_list = torch.cat([cu, cu.new_tensor([T + pad])]), cu_list + [T + pad]
    n = (T + pad) // sp
    mine = slice(rank * n, (rank + 1) * n)
    input_ids, position_ids, target_ids = input_ids[:, mine], position_ids[:, mine], target_ids[:, mine]
    if routed_experts is not None:
        routed_experts = routed_experts[:, mine]
    lens = [b - a for a, b in zip(cu_list, cu_list[1:])]
    whole_row = AttnBatch(cu_seqlens=cu, cu_seqlens_list=cu_list, max_seqlen=max(batch.max_seqlen, pad),
                          equal_docs=equal_lengths(lens), sp_group=group)
    return input_ids, position_ids, target_ids, routed_experts, whole_row


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0. Backward keeps this rank's slice and does not sum: every SP rank computes the
    same loss from the gathered values, so each back-propagates only through its own tokens, and FSDP's
    gradient reduction over the SP ranks adds those parts up."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.group.size())[torch.distributed.get_rank(ctx.group)], None


def ulysses_attention(q, k, v, batch: AttnBatch) -> torch.Tensor:
    """q [1, n, H, D], k/v [1, n, KVH, D] on this rank's n tokens -> [1, n, H, D], attending over the whole
    row."""
    group = batch.sp_group
    sp, H = group.size(), q.shape[2]
    if k.shape[2] % sp:
        # the kv heads (of this TP rank) do not split over sp: repeat each to lcm(kv heads, sp) heads, so that
        # query head i still reads the copies of kv head i // (H / kv heads)
        k, v = (t.repeat_interleave(math.lcm(t.shape[2], sp) // t.shape[2], dim=2) for t in (k, v))
    kvh = k.shape[2]
    # one differentiable all-to-all for q, k and v: this rank's n tokens, every head -> every token, 1/sp of
    # the heads
    qkv = torch.cat([t[0].unflatten(1, (sp, -1)) for t in (q, k, v)], dim=2).transpose(0, 1).contiguous()
    qkv = all_to_all_single_autograd(qkv, None, None, group).flatten(0, 1)
    q, k, v = (t.contiguous()[None] for t in qkv.split([H // sp, kvh // sp, kvh // sp], dim=1))
    # and back: the attention output of every token for 1/sp of the heads -> this rank's tokens, every head
    y = all_to_all_single_autograd(attention(q, k, v, batch)[0].contiguous(), None, None, group)
    return y.unflatten(0, (sp, -1)).transpose(0, 1).flatten(1, 2)[None]


# -----------------------------------------------------------------------------
# modules (names follow HF so state dicts match)

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.grad_sum_group = None  # set by tensor parallelism on per-head norms (each rank sees some heads)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight if self.grad_sum_group is None else _SumGrad.apply(self.weight, self.grad_sum_group)
        return w * xf.to(x.dtype)


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group (a replicated weight used on
    disjoint shards of the heads gets a partial gradient on each rank)."""
    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


def fuse_parameters(module: nn.Module, buffer: str, projs, attr: str):
    """The projections' `attr` tensors (weight or bias) concatenated into module's buffer `buffer` (not
    saved), each projection's parameter becoming its slice of it: one matmul reads them all, and copying into
    a parameter (as load_weights does) fills the fused tensor."""
    with torch.no_grad():
        fused = torch.cat([getattr(p, attr) for p in projs])
        module.register_buffer(buffer, fused, persistent=False)
        for p, piece in zip(projs, fused.split([p.out_features for p in projs])):
            setattr(p, attr, nn.Parameter(piece, requires_grad=False))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qkv_sizes = None  # fuse_qkv: the q, k and v rows of its one weight

    def fuse_qkv(self):
        """One [q; k; v] weight (and bias) of which q_proj, k_proj and v_proj's parameters become slices: one
        matmul instead of three (a decode step's three are mostly launch latency). For a module that is not
        trained (a rollout engine's copy); copying into the parameters, as load_weights does, fills it."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_sizes = [p.out_features for p in projs]
        fuse_parameters(self, "qkv_weight", projs, "weight")
        if self.q_proj.bias is not None:
            fuse_parameters(self, "qkv_bias", projs, "bias")
        else:
            self.qkv_bias = None

    def forward(self, x, cos, sin, batch: AttnBatch, kv_cache=None):
        """kv_cache: decode: this layer's (k, v) cache, a tuple; prefill: a list that receives its new
        (k, v)."""
        B, T, _ = x.shape
        # -1: under tensor parallelism a rank holds a slice of the heads
        if self.qkv_sizes is not None:  # fused (fuse_qkv)
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
            q, k, v = (t.view(B, T, -1, self.hd) for t in qkv.split(self.qkv_sizes, dim=-1))
        else:
            q, k, v = (proj(x).view(B, T, -1, self.hd) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(kv_cache, tuple):  # decode: write the new token's k/v at each row's position
            rows = torch.arange(B, device=x.device)
            for cache, new in zip(kv_cache, (k, v)):
                cache[rows, :, batch.cache_pos] = new[:, 0]
            y = decode_attention(q, *kv_cache, batch)
        else:
            if kv_cache is not None:
                # prefill: a fresh list per layer (not one shared by all layers), so that a compiled block
                # sees the same input each time
                kv_cache.append((k[0], v[0]))
            if batch.sp_group is not None:  # sequence parallel: this rank holds 1/sp of the row's tokens
                y = ulysses_attention(q, k, v, batch)
            else:
                y = attention(q, k, v, batch)
        return self.o_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused_gate_up = False  # fuse_gate_up: [gate; up] in one weight, gate_up_weight

    def fuse_gate_up(self):
        """One [gate; up] weight of which gate_proj and up_proj's weights become slices: one matmul instead of
        two. For a module that is not trained (a rollout engine's copy), like fuse_qkv."""
        fuse_parameters(self, "gate_up_weight", (self.gate_proj, self.up_proj), "weight")
        self.fused_gate_up = True

    def forward(self, x):
        if self.fused_gate_up:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _grouped_mm_dtype(x: torch.Tensor) -> torch.dtype | None:
    """bf16 when the experts should run as torch._grouped_mm (CUDA, bf16 inputs or autocast), else None."""
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return None
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return dtype if dtype == torch.bfloat16 else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


class Experts(nn.Module):
    """num_experts SwiGLU MLPs, stacked: gate_up_proj [E, 2 * I, H] (each expert's gate rows, then its up
    rows) and down_proj [E, H, I]. One parameter per projection, so FSDP (and expert parallelism) shard along
    experts."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x, ends):
        """x [N, H], rows sorted by expert; ends [E]: cumulative row counts (expert e has rows
        ends[e-1]:ends[e]) -> [N, H], each row through its expert."""
        # under expert parallelism the stacks are DTensors and ends counts this rank's experts only
        w13, w2 = _local(self.gate_up_proj), _local(self.down_proj)
        dtype = _grouped_mm_dtype(x)
        if dtype is not None:  # one grouped GEMM per projection, no host sync
            offs = ends.to(torch.int32)
            gate, up = torch._grouped_mm(x.to(dtype), w13.to(dtype).transpose(1, 2), offs=offs).chunk(2, -1)
            return torch._grouped_mm(F.silu(gate) * up, w2.to(dtype).transpose(1, 2), offs=offs)
        # other devices and dtypes: a loop over every expert, even one without rows, so that every rank's
        # stacks get a gradient (FSDP)
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
        out = []
        for e, xe in enumerate(x.split(counts)):
            gate, up = F.linear(xe, w13[e]).chunk(2, -1)
            out.append(F.linear(F.silu(gate) * up, w2[e]))
        return torch.cat(out)


class MoE(nn.Module):
    """Qwen3-MoE's sparse MLP: the router (`gate`) picks each token's top-k experts by softmax probability
    (fp32); the token's output is the sum of their outputs weighted by those probabilities (renormalized to
    sum to 1 when norm_topk_prob). Every expert computes, so nothing is dropped."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x, router_loads: list | None = None, routed=None):
        """routed: router replay, each token's k experts as the rollout engine chose them (any integer
        dtype)."""
        shape, E = x.shape, self.gate.weight.shape[0]
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        if routed is None:
            weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k]
        else:  # weighted by this router's probabilities, so the router still gets gradients
            experts = routed.reshape(-1, self.top_k).long()
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if router_loads is not None:
            router_loads.append(router_load(probs, experts))
        order = experts.flatten().argsort(stable=True)  # (token, k) slots grouped by expert
        ends = torch.searchsorted(experts.flatten()[order], torch.arange(E, device=x.device), right=True)
        y = self.experts(x[order // self.top_k], ends)
        y = torch.zeros_like(y).index_copy(0, order, y).view(-1, self.top_k, shape[-1])  # back to token order
        return (y * weights.to(y.dtype)[..., None]).sum(1).view(shape)


def router_load(probs, experts) -> torch.Tensor:
    """One MoE layer's router statistics over its tokens, fp32 [2, E]: row 0 = how many tokens picked each
    expert among their top-k (experts [N, k]), row 1 = the sum of the router probabilities (probs [N, E]) per
    expert."""
    picks = torch.zeros_like(probs[0]).index_add_(0, experts.flatten(), probs.new_ones(experts.numel()))
    return torch.stack([picks, probs.sum(0)])


def load_balancing_loss(router_loads: list, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers computes it (load_balancing_loss_func, no padding):
    over all tokens of all MoE layers, E * sum_e f_e * P_e with f_e = top-k picks of expert e / tokens and
    P_e = mean router probability of e. 1 x top_k when routing is uniform. Gradients reach the routers
    through P."""
    total = torch.stack(router_loads).sum(0)
    tokens = total[0].sum() / top_k
    return total.shape[1] * (total[0] / tokens * total[1] / tokens).sum()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    # the caller picks the layer's cache: no layer index inside, so all blocks of a kind share one compiled
    # graph
    def forward(self, x, cos, sin, batch: AttnBatch, kv_cache=None, router_loads=None, routed=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):  # router statistics and router replay concern MoE layers only
            return x + self.mlp(h, router_loads, routed)
        return x + self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, cfg.is_moe_layer(i))
                                          for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            # no lm_head module at all (HF checkpoints omit it too); logits use embed_tokens.weight
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # activation checkpointing: every block (True), none (False), or the first N blocks (an int)
        self.gradient_checkpointing = False
        # the log-prob head's chunk function; None: the eager _chunk_logprob_entropy (apply_compile sets a
        # compiled one)
        self.logprob_chunk_fn = None
        # sequence parallelism, set by parallel.apply_sp: packed log-prob forwards split their tokens over it
        self.sp_group = None
        self.inv_freq = rope_inv_freq(cfg)  # fp32, a plain attribute so that .to(bf16) never rounds it

    def init_weights(self, std: float = 0.02, seed: int | None = None):
        """Random init (tests, benchmarks, the demo's warm start): normal(0, std), zero biases, unit norms."""
        g = None  # None: torch's default generator
        if seed is not None:
            g = torch.Generator(device=self.output_weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
                elif name.endswith("norm.weight"):  # RMSNorm
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=g)
        return self

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, position_ids=None, batch: AttnBatch | None = None, *, target_ids=None,
                temperature: float = 1.0, with_entropy: bool | str = False, logprob_chunk: int = 1024,
                logits_at: torch.Tensor | None = None, router_loads: list | None = None,
                routed_experts: torch.Tensor | None = None):
        """input_ids [B, T] -> logits [B, T, vocab] (padded path), or with target_ids [B, T] ->
        (log p(target), entropy or None), each [B, T] in fp32, computed in chunks of logprob_chunk tokens.
        A target of IGNORE_INDEX (a prompt's own tokens) skips the head: its log-prob and entropy are 0.
        Packed path: B = 1, position_ids [1, T] restart at 0 per document, batch.cu_seqlens marks documents.
        logits_at: flat token indices -> logits only there, [len(logits_at), vocab] (generation's last
            tokens).
        router_loads: a list each MoE layer appends its router_load of this forward's (this SP rank's)
            tokens to.
        routed_experts [B, T, layers, top_k]: router replay, the experts each MoE layer sends each token to.
        With self.sp_group set, a packed forward with target_ids is sequence parallel: every rank passes the
        same row, computes 1/sp of it and gets the whole row's outputs."""
        batch = batch or AttnBatch()
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        # sequence parallel: only a packed forward that computes log-probs (target_ids) splits its tokens
        sp_group = self.sp_group if target_ids is not None and batch.cu_seqlens is not None else None
        if sp_group is not None:
            input_ids, position_ids, target_ids, routed_experts, batch = split_for_sp(
                input_ids, position_ids, target_ids, routed_experts, batch, sp_group)
        head_at = None  # positions the head computes; nonzero() waits for the GPU, so before the blocks
        if target_ids is not None:
            head_at = (target_ids.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
        if self.inv_freq.device != input_ids.device:  # moved once (not inside a CUDA-graph capture)
            self.inv_freq = self.inv_freq.to(input_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, D/2]
        cos, sin = freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]
        x = self.model.embed_tokens(input_ids)
        # how many blocks, from the first, recompute their activations in backward (activation checkpointing)
        if not torch.is_grad_enabled():
            n_ckpt = 0  # no backward will follow
        elif self.gradient_checkpointing is True:
            n_ckpt = len(self.model.layers)  # every block
        else:
            n_ckpt = int(self.gradient_checkpointing)  # the first N blocks; False: none
        for i, layer in enumerate(self.model.layers):
            if batch.kv_cache is not None:
                kv_cache = batch.kv_cache[i]  # decode: this layer's (k, v) cache, which the new token joins
            elif batch.collect_kv is not None:
                kv_cache = []  # prefill: a fresh list that receives this layer's (k, v), collected below
            else:
                kv_cache = None  # a plain forward (training, log-probs): no cache
            # router statistics go into an empty list per layer: FSDP rebuilds containers that hold tensors
            # needing grad before a block runs, and a recompute's appends land in it, not in the caller's list
            layer_loads = None if router_loads is None else []
            routed = None if routed_experts is None else routed_experts[:, :, i]
            args = (x, cos, sin, batch, kv_cache, layer_loads, routed)
            if i < n_ckpt:
                x = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
            if layer_loads is not None:
                router_loads.extend(layer_loads)
            if batch.collect_kv is not None:
                batch.collect_kv.extend(kv_cache)
        h = self.model.norm(x)
        if logits_at is not None:
            return F.linear(h.flatten(0, 1)[logits_at], self.output_weight)
        if target_ids is None:
            return F.linear(h, self.output_weight)
        # computed here (inside forward) so FSDP has the output weight unsharded. Compiled, with every block's
        # activations kept (no checkpointing), the head keeps its bf16 logits too instead of recomputing them
        keep_logits = not self.gradient_checkpointing and self.logprob_chunk_fn is not None
        logp, ent = token_logprobs_and_entropy(h.flatten(0, 1), self.output_weight, target_ids.flatten(),
                                               temperature, logprob_chunk, with_entropy,
                                               self.logprob_chunk_fn, recompute=not keep_logits, at=head_at)
        if sp_group is not None:  # every rank gets the whole row (padding dropped), hence the same loss
            logp = _GatherTokens.apply(logp, sp_group)[:T]
            if ent is not None:
                ent = _GatherTokens.apply(ent, sp_group)[:T]
        if ent is not None:
            ent = ent.view(B, T)
        return logp.view(B, T), ent


# -----------------------------------------------------------------------------
# token log-probs and entropy, without [tokens, vocab] in fp32 for the whole batch

def _chunk_logprob_entropy(h, weight, targets, temperature: float, with_entropy: bool | str):
    logits = (h @ weight.t()).float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    if with_entropy == "detached":
        # a metric: no graph, which would hold each chunk's logits to the end of backward
        logits, lse = logits.detach(), lse.detach()
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # H = logsumexp(z) - sum softmax(z) z
    return logp, entropy


def token_logprobs_and_entropy(hidden, weight, target_ids, temperature: float = 1.0, chunk: int = 1024,
                               with_entropy: bool | str = False, chunk_fn=None, recompute: bool = True,
                               at: torch.Tensor | None = None):
    """hidden [N, H], lm_head weight [V, H], target_ids [N] -> (logp [N], entropy [N] or None), fp32, of
    logits / temperature (what the rollout engines sample from). Under autograd each chunk is recomputed in
    backward (recompute=True), so only one chunk of fp32 logits exists at any time; recompute=False keeps
    what backward needs of every chunk (compiled: the bf16 logits, 2 bytes a token and vocabulary entry).
    with_entropy="detached": the entropy without a gradient. chunk_fn: _chunk_logprob_entropy or a compiled
    copy of it. at: the positions to compute (None: all); the others get 0."""
    if at is not None and at.numel() < hidden.shape[0]:
        # no position kept: one runs anyway, times 0, so that backward still reaches every parameter (and
        # sequence parallelism's collectives) on this rank
        none = at.numel() == 0
        idx = at.new_zeros(1) if none else at
        logp, ent = token_logprobs_and_entropy(hidden[idx], weight, target_ids[idx].clamp(min=0), temperature,
                                               chunk, with_entropy, chunk_fn, recompute)
        if none:
            logp, ent = logp * 0, (ent * 0 if ent is not None else None)

        def spread(v):  # [len(idx)] -> [N], 0 where not computed
            return v.new_zeros(hidden.shape[0]).index_copy(0, idx, v)
        return spread(logp), (spread(ent) if ent is not None else None)
    fn = chunk_fn or _chunk_logprob_entropy
    if recompute and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        fn = functools.partial(torch.utils.checkpoint.checkpoint, fn, use_reentrant=False)
    parts = []  # (logp, entropy or None) per chunk
    for s in range(0, hidden.shape[0], chunk):
        parts.append(fn(hidden[s:s + chunk], weight, target_ids[s:s + chunk], temperature, with_entropy))
    if not parts:  # no tokens
        return hidden.new_zeros(0, dtype=torch.float32), None
    logp = torch.cat([lp for lp, _ in parts])
    entropy = torch.cat([ent for _, ent in parts]) if with_entropy else None
    return logp, entropy


def pack_sequences(seqs: list[list[int]], device=None):
    """Documents -> (input_ids [1, N], position_ids [1, N], AttnBatch with cu_seqlens) for the packed path."""
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)[None]
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)[None]
    cu = list(itertools.accumulate(lens, initial=0))  # document boundaries: [0, len0, len0 + len1, ...]
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    return ids, pos, AttnBatch(cu_seqlens=cu_seqlens, cu_seqlens_list=cu, max_seqlen=max(lens),
                               equal_docs=equal_lengths(lens))
