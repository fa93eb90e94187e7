"""A stand-in for the few pieces of vllm that rollout.VLLMEngine touches, backed by model.py on the CPU.

It behaves like the real engine where the trainer depends on it: a max_model_len above the model's
max_position_embeddings is refused, "dummy" random weights at start, sleep(2) destroys the weights,
load_weights takes full tensors in HF's names only (an expert stack as one tensor per expert and projection),
each request is sampled with its own seed, and the sampled token's log-prob comes back per position (when
asked for). Its engine (llm.llm_engine) steps requests one token at a time with delta outputs, and an aborted
request leaves no output, as vLLM's does. It records every call, so the CPU tests can check the engine's
bookkeeping and the trainer's choreography (wake, push, generate, sleep) without a GPU.

tests/helpers/fake_vllm_launch.py runs train_dapo.py with this module as vllm, for torchrun tests."""
import enum
import importlib.machinery
import os
import sys
import time
import types
from types import SimpleNamespace

import torch

import hf
import model as M
import rollout as R


class RequestOutputKind(enum.Enum):  # vllm.sampling_params.RequestOutputKind
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(self, seed=None, flat_logprobs=False, logprobs=None, **kw):
        self.seed, self.flat_logprobs, self.logprobs = seed, flat_logprobs, logprobs
        self.__dict__.update(dict(n=1, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[], ignore_eos=False,
                                  detokenize=True, output_kind=RequestOutputKind.CUMULATIVE), **kw)  # vLLM's defaults


class LLM:
    instances = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.awake = kwargs, [], {"weights", "kv_cache"}
        self.logprobs_asked = []  # per generate call: whether any request asked for log-probs
        if kwargs.get("distributed_executor_backend") == "external_launcher":  # as vLLM's executor reads them
            self.rank, self.local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        config = hf.load_config(kwargs["model"])
        limit, max_model_len = config.max_position_embeddings, kwargs.get("max_model_len")
        if max_model_len is not None and max_model_len > limit:  # vLLM's ModelConfig check, in its words
            raise ValueError(f"User-specified max_model_len ({max_model_len}) is greater than the derived "
                             f"max_model_len (max_position_embeddings={limit} or model_max_length=None in model's "
                             "config.json). To allow overriding this maximum, set the env var "
                             "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
        self.model = M.Transformer(config).init_weights(seed=12345).eval()  # "dummy"
        self.llm_engine = LLMEngine(self)
        LLM.instances.append(self)

    def sleep(self, level):
        self.calls.append(("sleep", level))
        if level == 2:  # weights are discarded, not kept in host memory
            for p in self.model.parameters():
                p.data.fill_(float("nan"))
        self.awake = set()

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))
        self.awake |= set(tags)

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, fn):
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(load_weights=self._load),
                                                              reload_weights=self._reload))
        return [fn(worker)]

    def _reload(self, weights_iterator):
        """vLLM's layerwise reload: the same names as load_weights, with the kernels' weight processing redone."""
        self.calls.append(("reload",))
        self._load(weights_iterator)

    def _load(self, weights):
        assert "weights" in self.awake, "load_weights while the weights are asleep"
        assert not self.llm_engine.requests, "load_weights while requests are in flight would mix two weights"
        targets = hf.hf_targets(self.model)  # HF names only, as vLLM's own modules are named
        names = []
        with torch.no_grad():
            for name, t in weights:
                if name not in targets:
                    raise KeyError(f"{name!r} is not an HF tensor name of this model")
                hf.copy_hf_tensor(*targets[name], t)
                names.append(name)
        self.calls.append(("load", tuple(names)))

    def generate(self, requests, sampling, use_tqdm=True):
        assert self.awake == {"weights", "kv_cache"}, f"generate while asleep ({self.awake})"
        self.calls.append(("generate", len(requests)))
        sampling = sampling if isinstance(sampling, list) else [sampling] * len(requests)
        self.last_sampling = sampling
        self.logprobs_asked.append(any(sp.logprobs is not None for sp in sampling))
        outs = []
        for req, sp in zip(requests, sampling):
            c, logprobs = self._sample(req, sp)
            routed = self._routing(req["prompt_token_ids"] + list(c.token_ids)[:-1]) \
                if self.kwargs.get("enable_return_routed_experts") else None
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(c.token_ids), logprobs=logprobs,
                                                                 finish_reason=c.finish_reason,
                                                                 routed_experts=routed)]))
        return outs

    def _sample(self, req, sp):
        """One request's whole completion from the current weights -> (Completion, vLLM's FlatLogprobs or None)."""
        assert sp.n == 1
        engine = R.TorchEngine(self.model, use_cuda_graph=False)
        c = engine.generate([req["prompt_token_ids"]], R.SamplingParams(
            n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=sp.max_tokens, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
            seed=sp.seed))[0][0]
        assert sp.flat_logprobs or sp.logprobs is None  # else a {token: Logprob} dict per position, unread
        return c, None if sp.logprobs is None else flat_logprobs(c.token_ids, c.logprobs)

    def _routing(self, tokens):
        """vLLM's routed_experts: uint8 numpy [tokens fed to the model, all layers, top_k], each MoE layer's top-k
        ids by probability (dense layers 0): one row per token forwarded, so the last sampled token has none."""
        cfg = self.model.config
        out = torch.zeros(len(tokens), cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.uint8)
        def record(i, logits):  # returns None: a forward hook's return value would replace the router's logits
            out[:, i] = logits.float().softmax(-1).topk(out.shape[2]).indices

        hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, logits, i=i: record(i, logits))
                 for i, layer in enumerate(self.model.model.layers) if isinstance(layer.mlp, M.MoE)]
        with torch.no_grad():
            self.model(torch.tensor([tokens]))
        for h in hooks:
            h.remove()
        return out.numpy()


def flat_logprobs(token_ids, logprobs):
    """vLLM's FlatLogprobs: flat lists, positions by index ranges (one entry each: logprobs=0)."""
    return SimpleNamespace(start_indices=list(range(len(logprobs))), end_indices=list(range(1, len(logprobs) + 1)),
                           token_ids=list(token_ids), logprobs=list(logprobs))


class LLMEngine:
    """vLLM's engine under LLM (llm.llm_engine), stepped by the caller: add_request, step, abort_request. Each step
    samples one more token of every request in flight from the current weights (one packed forward of the whole
    sequences; each request with its own seeded generator, as the built-in engine samples a row) and hands it out
    as a delta (the only output kind nanodapo reads this way)."""

    def __init__(self, llm):
        self.llm, self.requests = llm, {}  # request id -> (prompt token ids, params, generator, tokens, log-probs)

    def add_request(self, request_id, prompt, params):
        assert params.output_kind == RequestOutputKind.DELTA, params.output_kind
        assert request_id not in self.requests and params.n == 1
        assert self.llm.awake == {"weights", "kv_cache"}, f"add_request while asleep ({self.llm.awake})"
        assert params.flat_logprobs or params.logprobs is None
        self.llm.calls.append(("add_request", request_id))
        g = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), params, g, [], [])

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(float(os.environ.get("FAKE_VLLM_STEP_S", "0")))  # a slower engine, for tests that need one
        outs = []
        if not self.requests:
            return outs
        # one packed forward of every request's sequence, logits at each one's last token
        ids, pos, batch = M.pack_sequences([p + t for p, _, _, t, _ in self.requests.values()], torch.device("cpu"))
        with torch.no_grad():
            last = self.llm.model(ids, pos, batch, logits_at=batch.cu_seqlens[1:].long() - 1)
        for row, (rid, (prompt, sp, g, tokens, logprobs)) in enumerate(list(self.requests.items())):
            tok, logp = R.sample_tokens(last[row:row + 1], sp.temperature, sp.top_p, sp.top_k if sp.top_k > 0 else -1,
                                        g)
            tokens.append(int(tok))
            logprobs.append(float(logp))
            stopped = not sp.ignore_eos and tokens[-1] in sp.stop_token_ids
            finished = stopped or len(tokens) == sp.max_tokens
            delta = None if sp.logprobs is None else flat_logprobs(tokens[-1:], logprobs[-1:])
            outs.append(SimpleNamespace(request_id=rid, finished=finished, outputs=[SimpleNamespace(
                token_ids=(tokens[-1],), logprobs=delta,
                finish_reason=("stop" if stopped else "length") if finished else None)]))
            if finished:
                del self.requests[rid]
        return outs

    def abort_request(self, request_ids):
        self.llm.calls.append(("abort", len(request_ids)))
        for rid in request_ids:
            self.requests.pop(rid, None)  # vLLM's sync engine returns nothing for an aborted request


def vllm_module():
    """A module `vllm` made of this file's stand-ins (and vllm.sampling_params)."""
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = LLM, SamplingParams
    module.sampling_params = types.ModuleType("vllm.sampling_params")
    module.sampling_params.RequestOutputKind = RequestOutputKind
    return module


GPU_BYTES = 80 * 2**30  # the device the stand-in engine sizes its KV pool against


def install_globally(free_bytes=8 * 2**30):
    """For a whole process (tests/helpers/fake_vllm_launch.py): `import vllm` gives the stand-ins."""
    module = vllm_module()
    sys.modules["vllm"], sys.modules["vllm.sampling_params"] = module, module.sampling_params
    R.free_device_memory = lambda: free_bytes
    R.device_memory_bytes = lambda: GPU_BYTES


def install(monkeypatch, free_bytes=lambda: 8 * 2**30):
    """Make `import vllm` return this module's stand-ins for the rest of the test."""
    module = vllm_module()
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", module.sampling_params)
    monkeypatch.setattr(R, "free_device_memory", free_bytes)
    monkeypatch.setattr(R, "device_memory_bytes", lambda: GPU_BYTES)
    # the CPU tests stay a plain process without a group; the environment is what _ensure_process_group leaves
    # for vLLM (test_a_single_rank_gets_a_process_group_for_vllm_without_hanging checks the real one)
    monkeypatch.setattr(R, "_ensure_process_group", lambda: [monkeypatch.setenv(k, os.environ.get(k, "0"))
                                                             for k in ("RANK", "LOCAL_RANK")])
    LLM.instances.clear()
    return module
