"""parallel.py on CPU: 2-process (gloo) FSDP2, TP and FSDP+TP runs against a single process, the
distributed update against the single-process one, checkpoints across world sizes, device selection."""
import copy
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import hf
import model as M
import parallel

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import dist_check  # noqa: E402
from conftest import compile_unavailable, max_diff, torchrun_dist_check  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "model"
    hf.save_pretrained(M.Transformer(dist_check.tiny_config()).init_weights(seed=0), str(path))
    return path


def single_process(model_dir, steps=3):
    dims = parallel.init_distributed("cpu")
    m = hf.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    losses = dist_check.train_steps(m, opt, dims, steps=steps)
    return m, opt, losses


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("mode,nproc", [("fsdp", 2), ("tp", 2), ("fsdp_tp", 4)])
def test_sharded_training_matches_single_process(model_dir, tmp_path, mode, nproc):
    ref, _, ref_losses = single_process(model_dir)
    torchrun_dist_check(nproc, mode, model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    # 3 AdamW steps of lr 1e-2 amplify fp32 rounding (thread count changes reduction order): allow 1% of a
    # step; the per-head-norm gradient bug this caught gave 4e-2
    assert max_diff(dict(ref.named_parameters()), got["params"]) < 1e-4
    if mode == "tp":  # every TP rank sees all documents: the same loss as one process
        assert got["losses"] == pytest.approx(ref_losses, abs=1e-5)
    # dp replicas: fsdp 2 (ranks 0, 1), tp 1, fsdp_tp 2 (each of 2 TP ranks): 1 + 2 and 0.5 + 0.5 once per replica
    assert got["dp_sum"] == {"fsdp": {"a": 3.0, "b": 1.0}, "tp": {"a": 1.0, "b": 0.5},
                             "fsdp_tp": {"a": 3.0, "b": 1.0}}[mode]


# update-2 is the fast tier's one distributed case (2 gloo ranks under torchrun); the others are slow
@pytest.mark.parametrize("mode,nproc", [("update", 2), pytest.param("update_sp", 2, marks=pytest.mark.slow),
                                        pytest.param("update_one", 1, marks=pytest.mark.slow)])
def test_update_policy_is_exact_across_ranks(model_dir, tmp_path, mode, nproc):
    """2 ranks x token-budget micro-batches give the single-process update (global token-mean); with sp=2 the
    two ranks split each micro-batch's tokens instead of the micro-batches; one rank under FSDP over a mesh of
    one (what one GPU runs) gives the plain module's."""

    import train_dapo as T
    from conftest import random_batch
    dims = parallel.init_distributed("cpu")
    m = hf.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)  # as dist_check.py
    cfg = T.Config(train_batch_size=3, n=2, ppo_mini_batch_size=3, max_response_length=7, grad_clip=1e9,
                   ppo_micro_batch_size_per_gpu=6)
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    T.update_policy(m, opt, T.make_scheduler(opt, cfg, 1), random_batch(), cfg, dims)
    torchrun_dist_check(nproc, mode, model_dir, tmp_path / "out.pt")
    assert max_diff(dict(m.named_parameters()), before) > 1e-3  # the step is large enough to see a scale error
    assert max_diff(dict(m.named_parameters()), torch.load(tmp_path / "out.pt")["params"]) < 1e-5


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("save_at,load_at,offload", [(2, 1, ""), (1, 2, ""), (2, 2, "_offload")])
def test_checkpoint_resumes_at_another_world_size(model_dir, tmp_path, save_at, load_at, offload):
    """_offload: FSDP-sharded AdamW states kept off the device between steps (optimizer_offload) on both sides."""
    torchrun_dist_check(save_at, "save" + offload, model_dir, tmp_path / "saved.pt")
    assert (tmp_path / "ckpt" / "COMPLETE").exists() and (tmp_path / "ckpt" / "config.json").exists()
    torchrun_dist_check(load_at, "load" + offload, model_dir, tmp_path / "loaded.pt")
    ref, _, _ = single_process(model_dir, steps=2)  # two uninterrupted steps
    got = torch.load(tmp_path / "loaded.pt")
    assert got["state"]["step"] == 1
    assert max_diff(dict(ref.named_parameters()), got["params"]) < 1e-4  # Adam amplifies fp32 rounding, as above
    exported = hf.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32)  # the HF export after step 1
    one, _, _ = single_process(model_dir, steps=1)
    assert max_diff(dict(one.named_parameters()), dict(exported.named_parameters())) < 1e-4


def test_device_selection_with_a_fake_npu(monkeypatch):
    fake = types.SimpleNamespace(type="npu")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: fake)
    assert parallel.device_type("auto") == "npu" and parallel.BACKENDS["npu"] == "hccl"
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert parallel.device_type("auto") == "cpu" and parallel.get_device("auto") == torch.device("cpu")


def test_an_explicit_device_must_exist_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' but torch sees no CUDA device.*use device='auto'"):
        parallel.device_type("cuda")
    # before any process group or device is set up
    with pytest.raises(ValueError, match=r"device='cuda' but torch sees no CUDA device"):
        parallel.init_distributed("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parallel.device_type("cuda") == "cuda"
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(ValueError, match=r"device='npu' but torch_npu is not installed.*use device='auto'"):
        parallel.device_type("npu")
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    with pytest.raises(ValueError, match=r"device='npu' but torch_npu sees no NPU"):
        parallel.device_type("npu")
    monkeypatch.setattr(torch.npu, "is_available", lambda: True)
    assert parallel.device_type("npu") == "npu"
    with pytest.raises(ValueError, match=r"device='tpu'; choose one of auto, cuda, npu, cpu"):
        parallel.device_type("tpu")


def test_process_group_backend():
    assert parallel.process_group_backend("cpu") == "gloo"
    assert parallel.process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert parallel.process_group_backend("npu") == "cpu:gloo,npu:hccl"


@pytest.mark.parametrize("world,tp,sp,dp", [(1, 1, 1, 1), (8, 2, 1, 4), (8, 2, 2, 2), (16, 1, 8, 2), (4, 4, 1, 1)])
def test_check_mesh_returns_dp(world, tp, sp, dp):
    assert parallel.check_mesh(world, tp, sp, num_attention_heads=8, num_key_value_heads=4) == dp


@pytest.mark.parametrize("args,message", [
    ((3, 2, 1), r"sp_size=1 x tp_size=2 = 2 must divide the world size 3"),
    ((8, 2, 4), r"num_attention_heads=4 must be divisible by tp_size x sp_size = 2 x 4"),
    ((8, 0, 1), r"tp_size=0, sp_size=1 and ep_size=1 must be >= 1"),
    ((8, 4, 1), r"num_key_value_heads=2 must be divisible by tp_size=4"),
    ((16, 1, 8), r"num_attention_heads=4 must be divisible by tp_size x sp_size = 1 x 8"),
])
def test_check_mesh_names_the_knobs(args, message):
    with pytest.raises(ValueError, match=message):
        parallel.check_mesh(*args, num_attention_heads=4, num_key_value_heads=2)


def test_tp_size_must_divide_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="sp_size=1 x tp_size=2 = 2 must divide the world size 3"):
        parallel.init_distributed("cpu", tp=2)
    with pytest.raises(ValueError, match="sp_size=1 x tp_size=2 = 2 must divide the world size 3"):
        parallel.ParallelDims(world_size=3, rank=0, local_rank=0, tp=2, device=torch.device("cpu"))


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(max_norm):
    """The global norm and the clipped gradients equal torch's clip_grad_norm_ on plain tensors; parameters
    without a gradient are skipped."""
    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in [(3, 4), (5,), (2, 2, 2), (1,)]]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in [(3, 4), (5,), (2, 2, 2), (1,)]]
    for a, b in zip(ours[:3], ref[:3]):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    norm = parallel.clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(ours[:3], ref[:3]):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert ours[3].grad is None
    assert parallel.clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0) == 0.0


@pytest.mark.slow  # torchrun
def test_mesh_of_one_computes_in_bf16_over_fp32_master_weights(model_dir, tmp_path):
    """One GPU's policy (FSDP2 over a mesh of one, bf16 compute): the forward is the bf16 model's, exactly, and the
    gradients are those of the bf16 model, kept in fp32 on the fp32 master parameters."""
    torchrun_dist_check(1, "bf16_one", model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    ref = hf.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    want = dist_check.forward_backward(ref, types.SimpleNamespace(world_size=1))
    assert torch.equal(got["logp"], want["logp"]) and got["logp"].dtype == torch.float32
    assert {g.dtype for g in got["grads"].values()} == {torch.float32}
    for name, g in got["grads"].items():
        assert torch.equal(g, want["grads"][name].float()), name


@pytest.mark.slow  # torchrun
def test_clip_grad_norm_over_plain_sharded_and_pending_gradients(model_dir, tmp_path):
    """2 ranks: a plain gradient (the same on both), a sharded one, and one whose sum over the ranks is still
    pending (Partial): the norm of the full gradients, and every full gradient scaled by max_norm / norm."""
    torchrun_dist_check(2, "clip_mixed", model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    assert got["norm"] == pytest.approx(got["expected"], rel=1e-6) and got["norm"] > 1.0
    for clipped, want in zip(got["clipped"], got["want"]):
        torch.testing.assert_close(clipped, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # torchrun
def test_mesh_of_one_accumulates_unsharded_with_the_same_sums(model_dir, tmp_path):
    """One GPU keeps its bf16 weights gathered and its gradients unsharded across a mini-batch's micro-batches:
    the gradients are those of a reduction after every backward, bit for bit, and every weight is back to its
    fp32 shard after the last backward and after no-grad forwards once resharded (else the next forward
    would read weights from before the optimizer step)."""
    torchrun_dist_check(1, "accumulate_one", model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    for name, g in got["each_backward"].items():
        assert g.dtype == torch.float32 and torch.equal(got["accumulated"][name], g), name
    assert got["sharded_between_each"] and not got["sharded_between_accumulated"]  # gathered once, kept
    assert got["sharded_after_backward"] and got["sharded_after_reshard"]
    assert not got["sharded_after_no_grad"]  # the mesh of one keeps what a forward gathered


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("nproc", [2, 4])
def test_router_replay_rows_reach_only_the_ranks_that_train_on_them(model_dir, tmp_path, nproc):
    """Routing stays on the rank that generated it; each rank receives exactly the rows of its own update and
    log-prob shares that it does not hold, and every row it uses is the one generated."""
    torchrun_dist_check(nproc, "routing", model_dir, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    for name in ("update", "logprobs"):
        covered = set()
        for rank, needed, nbytes, expected, right in out[name]:
            assert right and nbytes == expected, (name, rank)
            covered |= set(needed)
        assert covered == set(range(24))  # between them the ranks use every trajectory
        assert sum(nbytes for _, _, nbytes, _, _ in out[name]) < sum(
            (3 + i % 5) * 4 for i in range(24))  # less than every rank receiving every row would be
    for rank, held in enumerate(out["logprobs_held"]):  # generated here or fetched to be trained on here
        generated = {i for i in range(24) if (7 * i) % nproc == rank}
        used = set(out["update"][rank][1]) | set(out["logprobs"][rank][1])
        assert set(held) == generated | used


def test_optimizer_state_offload_steps_as_without_it_and_frees_the_states_between_steps():
    """optimizer_offload on plain host tensors (the mechanism is the same on a GPU, where the tape is pinned):
    three AdamW steps give the weights of three without it, bit for bit; between steps every state's
    storage is 0 bytes and its bytes sit in the host buffers; state_dict() and a checkpoint's on_device()
    bring them back, and a loaded state dict is what the next step uses."""
    def run(offload: bool, steps: int = 3):
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        # 64-byte chunks: the 128-byte states straddle them
        states = parallel.OptimizerStateOffload(opt, pin=False, chunk_bytes=64) if offload else None
        for _ in range(steps):
            m(torch.randn(5, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            if states is not None:
                assert [t.untyped_storage().nbytes() for _, t in states.states()] == [0] * 6
                # exp_avg, exp_avg_sq and step of each parameter, in 64-byte chunks
                assert sum(c.numel() for c in states.chunks) == 2 * 4 * (32 + 4) + 2 * 4
                assert [c.numel() for c in states.chunks] == [64] * 4 + [40]
        return m, opt, states

    plain_model, plain_opt, _ = run(False)
    model, opt, states = run(True)
    assert all(torch.equal(p, q) for p, q in zip(plain_model.parameters(), model.parameters()))
    assert states.pop_seconds() > 0 and states.seconds == 0  # the moves' time, for the step's metrics
    with states.on_device():  # a checkpoint reads them
        for (_, t), (_, u) in zip(states.states(), parallel.OptimizerStateOffload(plain_opt, pin=False).states()):
            assert torch.equal(t, u)
    assert all(t.untyped_storage().nbytes() == 0 for _, t in states.states()) and states.seconds == 0
    saved = copy.deepcopy(opt.state_dict())  # brings them in (until the next step, which frees its tensors)
    assert all(t.untyped_storage().nbytes() > 0 for _, t in states.states())
    opt.step()  # no gradients: AdamW leaves the states; the hooks send them out
    opt.load_state_dict({**saved, "state": {k: {n: v.clone() + 1 if n != "step" else v for n, v in st.items()}
                                            for k, st in saved["state"].items()}})
    assert all(t.untyped_storage().nbytes() > 0 for _, t in states.states())  # loaded: on the device
    opt.step()
    with states.on_device():  # the loaded values, not the host buffers' older bytes
        for key, t in states.states():
            if key[1] != "step":
                assert torch.equal(t, saved["state"][key[0]][key[1]] + 1)


COMPILED_FSDP_BLOCKS = """
import json, os, sys
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, os.getcwd())
import model as M, parallel
dims = parallel.init_distributed("cpu", mesh_of_one=True)  # FSDP2 on a mesh of one, as on one GPU
cfg = M.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
m = M.Transformer(cfg).init_weights(seed=0)
parallel.parallelize(m, dims, param_dtype=torch.float32, compile=True)
out = []
for lens in ([20, 20], [12, 30], [40], [25, 25], [9, 17]):  # one length, mixed, one document, then again
    ids, pos, batch = M.pack_sequences([list(range(1, n)) for n in lens])
    before = counters["stats"]["unique_graphs"]
    logp, _ = m(ids, pos, batch, target_ids=ids, with_entropy="detached")
    logp.sum().backward()
    out.append(counters["stats"]["unique_graphs"] - before)
print(json.dumps({"graph_breaks": sum(counters["graph_break"].values()), "new_graphs": out}))
"""


@pytest.mark.slow  # torch.compile (Inductor), in a process of its own (a process group of one)
def test_compiled_blocks_under_fsdp_trace_without_a_graph_break():
    """On one GPU the trainer's blocks are FSDP2 modules on a mesh of one, compiled with symbolic shapes. Their
    unsharded parameters are graph inputs there, so the head counts are symbolic too, and SDPA's enable_gqa
    got a SymBool: a graph break that ran attention outside the blocks' graphs (seen on an H100 as three frames
    a block). A CPU mesh of one has the same FSDP2 modules: every kind of micro-batch (documents of one length,
    mixed lengths, one document) traces with no break, forward and backward, and later micro-batches of each
    kind compile nothing new."""
    if (why := compile_unavailable()) is not None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", COMPILED_FSDP_BLOCKS], cwd=os.path.dirname(HERE), env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["graph_breaks"] == 0, res
    new_graphs = res["new_graphs"]
    assert all(n > 0 for n in new_graphs[:3]) and new_graphs[3:] == [0, 0], new_graphs
