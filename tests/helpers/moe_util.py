"""Tiny random Qwen3-MoE checkpoints made by transformers (the reference implementation), for tests/test_moe.py.
Run under torchrun (2 CPU processes, gloo) it loads one with FSDP sharding the expert stacks:
    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/moe_util.py MODEL_DIR OUT.pt
and rank 0 saves every parameter gathered from the shards."""
import sys

import torch
import transformers
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hf
import parallel

TINY_MOE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=5, num_experts_per_tok=2,
                max_position_embeddings=128)
# tests/test_ep.py, tests/test_ep_checkpoint.py: TINY_MOE with 8 experts (ep 2 and 4 divide them)
EP_MOE = dict(vocab_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)


def hf_moe_model(seed=0, **overrides):
    """A random transformers Qwen3MoeForCausalLM (TINY_MOE + overrides), eval mode, fp32, with random norm weights
    (transformers inits them to 1) so the q/k and layer norms are tested too."""
    torch.manual_seed(seed)
    m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides}))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "mlp.gate." in name:  # a router that prefers some experts, as trained ones do
                p.normal_(0.0, 0.3)
    return m.eval()


def save_hf_moe(path, seed=0, max_shard_size="20KB", **overrides):
    """hf_moe_model saved by transformers (sharded, with an index) -> the model."""
    m = hf_moe_model(seed, **overrides)
    m.save_pretrained(str(path), max_shard_size=max_shard_size)
    return m


def fsdp_load(model_dir, out):
    torch.distributed.init_process_group("gloo")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (torch.distributed.get_world_size(),))

    def shard(model):
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    model = hf.from_pretrained(model_dir, dtype=torch.float32, parallelize=shard)
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
    if torch.distributed.get_rank() == 0:
        torch.save({"full": full, "local_rank0": local}, out)
    parallel.shutdown()


if __name__ == "__main__":  # with the repository root on PYTHONPATH
    fsdp_load(*sys.argv[1:])
    parallel.exit_process(0)  # results written, process group destroyed: no teardown, where gloo can abort
