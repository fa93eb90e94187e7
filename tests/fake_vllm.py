"""A stand-in for the few pieces of vllm that rollout.VLLMEngine touches, backed by model.py on the CPU.

It behaves like the real engine where the trainer depends on it: a max_model_len above the model's
max_position_embeddings is refused, "dummy" random weights at start, sleep(2) destroys the weights,
load_weights takes full tensors in HF's names only (an expert stack as one tensor per expert and projection),
each request is sampled with its own seed, and the sampled token's log-prob comes back per position (when
asked for). It records every call, so the CPU tests can check the engine's bookkeeping and the trainer's
choreography (wake, push, generate, sleep) without a GPU."""
import importlib.machinery
import os
import sys
import types
from types import SimpleNamespace

import torch

import hf
import model as M
import rollout as R


class SamplingParams:
    def __init__(self, seed=None, flat_logprobs=False, logprobs=None, **kw):
        self.seed, self.flat_logprobs, self.logprobs = seed, flat_logprobs, logprobs
        self.__dict__.update(dict(n=1, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[], ignore_eos=False,
                                  detokenize=True), **kw)  # vLLM's defaults


class LLM:
    instances = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.awake = kwargs, [], {"weights", "kv_cache"}
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
        engine = R.TorchEngine(self.model, use_cuda_graph=False)
        outs = []
        sampling = sampling if isinstance(sampling, list) else [sampling] * len(requests)
        self.last_sampling = sampling
        for req, sp in zip(requests, sampling):
            assert sp.n == 1
            c = engine.generate([req["prompt_token_ids"]], R.SamplingParams(
                n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
                max_tokens=sp.max_tokens, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                seed=sp.seed))[0][0]
            assert sp.flat_logprobs or sp.logprobs is None  # else a {token: Logprob} dict per position, unread
            # vLLM's FlatLogprobs: flat lists, positions by index ranges (one entry each: logprobs=0); None unasked
            logprobs = None if sp.logprobs is None else SimpleNamespace(
                start_indices=list(range(len(c.logprobs))), end_indices=list(range(1, len(c.logprobs) + 1)),
                token_ids=list(c.token_ids), logprobs=list(c.logprobs))
            routed = self._routing(req["prompt_token_ids"] + list(c.token_ids)[:-1]) \
                if self.kwargs.get("enable_return_routed_experts") else None
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(c.token_ids), logprobs=logprobs,
                                                                 finish_reason=c.finish_reason,
                                                                 routed_experts=routed)]))
        return outs

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


def install(monkeypatch, free_bytes=lambda: 8 * 2**30):
    """Make `import vllm` return this module's stand-ins for the rest of the test."""
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(R, "free_device_memory", free_bytes)
    # the CPU tests stay a plain process without a group; the environment is what _ensure_process_group leaves
    # for vLLM (test_a_single_rank_gets_a_process_group_for_vllm_without_hanging checks the real one)
    monkeypatch.setattr(R, "_ensure_process_group", lambda: [monkeypatch.setenv(k, os.environ.get(k, "0"))
                                                             for k in ("RANK", "LOCAL_RANK")])
    LLM.instances.clear()
    return module
