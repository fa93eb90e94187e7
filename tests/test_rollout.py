"""The built-in engine against a naive full-recompute loop, the trainer's log-probs, and hand-computed
sampling distributions."""
import math

import pytest
import torch
from torch._dynamo.utils import counters

import model as M
import parallel
import rollout as R
from conftest import compile_unavailable


def tiny_model(seed=0, vocab=50, layers=2, architecture="Qwen2ForCausalLM"):
    cfg = M.ModelConfig(architecture=architecture, vocab_size=vocab, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    return M.Transformer(cfg).init_weights(seed=seed, std=0.3).eval()


def naive_greedy(m, prompt, max_tokens, stop):
    seq = list(prompt)
    for _ in range(max_tokens):
        with torch.no_grad():
            t = int(m(torch.tensor([seq]))[0, -1].argmax())
        seq.append(t)
        if t in stop:
            break
    return seq[len(prompt):]


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 11, 12], [10], [30, 31, 32, 33]]


@pytest.mark.parametrize("check_every", [1, 2, 5, 100])  # 100: finished rows decode on to the end
def test_greedy_equals_naive_loop_with_stops_and_compaction(monkeypatch, check_every):
    monkeypatch.setattr(R.TorchEngine, "finished_check_every", check_every)
    m = tiny_model()
    # pick stop tokens that the naive loop actually emits mid-way, so rows finish at different steps
    free = [naive_greedy(m, p, 12, stop=()) for p in PROMPTS]
    stop = {free[0][4], free[2][2]}
    expected = [naive_greedy(m, p, 12, stop) for p in PROMPTS]
    assert len({len(e) for e in expected}) > 1  # rows really finish at different steps
    params = R.SamplingParams(n=2, temperature=0, max_tokens=12, stop_token_ids=list(stop))
    for max_num_seqs in (16, 3):  # 3: several waves
        eng = R.TorchEngine(m, max_num_seqs=max_num_seqs)
        out = eng.generate(PROMPTS, params)
        for exp, comps in zip(expected, out):
            assert len(comps) == 2
            for c in comps:
                assert c.token_ids == exp
                assert c.finish_reason == ("stop" if exp[-1] in stop else "length")
                assert len(c.logprobs) == len(exp)
    # prompt 0's own budget ends it one token before its stop token, which it then decodes on to
    budgets = [len(expected[0]) - 1, 12, 12, 12]
    out = R.TorchEngine(m).generate(PROMPTS, params, max_tokens=budgets)
    for exp, comps, budget in zip(expected, out, budgets):
        for c in comps:
            assert c.token_ids == exp[:budget]
            assert c.finish_reason == ("stop" if len(exp) <= budget and exp[-1] in stop else "length")
    # paused after 8 tokens: rows that stopped before keep their ending, whether or not the host has looked
    asked = []
    paused = R.TorchEngine(m).generate(PROMPTS, params, should_pause=lambda: asked.append(1) or len(asked) > 8)
    for exp, comps in zip(expected, paused):
        for c in comps:
            if len(exp) <= 8 and exp[-1] in stop:
                assert (c.token_ids, c.finish_reason) == (exp, "stop")
            else:
                assert (c.token_ids, c.finish_reason) == (exp[:8], "abort")


def test_the_engines_pick_never_sees_one_row():
    """torch.compile specializes a size of 1: a single row is sampled with the eager pick, so a compiled engine
    does not compile a new sampler graph mid-run the first time one row is left (on an H200 that cost 0.8 s
    at step 21 of a 30-step run)."""
    eng = R.TorchEngine(tiny_model())
    seen = []
    eng.pick = lambda logits, *args: seen.append(logits.shape[0]) or R.gumbel_pick(logits, *args)
    sp = R.SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=0, ignore_eos=True)
    one = eng.generate([PROMPTS[0]], sp)  # one row from the prefill on
    assert len(one[0][0].token_ids) == 5 and seen == []
    eng.generate(PROMPTS[:2], sp)
    assert seen == [2] * 5  # the prefill's sample, then 4 decode steps


def test_a_stop_request_ends_generation_within_a_decode_step_and_a_false_one_changes_nothing():
    eng = R.TorchEngine(tiny_model(2), max_num_seqs=4)  # 2 prompts a wave: two waves
    params = R.SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    asked = []

    def stop_after(k):
        def should_stop():
            asked.append(1)
            return len(asked) > k
        return should_stop

    with pytest.raises(R.GenerationStopped, match="decode step 3 of 10"):
        eng.generate(PROMPTS, params, should_stop=stop_after(13))  # the first wave's 10 steps, then 3
    assert len(asked) == 14
    plain = eng.generate(PROMPTS, params)
    polled = eng.generate(PROMPTS, params, should_stop=lambda: False)
    assert [[c.token_ids for c in cs] for cs in polled] == [[c.token_ids for c in cs] for cs in plain]


def test_top_k_1_equals_greedy():
    m = tiny_model(1)
    eng = R.TorchEngine(m)
    greedy = eng.generate(PROMPTS, R.SamplingParams(n=1, temperature=0, max_tokens=8))
    topk1 = eng.generate(PROMPTS, R.SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=8, seed=5))
    for g, t in zip(greedy, topk1):
        assert all(c.token_ids == g[0].token_ids for c in t)


def test_logprobs_equal_trainer_logprobs():
    m = tiny_model(2)
    eng = R.TorchEngine(m)
    T = 0.8
    out = eng.generate(PROMPTS, R.SamplingParams(n=3, temperature=T, top_p=0.9, max_tokens=10, seed=0))
    for p, comps in zip(PROMPTS, out):
        for c in comps:
            seq = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logp, _ = m(seq[:, :-1], target_ids=seq[:, 1:], temperature=T)
            trainer = logp[0, len(p) - 1:]
            assert (trainer - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5


def test_same_seed_same_samples_different_seed_differs():
    m = tiny_model(3)
    eng = R.TorchEngine(m)
    sp = R.SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=123)
    a = [[c.token_ids for c in cs] for cs in eng.generate(PROMPTS, sp)]
    b = [[c.token_ids for c in cs] for cs in eng.generate(PROMPTS, sp)]
    sp.seed = 124
    c = [[c.token_ids for c in cs] for cs in eng.generate(PROMPTS, sp)]
    assert a == b and a != c


def test_eos_stops_and_max_tokens_respected():
    m = tiny_model(4, vocab=6)  # tiny vocab: every token shows up quickly
    eng = R.TorchEngine(m)
    out = eng.generate([[1, 2]] * 4, R.SamplingParams(n=8, temperature=1.5, max_tokens=7, stop_token_ids=[0],
                                                      seed=0))
    comps = [c for cs in out for c in cs]
    assert any(c.finish_reason == "stop" for c in comps) and any(c.finish_reason == "length" for c in comps)
    for c in comps:
        assert 1 <= len(c.token_ids) <= 7
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 0 and 0 not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 7 and 0 not in c.token_ids
    forced = eng.generate([[1, 2]], R.SamplingParams(n=8, max_tokens=7, stop_token_ids=[0], ignore_eos=True, seed=0))
    assert all(len(c.token_ids) == 7 for c in forced[0])


def reference_flash_varlen_decode(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k):
    """model.flash_varlen_decode by hand: sequence i's queries q[cu_q[i]:cu_q[i+1]] attend (not causally) to
    its first seqused_k[i] keys from cu_k[i] on."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, k0 = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1), int(cu_k[i])  # [heads, queries, D]
        used = int(seqused_k[i])
        assert 0 < used <= max_k and qs.shape[1] <= max_q
        ks, vs = (t[k0:k0 + used].transpose(0, 1) for t in (k, v))
        w = torch.softmax(qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5, -1)
        out[cu_q[i]:cu_q[i + 1]] = (w @ vs).transpose(0, 1)
    return out


def test_flash_decode_layout_equals_the_masked_attention(monkeypatch):
    """The decode step through flash varlen ((row, kv head) sequences laid over the cache, seqused_k live keys;
    here a by-hand varlen in its place) gives the masked SDPA's outputs, and generation the same tokens."""
    g = torch.Generator().manual_seed(0)
    rows, kv_heads, group, positions, D = 5, 2, 3, 12, 8
    caches = [torch.randn(rows + 2, kv_heads, positions, D, generator=g, dtype=torch.float64) for _ in range(2)]
    q = torch.randn(rows, 1, kv_heads * group, D, generator=g, dtype=torch.float64)
    cache_pos = torch.tensor([0, 4, 9, 2, 6])  # rows at different lengths

    def decode(kernel):
        monkeypatch.setattr(M, "decode_kernel", lambda device_type, dtype: kernel)
        batch = M.AttnBatch(kv_cache=[tuple(caches)], cache_pos=cache_pos, cache_len=10)
        assert (batch.decode_lens is not None) == (kernel == "varlen")
        return M.decode_attention(q, *caches, batch)

    monkeypatch.setattr(M, "flash_varlen_decode", reference_flash_varlen_decode)
    torch.testing.assert_close(decode("varlen"), decode("sdpa"), rtol=1e-12, atol=1e-12)
    # the engine end to end: stops and compaction move rows between steps
    sp = R.SamplingParams(n=2, temperature=0, max_tokens=12, stop_token_ids=[7])
    prompts = [[t % 12 for t in p] for p in PROMPTS]
    expected = R.TorchEngine(tiny_model(3, vocab=12)).generate(prompts, sp)
    monkeypatch.setattr(M, "decode_kernel", lambda device_type, dtype: "varlen")
    out = R.TorchEngine(tiny_model(3, vocab=12)).generate(prompts, sp)
    assert {c.finish_reason for cs in out for c in cs} == {"stop", "length"}
    for cs, es in zip(out, expected):
        for c, e in zip(cs, es):
            assert c.token_ids == e.token_ids
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs))


P = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("temperature,top_k,top_p,expected", [
    (1.0, -1, 1.0, P),
    (1.0, 2, 1.0, [0.625, 0.375, 0, 0]),  # renormalized top-2
    (1.0, -1, 0.7, [0.625, 0.375, 0, 0]),  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops
    (1.0, -1, 0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (2.0, -1, 1.0, [math.sqrt(x) / sum(math.sqrt(y) for y in P) for x in P]),  # p^(1/T) renormalized
])
def test_sampling_distribution(temperature, top_k, top_p, expected):
    N = 200_000
    logits = torch.log(torch.tensor(P)).repeat(N, 1)
    g = torch.Generator().manual_seed(0)
    tok, logp = R.sample_tokens(logits, temperature, top_p, top_k, g)
    freq = torch.bincount(tok, minlength=4).double() / N
    assert (freq - torch.tensor(expected, dtype=torch.float64)).abs().max() < 0.006
    # log-probs are always those of the unfiltered tempered distribution
    tempered = torch.log_softmax(torch.log(torch.tensor(P)) / temperature, -1)
    assert torch.allclose(logp, tempered[tok], atol=1e-6)


@pytest.mark.slow  # torch.compile (Inductor)
def test_compiled_engine_matches_the_eager_one():
    """TorchEngine(compile=True) (Inductor's C++ kernels on the CPU): the sampled tokens and log-probs of the eager
    engine, with stops and compaction, over sizes that change between calls; the blocks share a few graphs (a graph
    per layer would soon exhaust dynamo's recompile limit and leave the blocks eager), and so do the sampler's."""
    if (why := compile_unavailable()) is not None:
        pytest.skip(why)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()  # other tests' graphs out of the caches counted
    # a small vocabulary, so the stop token comes up; 6 layers, more than the graphs a prefill and a decode need
    m, ref = tiny_model(5, vocab=8, layers=6), tiny_model(5, vocab=8, layers=6)
    sp = R.SamplingParams(n=2, temperature=1.0, max_tokens=9, stop_token_ids=[3], seed=11)
    eng, eager = R.TorchEngine(m, compile=True), R.TorchEngine(ref)
    prompts = [[t % 8 for t in p] for p in PROMPTS]
    for prompts in (prompts, prompts[:3] + [[2] * 13]):  # other batch and prompt sizes on the second call
        out, exp = eng.generate(prompts, sp), eager.generate(prompts, sp)
        for cs, es in zip(out, exp):
            for c, e in zip(cs, es):
                assert c.token_ids == e.token_ids and c.finish_reason == e.finish_reason
                assert max(abs(a - b) for a, b in zip(c.logprobs, e.logprobs)) <= 1e-4
    assert any(len(c.token_ids) < 9 for cs in out for c in cs)  # some rows stopped early
    graphs = {f: len(_debug_get_cache_entry_list(f.__code__)) for f in (M.DecoderLayer.forward, R.gumbel_pick)}
    # the sampler: the prefill's logits, the decode step's view of them, and (vocabulary 8) a batch of 8 rows
    assert 2 <= graphs[M.DecoderLayer.forward] < 6 and 1 <= graphs[R.gumbel_pick] <= 3, graphs


@pytest.mark.slow  # torch.compile (Inductor)
def test_trainer_and_engine_graphs_fit_the_recompile_limit():
    """One process compiling as one GPU does: the trainer's blocks (training with the first block checkpointed,
    no-grad log-probs) and the built-in engine's (prefill, decode) share the blocks' cache of graphs. Over three
    sets of lengths, the third compiles nothing new, and each cache holds at most half of
    parallel.RECOMPILE_LIMIT (what the limit's comment states)."""
    if (why := compile_unavailable()) is not None:
        pytest.skip(why)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()  # other tests' graphs out of the caches counted
    m = tiny_model(3, vocab=16, layers=3).train()
    parallel.apply_compile(m, dynamic=True)
    m.gradient_checkpointing = 1
    engine = R.TorchEngine(m, compile=True, shares_weights=True)
    g = torch.Generator().manual_seed(0)
    new_graphs = []
    for k in range(3):  # fewer and longer documents each time; the engine's batch and prompt sizes change too
        docs = [torch.randint(0, 16, (4 + 3 * k + i,), generator=g).tolist() for i in range(4 - k)]
        before = counters["stats"]["unique_graphs"]
        ids, pos, batch = M.pack_sequences([d[:-1] for d in docs])
        target = torch.tensor([t for d in docs for t in d[1:]])[None]
        logp, _ = m(ids, pos, batch, target_ids=target, with_entropy="detached")
        logp.sum().backward()
        with torch.no_grad():
            m(ids, pos, batch, target_ids=target)
        engine.generate([d[:2 + k] for d in docs], R.SamplingParams(n=2, max_tokens=4 + k, seed=k))
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
    entries = {f.__qualname__: len(_debug_get_cache_entry_list(f.__code__))
               for f in (M.DecoderLayer.forward, M._chunk_logprob_entropy, R.gumbel_pick)}
    assert new_graphs[0] > 0 and new_graphs[2] == 0, new_graphs
    assert 0 < max(entries.values()) <= parallel.RECOMPILE_LIMIT // 2, entries


@pytest.mark.slow  # torch.compile (Inductor)
def test_a_new_token_count_does_not_compile_the_log_prob_head_again():
    """While every response has the same length, logprob_chunk can divide the head's tokens, so its chunk
    function sees one size; the first batch of other lengths must not compile it again (a recompile in the
    middle of a run's update). Chunks of 4: 8 response tokens (4 + 4), then 7 (4 + 3), with and without
    a gradient."""
    if (why := compile_unavailable()) is not None:
        pytest.skip(why)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()  # other tests' graphs out of the caches counted
    m = tiny_model(3, vocab=16, layers=2).train()
    parallel.apply_compile(m, dynamic=True)
    g = torch.Generator().manual_seed(0)
    new_graphs = []
    # two documents: 2 x 4 response tokens, then 4 + 3; of different lengths both times, so that the blocks'
    # attention kernel (documents of one length take another) stays the same
    for response_len in (4, 3):
        docs = [torch.randint(0, 16, (5 + 4,), generator=g).tolist(),
                torch.randint(0, 16, (7 + response_len,), generator=g).tolist()]
        ids, pos, batch = M.pack_sequences([d[:-1] for d in docs])
        assert not batch.equal_docs
        prompts = (5, 7)
        target = torch.tensor([t for d, p in zip(docs, prompts) for t in [M.IGNORE_INDEX] * (p - 1) + d[p:]])[None]
        before = counters["stats"]["unique_graphs"]
        logp, _ = m(ids, pos, batch, target_ids=target, with_entropy="detached", logprob_chunk=4)
        logp.sum().backward()
        with torch.no_grad():
            m(ids, pos, batch, target_ids=target, logprob_chunk=4)
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
    assert new_graphs[0] > 0 and new_graphs[1] == 0, new_graphs
    assert len(_debug_get_cache_entry_list(M._chunk_logprob_entropy.__code__)) == 2  # with and without a graph
    # only the rows are symbolic: the temperature is a constant of the graph, not an input (dynamic=True made
    # it one, and the first update on an H200 took about 40 s longer), so another temperature compiles anew
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        m(ids, pos, batch, target_ids=target, logprob_chunk=4, temperature=0.7)
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.slow  # torch.compile (Inductor)
def test_the_blocks_compile_once_per_attention_kernel_whatever_the_lengths():
    """Documents of one length take SDPA on a view, mixed lengths the other kernel, and a single document is a
    case of its own (a batch of one, which torch specializes): the first micro-batch of each kind compiles the
    blocks, and later micro-batches of new lengths and new document counts compile nothing. So a run compiles
    at most three times, each at the first micro-batch of its kind."""
    if (why := compile_unavailable()) is not None:
        pytest.skip(why)
    torch._dynamo.reset()
    m = tiny_model(3, vocab=16, layers=2).train()
    parallel.apply_compile(m, dynamic=True)
    g = torch.Generator().manual_seed(0)
    new_graphs = []
    for lens in ([12, 12], [12, 9], [20, 20, 20], [7, 30, 11], [25, 25], [5, 8], [40], [33]):
        ids, pos, batch = M.pack_sequences([torch.randint(0, 16, (n,), generator=g).tolist() for n in lens])
        assert batch.equal_docs == (len(set(lens)) == 1)
        before = counters["stats"]["unique_graphs"]
        logp, _ = m(ids, pos, batch, target_ids=ids, logprob_chunk=4)
        logp.sum().backward()
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
    first_of_a_kind = [0, 1, 6]  # [12, 12], [12, 9], [40]
    assert all(new_graphs[i] > 0 for i in first_of_a_kind), new_graphs
    assert all(n == 0 for i, n in enumerate(new_graphs) if i not in first_of_a_kind), new_graphs


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])  # q/k/v biases; q/k norms
def test_an_engine_copy_with_fused_projections_generates_and_loads_weights_as_the_unfused_one(architecture):
    """An engine that owns its copy fuses q, k and v, and gate and up, into weights whose slices are the
    parameters: the same tokens and log-probs as an engine on an unfused model, and pushed weights
    (load_weights, by the model's names) reach the fused weights."""
    sp = R.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    prompts = [[t % 50 for t in p] for p in PROMPTS]
    ref = R.TorchEngine(tiny_model(4, architecture=architecture))
    own = R.TorchEngine(tiny_model(4, architecture=architecture), shares_weights=False)
    attn = own.model.model.layers[0].self_attn
    k_rows = attn.qkv_weight[attn.q_proj.out_features:]
    assert attn.qkv_sizes is not None and attn.k_proj.weight.data_ptr() == k_rows.data_ptr()
    assert (attn.qkv_bias is None) == (architecture == "Qwen3ForCausalLM")
    mlp = own.model.model.layers[0].mlp
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[mlp.gate_proj.out_features:].data_ptr()

    def same(a, b):
        for cs, es in zip(a, b):
            for c, e in zip(cs, es):
                assert c.token_ids == e.token_ids
                torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs))

    same(own.generate(prompts, sp), ref.generate(prompts, sp))
    other = tiny_model(9, architecture=architecture)
    own.load_weights([list(other.named_parameters())], version=1)
    same(own.generate(prompts, sp, version=1), R.TorchEngine(other).generate(prompts, sp))
    assert "gate_up_weight" not in "".join(own.model.state_dict())
    assert "self_attn.qkv_weight" not in "".join(own.model.state_dict())  # not saved: the parameters are
