"""Run under torchrun by tests/test_parallel.py and tests/test_sp.py on CPU with gloo. Modes:
  fsdp | tp | fsdp_tp   a few AdamW steps of a tiny Qwen3, sharded so; rank 0 saves full params + losses, and
                        sum_over_dp of {"a": dp_rank + 1, "b": 0.5}
  sp | sp_tp | sp4 | sp_compile
                        sequence parallel (sp=2; sp_tp: and tp=2; sp4: sp=4; sp_compile: compiled blocks), FSDP
                        over the sp ranks, activation checkpointing: one forward + backward (log-probs, entropy,
                        loss, full gradients), then the AdamW steps
  update                train_dapo.update_policy on a fixed batch (token-mean over dp ranks), FSDP over all ranks
  update_sp             the same with sp=2: both ranks split every micro-batch's tokens (Ulysses)
  sp_replay             a tiny MoE, sp=2: forward + backward with router replay (a fixed routing)
  update_one            the same on one rank with a mesh of one (FSDP over one device, as on one GPU)
  bf16_one              a mesh of one computing in bf16 over fp32 master weights: one forward + backward
  clip_mixed            grad-norm clipping over a plain gradient, a sharded one and one with a pending sum
                        (Partial), against the norm of the full gradients
  accumulate_one        the same mesh: three micro-batches' gradients reduced after every backward, then
                        accumulated unsharded (parallel.accumulate_grads); which weights are sharded when
  save | load           a train_dapo-style checkpoint written / read at this world size
  routing               router replay's rows fetched by each rank from the ranks that generated them
  ep2 | ep4 | ep2_fsdp | moe_fsdp | moe_tp | ep2_compile
                        a tiny Qwen3-MoE: expert parallel over 2 or 4 ranks (ep2_compile: ep2, blocks compiled;
                        ep2_fsdp: ep 2 on 4 ranks, experts FSDP-sharded over the other 2; moe_fsdp: FSDP only;
                        moe_tp: TP 2, experts replicated): one
                        forward + backward with the router aux loss (log-probs per document, losses, full
                        gradients), AdamW steps, then the full weights in HF names and the push's bucket sizes
"""
import contextlib
import os
import sys

import torch

import checkpoint
import hf
import model as M
import parallel


def tiny_config(kv_heads=2):
    return M.ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
                         tie_word_embeddings=False)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


def train_steps(model, opt, dims, steps=3):
    """Loss = token-sum of -logp over this dp rank's docs / all tokens, whose gradients FSDP sums over the ranks.
    Returns this rank's losses."""
    docs = batch()
    n_tokens_total, rank_docs = sum(len(d) - 1 for d in docs), docs[dims.dp_rank::dims.dp]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        ids, pos, b = M.pack_sequences([d[:-1] for d in rank_docs])
        tgt = torch.tensor([t for d in rank_docs for t in d[1:]])[None]
        logp, _ = model(ids, pos, b, target_ids=tgt)
        loss = -logp.sum() / n_tokens_total
        loss.backward()
        parallel.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def accumulation(model, dims):
    """A mesh of one, three micro-batches: the gradients reduced after every backward (FSDP's default) and
    accumulated unsharded until the last (parallel.accumulate_grads); whether every weight is back to its
    fp32 shard after the last backward, and after no-grad forwards and parallel.reshard."""
    from torch.distributed.tensor import DTensor
    micro = [batch(seed) for seed in range(3)]

    def sharded():
        return all(isinstance(p, DTensor) for p in model.parameters())

    def grads(accumulate):
        for i, docs in enumerate(micro):
            if accumulate:
                parallel.accumulate_grads(model, dims, last=i == len(micro) - 1)
            ids, pos, b = M.pack_sequences([d[:-1] for d in docs])
            logp, _ = model(ids, pos, b, target_ids=torch.tensor([t for d in docs for t in d[1:]])[None])
            (-logp.sum()).backward()
            if i == 0:
                between = sharded()
        out = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out, between

    out = {}
    out["each_backward"], out["sharded_between_each"] = grads(False)
    out["accumulated"], out["sharded_between_accumulated"] = grads(True)
    out["sharded_after_backward"] = sharded()
    with torch.no_grad():
        for docs in micro:
            ids, pos, b = M.pack_sequences([d[:-1] for d in docs])
            model(ids, pos, b)
    out["sharded_after_no_grad"] = sharded()
    parallel.reshard(model, dims)
    out["sharded_after_reshard"] = sharded()
    return out


def clip_mixed(dims):
    """parallel.clip_grad_norm_ over three kinds of gradient on 2 ranks -> the norm it returns, the one of the
    full gradients, and the clipped full gradients with the expected ones."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    mesh = DeviceMesh("cpu", list(range(dims.world_size)))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(4, 3, generator=g), torch.randn(6, generator=g), torch.randn(5, generator=g)]
    halves = [torch.randn(6, generator=g)]  # rank 1's share of the Partial sum; rank 0 holds full[1] - it
    local = full[2][:3] if dims.rank == 0 else full[2][3:]  # Shard(0) of 5 over 2 ranks: 3 + 2
    params = [torch.nn.Parameter(torch.zeros(4, 3)),
              torch.nn.Parameter(DTensor.from_local(torch.zeros(6), mesh, [Replicate()])),
              torch.nn.Parameter(DTensor.from_local(torch.zeros_like(local), mesh, [Shard(0)], shape=(5,),
                                                    stride=(1,)))]
    params[0].grad = full[0].clone()
    mine = halves[0] if dims.rank == 1 else full[1] - halves[0]
    params[1].grad = DTensor.from_local(mine, mesh, [Partial()])
    params[2].grad = DTensor.from_local(local.clone(), mesh, [Shard(0)], shape=(5,), stride=(1,))
    expected = torch.cat([f.flatten() for f in full]).double().norm().item()
    norm = parallel.clip_grad_norm_(params, 1.0)
    clipped = [params[0].grad, params[1].grad.full_tensor(), params[2].grad.full_tensor()]
    return {"norm": norm, "expected": expected, "clipped": clipped,
            "want": [f * (1.0 / (expected + 1e-6)) for f in full]}


AUX_COEF = 0.5  # large, so that a wrong router gradient shows


def moe_loss(model, dims, docs):
    """-token-sum of log p over this rank's docs / all tokens + AUX_COEF x the load-balancing loss over all ranks'
    tokens (router statistics summed over the dp ranks) -> (loss, this rank's per-doc log-probs, aux)."""
    n_tokens_total, mine = sum(len(d) - 1 for d in docs), list(range(len(docs)))[dims.dp_rank::dims.dp]
    ids, pos, b = M.pack_sequences([docs[i][:-1] for i in mine])
    tgt = torch.tensor([t for i in mine for t in docs[i][1:]])[None]
    loads = []
    logp, _ = model(ids, pos, b, target_ids=tgt, router_loads=loads)
    group = dims.fsdp_mesh.get_group() if dims.world_size > 1 else None  # the dp x sp ranks of this TP index
    aux = M.load_balancing_loss(parallel.reduce_router_loads(loads, group), model.config.num_experts_per_tok)
    per_doc = dict(zip(mine, logp[0].detach().split([len(docs[i]) - 1 for i in mine])))
    return -logp.sum() / n_tokens_total + AUX_COEF * aux, per_doc, aux.item()


def moe_run(model, opt, dims, steps=3):
    from torch.distributed.tensor import DTensor
    docs = batch()
    loss, per_doc, aux = moe_loss(model, dims, docs)
    loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    out = {"grads": grads, "aux": aux, "logp": {}, "loss": 0.0}
    for part, rank_loss in parallel.all_gather_objects((per_doc, loss.item()), dims)[::dims.tp]:
        out["logp"].update(part)
        out["loss"] += rank_loss  # the policy terms add up over the dp ranks; each rank adds the whole aux once
    out["loss"] -= (dims.dp - 1) * AUX_COEF * aux
    model.zero_grad(set_to_none=True)
    for _ in range(steps):
        opt.zero_grad()
        moe_loss(model, dims, docs)[0].backward()
        parallel.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
    pushed = list(parallel.iter_full_weights(model, bucket_bytes=4096, dtype=torch.float32, rename=hf.hf_tensors))
    out["hf"] = {k: v for b in pushed for k, v in b}
    out["bucket_bytes"] = [sum(v.numel() * v.element_size() for _, v in b) for b in pushed]
    return out


def forward_backward(model, dims):
    """One packed forward + backward over every document (the SP modes have dp = 1) -> per-token log-probs and
    entropy, the loss, and the full gradients; also the no-grad log-probs and the packed logits."""
    from torch.distributed.tensor import DTensor
    docs = batch()
    ids, pos, b = M.pack_sequences([d[:-1] for d in docs])
    tgt = torch.tensor([t for d in docs for t in d[1:]])[None]
    logp, ent = model(ids, pos, b, target_ids=tgt, with_entropy=True, logprob_chunk=8)
    loss = (-logp.sum() - 0.1 * ent.sum()) / tgt.numel()
    loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # the first 14 targets ignored (as a prompt's): at sp 2 the first rank's 13 tokens compute none of them
    ignored = tgt.clone()
    ignored[0, :14] = M.IGNORE_INDEX
    logp_ignored, ent_ignored = model(ids, pos, b, target_ids=ignored, with_entropy=True, logprob_chunk=8)
    ((-logp_ignored.sum() - 0.1 * ent_ignored.sum()) / tgt.numel()).backward()
    grads_ignored = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                     for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logp_no_grad, _ = model(ids, pos, b, target_ids=tgt)
        logits = model(ids, pos, b)
    return {"logp": logp.detach(), "entropy": ent.detach(), "loss": loss.item(), "grads": grads,
            "logp_no_grad": logp_no_grad, "logits": logits, "logp_ignored": logp_ignored.detach(),
            "grads_ignored": grads_ignored}


def replay_forward_backward(model):
    """A tiny MoE's packed forward + backward over every document with router replay: a fixed routing of distinct
    experts per token and layer (not the router's own top-k) -> log-probs and full gradients."""
    from torch.distributed.tensor import DTensor
    docs, cfg = batch(), model.config
    ids, pos, b = M.pack_sequences([d[:-1] for d in docs])
    tgt = torch.tensor([t for d in docs for t in d[1:]])[None]
    g = torch.Generator().manual_seed(7)
    routed = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok]
                          for _ in range(ids.shape[1] * cfg.num_hidden_layers)]).view(1, ids.shape[1], -1, 2)
    logp, _ = model(ids, pos, b, target_ids=tgt, routed_experts=routed.to(torch.uint8))
    logp.sum().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return {"logp": logp.detach(), "grads": grads}


def routing_exchange(dims):
    """24 trajectories whose routing rows were generated on ranks in an interleaved order (as dynamic sampling's
    selection leaves them); every rank fetches the rows of its update share and of its log-prob share."""
    import train_dapo as T
    n, world = 24, dims.world_size
    owner = torch.tensor([(7 * i) % world for i in range(n)])
    full = [torch.full((3 + i % 5, 2, 2), i, dtype=torch.uint8) for i in range(n)]  # [tokens, layers, top_k]
    traj = T.Trajectories(
        prompt_ids=[[1]] * n, response_ids=[[1]] * n, group_ids=torch.arange(n) // 2, rollout_logp=torch.zeros(n, 1),
        response_mask=torch.ones(n, 1), finish_reasons=["stop"] * n, data_sources=["x"] * n, acc=torch.zeros(n),
        score=torch.zeros(n), seq_reward=torch.zeros(n), routing_owner=owner,
        routed_experts=[row if owner[i] == dims.rank else None for i, row in enumerate(full)])
    out = {}
    for name, needed in (("update", T.update_share(n, 8, dims)), ("logprobs", T.rank_share(list(range(n)), dims))):
        missing = {i for i in needed if traj.routed_experts[i] is None}  # fetched by an earlier call: kept
        nbytes = T.fetch_routing(traj, needed, dims)
        expected = sum(full[i].numel() for i in missing)
        right = all(torch.equal(traj.routed_experts[i], full[i]) for i in needed)
        out[name] = parallel.all_gather_objects((dims.rank, sorted(set(needed)), nbytes, expected, right), dims)
        held = [i for i, row in enumerate(traj.routed_experts) if row is not None]
        out[name + "_held"] = parallel.all_gather_objects(held, dims)
    return out


def full_params(model):
    out = {}
    for bucket in parallel.iter_full_weights(model, bucket_bytes=4096, dtype=torch.float32):
        out.update(bucket)
    return out


def main(mode, ckpt_dir, out):
    sp = {"sp": 2, "sp_tp": 2, "sp4": 4, "sp_compile": 2, "update_sp": 2, "sp_replay": 2}.get(mode, 1)
    ep = int(mode[2]) if mode.startswith("ep") else 1
    dims = parallel.init_distributed("cpu", tp=2 if "tp" in mode else 1, sp=sp, ep=ep, mesh_of_one=mode.endswith("one"))
    dtype = torch.bfloat16 if mode in ("bf16_one", "accumulate_one") else torch.float32  # compute dtype; master weights stay fp32
    shard = (lambda m: parallel.apply_tp(m, dims.mesh["tp"])) if mode == "tp" else \
        (lambda m: parallel.parallelize(m, dims, param_dtype=dtype, compile=mode.endswith("compile"))) \
        if dims.sharded else None
    model = hf.from_pretrained(ckpt_dir, dtype=torch.float32, device="cpu", parallelize=shard)
    result = {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    held = contextlib.nullcontext()  # save / load: where the checkpoint finds the optimizer's states
    if mode.endswith("_offload"):  # save_offload, load_offload: the states on the "host" between steps
        mode, states = mode[:-len("_offload")], parallel.OptimizerStateOffload(opt, pin=False)
        held = states.on_device()
    if mode in ("fsdp", "tp", "fsdp_tp", "single"):
        result["losses"] = train_steps(model, opt, dims)
        result["dp_sum"] = parallel.sum_over_dp({"a": dims.dp_rank + 1.0, "b": 0.5}, dims)
    elif mode in ("ep2", "ep4", "ep2_fsdp", "moe_fsdp", "moe_tp", "ep2_compile"):
        result.update(moe_run(model, opt, dims))
    elif mode == "sp_replay":
        result.update(replay_forward_backward(model))
    elif mode == "bf16_one":
        result.update(forward_backward(model, dims))
    elif mode == "accumulate_one":
        result.update(accumulation(model, dims))
    elif mode in ("sp", "sp_tp", "sp4", "sp_compile"):
        model.gradient_checkpointing = True  # backward then recomputes the all-to-alls
        result.update(forward_backward(model, dims))
        result["losses"] = train_steps(model, opt, dims)
    elif mode in ("update", "update_sp", "update_one"):
        import train_dapo as T
        from conftest import random_batch  # the fixed batch of the single-process tests
        cfg = T.Config(train_batch_size=3, n=2, ppo_mini_batch_size=3, max_response_length=7, grad_clip=1e9,
                       ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=15)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # plain SGD: a wrong gradient scale would show
        T.update_policy(model, opt, T.make_scheduler(opt, cfg, 1), random_batch(), cfg,
                        dims)
    elif mode == "clip_mixed":
        result.update(clip_mixed(dims))
    elif mode == "routing":  # router replay's rows: each rank receives only those it trains on
        result.update(routing_exchange(dims))
    elif mode == "save":  # one step, then a checkpoint
        import train_dapo as T
        train_steps(model, opt, dims, steps=1)
        export = lambda tmp: checkpoint.export_hf(model, tmp, dims, torch.float32)  # noqa: E731
        state = {"step": 1, "scheduler": {}, "sampler": {}}
        with held:
            checkpoint.write_checkpoint(os.path.join(os.path.dirname(out), "ckpt"), model, opt, state, dims, export)
    elif mode == "load":  # resume that checkpoint, one more step (uses the restored Adam moments)
        with held:
            result["state"] = checkpoint.load_checkpoint(os.path.join(os.path.dirname(out), "ckpt"), model, opt,
                                                         dims)
        train_steps(model, opt, dims, steps=1)
    result["params"] = full_params(model)
    if dims.is_main:
        torch.save(result, out)
    parallel.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest
    main(*sys.argv[1:])
    parallel.exit_process(0)  # results written, process group destroyed: no teardown, where gloo can abort
