"""
Hugging Face model directories in and out: config.json -> ModelConfig, *.safetensors -> a Transformer and
back, and the HF name of every parameter. A MoE layer's experts are one stacked parameter here
(mlp.experts.gate_up_proj [E, 2 * I, H]) and one tensor per expert and projection in HF checkpoints and vLLM
(mlp.experts.e.gate_proj.weight, ...): hf_tensors and hf_targets map between the two, for loading, saving
and the weight push to the rollout engine.
"""
import json
import os

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from data import read_json
from model import ModelConfig, Transformer

# The published config.json fields that ModelConfig.from_hf reads, keyed by the lower-cased model directory
# name: --dry_run plans the recipes in configs/ with them when the model is not present; bench/ builds random
# models of them.
KNOWN_CONFIGS = {
    "smollm2-135m-instruct": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
        rms_norm_eps=1e-05, tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-32b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=5120, intermediate_size=27648,
        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, rope_theta=1000000.0,
        rms_norm_eps=1e-05, tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
        rms_norm_eps=1e-06, tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000,
        rms_norm_eps=1e-06, tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen2.5-1.5b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, rope_theta=1000000.0,
        rms_norm_eps=1e-06, tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=False, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001),
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=False, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001),
    "qwen2-0.5b-instruct": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
        rms_norm_eps=1e-06, tie_word_embeddings=True, max_position_embeddings=32768),
}




# an expert stack's name -> the HF projections stacked in it, in order along its dim 1
_EXPERT_PROJ = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def hf_slices(name: str, shape) -> list[tuple[str, tuple]]:
    """A parameter (name, shape) -> its HF tensors as (HF name, index into the parameter): an expert stack
    ...mlp.experts.gate_up_proj [E, 2I, H] -> ...experts.e.gate_proj.weight at [e, :I] and
    ...experts.e.up_proj.weight at [e, I:] for each expert e, down_proj alike; any other name (HF names
    included) maps to itself at index ()."""
    layer, _, proj = name.rpartition(".experts.")
    if proj not in _EXPERT_PROJ:
        return [(name, ())]
    n = shape[1] // len(_EXPERT_PROJ[proj])  # rows of one projection
    slices = []
    for e in range(shape[0]):
        for j, hf in enumerate(_EXPERT_PROJ[proj]):
            slices.append((f"{layer}.experts.{e}.{hf}.weight", (e, slice(j * n, (j + 1) * n))))
    return slices


def hf_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A full parameter (not a DTensor shard) -> [(HF name, tensor)]: the tensor itself, or for an expert
    stack one view per expert and projection (writing into a view writes the stack). For checkpoints and
    load_weights."""
    return [(hf, tensor[ix] if ix else tensor) for hf, ix in hf_slices(name, tensor.shape)]


def hf_targets(model: nn.Module) -> dict:
    """The inverse of hf_tensors: HF name -> (parameter, index) where that HF tensor goes (see
    copy_hf_tensor)."""
    return {hf: (p, ix) for name, p in model.named_parameters() for hf, ix in hf_slices(name, p.shape)}


def copy_hf_tensor(p: torch.Tensor, ix: tuple, t: torch.Tensor):
    """p[ix] = t (under no_grad); p may be a DTensor: each rank holds the full t and keeps the part in its
    shard."""
    if not isinstance(p, DTensor):
        (p[ix] if ix else p).copy_(t)
    elif not ix:
        p.to_local().copy_(distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements,
                                             src_data_rank=None).to_local())
    else:  # a slice of a sharded expert stack: intersect its box with this rank's box, dim by dim
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        # the slice's box in the parameter: an integer index is one row of its dim; the dims after ix are
        # whole
        box = [slice(i, i + 1) if isinstance(i, int) else i for i in ix]
        box += [slice(0, n) for n in p.shape[len(ix):]]
        src, dst = [], []
        for s, o, n in zip(box, offset, shape):
            lo, hi = max(s.start, o), min(s.stop, o + n)
            if lo >= hi:
                return  # not on this rank
            src.append(slice(lo - s.start, hi - s.start))
            dst.append(slice(lo - o, hi - o))
        p.to_local()[tuple(dst)].copy_(t.reshape([s.stop - s.start for s in box])[tuple(src)])


def load_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in model directory {path!r}; model_path must be an HF model "
                                "directory (config.json + *.safetensors), e.g. one saved by save_pretrained")
    try:
        return ModelConfig.from_hf(read_json(cfg_path))
    except KeyError as e:
        raise ValueError(f"{cfg_path} has no {e.args[0]!r}; an HF config.json of a supported architecture "
                         "has it (copy the file again from the model's source)") from None
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted({os.path.join(path, f) for f in read_json(index)["weight_map"].values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} lists {len(missing)} shard(s) that are not in {path!r}, e.g. "
                                    f"{missing[0]!r}; copy the missing shards")
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}; nanodapo "
                            "reads HF safetensors checkpoints (convert .bin with transformers' "
                            "save_pretrained)")


def _checkpoint_tensors(path: str, cfg: ModelConfig):
    """(file, its open safe_open handle, HF name) for each tensor of the checkpoint at path that the model
    holds."""
    for f in safetensors_files(path):
        try:
            sf = safe_open(f, framework="pt", device="cpu")
        except SafetensorError as e:  # raised on open for a truncated or corrupt header
            raise ValueError(f"{f} is not a readable safetensors file ({e}); it is truncated or corrupt: "
                             "copy it again from the model's source") from None
        with sf:
            for name in sf.keys():
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied embeddings: the model has no lm_head
                yield f, sf, name


def check_weights(path: str) -> ModelConfig:
    """The checkpoint at path against its config.json, from the safetensors headers only (no weights are
    read): every tensor named and shaped as config.json implies, none missing, no file truncated. -> its
    ModelConfig."""
    cfg = load_config(path)
    expected = {}  # HF name -> the shape config.json implies
    with torch.device("meta"):
        for name, p in Transformer(cfg).named_parameters():
            for hf, t in hf_tensors(name, p):
                expected[hf] = tuple(t.shape)
    found = set()
    for f, sf, name in _checkpoint_tensors(path, cfg):
        if name not in expected:
            raise ValueError(f"unexpected tensor {name!r} in {f}: not part of a {cfg.architecture} "
                             "with this config.json (wrong architecture or config?)")
        shape = tuple(sf.get_slice(name).get_shape())
        if shape != expected[name]:
            raise ValueError(f"shape mismatch for {name!r} in {f}: the checkpoint has {shape}, config.json "
                             f"implies {expected[name]}; copy the model's own config.json (this one does not "
                             "describe it)")
        found.add(name)
    missing = sorted(set(expected) - found)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensors that its config.json implies, "
                         f"e.g. {missing[:3]}; a shard is missing or config.json does not describe these "
                         "weights (num_hidden_layers, tie_word_embeddings, num_experts)")
    return cfg


def from_pretrained(path: str, dtype=torch.bfloat16, device="cpu", parallelize=None) -> Transformer:
    """Load an HF checkpoint straight into the module: built on the meta device, optionally sharded by
    `parallelize(model)` (TP / FSDP, still on meta), materialized on `device`, then filled tensor by tensor,
    so each rank only ever holds its shard."""
    cfg = check_weights(path)  # names and shapes, before any memory is spent
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=device)
    targets = hf_targets(model)
    with torch.no_grad():
        for _, sf, name in _checkpoint_tensors(path, cfg):
            copy_hf_tensor(*targets[name], sf.get_tensor(name))
    return model


def save_pretrained(model: Transformer, path: str, max_shard_bytes: int = 5 * 2**30, state_dict=None):
    """Write config.json + safetensors (sharded with an index above max_shard_bytes) in HF's names, which
    transformers and vLLM load. `state_dict` (nanodapo's or HF's names, e.g. gathered from FSDP) overrides
    model.state_dict()."""
    os.makedirs(path, exist_ok=True)
    sd = state_dict if state_dict is not None else model.state_dict()
    tensors = [pair for k, v in sd.items() for pair in hf_tensors(k, v.detach())]  # (HF name, tensor)
    shards, size = [[]], 0  # consecutive tensors, a new shard whenever the next would pass max_shard_bytes
    for k, v in tensors:
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append((k, v))
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        # copies, one shard at a time: views of one expert stack may not share memory in a file
        save_file({k: v.to("cpu", copy=True, memory_format=torch.contiguous_format) for k, v in shard},
                  os.path.join(path, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for _, v in tensors)},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k, _ in shard}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(tensors[0][1].dtype), f, indent=2)
