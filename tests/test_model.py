"""model.py against transformers (a test-only reference) and float64 hand computations."""
import json

import pytest
import torch

import model as M

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def hf_model(arch: str):
    torch.manual_seed(0)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
        m = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=True)
        m = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))
        m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF inits biases and norms to constants; randomize so they are tested too
        for name, p in m.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


@pytest.fixture(params=["qwen2", "qwen3", "llama"])
def hf_dir(request, tmp_path):
    m = hf_model(request.param)
    m.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards + index
    return request.param, m, tmp_path


def test_load_sharded_matches_transformers_logits(hf_dir):
    arch, ref, path = hf_dir
    assert (path / "model.safetensors.index.json").exists()
    ours = M.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.randint(0, TINY["vocab_size"], (3, 40))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    assert (got - expected).abs().max().item() <= 1e-4
    if arch == "llama":  # llama3 scaling must actually change the frequencies
        assert ours.config.rope_scaling["rope_type"] == "llama3"
        plain = M.rope_inv_freq(M.ModelConfig(**{**_cfg_kwargs(ours.config), "rope_scaling": None}))
        assert not torch.allclose(plain, ours.inv_freq)


def _cfg_kwargs(c):
    return {k: getattr(c, k) for k in c.__dataclass_fields__ if k != "hf_config"}


def test_packed_path_equals_each_document_alone(hf_dir):
    _, _, path = hf_dir
    ours = M.from_pretrained(str(path), dtype=torch.float32)
    docs = [torch.randint(0, 97, (n,)).tolist() for n in (5, 17, 1, 9)]
    ids, pos, batch = M.pack_sequences(docs)
    with torch.no_grad():
        packed = ours(ids, pos, batch)[0]
        alone = torch.cat([ours(torch.tensor([d]))[0] for d in docs])
    assert (packed - alone).abs().max().item() <= 1e-5


def test_save_pretrained_round_trips_through_transformers(hf_dir, tmp_path_factory):
    _, ref, path = hf_dir
    ours = M.from_pretrained(str(path), dtype=torch.float32)
    out = tmp_path_factory.mktemp("saved")
    M.save_pretrained(ours, str(out), max_shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        assert (back(ids).logits - ref(ids).logits).abs().max().item() <= 1e-5
    again = M.from_pretrained(str(out), dtype=torch.float32)  # and we read our own output
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_logprobs_and_entropy_match_float64_reference():
    torch.manual_seed(0)
    h, w = torch.randn(37, 16), torch.randn(50, 16)
    targets = torch.randint(0, 50, (37,))
    logp, ent = M.token_logprobs_and_entropy(h, w, targets, temperature=0.7, chunk=8, with_entropy=True)
    z = (h.double() @ w.double().t()) / 0.7
    p = torch.softmax(z, -1)
    ref_logp = torch.log(p[torch.arange(37), targets])
    ref_ent = -(p * torch.log(p)).sum(-1)  # textbook entropy, an independent formula
    assert (logp.double() - ref_logp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5


def test_logprob_gradients_match_unchunked():
    torch.manual_seed(1)
    h = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (20,))
    logp, ent = M.token_logprobs_and_entropy(h, w, t, chunk=6, with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    g_h, g_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    z = h @ w.t()
    ref = torch.log_softmax(z, -1)
    (ref[torch.arange(20), t].sum() - (ref.exp() * ref).sum()).backward()
    # the function works in fp32 inside a chunk by design, hence the fp32-level tolerance
    assert torch.allclose(g_h, h.grad, atol=1e-5) and torch.allclose(g_w, w.grad, atol=1e-5)


def test_forward_with_targets_equals_logits_path():
    cfg = M.ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=40, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    m = M.Transformer(cfg).init_weights(seed=0)
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        logits = m(ids)
        logp, ent = m(ids[:, :-1], target_ids=ids[:, 1:], temperature=1.3, with_entropy=True)
    ref = torch.log_softmax(logits[:, :-1].double() / 1.3, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (logp.double() - ref).abs().max() < 1e-5
    assert ent.shape == (2, 11)


def test_activation_checkpointing_gives_same_gradients():
    cfg = M.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    m = M.Transformer(cfg).init_weights(seed=0)
    ids = torch.randint(0, 40, (2, 10))
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        m.gradient_checkpointing = ckpt
        m(ids).square().mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="MistralForCausalLM.*Qwen2ForCausalLM"):
        M.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.from_pretrained(str(tmp_path / "nope"))


def test_shape_mismatch_and_missing_tensors_name_the_tensor(tmp_path):
    m = hf_model("qwen2")
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    with pytest.raises(ValueError, match="mlp.*shape mismatch|shape mismatch.*mlp"):
        M.from_pretrained(str(tmp_path), dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="lacks"):
        M.from_pretrained(str(tmp_path), dtype=torch.float32)


# -----------------------------------------------------------------------------
# tokenizer

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}\n"
    "    {%- if message.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + message.role) }}{% endif %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- endif %}\n{{- (messages | tojson) if false }}"
)


def make_tokenizer_dir(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 2+2? The answer is 4.", "Solve the problem step by step. Answer: 12"] * 20,
                            trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return fast


def test_tokenizer_matches_transformers(tmp_path):
    ref = make_tokenizer_dir(tmp_path)
    ours = M.Tokenizer.from_pretrained(str(tmp_path))
    text = "What is 12+30? Answer: 42 — ünïcode"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    ids = ref.encode(text, add_special_tokens=False) + [2]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]):
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
                ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(msgs, tokenize=True) == \
            ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.apply_chat_template(msgs, enable_thinking=False) == \
            ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert ours.eos_token_ids == [2, 0]  # eos_token first, then generation_config's extra ids
    with pytest.raises(Exception, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_without_template_is_a_clear_error(tmp_path):
    make_tokenizer_dir(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in tmp_path.glob("chat_template.jinja"):
        f.unlink()
    tok = M.Tokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
