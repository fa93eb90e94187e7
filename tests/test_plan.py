"""plan.py: the --dry_run batch arithmetic, and the memory planner (plan.memory_plan) on tiny made-up models,
every number worked out by hand."""
import dataclasses
import functools
import os
import re

import pytest

import config
import hf
import model as M
import plan
import train_dapo as T
from conftest import ROOT, GiB, plan_bytes, planner_cfg, planner_model


# -----------------------------------------------------------------------------
# memory_plan on a tiny Qwen2-shaped model, every number by hand: conftest.planner_model (its parameter count is
# worked out there) under conftest.planner_cfg

def test_tiny_model_parameter_count():
    assert planner_model().num_params() == 202_304


def test_memory_plan_dp4_tp2_by_hand():
    b = plan_bytes(plan.memory_plan(planner_cfg(), planner_model(), world_size=8, gpu_gib=80, runtime_gib=0))
    # one GPU holds 1/8 of the TP-sharded weights and 1/4 of the rest: 2*36,992/8 + (202,304 - 73,984)/4 = 41,328
    assert b["params"] == 4 * 41_328 == 165_312
    assert b["grads"] == 165_312
    assert b["optimizer"] == 8 * 41_328
    assert b["ref_params"] == 0  # no KL term, no reference model
    assert b["engine_weights"] == 2 * 202_304  # the built-in engine's full bf16 copy
    # bf16, 2 x (root + one block's TP shard + its norms) = 2 * 2 * (128,064 + 36,992/2 + 128)
    assert b["working"] == 4 * 146_688
    # 2 trajectories x 64 tokens = 128 tokens: block inputs 128 * 64 * 2 bytes * 2 layers, + one block's saved
    # tensors, 16 bytes x hidden + (8 x q + 8 x intermediate) / tp = 1024 + (512 + 1024) / 2 = 1792 bytes a token
    assert b["activations"] == 32_768 + 128 * 1_792
    assert b["logprob_buffer"] == 16 * 1000 * 4 * 3
    # 8 rows x 257 positions (a row reads 63, rounded up to 256, + 1) x 2 layers x (k, v) x 2 kv heads x 16 x 2 bytes
    assert b["kv_cache"] == 526_336


def test_memory_plan_peak_is_resident_plus_larger_phase_and_verdict_flips():
    cfg, mc = planner_cfg(), planner_model()
    resident = 3 * 165_312 + 404_608  # params, AdamW (2x), engine copy
    training = 165_312 + 586_752 + 262_144 + 192_000  # grads, working weights, activations, log-prob buffer
    peak = resident + max(training, 131_072)
    small = plan.memory_plan(cfg, mc, 8, gpu_gib=peak / GiB * 0.99, runtime_gib=0)
    large = plan.memory_plan(cfg, mc, 8, gpu_gib=peak / GiB * 1.01, runtime_gib=0)
    for p in (small, large):
        assert round(p["peak_gib"] * GiB) == peak
        assert p["peak_phase"] == "training"
    assert (small["verdict"], large["verdict"]) == ("does not fit", "fits")
    assert large["knob"] is None
    assert small["largest"] == "working" and "tp_size" in small["knob"]  # 586,752 bytes: the largest term
    # the default runtime allowance (CUDA context, NCCL, allocator slack) is resident
    assert plan.memory_plan(cfg, mc, 8, gpu_gib=80)["peak_gib"] == pytest.approx(peak / GiB + 3.0)


def test_memory_plan_offload_moves_states_to_the_host():
    b0 = plan.memory_plan(planner_cfg(), planner_model(), 8, 80, runtime_gib=0)
    p = plan.memory_plan(planner_cfg(param_offload=True, optimizer_offload=True), planner_model(), 8, 80, runtime_gib=0)
    assert p["gib"]["params"] == p["gib"]["grads"] == p["gib"]["optimizer"] == 0
    assert round(p["host_gib"] * GiB) == 16 * 41_328  # 4 + 4 + 8 bytes per parameter of this GPU's shard
    assert b0["host_gib"] == 0
    assert round((b0["peak_gib"] - p["peak_gib"]) * GiB) == 16 * 41_328
    # the reference model (KL loss) is a further fp32 shard, offloaded with the rest
    r = plan.memory_plan(planner_cfg(use_kl_loss=True, param_offload=True), planner_model(), 8, 80, runtime_gib=0)
    assert round(r["host_gib"] * GiB) == 20 * 41_328 and r["gib"]["ref_params"] == 0


def test_memory_plan_counts_the_kept_logits_of_a_compiled_head_without_checkpointing():
    """Compiled and without checkpointing, the head keeps the bf16 logits of every token it computes, on top of a
    chunk's fp32 buffers: the responses' (2 sequences x 48 tokens, not the prompts': 2 bytes x 96 x 1000 vocab),
    or with a token budget all of its 64 tokens (short prompts leave it all response); checkpointed or eager,
    each chunk is recomputed."""
    chunk = 16 * 1000 * 12
    for kw, kept in ((dict(compile=True, gradient_checkpointing=False), 2 * 96 * 1000),
                     (dict(compile=True, gradient_checkpointing=False, use_dynamic_bsz=True,
                           ppo_max_token_len_per_gpu=64), 2 * 64 * 1000),
                     (dict(compile=True, gradient_checkpointing=1), 0),
                     (dict(compile=False, gradient_checkpointing=False), 0)):
        b = plan_bytes(plan.memory_plan(planner_cfg(**kw), planner_model(), 8, 80, runtime_gib=0))
        assert b["logprob_buffer"] == chunk + kept, kw


def test_optimizer_offload_brings_the_adamw_states_in_for_the_step_only():
    """optimizer_offload alone: the AdamW states (8 bytes a parameter of the shard) go to the host and count on
    the GPU in the optimizer step's phase, with the gradients it reads, not through training and generation."""
    b0 = plan.memory_plan(planner_cfg(), planner_model(), 8, 80, runtime_gib=0)
    p = plan.memory_plan(planner_cfg(optimizer_offload=True), planner_model(), 8, 80, runtime_gib=0)
    assert round(p["host_gib"] * GiB) == 8 * 41_328 and p["phase"]["optimizer"] == "step"
    assert round(p["step_gib"] * GiB) == 4 * 41_328 + 8 * 41_328  # grads + states
    assert round((b0["resident_gib"] - p["resident_gib"]) * GiB) == 8 * 41_328
    assert p["gib"]["params"] > 0 and p["training_gib"] == b0["training_gib"]
    # one GPU, no engine weights to speak of: the step (grads 4 + states 8 bytes a parameter) is the peak
    one = plan.memory_plan(planner_cfg(tp_size=1, optimizer_offload=True), planner_model(), 1, 80, runtime_gib=0)
    assert one["peak_phase"] == "step"
    assert round(one["peak_gib"] * GiB) == round((one["resident_gib"] + one["step_gib"]) * GiB)
    assert round(one["step_gib"] * GiB) == 12 * 202_304
    # not fitting: first optimizer_offload, then param_offload
    assert "optimizer_offload=True" in plan.memory_plan(planner_cfg(tp_size=1), planner_model(), 1, 1e-4)["knob"]
    tight = plan.memory_plan(planner_cfg(tp_size=1, optimizer_offload=True), planner_model(), 1, 1e-4)
    assert tight["largest"] in ("params", "optimizer", "grads") and "param_offload=True" in tight["knob"]
    assert "optimizer step phase" in plan.format_memory_plan([p])


def test_offload_that_would_fill_the_host_is_refused_before_loading():
    """Qwen2.5-7B's fp32 weights, gradients and AdamW states: 16 bytes x 7.62B = 113.5 GiB a GPU on one, which
    a 125 GiB host cannot give (90% is 112.5); 4 GPUs of a node in a world of 8 need 4 x 14.2 GiB."""
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen2.5-7b"])
    cfg = planner_cfg(param_offload=True, optimizer_offload=True, tp_size=1)
    for world, on_node in ((1, 1), (2, 2)):
        with pytest.raises(config.ConfigError, match=r"113\.5 GiB for the \d GPU\(s\) on this node, which has 125 GiB"):
            plan.check_host_memory(cfg, mc, world, on_node, 125.0, "vllm")
    plan.check_host_memory(cfg, mc, 8, 4, 125.0, "vllm")  # 56.8 GiB on each node
    plan.check_host_memory(planner_cfg(tp_size=1), mc, 1, 1, 125.0, "vllm")  # nothing offloaded
    # the AdamW states alone, 8 x 7.62B = 56.7 GiB on one GPU: they fit on this host, not on a 60 GiB one
    plan.check_host_memory(planner_cfg(optimizer_offload=True, tp_size=1), mc, 1, 1, 125.0, "vllm")
    with pytest.raises(config.ConfigError, match=r"optimizer_offload: the offloaded AdamW states take 56\.7 GiB"):
        plan.check_host_memory(planner_cfg(optimizer_offload=True, tp_size=1), mc, 1, 1, 60.0, "vllm")


def test_memory_plan_without_checkpointing_keeps_every_block():
    p = plan.memory_plan(planner_cfg(gradient_checkpointing=False), planner_model(), 8, gpu_gib=1e-4, runtime_gib=0)
    assert round(p["gib"]["activations"] * GiB) == 2 * 128 * 1_792
    # 64 trajectories: checkpointing every block (activations 8,388,608 bytes, peak 10,233,216) fits 12 MB, not
    # 1e-4 GiB, where even one trajectory with checkpointing leaves the working weights the largest term
    cfg = planner_cfg(gradient_checkpointing=False, ppo_micro_batch_size_per_gpu=64)
    p = plan.memory_plan(cfg, planner_model(), 8, gpu_gib=12e6 / GiB, runtime_gib=0)
    assert p["largest"] == "activations" and p["knob"] == "gradient_checkpointing=True"
    assert plan.memory_plan(dataclasses.replace(cfg, gradient_checkpointing=True), planner_model(), 8, 12e6 / GiB,
                            runtime_gib=0)["verdict"] == "fits"
    p = plan.memory_plan(cfg, planner_model(), 8, gpu_gib=1e-4, runtime_gib=0)
    assert p["largest"] == "activations" and p["knob"].startswith("tp_size")
    assert ("even one sequence a micro-batch (gradient_checkpointing=True, ppo_micro_batch_size_per_gpu=1) does not "
            "fit, and then the largest term is the unsharded compute-dtype weights") in p["knob"]


# the knob of a plan whose activations do not fit, on Qwen2.5-1.5B (one GPU, the vLLM engine, the defaults: 64
# trajectories a micro-batch of a per-rank mini-batch of 32 x 8 = 256, "auto" checkpointing): the value it names is
# the largest that fits, each checked here by planning it

QWEN_1_5B = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen2.5-1.5b"])


def _fits(cfg, gpu_gib, **change):
    return plan.memory_plan(dataclasses.replace(cfg, **change), QWEN_1_5B, 1, gpu_gib,
                            engine="vllm")["verdict"] == "fits"


def _value(knob, key):
    return int(re.search(rf"{key}=(\d+)", knob)[1])


def _token_budget(knob):
    """The token-budget alternative a knob names: {key: value} of each setting after "use_dynamic_bsz=True with"."""
    alternative = knob.split("use_dynamic_bsz=True with ")[1].split(" (")[0].split(")")[0]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", alternative)}


@pytest.mark.parametrize("response,gpu_gib,ckpt", [
    (4096, 80, False), (8192, 80, "auto"), (8192, 80, True), (8192, 80, False), (16384, 80, "auto"),
    (16384, 141, "auto"), (16384, 80, True), (32768, 80, False)])
def test_activation_knob_names_the_largest_micro_batch_that_fits(response, gpu_gib, ckpt):
    """The plan does not fit: checkpointing every block, where that fits; else the largest micro-batch that
    fits with checkpointing as asked (a divisor of the per-rank mini-batch, as check_config asks; the next
    divisor does not fit), and the token-budget alternative (the next 1024 tokens do not fit); checkpointing
    too where even one trajectory does not fit without it."""
    cfg = T.Config(max_prompt_length=256, max_response_length=response, gradient_checkpointing=ckpt)
    p = plan.memory_plan(cfg, QWEN_1_5B, 1, gpu_gib, engine="vllm")
    assert p["verdict"] == "does not fit" and p["largest"] == "activations"
    if ckpt is not True and _fits(cfg, gpu_gib, gradient_checkpointing=True):
        assert p["knob"] == "gradient_checkpointing=True"
        assert (response, ckpt) == (4096, False)  # here only: checkpointing alone does not fit at 8192 and up
        return
    assert p["knob"].startswith("gradient_checkpointing=True with " if ckpt is False and response == 32768
                                else "ppo_micro_batch_size_per_gpu=")
    if p["knob"].startswith("gradient_checkpointing=True"):
        assert not _fits(cfg, gpu_gib, ppo_micro_batch_size_per_gpu=1)
        cfg = dataclasses.replace(cfg, gradient_checkpointing=True)
    k = _value(p["knob"], "ppo_micro_batch_size_per_gpu")
    assert 256 % k == 0 and k < 64 and _fits(cfg, gpu_gib, ppo_micro_batch_size_per_gpu=k)
    assert not _fits(cfg, gpu_gib, ppo_micro_batch_size_per_gpu=next(d for d in range(k + 1, 257) if 256 % d == 0))
    config.check_config(dataclasses.replace(cfg, ppo_micro_batch_size_per_gpu=k), 1, check_files=False)
    budget = _token_budget(p["knob"])
    t = budget["ppo_max_token_len_per_gpu"]
    assert t % 1024 == 0 and t >= 256 + response
    # the log-prob budget too where its default (32,768) is shorter than a sequence, as check_config asks
    assert budget.get("log_prob_max_token_len_per_gpu") == (256 + response if response > 32768 - 256 else None)
    assert _fits(cfg, gpu_gib, use_dynamic_bsz=True, **budget)
    assert not _fits(cfg, gpu_gib, use_dynamic_bsz=True, **{**budget, "ppo_max_token_len_per_gpu": t + 1024})
    config.check_config(dataclasses.replace(cfg, use_dynamic_bsz=True, **budget), 1, check_files=False)


@pytest.mark.parametrize("response,gpu_gib", [(4096, 80), (8192, 80), (16384, 80), (16384, 141)])
def test_activation_knob_names_the_largest_token_budget_that_fits(response, gpu_gib):
    """use_dynamic_bsz=True with a budget of 2**20 tokens: the largest multiple of 1024 tokens that fits; the
    next 1024 do not."""
    cfg = T.Config(max_prompt_length=256, max_response_length=response, use_dynamic_bsz=True,
                   ppo_max_token_len_per_gpu=2**20)
    p = plan.memory_plan(cfg, QWEN_1_5B, 1, gpu_gib, engine="vllm")
    assert p["verdict"] == "does not fit" and p["largest"] == "activations"
    assert p["knob"].startswith("ppo_max_token_len_per_gpu=") and "micro_batch_size" not in p["knob"]
    t = _value(p["knob"], "ppo_max_token_len_per_gpu")
    assert t % 1024 == 0 and 256 + response <= t < 2**20
    assert _fits(cfg, gpu_gib, ppo_max_token_len_per_gpu=t)
    assert not _fits(cfg, gpu_gib, ppo_max_token_len_per_gpu=t + 1024)
    config.check_config(dataclasses.replace(cfg, ppo_max_token_len_per_gpu=t), 1, check_files=False)


def test_activation_knob_where_not_even_one_sequence_fits():
    """A response of 2**20 tokens: one trajectory a micro-batch with every block checkpointed does not fit 80 GiB,
    as a count or as a token budget; sequence parallelism splits it."""
    for kw, least in ((dict(), dict(ppo_micro_batch_size_per_gpu=1)),
                      (dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=2**21),
                       dict(ppo_max_token_len_per_gpu=2**20 + 256))):
        cfg = T.Config(max_prompt_length=256, max_response_length=2**20, **kw)
        p = plan.memory_plan(cfg, QWEN_1_5B, 1, 80, engine="vllm")
        assert p["largest"] == "activations" and p["knob"].startswith("sp_size")
        assert not _fits(cfg, 80, gradient_checkpointing=True, **least)
        assert ", ".join(f"{k}={v}" for k, v in least.items()) in p["knob"]


def test_logprob_buffer_knob_names_the_largest_chunk_that_fits():
    """The fp32 buffers of a chunk of 96 tokens (1,152,000 bytes) outgrow a micro-batch's activations (262,144):
    the knob is the largest logprob_chunk that fits; one more token does not."""
    cfg = planner_cfg(logprob_chunk=96)
    full = plan.memory_plan(cfg, planner_model(), 8, 80, runtime_gib=0)
    gpu_gib = (full["peak_gib"] - 40 * 1000 * 12 / GiB)
    p = plan.memory_plan(cfg, planner_model(), 8, gpu_gib, runtime_gib=0)
    assert p["largest"] == "logprob_buffer" and p["knob"].startswith("logprob_chunk=")
    c = _value(p["knob"], "logprob_chunk")
    assert c == 56
    fits = [plan.memory_plan(planner_cfg(logprob_chunk=x), planner_model(), 8, gpu_gib, runtime_gib=0)["verdict"]
            for x in (c, c + 1)]
    assert fits == ["fits", "does not fit"]


@pytest.mark.parametrize("shape,compile,measured", [
    ("qwen2.5-1.5b", False, 108_600), ("qwen2.5-1.5b", True, 78_392),
    ("qwen2.5-7b", False, 237_696), ("qwen2.5-7b", True, 171_136)])
def test_activation_estimate_matches_a_measurement(shape, compile, measured):
    """Measured on an H200 (bench/activations.py; BENCHMARKS.md row memory-plan-activations): what one decoder
    block keeps for backward, per token, in a packed bf16 training forward, eager and with the block
    torch.compile'd (the default on CUDA)."""
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS[shape])
    assert plan.block_activation_bytes(mc, 0, tp=1, compiled=compile) == pytest.approx(measured, rel=0.01)
    cfg = planner_cfg(tp_size=1, gradient_checkpointing=False, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16384,
                      max_prompt_length=16, max_response_length=16368, compile=compile)
    p = plan.memory_plan(cfg, mc, 8, 141)
    assert p["gib"]["activations"] * GiB / (16384 * mc.num_hidden_layers) == pytest.approx(measured, rel=0.01)


def test_memory_plan_token_budget_and_kv_knob():
    # use_dynamic_bsz: the token budget replaces micro-batch x sequence length
    p = plan.memory_plan(planner_cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=256), planner_model(), 8, 80,
                             runtime_gib=0)
    assert round(p["gib"]["activations"] * GiB) == 256 * 64 * 2 * 2 + 256 * 1_792
    # a big KV cache: max_num_seqs is the knob; at its floor (n rows) the response length is
    p = plan.memory_plan(planner_cfg(max_num_seqs=4096), planner_model(), 8, gpu_gib=0.01, runtime_gib=0)
    assert p["largest"] == "kv_cache" and p["knob"].startswith("max_num_seqs")
    p = plan.memory_plan(planner_cfg(max_num_seqs=2, n=4096), planner_model(), 8, gpu_gib=0.01, runtime_gib=0)
    assert p["kv_rows"] == 4096 and p["knob"].startswith("max_response_length")


def test_memory_plan_refuses_a_mesh_that_does_not_divide():
    # the tiny model has 4 query heads and 2 kv heads
    with pytest.raises(ValueError, match=r"sp_size=1 x tp_size=3 = 3 must divide the world size 8"):
        plan.memory_plan(planner_cfg(tp_size=3), planner_model(), 8, 80)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 must be divisible by tp_size=4"):
        plan.memory_plan(planner_cfg(tp_size=4), planner_model(), 8, 80)


def test_memory_plan_single_gpu_is_fsdp_over_a_mesh_of_one():
    # world size 1: FSDP over one GPU holds full fp32 params, grads and AdamW states (offload moves them to the
    # host), keeps every bf16 weight gathered through a mini-batch, and the built-in engine decodes its own bf16
    # copy
    b = plan_bytes(plan.memory_plan(planner_cfg(tp_size=1), planner_model(), 1, 80, runtime_gib=0))
    assert (b["params"], b["grads"], b["optimizer"]) == (4 * 202_304, 4 * 202_304, 8 * 202_304)
    # bf16 x (all P + one whole block's gradients 37,120); the engine's copy: 2 bytes x P
    assert (b["working"], b["engine_weights"], b["kv_cache"]) == (2 * (202_304 + 37_120), 2 * 202_304, 526_336)
    p = plan.memory_plan(planner_cfg(tp_size=1, param_offload=True), planner_model(), 1, 80, runtime_gib=0)
    assert p["gib"]["params"] == p["gib"]["grads"] == p["gib"]["optimizer"] == 0
    assert round(p["host_gib"] * GiB) == 16 * 202_304


def test_memory_plan_with_the_vllm_engine():
    """vLLM replaces the built-in engine's weight copy and KV cache by its awake memory: its bf16 weights share,
    a KV pool for max_num_seqs full-length sequences and 1 GiB of activations; ~1 GiB while asleep, and one push
    bucket. Where such a pool would not fit in utilization x GPU, vLLM fills that share and the note gives its
    KV capacity in full-length sequences. By hand."""
    cfg = planner_cfg(gpu_memory_utilization=0.5, weight_sync_bucket_mb=1, gen_tp=2)
    torch_plan = plan.memory_plan(cfg, planner_model(), 8, gpu_gib=80, runtime_gib=0)
    p = plan.memory_plan(cfg, planner_model(), 8, gpu_gib=80, runtime_gib=0, engine="vllm")
    g = p["gib"]
    # 8 sequences x (64 tokens + a spare block of 64) x 2 layers x (k, v) x 1 kv head per TP rank x 16 x bf16
    kv_pool = 8 * 128 * 2 * 2 * 1 * 16 * 2
    awake = (2 * 202_304 / 2 + kv_pool + GiB) / GiB
    assert (g["engine_weights"], g["kv_cache"], g["vllm_asleep"]) == (0, 0, 1.0)
    assert g["vllm_awake"] == pytest.approx(awake)
    # one bucket, plus the largest parameter gathered whole before it is cut up (lm_head, 1000 x 64 in bf16)
    assert g["sync_bucket"] == pytest.approx((min(2**20, 2 * 202_304) + 2 * 64_000) / GiB)
    assert p["resident_gib"] == pytest.approx(torch_plan["resident_gib"] - torch_plan["gib"]["engine_weights"] + 1.0)
    assert p["generation_gib"] == pytest.approx(awake + g["sync_bucket"])
    assert any("a KV pool of 0.0 GiB a GPU, room for max_num_seqs=8 sequences of max length (64 tokens)" in n
               for n in p["notes"])
    # the user's own pool size, as the engine passes it on
    mine = plan.memory_plan(planner_cfg(gen_tp=2, vllm_kwargs={"kv_cache_memory_bytes": 3 * GiB}), planner_model(),
                            8, gpu_gib=80, runtime_gib=0, engine="vllm")
    assert mine["gib"]["vllm_awake"] == pytest.approx((202_304 + 3 * GiB + GiB) / GiB)

    # 8192 sequences of 65,536 tokens would need 64 GiB a GPU: vLLM takes utilization x GPU
    cfg = planner_cfg(gpu_memory_utilization=0.5, gen_tp=2, max_num_seqs=8192, max_response_length=2**16 - 16)
    p = plan.memory_plan(cfg, planner_model(), 8, gpu_gib=80, runtime_gib=0, engine="vllm")
    assert p["gib"]["vllm_awake"] == 40.0
    kv_gib = 0.5 * 80 * 2 - 2 * 202_304 / GiB - 2
    seqs = kv_gib * GiB / (2 * 2 * 2 * 16 * 2 * 2**16)  # layers x (k, v) x kv_heads x head_dim x bf16
    assert any(f"~{kv_gib:.0f} GiB of KV cache = {seqs:.0f} sequences" in n for n in p["notes"])


def test_memory_plan_of_an_engine_that_stays_awake():
    """free_cache_engine=False: vLLM's pool (or the built-in engine's KV cache) is resident through training."""
    for engine, awake in (("vllm", "vllm_awake"), ("torch", "kv_cache")):
        freed = plan.memory_plan(planner_cfg(), planner_model(), 8, gpu_gib=80, runtime_gib=0, engine=engine)
        kept = plan.memory_plan(planner_cfg(free_cache_engine=False), planner_model(), 8, gpu_gib=80, runtime_gib=0,
                                engine=engine)
        asleep = freed["gib"]["vllm_asleep"]
        assert kept["phase"][awake] == "resident" and kept["gib"]["vllm_asleep"] == 0
        assert kept["resident_gib"] == pytest.approx(freed["resident_gib"] - asleep + freed["gib"][awake])
        assert kept["peak_gib"] == pytest.approx(kept["resident_gib"] + max(kept["training_gib"],
                                                                            kept["generation_gib"]))
        assert kept["training_gib"] == freed["training_gib"]  # now on top of the engine's memory, not beside it
        text = plan.format_memory_plan([kept])  # the awake term is printed among the resident ones
        assert text.index("resident") < text.index(plan.MEMORY_TERMS[awake][1]) < text.index("training")
        # the plan of the default (freed) names the other choice and what it would take, "auto" planned for it
        note = next(n for n in freed["notes"] if n.startswith("free_cache_engine=False"))
        assert f"fits: peak {kept['peak_gib']:.1f} of 80 GiB, gradient_checkpointing True" in note
    mc = dataclasses.replace(planner_model(), num_hidden_layers=8)  # "auto" is planned for the awake engine too
    awake = [plan.memory_plan(planner_cfg(gradient_checkpointing=n, free_cache_engine=False), mc, 8, 80, 0)["peak_gib"]
             for n in range(8)]
    gpu_gib = (awake[2] + awake[3]) / 2 / 0.85
    p = plan.memory_plan(planner_cfg(gradient_checkpointing="auto"), mc, 8, gpu_gib, 0)
    assert any(n.endswith(f"fits: peak {awake[3]:.1f} of {gpu_gib:g} GiB, gradient_checkpointing 3") for n in p["notes"])


def test_memory_plan_with_param_offload_names_the_faster_choice():
    """param_offload runs the AdamW step on the host; the plan says what param_offload=False (optimizer_offload as
    asked) would take, planned alike, and whether it fits this GPU. On the 30B-A3B recipe (8 GPUs) the states are
    GiBs, so the note's figure tells the two offload choices apart."""
    recipe, _ = T.parse_args(T.Config, [os.path.join(ROOT, "configs", "qwen3_30b_a3b_dapo.py")])
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen3-30b-a3b"])
    assert recipe.param_offload and recipe.optimizer_offload
    for opt in (True, False):
        offloaded = dataclasses.replace(recipe, optimizer_offload=opt)
        on_gpu = plan.memory_plan(dataclasses.replace(offloaded, param_offload=False), mc, 8, 141, engine="vllm")
        p = plan.memory_plan(offloaded, mc, 8, 141, engine="vllm")
        note = next(n for n in p["notes"] if n.startswith("param_offload=False"))
        assert note.endswith(f"{on_gpu['verdict']}: peak {on_gpu['peak_gib']:.1f} of 141 GiB, "
                             f"gradient_checkpointing {on_gpu['gradient_checkpointing']}")
        assert ("AdamW states still on the host" in note) == opt
    # with the AdamW states on the host it fits 80 GiB GPUs; with every state on the GPU it does not
    notes = [plan.memory_plan(dataclasses.replace(recipe, optimizer_offload=opt), mc, 8, 80, engine="vllm")["notes"]
             for opt in (True, False)]
    assert any(n.startswith("param_offload=False") and " fits: peak" in n for n in notes[0])
    assert any(n.startswith("param_offload=False") and "does not fit: peak" in n for n in notes[1])
    plain = plan.memory_plan(dataclasses.replace(recipe, param_offload=False), mc, 8, 80, engine="vllm")
    assert not any(n.startswith("param_offload=False") for n in plain["notes"])


def test_format_memory_plan_lists_every_term_and_both_gpu_sizes():
    cfg, _ = T.parse_args(T.Config, [os.path.join(ROOT, "configs", "qwen32b.py")])
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen2.5-32b"])
    plans = [plan.memory_plan(cfg, mc, 128, g, engine="vllm") for g in (80, 141)]
    text = plan.format_memory_plan(plans)
    assert "80 GiB" in text and "141 GiB" in text and "world 128 = dp 16 x sp 8 x tp 1" in text
    for _, label in plan.MEMORY_TERMS.values():
        assert label in text
    for p in plans:
        assert p["verdict"] in text
        assert p["gib"]["params"] > 0 and p["host_gib"] == pytest.approx(p["gib"]["optimizer"])  # optimizer offload


# -----------------------------------------------------------------------------
# memory_plan on a tiny Qwen3-MoE, by hand
#
# hidden 64, 2 layers, both MoE: 8 experts of width 32, top-2; 4 heads x 16 (q 64), 2 kv heads (kv 32), vocab 1000.
# per layer: attention 3 * 64*64 + 64*32 ... = 64*64 + 2*64*32 + 64*64 = 12,288; norms 2*64 + q/k norms 2*16 = 160;
#            router 8*64 = 512; experts 8 * 3*64*32 = 49,152                                      layer = 62,112
# root: embeddings + lm_head 2*1000*64 + final norm 64 = 128,064; P = 2 * 62,112 + 128,064 = 252,288
# active: 2 of 8 experts a token, 2 * 3*64*32 = 12,288 a layer: P - 2 * (49,152 - 12,288) = 178,560

def tiny_moe():
    return M.ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32)


def test_tiny_moe_parameter_counts():
    assert (tiny_moe().num_params(), tiny_moe().num_active_params()) == (252_288, 178_560)


def test_memory_plan_moe_with_expert_parallelism_by_hand():
    with_ep = plan.memory_plan(planner_cfg(tp_size=1, ep_size=4), tiny_moe(), 8, 80, runtime_gib=0)
    no_ep = plan.memory_plan(planner_cfg(tp_size=1), tiny_moe(), 8, 80, runtime_gib=0)
    b, b1 = plan_bytes(with_ep), plan_bytes(no_ep)
    # experts: 2 of 8 per EP rank, FSDP over the other 8 / 4 = 2 ranks: 1/8 a GPU, like every other weight
    assert b["params"] == b1["params"] == 4 * 252_288 // 8
    # bf16, 2 x (root + one MoE block: attention, norms, router, 8 / ep experts)
    assert b["working"] == 4 * (128_064 + 12_288 + 160 + 512 + 49_152 // 4)
    assert b1["working"] == 4 * (128_064 + 12_288 + 160 + 512 + 49_152)
    # 128 tokens: block inputs 128 * 64 * 2 bytes * 2 layers, + one block's saved tensors a token: 16 x hidden
    # 1024, attention 8q + q/k norms 6q + 6kv = 1088, MoE 8 x 2 x 32 + 6 x 2 x 64 + 8 x 8 = 1344
    assert b["activations"] == b1["activations"] == 32_768 + 128 * (1024 + 1088 + 1344)
    # the all-to-all: 128 tokens x top-2 rows of 64 bf16 values, sent and received
    assert (b["a2a_buffers"], b1["a2a_buffers"]) == (2 * 128 * 2 * 64 * 2, 0)
    text = plan.format_memory_plan([with_ep])
    assert "0.00B params (0.00B active a token), world 8 = dp 8 x tp 1, ep 4" in text
    assert with_ep["num_active_params"] == 178_560 and "EP 4: each GPU computes 2 of 8 experts" in text


def test_memory_plan_moe_knobs_and_refusals():
    p = plan.memory_plan(planner_cfg(tp_size=1), tiny_moe(), 8, gpu_gib=1e-5, runtime_gib=0)
    assert p["largest"] == "working" and p["knob"].startswith("ep_size")  # all experts gathered on every GPU
    with pytest.raises(ValueError, match=r"ep_size=4 must divide the dp x sp = 6 ranks"):
        plan.memory_plan(planner_cfg(tp_size=1, ep_size=4), tiny_moe(), 6, 80)
    with pytest.raises(ValueError, match=r"ep_size=4 must divide num_experts=0"):
        plan.memory_plan(planner_cfg(tp_size=1, ep_size=4), planner_model(), 8, 80)
    # vLLM whose weights alone exceed gpu_memory_utilization x GPU x gen_tp: does not fit, turn gen_tp
    p = plan.memory_plan(planner_cfg(tp_size=1, gen_tp=1), tiny_moe(), 8, gpu_gib=252_288 * 2 / GiB, runtime_gib=0,
                         engine="vllm")
    assert p["verdict"] == "does not fit" and p["knob"].startswith("gen_tp")


def test_qwen3_235b_recipe_plan():
    """256 GPUs = dp 32 x sp 8, EP 8 within each node: fits 141 GiB GPUs with room for the vLLM KV cache; on 80 GiB
    GPUs the engines hold fewer full-length sequences than a group of n (the header says so)."""
    cfg, _ = T.parse_args(T.Config, [os.path.join(ROOT, "configs", "qwen3_235b_dapo.py")])
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen3-235b-a22b"])
    big, small = (plan.memory_plan(cfg, mc, cfg.nnodes * cfg.n_gpus_per_node, g, engine="vllm") for g in (141, 80))
    assert (big["dp"], big["sp"], big["ep"], big["world_size"]) == (32, 8, 8, 256)
    assert round(big["num_params"] / 1e9, 1) == 235.1 and round(big["num_active_params"] / 1e9, 1) == 22.2
    assert big["verdict"] == "fits" and big["host_gib"] > 0  # params, grads and AdamW states on the host
    assert any("fewer than n=16" in note for note in small["notes"])
    assert not any("fewer than n" in note for note in big["notes"])


def test_gradient_checkpointing_auto_checkpoints_the_fewest_blocks_that_fit_in_85_percent():
    mc = dataclasses.replace(planner_model(), num_hidden_layers=8)
    cfg = functools.partial(planner_cfg, max_num_seqs=4)  # a small KV cache: the training phase sets the peak
    peaks = [plan.memory_plan(cfg(gradient_checkpointing=n), mc, 8, gpu_gib=80, runtime_gib=0)["peak_gib"]
             for n in range(9)]
    assert all(a > b for a, b in zip(peaks[:8], peaks[1:8]))  # a checkpointed block keeps only its input, ...
    assert peaks[8] > peaks[7]  # ... but the last one's recompute comes right after its forward: no saving
    for n, ckpt in ((0, False), (8, True)):
        assert peaks[n] == plan.memory_plan(cfg(gradient_checkpointing=ckpt), mc, 8, 80, 0)["peak_gib"]

    def auto(gpu_gib):
        p = plan.memory_plan(cfg(gradient_checkpointing="auto"), mc, 8, gpu_gib, runtime_gib=0)
        return p["gradient_checkpointing"], p["peak_gib"]
    assert auto(peaks[0] / 0.80) == (False, peaks[0])
    assert auto((peaks[2] + peaks[3]) / 2 / 0.85) == (3, peaks[3])  # 3 checkpointed blocks fit in 85%, 2 do not
    assert auto(peaks[7] / 2) == (7, peaks[7])  # nothing fits: the least memory
    assert "gradient_checkpointing" in plan.format_memory_plan(
        [plan.memory_plan(cfg(gradient_checkpointing="auto"), mc, 8, peaks[3] / 0.85, runtime_gib=0)])


def test_gradient_checkpointing_takes_a_block_count_up_to_the_model_depth(tiny_dir):
    config.check_config(T.Config(gradient_checkpointing=1), check_files=False)
    with pytest.raises(T.ConfigError, match=r"gradient_checkpointing=-1.*an int N"):
        config.check_config(T.Config(gradient_checkpointing=-1), check_files=False)
    with pytest.raises(T.ConfigError, match="gradient_checkpointing=3 is more blocks than the model's 2"):
        config.check_model_dir(T.Config(model_path=str(tiny_dir / "model"), gradient_checkpointing=3), 1)


def test_memory_plan_of_an_asynchronous_run_puts_the_engine_on_the_generator_gpus():
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen2.5-7b"])  # 28 layers, 4 kv heads of 128
    cfg = dict(tp_size=1, max_num_seqs=256, max_prompt_length=1024, max_response_length=3072)
    colocated = plan.memory_plan(planner_cfg(**cfg), mc, 1, 141, runtime_gib=0)
    p = plan.memory_plan(planner_cfg(**cfg, rollout_gpus=1), mc, 1, 141, runtime_gib=0)
    assert p["gib"]["engine_weights"] == p["gib"]["kv_cache"] == 0 and colocated["gib"]["kv_cache"] > 0
    # rows x positions (a row reads 4095, rounded up to 4096, + 1) x layers x (k, v) x kv heads x head_dim x bf16
    kv = 256 * 4097 * 28 * 2 * 4 * 128 * 2
    assert f"each of the 1 generator GPUs holds the built-in engine: {(2 * mc.num_params() + kv) / GiB:.2f} GiB" \
        in p["notes"][0]


def test_dry_run_prints_batch_arithmetic(tiny_dir, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc = T.main([f"--model_path={tiny_dir / 'model'}", f"--train_files={tiny_dir / 'train.parquet'}",
                 f"--val_files={tiny_dir / 'val.parquet'}", "--train_batch_size=16", "--gen_batch_size=24",
                 "--n=4", "--ppo_mini_batch_size=4", "--ppo_micro_batch_size_per_gpu=2", "--ppo_epochs=2",
                 "--n_gpus_per_node=2", "--max_prompt_length=128", "--max_response_length=256", "--dry_run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "trajectories_per_step: 64" in out  # 16 prompts x 4
    assert "optimizer_steps_per_step: 8" in out  # 2 epochs x 16 / 4
    assert "per_rank_mini_batch: 8" in out  # 4 x 4 / 2 ranks
    assert "accumulation_steps: 4" in out  # 8 / 2
    assert "steps_per_epoch (if no group is filtered): 4" in out  # 64 prompts / 16
