"""
Generation (rollout). One interface, two engines:

- TorchEngine: the built-in batched sampler over model.py. Runs anywhere (CPU demo, CI, a GPU without
  vLLM, an NPU). Prompts are prefilled once, packed; the n samples of a prompt copy that prompt's KV
  into their rows of a preallocated cache; every decode step is one batched forward of one token per
  live row; finished rows are compacted away; on CUDA the decode step is replayed from CUDA graphs
  captured per batch-size bucket and cache span.
- the in-process vLLM engine (colocated with training) is a separate piece of work; `make_engine`
  says so when asked for it.

Log-probs returned by both are those of the sampled tokens under log_softmax(logits / temperature),
the same transform the trainer uses (top-p / top-k only restrict what is sampled).
"""
from dataclasses import dataclass, field

import torch

from model import AttnBatch, pack_sequences


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # EOS ids; the stop token is kept in the response
    ignore_eos: bool = False  # always generate max_tokens (benchmarks)
    seed: int | None = None
    logprobs: bool = True


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" (a stop token was sampled) or "length" (max_tokens)


# -----------------------------------------------------------------------------
# sampling (pure functions on a [rows, vocab] logits tensor)


def sample_tokens(logits, temperature: float, top_p: float, top_k: int, generator=None):
    """-> (token ids [rows], log p(token) under log_softmax(logits / T)) with top-k / top-p filtering."""
    logits = logits.float()
    if temperature <= 0:  # greedy; log-probs at temperature 1
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)
    filtered = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:  # smallest set of most likely tokens whose probability reaches top_p
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep a token if the mass before it is < top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(filtered, -1)
    # Gumbel-max in its exponential form: argmax p / E with E ~ Exp(1) samples from p (graph- and seed-friendly)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    tok = (probs / noise).argmax(-1)
    return tok, logp_all.gather(-1, tok[:, None])[:, 0]


# -----------------------------------------------------------------------------
# the built-in engine


class TorchEngine:
    """Batched generation over a model.Transformer it shares with the trainer (no weight copy).

    Memory: a KV cache of max_num_seqs x (longest prompt + max_tokens) tokens x layers x 2 x kv_heads x
    head_dim in the model's dtype (Qwen2.5-1.5B: 28 KiB per token in bf16), allocated per generate call
    and freed by sleep(). Under FSDP the trainer hands this engine a full (gathered) copy of the weights:
    that costs one more model in memory while generating.

    Decode speed (CUDA): the step is replayed from CUDA graphs captured per (batch-size bucket, cache span):
    attention reads only the first `span` cache positions, the live length rounded up (see _span). A step is
    ~50 small kernels per layer, so kernel count, not bandwidth, bounds it (BENCHMARKS.md); torch.compile of
    the step would fuse them, but compiling the Qwen2.5-1.5B step did not finish within 165 s on an H200.
    """

    def __init__(self, model, max_num_seqs: int = 256, use_cuda_graph: bool | None = None):
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.device = model.output_weight.device
        self.use_cuda_graph = (self.device.type == "cuda") if use_cuda_graph is None else use_cuda_graph
        self._cache, self._io, self._graphs, self._pool = None, None, {}, None  # graphs live in one memory pool

    # interface shared with the vLLM engine -----------------------------------
    def update_weights(self, named_tensors):
        """Copy HF-named tensors into the model (only needed when the engine does not share the trainer's)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named_tensors:
                params[name].copy_(t)

    def sleep(self):
        self._cache, self._io, self._graphs, self._pool = None, None, {}, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self):
        pass  # the cache is allocated lazily by generate

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """-> per prompt, params.n completions. Prompts are processed in waves of whole prompts
        (at most max_num_seqs rows each)."""
        g = None
        if params.seed is not None:
            g = torch.Generator(device=self.device).manual_seed(params.seed)
        per_wave = max(1, self.max_num_seqs // params.n)
        out = []
        for s in range(0, len(prompts), per_wave):
            out += self._generate_wave(prompts[s:s + per_wave], params, g)
        return out

    # internals -----------------------------------------------------------------
    def _alloc_cache(self, rows: int, max_len: int):
        """One preallocated cache reused across waves while it is large enough: per layer (k, v) [rows, kvh, L, D];
        with CUDA graphs also their inputs (tokens, positions) and output (logits), shared by all graphs."""
        c = self._cache
        if c is not None and c[0][0].shape[0] >= rows and c[0][0].shape[2] >= max_len:
            return c
        cfg, w = self.model.config, self.model.output_weight
        shape = (rows, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self._cache, self._io, self._graphs, self._pool = None, None, {}, None  # old graphs read the old cache
        self._cache = [(torch.zeros(shape, dtype=w.dtype, device=self.device),
                        torch.zeros(shape, dtype=w.dtype, device=self.device)) for _ in range(cfg.num_hidden_layers)]
        if self.use_cuda_graph:
            self._io = (torch.zeros(rows, dtype=torch.long, device=self.device),
                        torch.zeros(rows, dtype=torch.long, device=self.device),
                        torch.zeros(rows, w.shape[0], dtype=w.dtype, device=self.device))
        return self._cache

    def _prefill(self, prompts, params, cache, g):
        """Packed forward of each prompt once; copy its KV into its n rows; sample the first tokens."""
        n = params.n
        ids, pos, batch = pack_sequences(prompts, self.device)
        batch.collect_kv = []
        last = batch.cu_seqlens[1:].long() - 1
        logits = self.model(ids, pos, batch, logits_at=last)  # [P, vocab]
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        Lp = int(lens.max())
        # token index of (row, t) in the packed prompt; rows of a prompt are adjacent
        start = batch.cu_seqlens[:-1].long().repeat_interleave(n)
        idx = (start[:, None] + torch.arange(Lp, device=self.device)[None]).clamp(max=ids.shape[1] - 1)
        for (k, v), (k_cache, v_cache) in zip(batch.collect_kv, cache):
            rows = idx.shape[0]
            k_cache[:rows, :, :Lp] = k[idx].transpose(1, 2)  # positions past a prompt's end are masked later
            v_cache[:rows, :, :Lp] = v[idx].transpose(1, 2)
        tok, logp = sample_tokens(logits.repeat_interleave(n, 0), params.temperature, params.top_p,
                                  params.top_k, g)
        return tok, logp, lens.repeat_interleave(n)

    def _decode(self, tokens, cache_pos, cache, cache_len: int):
        """One token per row -> logits [rows, vocab]; replayed from a CUDA graph when enabled."""
        rows = tokens.shape[0]
        if not self.use_cuda_graph:
            return _decode_step(self.model, tokens, cache_pos, [(k[:rows], v[:rows]) for k, v in cache], cache_len)
        bucket = next(b for b in _buckets(self.max_num_seqs) if b >= rows)
        span = _span(cache_len, cache[0][0].shape[2] - 1)
        if (bucket, span) not in self._graphs:
            self._graphs[bucket, span] = self._capture(bucket, span, cache)
        t_in, p_in, logits = self._io
        t_in[:rows], p_in[:rows] = tokens, cache_pos
        p_in[rows:bucket] = span - 1  # padding rows: their cache rows hold no live sequence, any slot will do
        self._graphs[bucket, span].replay()
        return logits[:rows]

    def _capture(self, bucket: int, span: int, cache):
        """A CUDA graph of the decode step for the first `bucket` rows, attending over the first `span` positions."""
        kv = [(k[:bucket, :, :span], v[:bucket, :, :span]) for k, v in cache]
        t_in, p_in, logits = (x[:bucket] for x in self._io)
        # warm-up and capture really run. They write k/v at slot span - 1 of every row: no live row has written
        # that slot yet (live rows hold positions < cache_len <= span), and each writes it before reading it.
        p_in.fill_(span - 1)

        def step():
            logits.copy_(_decode_step(self.model, t_in, p_in, kv, span))

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up kernels outside the graph
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        self._pool = graph.pool()
        return graph

    def _generate_wave(self, prompts, params, g):
        n, T = params.n, params.max_tokens
        rows = len(prompts) * n
        max_len = max(len(p) for p in prompts) + T
        cache = self._alloc_cache(rows if not self.use_cuda_graph else self.max_num_seqs, max_len)
        tok, logp, cache_pos = self._prefill(prompts, params, cache, g)
        stop = torch.tensor(sorted(set(params.stop_token_ids)) if not params.ignore_eos else [-1],
                            device=self.device)
        out_tok = torch.full((rows, T), -1, dtype=torch.long, device=self.device)
        out_logp = torch.zeros(rows, T, device=self.device)
        alive = torch.arange(rows, device=self.device)  # original row of each live cache row
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        for step in range(T):
            out_tok[alive, step], out_logp[alive, step] = tok, logp
            done = torch.isin(tok, stop)
            stopped[alive] = done
            lengths[alive] = step + 1
            if step == T - 1:
                break
            keep = ~done
            n_keep = int(keep.sum())  # the one host sync per step
            if n_keep == 0:
                break
            cache_len = max(len(p) for p in prompts) + step + 1  # positions any row reads at this step
            if n_keep < len(alive):  # compact: live rows move to the front of the cache
                keep_idx = keep.nonzero()[:, 0]
                for k, v in cache:
                    k[:n_keep, :, :cache_len] = k[keep_idx, :, :cache_len]
                    v[:n_keep, :, :cache_len] = v[keep_idx, :, :cache_len]
                alive, tok, cache_pos = alive[keep_idx], tok[keep_idx], cache_pos[keep_idx]
            logits = self._decode(tok, cache_pos, cache, cache_len)
            tok, logp = sample_tokens(logits, params.temperature, params.top_p, params.top_k, g)
            cache_pos = cache_pos + 1
        out_tok, out_logp = out_tok.tolist(), out_logp.tolist()
        lengths, stopped = lengths.tolist(), stopped.tolist()
        results = []
        for i in range(len(prompts)):
            results.append([Completion(token_ids=out_tok[r][:lengths[r]],
                                       logprobs=out_logp[r][:lengths[r]] if params.logprobs else None,
                                       finish_reason="stop" if stopped[r] else "length")
                            for r in range(i * n, (i + 1) * n)])
        return results


def _buckets(max_num_seqs: int) -> list[int]:
    """CUDA-graph batch sizes: 2, 4, 8, then multiples of 16 up to max_num_seqs (one row costs what two do)."""
    b = [x for x in (2, 4, 8) if x < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(b + [max_num_seqs]))


def _span(cache_len: int, max_len: int) -> int:
    """Cache positions a decode graph attends over: cache_len rounded up to a multiple of max(256, max_len / 16),
    so at most 16 spans per batch bucket, and attention reads at most max_len / 16 positions it does not need."""
    step = max(256, -(-max_len // 16))
    return min(max_len, -(-cache_len // step) * step)


def _decode_step(model, tokens, cache_pos, kv, cache_len: int):
    """One token per row, written at cache_pos, attending over kv[:, :, :cache_len] -> logits [rows, vocab];
    the unit the CUDA graphs replay."""
    batch = AttnBatch(kv_cache=kv, cache_pos=cache_pos, cache_len=cache_len)
    return model(tokens[:, None], cache_pos[:, None], batch)[:, 0]


def make_engine(kind: str, model, max_num_seqs: int = 256, log=print):
    """rollout_engine = "auto" | "torch": the built-in engine (the in-process vLLM engine is not built yet)."""
    if kind not in ("auto", "torch"):
        raise ValueError(f"rollout_engine={kind!r}; use 'auto' or 'torch'")
    log(f"rollout engine: torch (built-in{', CUDA graphs' if model.output_weight.is_cuda else ''})")
    return TorchEngine(model, max_num_seqs=max_num_seqs)
