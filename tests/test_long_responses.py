"""Long responses (4k-20k tokens): the chunked log-prob/entropy head and the token-budget micro-batching at the
lengths a long-response run trains on. The other test files check the same code at a few dozen tokens; here the
head's row is 21,504 tokens (a 1,024-token prompt and a 20,480-token response) and micro-batches hold sequences
of up to 20,736, so chunk boundaries, last partial chunks and micro-batch splits land where they do in such a
run. Small hidden and vocabulary sizes keep each test within a second or two on a CPU."""
import math

import numpy as np
import pytest
import torch

import data
import model as M
import parallel
import train_dapo as T

PROMPT, RESPONSE = 1024, 20480
N = PROMPT + RESPONSE  # 21 x 1024 tokens
HIDDEN, VOCAB, TEMP = 16, 64, 0.7
# 1024 and 7168 divide N; 1000 and 4096 leave a last partial chunk; N is one whole chunk; N + 1000 is larger
CHUNKS = [1024, 7168, 1000, 4096, N, N + 1000]


def long_row(seed=0):
    """hidden [N, HIDDEN], lm_head weight [VOCAB, HIDDEN], targets [N] and the random weights a, b of the loss
    sum(a * logp) + sum(b * entropy), all float64 (the weights' scale makes the logits' spread about 3)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, HIDDEN, generator=g, dtype=torch.float64)
    w = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, VOCAB, (N,), generator=g)
    a = torch.randn(N, generator=g, dtype=torch.float64)
    b = torch.randn(N, generator=g, dtype=torch.float64)
    return h, w, t, a, b


def reference(h, w, t, a, b, entropy_grad=True):
    """The whole row at once, float64, textbook formulas: (logp, entropy, d loss / d hidden, d loss / d weight).
    entropy_grad=False: the loss is sum(a * logp) alone (the entropy a metric)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    log_q = torch.log_softmax(h @ w.t() / TEMP, dim=-1)  # full [N, VOCAB] logits
    logp = log_q.gather(-1, t[:, None]).squeeze(-1)
    ent = -(log_q.exp() * log_q).sum(-1)
    ((a * logp).sum() + ((b * ent).sum() if entropy_grad else 0.0)).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def head(h, w, t, a, b, chunk, with_entropy, recompute=True, chunk_fn=None):
    """token_logprobs_and_entropy on the row, then backward of sum(a * logp) + sum(b * entropy) (the entropy
    only where it has a gradient) -> (logp, entropy or None, d/d hidden, d/d weight)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = M.token_logprobs_and_entropy(h, w, t, TEMP, chunk, with_entropy, chunk_fn, recompute=recompute)
    loss = (a * logp).sum()
    if ent is not None and ent.requires_grad:
        loss = loss + (b * ent).sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), h.grad, w.grad


def rel(x, y):
    """||x - y|| / ||y||: a gradient summed over 21k tokens compared at its own scale."""
    return ((x - y).norm() / y.norm()).item()


def chunk_float64(h, weight, targets, temperature, with_entropy):
    """One chunk of the head as _chunk_logprob_entropy's contract, but in float64 throughout (the eager one
    rounds the logits to fp32 by design): the head's chunk_fn hook, the one a compiled copy comes through."""
    log_q = torch.log_softmax(h @ weight.t() / temperature, dim=-1)
    logp = log_q.gather(-1, targets[:, None]).squeeze(-1)
    return logp, (-(log_q.exp() * log_q).sum(-1) if with_entropy else None)


# -----------------------------------------------------------------------------
# the chunked log-prob / entropy head on a 21,504-token row


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunk_loop_matches_the_whole_row_in_float64_at_every_chunk_size(with_entropy, recompute):
    """token_logprobs_and_entropy's chunk loop (slicing, per-chunk recompute in backward or kept graphs,
    concatenation), run with a float64 chunk function: log-probs and entropy equal the whole row's float64
    reference to 1e-12 and the gradients w.r.t. hidden and lm_head weight to 1e-10, whether the chunk divides
    the row, leaves a last partial chunk, is the row or is larger than it."""
    h, w, t, a, b = long_row()
    ref_logp, ref_ent, ref_gh, ref_gw = reference(h, w, t, a, b, entropy_grad=with_entropy)
    for chunk in CHUNKS:
        logp, ent, gh, gw = head(h, w, t, a, b, chunk, with_entropy, recompute, chunk_fn=chunk_float64)
        assert logp.shape == (N,) and (logp - ref_logp).abs().max() <= 1e-12, chunk
        if with_entropy:
            assert (ent - ref_ent).abs().max() <= 1e-12, chunk
        else:
            assert ent is None
        assert rel(gh, ref_gh) <= 1e-10 and rel(gw, ref_gw) <= 1e-10, chunk


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("with_entropy", [True, "detached", False])
def test_eager_head_chunks_give_the_unchunked_values_and_gradients(with_entropy, recompute):
    """The eager head (fp32 logits inside a chunk) on float64 inputs: each chunk size gives bit-for-bit the
    log-probs and entropy of one chunk over the whole row (a row's values depend on that row alone), and the
    same gradients to 1e-10 (only the float64 sum over chunks of the weight gradient changes order).
    "detached": the entropy carries no gradient, the same values as with it."""
    h, w, t, a, b = long_row(seed=1)
    whole = head(h, w, t, a, b, N + 1000, with_entropy, recompute)
    if with_entropy == "detached":
        with_grad = head(h, w, t, a, b, N + 1000, True, recompute)
        assert torch.equal(whole[1], with_grad[1])
    for chunk in (1024, 1000, 4096):
        logp, ent, gh, gw = head(h, w, t, a, b, chunk, with_entropy, recompute)
        assert torch.equal(logp, whole[0]), chunk
        assert (ent is None) == (not with_entropy) and (ent is None or torch.equal(ent, whole[1])), chunk
        assert rel(gh, whole[2]) <= 1e-10 and rel(gw, whole[3]) <= 1e-10, chunk


@pytest.mark.parametrize("with_entropy", [True, "detached"])
def test_eager_head_on_a_long_row_matches_the_float64_reference_at_fp32_precision(with_entropy):
    """The eager head against the independent float64 reference over the whole row, with a last partial chunk:
    log-probs and entropy to fp32 rounding (1e-5), gradients to 1e-5 of their norm; "detached": the gradient
    is the log-probs' alone and the entropy has no graph."""
    h, w, t, a, b = long_row(seed=2)
    ref_logp, ref_ent, ref_gh, ref_gw = reference(h, w, t, a, b, entropy_grad=with_entropy is True)
    logp, ent, gh, gw = head(h, w, t, a, b, 1000, with_entropy)
    assert (logp - ref_logp).abs().max() <= 1e-5 and (ent - ref_ent).abs().max() <= 1e-5
    assert rel(gh, ref_gh) <= 1e-5 and rel(gw, ref_gw) <= 1e-5
    if with_entropy == "detached":
        hh = h.clone().requires_grad_()
        _, ent = M.token_logprobs_and_entropy(hh, w, t, TEMP, 1000, "detached")
        assert not ent.requires_grad


def test_packed_forward_of_long_documents_is_the_same_for_any_logprob_chunk():
    """Transformer.forward on a packed row of three long documents (16,857 tokens; prompt targets ignored as
    train_dapo.sequence_logprobs does), float64: logprob_chunk 1024 and 1000 give the log-probs and entropy of
    one chunk larger than the row (to 1e-12) and the same gradient of every parameter (to 1e-10)."""
    cfg = M.ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        max_position_embeddings=16384)
    m = M.Transformer(cfg).init_weights(std=0.2, seed=0).double()
    g = torch.Generator().manual_seed(3)
    prompts, responses = [256, 200, 131], [8192, 3000, 5081]
    docs = [torch.randint(0, VOCAB, (p + r,), generator=g).tolist() for p, r in zip(prompts, responses)]
    ids, pos, batch = M.pack_sequences([d[:-1] for d in docs])
    targets = torch.tensor([x for d, p in zip(docs, prompts) for x in [M.IGNORE_INDEX] * (p - 1) + d[p:]])[None]
    T_ = ids.shape[1]
    assert T_ == sum(prompts) + sum(responses) - 3 and T_ > 16384
    a = torch.randn(T_, generator=g, dtype=torch.float64)
    b = torch.randn(T_, generator=g, dtype=torch.float64)
    outs = []
    for chunk in (T_ + 1000, 1024, 1000):
        m.zero_grad()
        logp, ent = m(ids, pos, batch, target_ids=targets, with_entropy=True, temperature=TEMP,
                      logprob_chunk=chunk)
        ((a * logp[0]).sum() + (b * ent[0]).sum()).backward()
        outs.append((logp.detach(), ent.detach(), [p.grad.clone() for p in m.parameters()]))
    (ref_logp, ref_ent, ref_grads) = outs[0]
    kept = targets != M.IGNORE_INDEX
    assert int(kept.sum()) == sum(responses) and (ref_logp[kept] < 0).all() and (ref_logp[~kept] == 0).all()
    for logp, ent, grads in outs[1:]:
        assert (logp - ref_logp).abs().max() <= 1e-12 and (ent - ref_ent).abs().max() <= 1e-12
        for gr, ref in zip(grads, ref_grads):
            assert ref.norm() > 0 and rel(gr, ref) <= 1e-10


# -----------------------------------------------------------------------------
# token-budget micro-batches of long sequences (use_dynamic_bsz)


def long_lengths(seed, n, max_response):
    """n prompt + response lengths: prompts of 64-256 tokens, responses lognormal with median 3000 (sigma 1,
    so a few percent hit the cap) capped at max_response: at most 256 + max_response each."""
    rng = np.random.default_rng(seed)
    resp = np.minimum(np.round(rng.lognormal(math.log(3000), 1.0, n)), max_response).astype(int)
    return [int(x) for x in resp + rng.integers(64, 257, n)]


def count_bound(lengths, budget, start):
    """The most micro-batches balanced_micro_batches can return, from its rule alone. It starts at `start`
    (max(ceil(total / budget), min_num_micro_batches)) and adds one micro-batch only after a sequence of s
    tokens found even the lightest of k micro-batches too full, i.e. every one of them holds more than
    budget - s. Longest first, so the tokens placed before it, P, are those of the sequences ahead of it in that
    order, and P > k (budget - s): k < P / (budget - s), so the count it moves to, k + 1, is at most
    ceil(P / (budget - s)). Where s > budget / 2 every sequence placed is longer than budget / 2 too, each alone,
    so k + 1 sequences are longer than budget / 2 and k + 1 <= their number (no packing has fewer
    micro-batches). The bound is the largest of these over the sequences, and start."""
    ordered = sorted(lengths, reverse=True)
    n_big = sum(s > budget / 2 for s in lengths)
    bound, placed = start, 0
    for s in ordered:
        bound = max(bound, n_big if s > budget / 2 else math.ceil(placed / (budget - s)))
        placed += s
    return bound


def check_split(lengths, mbs, budget):
    """Every index exactly once, ascending inside each non-empty micro-batch, each within the budget."""
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    assert all(mb and mb == sorted(mb) for mb in mbs)
    assert all(sum(lengths[i] for i in mb) <= budget for mb in mbs)


@pytest.mark.parametrize("max_response,budget", [(16384, 16640), (16384, 32768), (16384, 65536),
                                                 (20480, 20736), (20480, 32768), (20480, 65536)])
def test_micro_batches_of_long_sequences_cover_fit_and_are_few(max_response, budget):
    """256 sequences of long-tailed lengths (median about 3,200 tokens, up to 256 + max_response) under a
    budget from exactly the longest possible sequence to 64k tokens: every index once, no micro-batch over the
    budget, at least ceil(total / budget) micro-batches and at most count_bound's (a few more at these
    lengths), also when min_num_micro_batches asks for more."""
    for seed in range(3):
        lengths = long_lengths(seed, 256, max_response)
        assert max(lengths) <= budget and sum(s > max_response for s in lengths) >= 3  # some at the cap
        floor = math.ceil(sum(lengths) / budget)
        mbs = data.balanced_micro_batches(lengths, budget)
        check_split(lengths, mbs, budget)
        assert floor <= len(mbs) <= count_bound(lengths, budget, floor), (seed, len(mbs), floor)
        more = floor + 5  # another rank has more micro-batches: every rank runs as many
        mbs = data.balanced_micro_batches(lengths, budget, min_num_micro_batches=more)
        check_split(lengths, mbs, budget)
        assert more <= len(mbs) <= count_bound(lengths, budget, more), (seed, len(mbs), more)


def test_a_sequence_at_the_budget_fits_alone_and_one_token_more_is_an_error():
    """A 21,504-token sequence (1,024 prompt + 20,480 response) under a budget of exactly 21,504 is a
    micro-batch of its own, beside long ones that pack together; one token less of budget is a DataError that
    names the sequence, its length and ppo_max_token_len_per_gpu."""
    lengths = [5000, N, 4000, 7000, N, 3000]
    mbs = data.balanced_micro_batches(lengths, N)
    check_split(lengths, mbs, N)
    assert [1] in mbs and [4] in mbs and len(mbs) == 3  # 5000 + 4000 + 7000 + 3000 = 19000 <= N: one more
    with pytest.raises(data.DataError) as e:
        data.balanced_micro_batches(lengths, N - 1)
    msg = str(e.value)
    assert f"sequence 1 has {N} tokens" in msg and f"budget is {N - 1}" in msg
    assert "ppo_max_token_len_per_gpu" in msg and "log_prob_max_token_len_per_gpu" in msg


# -----------------------------------------------------------------------------
# the trainer's use of the budget: micro_batches and update_policy


def long_trajectories(prompt_lens, response_lens, vocab=VOCAB, seed=0):
    """Trajectories with these prompt and response lengths (random tokens), old log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    n, R = len(prompt_lens), max(response_lens)
    mask = torch.zeros(n, R)
    for i, r in enumerate(response_lens):
        mask[i, :r] = 1
    return T.Trajectories(
        prompt_ids=[torch.randint(0, vocab, (p,), generator=g).tolist() for p in prompt_lens],
        response_ids=[torch.randint(0, vocab, (r,), generator=g).tolist() for r in response_lens],
        group_ids=torch.arange(n) // 2, rollout_logp=torch.zeros(n, R), response_mask=mask,
        finish_reasons=["stop"] * n, data_sources=["x"] * n, acc=torch.zeros(n), score=torch.zeros(n),
        seq_reward=torch.zeros(n), old_logp=torch.randn(n, R, generator=g) * 0.1 - math.log(vocab),
        adv=torch.randn(n, generator=g))


def test_trainer_micro_batches_budget_prompt_plus_response_of_long_trajectories():
    """train_dapo.micro_batches with a token budget, on 64 trajectories of long-tailed lengths given as a subset
    of the batch's indices: the trajectory indices of that subset, each once, each micro-batch's prompt +
    response tokens within the budget, as many micro-batches as balanced_micro_batches gives for those
    lengths."""
    lengths = long_lengths(7, 128, 20480)
    prompts = [min(256, s // 4) for s in lengths]
    traj = T.Trajectories(
        prompt_ids=[[0] * p for p in prompts], response_ids=[[0] * (s - p) for s, p in zip(lengths, prompts)],
        group_ids=torch.zeros(128), rollout_logp=torch.zeros(128, 1), response_mask=torch.ones(128, 1),
        finish_reasons=["stop"] * 128, data_sources=["x"] * 128, acc=torch.zeros(128), score=torch.zeros(128),
        seq_reward=torch.zeros(128))
    idx = list(range(1, 128, 2))
    dims = parallel.init_distributed("cpu")
    for budget in (20736, 32768):
        mbs = T.micro_batches(traj, idx, 4, budget, dims)
        assert sorted(i for mb in mbs for i in mb) == idx
        assert all(sum(lengths[i] for i in mb) <= budget for mb in mbs)
        assert len(mbs) == len(data.balanced_micro_batches([lengths[i] for i in idx], budget))
        assert len(mbs) >= math.ceil(sum(lengths[i] for i in idx) / budget) >= 5


def update_gradient(cfg, traj):
    """update_policy on a tiny float64 model -> the gradient its one optimizer step reads (SGD with lr 0)."""
    mcfg = M.ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384)
    m = M.Transformer(mcfg).init_weights(std=0.2, seed=0).double()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(torch.cat([p.grad.flatten() for p in m.parameters()])))
    T.update_policy(m, opt, T.make_scheduler(opt, cfg, 1), traj, cfg, parallel.init_distributed("cpu"))
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_update_gradient_of_long_responses_is_the_same_whatever_the_token_budget(mode):
    """update_policy on four trajectories of 4k-8k response tokens (24,152 tokens in all), float64: a token
    budget that splits the mini-batch into several micro-batches gives the gradient of one micro-batch holding
    it all, to 1e-12 of its norm (each micro-batch's loss is divided by the whole mini-batch's count)."""
    prompts, responses = [256, 200, 131, 245], [8000, 4096, 5120, 6104]
    traj = long_trajectories(prompts, responses)
    total = sum(prompts) + sum(responses)
    dims = parallel.init_distributed("cpu")
    assert len(T.micro_batches(traj, [0, 1, 2, 3], 4, total, dims)) == 1
    assert len(T.micro_batches(traj, [0, 1, 2, 3], 4, 8320, dims)) >= 3
    base = dict(train_batch_size=2, n=2, ppo_mini_batch_size=2, max_response_length=max(responses),
                grad_clip=1e9, entropy_coeff=0.01, loss_agg_mode=mode, use_dynamic_bsz=True)
    whole = update_gradient(T.Config(**base, ppo_max_token_len_per_gpu=total), traj)
    split = update_gradient(T.Config(**base, ppo_max_token_len_per_gpu=8320), traj)
    assert whole.norm() > 0 and rel(split, whole) <= 1e-12
