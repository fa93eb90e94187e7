"""
Generation (rollout). One interface, two engines:

- TorchEngine: the built-in batched sampler over model.py; runs anywhere (CPU, a GPU without vLLM, an NPU).
  Prompts are prefilled once, packed; a prompt's n samples copy its KV into their rows of a preallocated
  cache; each decode step is one batched forward of one token per live row; finished rows are compacted
  away; on CUDA the decode step is replayed from CUDA graphs (its blocks compiled with compile=True).
- VLLMEngine: vLLM in the training process ("colocated"): ranks [e * gen_tp, (e + 1) * gen_tp) form engine
  e, which generates its share of the prompts from weights pushed by the trainer in buckets of full tensors,
  and sleeps between rollouts to give its memory back to training.

The interface: generate(prompts, params, version) -> per prompt, n Completions; load_weights(buckets,
version); wake_up(tags); sleep(). `weights_version` is the trainer version the engine holds (None: no
weights); generating with another version than the caller's raises StaleWeightsError.

Log-probs are the sampled tokens' under log_softmax(logits / temperature), as the trainer computes them.
With top_p < 1 or top_k, vLLM's ("processed_logprobs") are renormalized over the kept tokens and the
built-in engine's are not, so they differ by the log of the kept mass (the training defaults top_p=1,
top_k=-1 make them equal).
"""
import functools
import importlib.util
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import parallel
from hf import copy_hf_tensor, hf_targets, hf_tensors, load_config
from model import MLP, AttnBatch, pack_sequences


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
    # the sampled tokens' log-probs (the built-in engine returns them always: they are free)
    logprobs: bool = True


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float] | None
    # "stop" (a stop token was sampled), "length" (max_tokens) or "abort" (paused: generate's should_pause)
    finish_reason: str
    # vLLM's MoE routing, [prompt + response - 1 tokens, layers, top_k]
    routed_experts: torch.Tensor | None = None


# -----------------------------------------------------------------------------
# sampling (pure functions on a [rows, vocab] logits tensor)

def sample_tokens(logits, temperature: float, top_p: float, top_k: int, generator=None, pick=None):
    """-> (token ids [rows], log p(token) under log_softmax(logits / T)) with top-k / top-p filtering.
    pick: gumbel_pick or a compiled copy of it (the engine's, one fused kernel instead of a dozen); one row
    takes the eager one, because torch.compile specializes a size of 1 (a compiled pick would compile a graph
    of its own mid-run, the first time one row is left)."""
    if temperature <= 0:  # greedy; log-probs at temperature 1
        logits = logits.float()
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    noise = torch.empty(logits.shape, device=logits.device).exponential_(generator=generator)
    if pick is None or logits.shape[0] == 1:
        pick = gumbel_pick
    return pick(logits, noise, temperature, top_p, top_k)


def gumbel_pick(logits, noise, temperature: float, top_p: float, top_k: int):
    """Sample with Gumbel-max: argmax(log p - log E), E ~ Exp(1) (noise), draws from p; no random numbers
    here, so it compiles (the noise keeps the caller's seeded generator). -> (tokens, unfiltered
    log-probs)."""
    scaled = logits.float() / temperature
    filtered = scaled
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:  # smallest set of most likely tokens whose probability reaches top_p
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep a token if the mass before it is < top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    tok = (filtered - noise.log()).argmax(-1)  # log p's normalizer is the same for every token: left out
    return tok, scaled.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(scaled, -1)


# -----------------------------------------------------------------------------
# the built-in engine

class TorchEngine:
    """Batched generation over a model.Transformer, the trainer's own (shares_weights) or, under FSDP / TP, a
    full bf16 copy filled by load_weights before every rollout. The KV cache (at most max_num_seqs rows of
    cache_positions(longest prompt + max_tokens)) is allocated by the first generate that needs it, reused
    while large enough, freed by sleep(). On CUDA the decode step, many small kernels, is replayed from CUDA
    graphs captured per (batch-size bucket, cache span). compile: torch.compile the decoder blocks (the
    engine's own copy) and the sampler, so Inductor fuses the norms, RoPE and SwiGLU that otherwise launch
    most of those kernels, and the sampler's dozen passes over the logits."""
    # decode steps between the host's looks at which rows finished (each look waits for the GPU); a row that
    # finishes in between decodes on until then, its tokens past its length dropped
    finished_check_every = 8

    def __init__(self, model, max_num_seqs: int = 256, use_cuda_graph: bool | None = None,
                 shares_weights: bool = True, compile: bool = False):
        self.model = model
        if not shares_weights:  # a copy of its own, never trained: q, k, v in one matmul, gate, up in one
            for layer in model.model.layers:
                layer.self_attn.fuse_qkv()
                if isinstance(layer.mlp, MLP):  # dense; an MoE layer's experts are stacked already
                    layer.mlp.fuse_gate_up()
        self.pick = None  # sample_tokens' default, eager gumbel_pick
        if compile:  # shapes symbolic from the start: the graphs serve every batch bucket and cache span
            parallel.apply_compile(model, dynamic=True)
            self.pick = torch.compile(gumbel_pick, dynamic=True)
        self.max_num_seqs = max_num_seqs
        self.device = model.output_weight.device
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        self.use_cuda_graph = use_cuda_graph
        self.shares_weights = shares_weights  # the trainer's own tensors: every update reaches us, no push
        self.weights_version = 0
        self._drop_cache()

    # the engine interface ------------------------------------------------------
    def load_weights(self, buckets, version: int) -> int:
        """Copy buckets of (name, tensor), in the model's names or HF's (one per expert), into it -> bytes
        copied."""
        params = dict(self.model.named_parameters())
        targets = None  # HF name -> (parameter, index), built when the first HF name comes
        nbytes = 0
        with torch.no_grad():
            for bucket in buckets:
                for name, t in bucket:
                    if name in params:
                        params[name].copy_(t)
                    else:
                        targets = targets or hf_targets(self.model)
                        copy_hf_tensor(*targets[name], t)
                    nbytes += t.numel() * t.element_size()
        self.weights_version = version
        return nbytes

    def sleep(self):
        """Free the KV cache and graphs; the weights stay (they are the trainer's, or a copy we keep)."""
        self._drop_cache()
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).empty_cache()

    def wake_up(self, tags=None):
        pass  # the cache is allocated lazily by generate

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int | None = None,
                 should_stop=None, should_pause=None,
                 max_tokens: list[int] | None = None) -> list[list[Completion]]:
        """-> per prompt, params.n completions, in waves of whole prompts (at most max_num_seqs rows each).
        version: the trainer's weight version the caller expects. should_stop(), if given, is asked before
        every decode step: True abandons the generation (GenerationStopped). should_pause() likewise: True
        ends it early, the unfinished completions (those of waves not begun: empty) with finish_reason
        "abort" (partial rollout). max_tokens: each prompt's own budget instead of params.max_tokens."""
        check_version(self.weights_version, version)
        g = None if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        budgets = max_tokens or [params.max_tokens] * len(prompts)
        per_wave = max(1, self.max_num_seqs // params.n)
        out = []
        for s in range(0, len(prompts), per_wave):
            if out and any(c.finish_reason == "abort" for c in out[-1]):  # paused: the rest is not begun
                not_begun = prompts[s:s + per_wave]
                out += [[Completion([], [], "abort") for _ in range(params.n)] for _ in not_begun]
                continue
            out += self._generate_wave(prompts[s:s + per_wave], params, g, should_stop, should_pause,
                                       budgets[s:s + per_wave])
        return out

    # internals -----------------------------------------------------------------
    def _drop_cache(self):
        """Forget the KV cache, the CUDA graphs' inputs and output, and the graphs (which live in one memory
        pool)."""
        self._cache, self._io, self._graphs, self._pool = None, None, {}, None

    def _alloc_cache(self, rows: int, max_len: int):
        """Per layer (k, v) [rows, kv_heads, >= max_len, head_dim], reused while large enough; with CUDA
        graphs also their inputs (tokens, positions) and output (logits), shared by all graphs."""
        cfg, w, c = self.model.config, self.model.output_weight, self._cache
        if c is not None and c[0][0].shape[0] >= rows and c[0][0].shape[2] >= max_len:  # rows, positions
            return c
        shape = (rows, cfg.num_key_value_heads, cache_positions(max_len), cfg.head_dim)
        self._drop_cache()  # the old graphs read the old cache
        cache = []
        for _ in range(cfg.num_hidden_layers):
            cache.append((torch.zeros(shape, dtype=w.dtype, device=self.device),
                          torch.zeros(shape, dtype=w.dtype, device=self.device)))
        self._cache = cache
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
        # logits of each prompt's last token only: [prompts, vocab]
        logits = self.model(ids, pos, batch, logits_at=batch.cu_seqlens[1:].long() - 1)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        Lp = int(lens.max())
        # token index of (row, t) in the packed prompt; rows of a prompt are adjacent
        start = batch.cu_seqlens[:-1].long().repeat_interleave(n)
        idx = (start[:, None] + torch.arange(Lp, device=self.device)[None]).clamp(max=ids.shape[1] - 1)
        rows = idx.shape[0]
        for (k, v), (k_cache, v_cache) in zip(batch.collect_kv, cache):
            k_cache[:rows, :, :Lp] = k[idx].transpose(1, 2)  # positions past a prompt's end are masked later
            v_cache[:rows, :, :Lp] = v[idx].transpose(1, 2)
        tok, logp = sample_tokens(logits.repeat_interleave(n, 0), params.temperature, params.top_p,
                                  params.top_k, g, self.pick)
        return tok, logp, lens.repeat_interleave(n)

    def _decode(self, tokens, cache_pos, cache, cache_len: int):
        """One token per row -> logits [rows, vocab]; replayed from a CUDA graph when enabled."""
        rows = tokens.shape[0]
        if not self.use_cuda_graph:
            return _decode_step(self.model, tokens, cache_pos, cache, cache_len)
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
        """A CUDA graph of the decode step for the first `bucket` rows, attending over the first `span`
        positions."""
        t_in, p_in, logits = (x[:bucket] for x in self._io)
        # warm-up and capture really run: they write slot span - 1 of every row, which no live row holds yet
        p_in.fill_(span - 1)

        def step():
            logits.copy_(_decode_step(self.model, t_in, p_in, cache, span))

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

    def _generate_wave(self, prompts, params, g, should_stop=None, should_pause=None, budgets=None):
        """One wave of whole prompts -> per prompt, params.n completions."""
        n = params.n
        budgets = budgets or [params.max_tokens] * len(prompts)
        T = max(budgets)
        rows, longest = len(prompts) * n, max(len(p) for p in prompts)
        if self.use_cuda_graph:
            cache_rows = self.max_num_seqs  # the graphs' batch buckets go up to max_num_seqs rows
        else:
            cache_rows = rows
        cache = self._alloc_cache(cache_rows, longest + T)
        tok, logp, cache_pos = self._prefill(prompts, params, cache, g)
        if params.ignore_eos:
            stop_ids = [-1]  # no token is -1: every row runs to max_tokens
        else:
            stop_ids = sorted(set(params.stop_token_ids))
        stop = torch.tensor(stop_ids, device=self.device)
        out_tok = torch.full((rows, T), -1, dtype=torch.long, device=self.device)
        out_logp = torch.zeros(rows, T, device=self.device)
        alive = torch.arange(rows, device=self.device)  # original row of each live cache row
        limit = torch.tensor(budgets, device=self.device).repeat_interleave(n)  # each row's max_tokens
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        paused = torch.zeros(rows, dtype=torch.bool, device=self.device)
        running = torch.ones(rows, dtype=torch.bool, device=self.device)  # per live cache row: not finished
        for step in range(T):
            if should_stop is not None and should_stop():
                raise GenerationStopped(f"stopped at decode step {step} of {T}")
            if should_pause is not None and should_pause():  # this step's tokens are not kept
                paused[alive] = running
                break
            # a finished row's later tokens land past its length: never read
            out_tok[alive, step], out_logp[alive, step] = tok, logp
            hit = torch.isin(tok, stop) & running
            stopped[alive] |= hit
            lengths[alive] = torch.where(running, step + 1, lengths[alive])
            running &= ~hit & (limit[alive] > step + 1)
            if step == T - 1:
                break
            cache_len = longest + step + 1  # positions any row reads at this step
            if (step + 1) % self.finished_check_every == 0:  # the host sync: drop finished rows
                n_keep = int(running.sum())
                if n_keep == 0:
                    break
                if n_keep < len(alive):  # compact: live rows move to the front of the cache
                    keep_idx = running.nonzero()[:, 0]
                    for k, v in cache:
                        k[:n_keep, :, :cache_len] = k[keep_idx, :, :cache_len]
                        v[:n_keep, :, :cache_len] = v[keep_idx, :, :cache_len]
                    alive, tok, cache_pos = alive[keep_idx], tok[keep_idx], cache_pos[keep_idx]
                    running = running[keep_idx]
            logits = self._decode(tok, cache_pos, cache, cache_len)
            tok, logp = sample_tokens(logits, params.temperature, params.top_p, params.top_k, g, self.pick)
            cache_pos = cache_pos + 1
        out_tok, out_logp, lengths = out_tok.tolist(), out_logp.tolist(), lengths.tolist()
        stopped, paused = stopped.tolist(), paused.tolist()
        flat = []
        for r in range(rows):
            if paused[r]:
                reason = "abort"
            elif stopped[r]:
                reason = "stop"
            else:
                reason = "length"
            flat.append(Completion(token_ids=out_tok[r][:lengths[r]], logprobs=out_logp[r][:lengths[r]],
                                   finish_reason=reason))
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]  # a prompt's n rows are adjacent


def _buckets(max_num_seqs: int) -> list[int]:
    """CUDA-graph batch sizes: 2, 4, 8, then multiples of 16 up to max_num_seqs."""
    b = [x for x in (2, 4, 8) if x < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(b + [max_num_seqs]))


def cache_positions(max_len: int) -> int:
    """KV-cache positions per row for sequences of up to max_len tokens: the positions a row reads
    (max_len - 1) rounded up to a multiple of 256, so that every span a decode graph attends over is one (the
    decode step is slower over a span that is not a multiple of 256; bench/LOG.md has the figures), plus the
    last slot."""
    return -(-(max_len - 1) // 256) * 256 + 1


def _span(cache_len: int, max_len: int) -> int:
    """Cache positions a decode graph attends over: cache_len rounded up to a multiple of
    256 * ceil(max_len / 4096), so at most 16 graphs per batch bucket, each over a multiple of 256 positions
    when max_len is one."""
    step = 256 * -(-max_len // 4096)
    return min(max_len, -(-cache_len // step) * step)


def _decode_step(model, tokens, cache_pos, kv, cache_len: int):
    """One token per row, written at cache_pos, attending over kv[:rows, :, :cache_len] -> logits [rows,
    vocab]."""
    batch = AttnBatch(kv_cache=kv, cache_pos=cache_pos, cache_len=cache_len)
    return model(tokens[:, None], cache_pos[:, None], batch)[:, 0]


class StaleWeightsError(RuntimeError):
    """A generate call with weights of another version than the caller expects."""


class GenerationStopped(Exception):
    """A stop was requested (a signal) during generate(): its completions are discarded."""


def check_version(held, expected):
    """StaleWeightsError unless the engine holds version `expected` (None: the caller does not check)."""
    if expected is not None and held != expected:
        raise StaleWeightsError(f"the rollout engine holds weights version {held} but the trainer is at "
                                f"{expected}: generating now would train on samples from other weights (push "
                                "the weights first)")


# -----------------------------------------------------------------------------
# the in-process vLLM engine

def engine_share(num_prompts: int, world_size: int, gen_tp: int, rank: int) -> tuple[int, int, int]:
    """-> (engine index, lo, hi): ranks [e * gen_tp, (e + 1) * gen_tp) form engine e (vLLM's "external data
    parallel" layout), which generates prompts[lo:hi]. The built-in engine is the case gen_tp = 1."""
    engines, e = world_size // gen_tp, rank // gen_tp
    k = -(-num_prompts // engines)  # prompts per engine, rounded up
    return e, min(e * k, num_prompts), min((e + 1) * k, num_prompts)


def engine_results(per_rank: list, gen_tp: int) -> list:
    """From every rank's result (rank order), one per engine (its TP rank 0), in engine order = prompt
    order."""
    return per_rank[::gen_tp]


def _ensure_process_group():
    """vLLM's external_launcher joins torchrun's process group (parallel.init_process_group: a group of one
    without torchrun) and reads RANK and LOCAL_RANK."""
    kind = parallel.device_type()
    parallel.init_process_group(kind)
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(torch.accelerator.current_device_index() if kind != "cpu" else 0))


VLLM_RESERVE_BYTES = 2**30  # a vLLM engine's activations and CUDA graphs besides its weights and KV cache


def device_memory_bytes() -> int:
    """The current accelerator's total memory."""
    return torch.get_device_module().mem_get_info()[1]


def free_device_memory() -> int:
    """Bytes free on the current accelerator as the driver sees them, after torch's allocator returns its
    cached blocks (vLLM's memory pool is invisible to torch's allocator statistics)."""
    module = torch.get_device_module()
    module.empty_cache()
    return module.mem_get_info()[0]


def vllm_kv_cache_bytes(model_cfg, *, max_model_len: int, max_num_seqs: int, gen_tp: int,
                        gpu_memory_utilization: float, gpu_bytes: int, dtype_bytes: int = 2) -> int | None:
    """The KV pool per GPU of a vLLM engine: room for max_num_seqs sequences (the most it decodes at once) of
    max_model_len tokens, each rounded up to 64-token blocks plus one; or None (vLLM fills what
    gpu_memory_utilization x gpu_bytes leaves after the weights) where that is not more. A smaller pool is
    cheaper to map on every wake and release on every sleep, and leaves the rest to training."""
    m = model_cfg
    kv_heads = max(1, m.num_key_value_heads // gen_tp)  # each TP rank keeps its own heads (at least one)
    per_token = m.num_hidden_layers * 2 * kv_heads * m.head_dim * dtype_bytes  # k and v of every layer
    tokens = max_num_seqs * (math.ceil(max_model_len / 64) + 1) * 64
    room = gpu_memory_utilization * gpu_bytes - dtype_bytes * m.num_params() / gen_tp - VLLM_RESERVE_BYTES
    if tokens * per_token >= room:
        return None
    return tokens * per_token


class VLLMEngine:
    """vllm.LLM in this process, one per TP group of gen_tp ranks, on torchrun's process group; built before
    the trainer allocates its memory, with dummy weights that the trainer replaces before the first generate.
    Per rollout (sleep level 2 drops weights and KV cache, so every wake needs a full push):
        wake_up(["weights"]) -> load_weights(buckets) -> wake_up(["kv_cache"]) -> generate -> sleep()
    """
    shares_weights = False

    def __init__(self, model_path: str, *, gen_tp: int = 1, gpu_memory_utilization: float = 0.5,
                 max_model_len: int, max_num_seqs: int = 256, enforce_eager: bool = False,
                 enable_chunked_prefill: bool = True, max_num_batched_tokens: int | None = None,
                 seed: int = 0, dtype: str = "bfloat16", engine_kwargs: dict | None = None):
        kw = dict(model=model_path, tensor_parallel_size=gen_tp, enable_sleep_mode=True,
                  gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                  enable_chunked_prefill=enable_chunked_prefill, max_model_len=max_model_len,
                  max_num_seqs=max_num_seqs, skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
                  seed=seed,  # the same on every rank of a TP group: their schedulers must sample alike
                  logprobs_mode="processed_logprobs",  # log p after temperature (and top-k/top-p), as trained
                  distributed_executor_backend="external_launcher")  # vLLM joins the trainer's process group
        if max_num_batched_tokens:
            kw["max_num_batched_tokens"] = max_num_batched_tokens
        kw.update(engine_kwargs or {})
        config = load_config(model_path)
        self.moe = config.num_experts > 0
        limit = config.max_position_embeddings  # vLLM refuses a longer context
        if kw["max_model_len"] > limit:
            raise ValueError(f"max_model_len={kw['max_model_len']} (max_prompt_length + max_response_length) "
                             f"is above max_position_embeddings={limit} in "
                             f"{os.path.join(model_path, 'config.json')}: lower max_prompt_length or "
                             f"max_response_length so that their sum is at most {limit}")
        if "kv_cache_memory_bytes" not in kw:  # vLLM then takes this much for KV and skips its profiling
            kw["kv_cache_memory_bytes"] = vllm_kv_cache_bytes(
                config, max_model_len=kw["max_model_len"], max_num_seqs=kw["max_num_seqs"],
                gen_tp=kw["tensor_parallel_size"], gpu_memory_utilization=kw["gpu_memory_utilization"],
                gpu_bytes=device_memory_bytes(), dtype_bytes=getattr(torch, kw["dtype"]).itemsize)
        self.kv_cache_bytes = kw["kv_cache_memory_bytes"]  # None: sized by vLLM from gpu_memory_utilization
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine must live in this process
        from vllm import LLM
        _ensure_process_group()
        self.llm = LLM(**kw)
        self.weights_version = None  # dummy weights
        self.awake = {"weights", "kv_cache"}
        self.stepped_calls = 0  # _generate_stepwise's request ids are unique per call
        free_before = free_device_memory()
        self.sleep()
        # weights + KV cache: what waking up must find free
        self.awake_bytes = free_device_memory() - free_before

    def sleep(self):
        if self.awake:
            self.llm.sleep(level=2)
        self.awake, self.weights_version = set(), None

    def wake_up(self, tags=("weights", "kv_cache")):
        tags = [t for t in tags if t not in self.awake]
        if not tags:
            return
        free = free_device_memory()
        if not self.awake and free < 0.95 * self.awake_bytes:  # checked before the first tag of a cycle wakes
            raise RuntimeError(f"vLLM needs ~{self.awake_bytes / 2**30:.1f} GiB back (weights + KV cache) to "
                               f"wake up but only {free / 2**30:.1f} GiB are free next to training: lower "
                               "gpu_memory_utilization or max_num_seqs (its KV pool), or turn on "
                               "optimizer_offload (or param_offload)")
        self.llm.wake_up(tags=tags)
        self.awake.update(tags)

    def load_weights(self, buckets, version: int) -> int:
        """Stream buckets of (name, full tensor) into vLLM in HF's names (hf_tensors: views, no copy), one
        bucket alive at a time; vLLM fuses and slices them itself. A MoE goes through vLLM's layerwise reload
        (model_runner.reload_weights), which redoes the expert layouts some MoE kernels build after loading;
        raw load_weights would leave those stale. -> bytes pushed."""
        self.wake_up(["weights"])
        nbytes = 0

        def stream():
            nonlocal nbytes
            for bucket in buckets:
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                for name, t in bucket:
                    yield from hf_tensors(name, t)
        self.llm.collective_rpc(functools.partial(_load_weights_on_worker, weights=stream, moe=self.moe))
        self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights
        self.weights_version = version
        return nbytes

    def requests(self, prompts: list[list[int]], params: SamplingParams, max_tokens: list[int] | None = None,
                 stepwise: bool = False):
        """vLLM's (prompts, sampling params): n requests of one sample per prompt in order (the prefix cache
        shares the prompt's KV), seeded seed + index alike on every TP rank; log-probs as flat lists (not a
        dict and a Logprob object per token). max_tokens: each prompt's own budget. stepwise: each engine step
        returns only the new tokens (generate's step loop)."""
        from vllm import SamplingParams as VLLMSamplingParams
        extra = {}
        if stepwise:
            from vllm.sampling_params import RequestOutputKind
            extra["output_kind"] = RequestOutputKind.DELTA
        budgets = max_tokens or [params.max_tokens] * len(prompts)
        sampling = []
        for i in range(len(prompts)):
            for j in range(params.n):
                seed = None if params.seed is None else params.seed + i * params.n + j
                sampling.append(VLLMSamplingParams(
                    n=1, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                    max_tokens=budgets[i], stop_token_ids=list(params.stop_token_ids),
                    ignore_eos=params.ignore_eos, detokenize=False, logprobs=0 if params.logprobs else None,
                    flat_logprobs=True, seed=seed, **extra))
        prompt_requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(params.n)]
        return prompt_requests, sampling

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int | None = None,
                 should_stop=None, should_pause=None,
                 max_tokens: list[int] | None = None) -> list[list[Completion]]:
        """should_stop is not asked: a vLLM generate call runs to its end, because its TP ranks step together
        (one that stopped alone would leave the others waiting in a collective); the caller's agreement after
        the call stops every rank. should_pause() is asked before every engine step (the caller makes it
        agree over the engine's TP ranks): True aborts the unfinished requests, which come back with the
        tokens they have and finish_reason "abort". max_tokens: each prompt's own budget."""
        check_version(self.weights_version, version)
        self.wake_up(["kv_cache"])
        if should_pause is None:
            outs = self.llm.generate(*self.requests(prompts, params, max_tokens), use_tqdm=False)
            return vllm_completions(outs, params)
        return self._generate_stepwise(prompts, params, should_pause, max_tokens)

    def _generate_stepwise(self, prompts, params: SamplingParams, should_pause, max_tokens):
        """generate through vLLM's engine, one step at a time (what LLM.generate runs), so that it can stop
        between steps: abort_request drops a request without an output, so the tokens come as deltas and
        are kept here."""
        engine = self.llm.llm_engine
        requests, sampling = self.requests(prompts, params, max_tokens, stepwise=True)
        self.stepped_calls += 1
        ids = [f"nanodapo-{self.stepped_calls}-{i}" for i in range(len(requests))]
        for rid, request, sp in zip(ids, requests, sampling):
            engine.add_request(rid, request, sp)
        tokens = {rid: [] for rid in ids}
        logprobs = {rid: [] for rid in ids}
        finish = {}
        while engine.has_unfinished_requests():
            if should_pause():
                unfinished = [rid for rid in ids if rid not in finish]
                engine.abort_request(unfinished)
                finish.update(dict.fromkeys(unfinished, "abort"))
                break
            for out in engine.step():
                c = out.outputs[0]
                tokens[out.request_id] += list(c.token_ids)
                if c.logprobs is not None:
                    logprobs[out.request_id] += _sampled_logprobs(c.logprobs)
                if out.finished:
                    finish[out.request_id] = "stop" if c.finish_reason == "stop" else "length"
        flat = [Completion(token_ids=tokens[rid], logprobs=logprobs[rid] if params.logprobs else None,
                           finish_reason=finish[rid]) for rid in ids]
        return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]


def _load_weights_on_worker(worker, weights, moe: bool):
    """Run by vLLM's worker (collective_rpc): load weights(), an iterator of (HF name, tensor), into its
    model."""
    if moe:
        # layerwise reload: redoes the expert layouts some MoE kernels build after loading
        worker.model_runner.reload_weights(weights_iterator=weights())
    else:
        worker.model_runner.model.load_weights(weights())


def vllm_completions(outs, params: SamplingParams) -> list[list[Completion]]:
    """vLLM's RequestOutputs of VLLMEngine.requests -> n Completions per prompt."""
    flat = []
    for o in outs:
        c = o.outputs[0]
        routed = getattr(c, "routed_experts", None)  # with enable_return_routed_experts (router replay)
        # top-k expert ids are distinct, so a recorded row is never all 0
        if routed is not None and not routed.any():
            raise RuntimeError("vLLM returned no routing (all expert ids 0): its MoE kernel does not record "
                               "it; use the Triton MoE backend, or router_replay=False")
        flat.append(Completion(token_ids=list(c.token_ids),
                               logprobs=None if c.logprobs is None else _sampled_logprobs(c.logprobs),
                               finish_reason="stop" if c.finish_reason == "stop" else "length",
                               routed_experts=None if routed is None else torch.from_numpy(routed)))
    return [flat[i * params.n:(i + 1) * params.n] for i in range(len(flat) // params.n)]


def _sampled_logprobs(lp) -> list[float]:
    """The sampled token's log-prob per position of vLLM's FlatLogprobs: each position's first entry."""
    return [lp.logprobs[k] for k in lp.start_indices]


def resolve_engine(kind: str, device_type: str) -> str:
    """rollout_engine = "auto" (vLLM on CUDA when it is installed, else the built-in engine) | "torch" |
    "vllm"."""
    if kind not in ("auto", "torch", "vllm"):
        raise ValueError(f"rollout_engine={kind!r}; use 'auto', 'torch' or 'vllm'")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if kind == "vllm" and not has_vllm:
        raise ValueError("rollout_engine='vllm' but vllm is not installed: pip install -e '.[vllm]', "
                         "or use rollout_engine='torch'")
    if kind == "auto":
        return "vllm" if has_vllm and device_type == "cuda" else "torch"
    return kind


# -----------------------------------------------------------------------------
# partial rollout: a generation that newer weights can pause

CONTINUATION_SEED_STRIDE = 7919  # continuation k samples with seed + 7919 k: a stream apart from the first part's


def generate_resumable(engine, prompts: list[list[int]], params: SamplingParams, *, version: int,
                       should_stop=None, pause=None) -> tuple[list[list[Completion]], list[list[int]]]:
    """engine.generate, with partial rollout when `pause` is given: pause.requested() (newer weights are
    waiting) ends the generation early; pause.resume() loads them and returns their version; the unfinished
    responses then continue from the tokens they have (prompt + response so far, as a new prompt: the KV is
    computed again, by the new weights) until none is left unfinished.
    -> (per prompt, params.n Completions; per completion, in the same flat order, each token's version, or
    None without a pause: every token is `version`'s)"""
    if pause is None:
        return engine.generate(prompts, params, version=version, should_stop=should_stop), None
    outs = engine.generate(prompts, params, version=version, should_stop=should_stop,
                           should_pause=pause.requested)
    flat = [c for cs in outs for c in cs]
    versions = [[version] * len(c.token_ids) for c in flat]
    prompt_of = [p for p in prompts for _ in range(params.n)]
    part = 0
    while unfinished := [i for i, c in enumerate(flat) if c.finish_reason == "abort"]:
        version = pause.resume()
        part += 1  # each continuation samples with a seed of its own
        seed = None if params.seed is None else params.seed + CONTINUATION_SEED_STRIDE * part
        more = engine.generate([prompt_of[i] + flat[i].token_ids for i in unfinished],
                               SamplingParams(**{**params.__dict__, "n": 1, "seed": seed}), version=version,
                               should_stop=should_stop, should_pause=pause.requested,
                               max_tokens=[params.max_tokens - len(flat[i].token_ids) for i in unfinished])
        for i, (c,) in zip(unfinished, more):
            logprobs = None
            if c.logprobs is not None:
                logprobs = flat[i].logprobs + c.logprobs
            flat[i] = Completion(token_ids=flat[i].token_ids + c.token_ids, logprobs=logprobs,
                                 finish_reason=c.finish_reason)
            versions[i] += [version] * len(c.token_ids)
    n = params.n
    return [flat[k * n:(k + 1) * n] for k in range(len(prompts))], versions
