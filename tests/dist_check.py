"""Run under torchrun by tests/test_parallel.py: a few AdamW steps of a tiny model, sharded as asked
(fsdp | tp | fsdp_tp), on CPU with gloo; rank 0 writes the full parameters and losses to OUT."""
import sys

import torch

import model as M
import parallel


def tiny_config():
    return M.ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         tie_word_embeddings=False)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    return docs


def train_steps(model, docs, rank_docs, n_tokens_total, world, steps=3):
    """Loss = token-sum of -logp over this rank's docs / all tokens * world (FSDP averages gradients)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        ids, pos, b = M.pack_sequences([d[:-1] for d in rank_docs])
        tgt = torch.tensor([t for d in rank_docs for t in d[1:]])[None]
        logp, _ = model(ids, pos, b, target_ids=tgt)
        loss = -logp.sum() / n_tokens_total * world
        loss.backward()
        parallel.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def main(mode, ckpt_dir, out):
    tp = 2 if "tp" in mode else 1
    dims = parallel.init_distributed("cpu", tp=tp)
    docs = batch()
    n_tok = sum(len(d) - 1 for d in docs)
    # data parallel over dp ranks: dp rank r takes docs r::dp
    rank_docs = docs[dims.dp_rank::dims.dp]

    def shard(m):
        if mode == "tp":
            parallel.apply_tp(m, dims.mesh["tp"])
        else:
            parallel.parallelize(m, dims, param_dtype=torch.float32)

    model = M.from_pretrained(ckpt_dir, dtype=torch.float32, device="cpu", parallelize=shard)
    losses = train_steps(model, docs, rank_docs, n_tok, dims.dp)
    full = {}
    for bucket in parallel.iter_full_weights(model, bucket_bytes=4096, dtype=torch.float32):
        full.update(bucket)
    if dims.is_main:
        torch.save({"params": full, "losses": losses}, out)
    parallel.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
