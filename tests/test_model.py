"""model.py against transformers (a test-only reference) and float64 hand computations."""

import pytest
import torch

import hf
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
    ours = hf.from_pretrained(str(path), dtype=torch.float32)
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
    ours = hf.from_pretrained(str(path), dtype=torch.float32)
    docs = [torch.randint(0, 97, (n,)).tolist() for n in (5, 17, 1, 9)]
    ids, pos, batch = M.pack_sequences(docs)
    with torch.no_grad():
        packed = ours(ids, pos, batch)[0]
        alone = torch.cat([ours(torch.tensor([d]))[0] for d in docs])
    assert (packed - alone).abs().max().item() <= 1e-5


def test_save_pretrained_round_trips_through_transformers(hf_dir, tmp_path_factory):
    _, ref, path = hf_dir
    ours = hf.from_pretrained(str(path), dtype=torch.float32)
    out = tmp_path_factory.mktemp("saved")
    hf.save_pretrained(ours, str(out), max_shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        assert (back(ids).logits - ref(ids).logits).abs().max().item() <= 1e-5
    again = hf.from_pretrained(str(out), dtype=torch.float32)  # and we read our own output
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


def test_detached_entropy_is_the_same_value_and_keeps_nothing_for_backward():
    torch.manual_seed(2)
    h = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    t = torch.randint(0, 30, (20,))
    saved = []  # what autograd keeps for backward: the recomputed chunk's logits would be the big ones
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        logp, ent = M._chunk_logprob_entropy(h, w, t, 1.0, "detached")
    _, ent_grad = M._chunk_logprob_entropy(h, w, t, 1.0, True)
    assert not ent.requires_grad and torch.equal(ent, ent_grad.detach())
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(-x.numel()) or x, lambda x: x):
        M._chunk_logprob_entropy(h, w, t, 1.0, True)
    kept_detached = sum(n for n in saved if n > 0)
    kept_with_grad = -sum(n for n in saved if n < 0)
    assert kept_with_grad - kept_detached >= 2 * 20 * 30  # the entropy's softmax and logits are not kept
    logp.sum().backward()  # the log-probs keep theirs: d log p_t / dz = onehot(t) - softmax(z), z = h w^T
    hd, wd = h.detach().double(), w.detach().double()
    dz = torch.nn.functional.one_hot(t, 30).double() - torch.softmax(hd @ wd.t(), -1)
    assert (h.grad.double() - dz @ wd).abs().max() < 1e-5
    assert (w.grad.double() - dz.t() @ hd).abs().max() < 1e-5


@pytest.mark.slow  # torch.compile (Inductor)
def test_compiled_logprob_head_matches_the_eager_one():
    """parallel.apply_compile's head (torch.compile of the chunk function; the CPU runs Inductor's C++ kernels):
    log-probs, entropy and gradients as the plain torch path, with a last chunk of another size."""
    torch.manual_seed(3)
    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (40,))
    compiled = torch.compile(M._chunk_logprob_entropy)
    outs = []
    for fn in (compiled, None):
        h.grad = w.grad = None
        logp, ent = M.token_logprobs_and_entropy(h, w, t, 0.7, 16, True, fn)
        (logp.sum() + 0.3 * ent.sum()).backward()
        outs.append([logp.detach(), ent.detach(), h.grad, w.grad])
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("with_entropy", [False, "detached", True])
def test_logprob_chunks_kept_or_recomputed_give_the_same_gradients(with_entropy):
    """recompute=False (a compiled head without checkpointing) keeps what backward needs instead of recomputing
    each chunk: the same log-probs, entropy and gradients."""
    torch.manual_seed(2)
    h = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (20,))
    outs = []
    for recompute in (True, False):
        logp, ent = M.token_logprobs_and_entropy(h, w, t, 0.7, 6, with_entropy, recompute=recompute)
        loss = logp.sum() + (ent.sum() if with_entropy is True else 0.0)
        loss.backward()
        outs.append((logp.detach(), None if ent is None else ent.detach(), h.grad.clone(), w.grad.clone()))
        h.grad = w.grad = None
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("with_entropy", [False, "detached", True])
def test_logprob_head_skips_ignored_targets(with_entropy, recompute):
    """at (the positions whose target is not IGNORE_INDEX): the same log-probs, entropy and gradients as the
    whole computation at those positions, 0 at the others, which add nothing to the gradients."""
    torch.manual_seed(3)
    h = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (20,))
    kept = torch.tensor([2, 3, 4, 9, 10, 11, 12, 19])
    t_ignored = torch.full_like(t, M.IGNORE_INDEX).index_copy(0, kept, t[kept])
    outs = []
    for targets, at in ((t, None), (t_ignored, (t_ignored != M.IGNORE_INDEX).nonzero().squeeze(1))):
        logp, ent = M.token_logprobs_and_entropy(h, w, targets, 0.7, 6, with_entropy, recompute=recompute,
                                                 at=at)
        lp, en = logp[kept], (None if ent is None else ent[kept])  # both read at the kept positions
        (lp.sum() + (en.sum() if with_entropy is True else 0.0)).backward()
        outs.append((lp.detach(), None if en is None else en.detach(), h.grad.clone(), w.grad.clone()))
        if at is not None:
            skipped = torch.ones(20, dtype=torch.bool).index_fill(0, kept, False)
            assert (logp[skipped] == 0).all() and (ent is None or (ent[skipped] == 0).all())
        h.grad = w.grad = None
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_logprob_head_with_no_target_kept_still_reaches_the_weights():
    """Every target ignored: log-probs 0, and backward still runs into the weights (zero gradients), so a rank
    whose share holds no response token joins the others' backward collectives."""
    h = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    t = torch.full((5,), M.IGNORE_INDEX)
    logp, ent = M.token_logprobs_and_entropy(h, w, t, chunk=4, with_entropy=True,
                                             at=(t != M.IGNORE_INDEX).nonzero().squeeze(1))
    assert (logp == 0).all() and (ent == 0).all()
    (logp.sum() + ent.sum()).backward()
    assert h.grad is not None and w.grad is not None
    assert (h.grad == 0).all() and (w.grad == 0).all()


def test_forward_skips_ignored_targets():
    """A forward whose first targets are IGNORE_INDEX (a prompt's own tokens) gives the same log-probs at the
    others as one that computes every position, and 0 at the ignored ones."""
    cfg = M.ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=40, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    m = M.Transformer(cfg).init_weights(seed=0).double()
    docs = [[int(x) for x in torch.randint(0, 40, (n,))] for n in (9, 6, 12)]
    prompt_lens = [4, 1, 7]
    ids, pos, batch = M.pack_sequences([d[:-1] for d in docs])
    full = torch.tensor([t for d in docs for t in d[1:]])[None]
    ignored = torch.tensor([t for d, p in zip(docs, prompt_lens)
                            for t in [M.IGNORE_INDEX] * (p - 1) + d[p:]])[None]
    with torch.no_grad():
        ref, ref_ent = m(ids, pos, batch, target_ids=full, with_entropy=True)
        logp, ent = m(ids, pos, batch, target_ids=ignored, with_entropy=True)
    kept = ignored != M.IGNORE_INDEX
    assert int(kept.sum()) == sum(len(d) - p for d, p in zip(docs, prompt_lens))
    assert torch.allclose(logp[kept], ref[kept], rtol=0, atol=1e-12)
    assert torch.allclose(ent[kept], ref_ent[kept], rtol=0, atol=1e-12)
    assert (logp[~kept] == 0).all() and (ent[~kept] == 0).all()


def test_forward_with_targets_equals_logits_path():
    cfg = M.ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=40, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    m = M.Transformer(cfg).init_weights(seed=0)
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        logits = m(ids)
        logp, ent = m(ids[:, :-1], target_ids=ids[:, 1:], temperature=1.3, with_entropy=True)
    log_q = torch.log_softmax(logits[:, :-1].double() / 1.3, -1)
    ref = log_q.gather(-1, ids[:, 1:, None])[..., 0]
    assert (logp.double() - ref).abs().max() < 1e-5
    ref_ent = -(log_q.exp() * log_q).sum(-1)  # the entropy at temperature 1.3
    assert (ent.double() - ref_ent).abs().max() < 1e-5


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


def test_checkpointing_the_first_n_blocks_recomputes_only_those(monkeypatch):
    cfg = M.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2)
    m = M.Transformer(cfg).init_weights(seed=0)
    ids = torch.randint(0, 40, (2, 10))
    m(ids).square().mean().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    calls = []
    for i, layer in enumerate(m.model.layers):
        monkeypatch.setattr(layer, "forward", lambda *a, f=layer.forward, i=i: calls.append(i) or f(*a))
    m.zero_grad()
    m.gradient_checkpointing = 2
    m(ids).square().mean().backward()
    assert calls == [0, 1, 2, 1, 0]  # forward of all three, then in backward the recompute of blocks 1 and 0 only
    for a, p in zip(ref, m.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)


def test_pack_sequences_marks_documents_of_one_length():
    """SDPA on a [docs, length] view replaces flash varlen only where every document has one length (one
    sequence a micro-batch, or responses that all ran to max_response_length): no padding, no gather."""
    assert M.equal_lengths([16640]) and M.equal_lengths([4352, 4352])
    assert not M.equal_lengths([4352, 4351])
    _, _, one = M.pack_sequences([[1] * 300])
    _, _, two = M.pack_sequences([[1] * 30, [2] * 30])
    _, _, mixed = M.pack_sequences([[1] * 300, [2] * 20, [3] * 5])
    assert one.equal_docs and two.equal_docs and not mixed.equal_docs


def test_attention_of_packed_documents_equals_sdpa_per_document():
    """The packed kernels the CPU runs, in float64 against SDPA called on each document alone: the [docs,
    length] view for documents of one length (one, two), the gathered padded batch for mixed lengths."""
    g = torch.Generator().manual_seed(0)
    for lens in ([37], [20, 20], [30, 3, 11]):
        T = sum(lens)
        q = torch.randn(1, T, 4, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(1, T, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        _, _, batch = M.pack_sequences([[0] * n for n in lens])
        out = M.attention(q, k, v, batch)
        ref, s = [], 0
        for n in lens:
            ref.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, s:s + n].transpose(1, 2), k[:, s:s + n].transpose(1, 2), v[:, s:s + n].transpose(1, 2),
                is_causal=True, enable_gqa=True).transpose(1, 2))
            s += n
        torch.testing.assert_close(out, torch.cat(ref, dim=1), rtol=1e-12, atol=1e-12)
