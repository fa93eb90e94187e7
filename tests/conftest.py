"""Shared test helpers. Everything is built in the test; nothing is downloaded. No test file imports
another test file: what two of them share lives here (`from conftest import NAME`) or in a plain helper
module of tests/helpers/ (dist_check.py, ep_ckpt_util.py, moe_util.py, fake_vllm.py, fake_vllm_launch.py,
reference.py), which this file puts on sys.path: a test imports them by name (`import dist_check`).

Paths
    ROOT, TESTS_DIR        the repository root and tests/; HELPERS_DIR tests/helpers/
Tiny models and data
    byte_tokenizer_dir     a model directory's tokenizer files (a token per byte + SPECIALS), chat template
    make_model_dir         a tiny random Qwen2 model directory with that tokenizer
    tiny_dir (fixture)     session-wide: {root}/model, {root}/train.parquet, {root}/val.parquet (arithmetic)
    random_batch           a fixed batch of 6 trajectories for the update tests (one process or across ranks)
The trainer on the tiny model
    TINY_RUN               the end-to-end tests' small-run settings (few tokens and prompts, one CPU thread)
    tiny_train_config      TINY_RUN on tiny_dir as a train_dapo.Config (in-process: train_dapo.train)
    trainer_argv           TINY_RUN on tiny_dir as command-line flags (train_dapo.main, or the script)
    run_metrics            a run's metrics.jsonl rows without timings (what must match between runs)
Processes
    torchrun_script        `torchrun --standalone` a script of tests/helpers/ on N CPU processes; asserts it exits 0
    torchrun_dist_check    torchrun_script for tests/helpers/dist_check.py (a mode and its arguments)
Comparisons and environment probes
    max_diff               the largest absolute difference between two same-keyed dicts of tensors
    compile_unavailable    None, or why torch.compile (Inductor) cannot run on this machine
The memory planner's tiny model, its numbers worked out by hand (tests/test_plan.py, tests/test_sp.py)
    GiB, planner_model, planner_cfg, plan_bytes

Tiers: tests marked `slow` (they start processes, compile, or otherwise take long) are left out of the
default `python -m pytest -q` (pyproject.toml's addopts); `python -m pytest -q -m slow` runs them."""
import json
import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import data
import hf
import model as M
import train_dapo as T
from tools import prepare_data

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
HELPERS_DIR = os.path.join(TESTS_DIR, "helpers")
sys.path.insert(0, HELPERS_DIR)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def byte_tokenizer_dir(path, template=CHAT_TEMPLATE, eos_token="<|im_end|>", generation_config=None, config=None,
                       pad_token=None):
    """A model directory's tokenizer files: one token per byte plus SPECIALS (ids 0, 1, 2); the JSON files given."""
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    tc = {"chat_template": template} if template is not None else {}
    tc.update({k: v for k, v in (("eos_token", eos_token), ("pad_token", pad_token)) if v is not None})
    files = {"tokenizer_config.json": tc, "generation_config.json": generation_config, "config.json": config}
    for name, d in files.items():
        if d is not None:
            (path / name).write_text(json.dumps(d))
    return str(path)


def make_model_dir(path, seed=0, hidden=32, layers=2):
    """A tiny random Qwen2 model directory with the byte tokenizer and the chat template."""
    byte_tokenizer_dir(path, pad_token="<|endoftext|>")
    vocab_size = len(SPECIALS) + len(pre_tokenizers.ByteLevel.alphabet())
    cfg = M.ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=vocab_size, hidden_size=hidden,
                        intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
    hf.save_pretrained(M.Transformer(cfg).init_weights(seed=seed), str(path))
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """{root}/model (random tiny Qwen2 + tokenizer), {root}/train.parquet, {root}/val.parquet"""
    root = tmp_path_factory.mktemp("tiny")
    make_model_dir(root / "model")
    data.write_parquet(prepare_data.make_arith_rows(64, "train", seed=0), str(root / "train.parquet"))
    data.write_parquet(prepare_data.make_arith_rows(16, "val", seed=0), str(root / "val.parquet"))
    return root


def random_batch(vocab=40, n_traj=6, R=7, seed=0):
    """A fixed batch of 6 trajectories (3 groups of 2) with response lengths 1..7, old log-probs and advantages:
    the update tests' input, in one process and across ranks."""
    g = torch.Generator().manual_seed(seed)
    resp_lens = [1, 7, 3, 5, 2, 6][:n_traj]
    prompts = [torch.randint(0, vocab, (3 + i,), generator=g).tolist() for i in range(n_traj)]
    resps = [torch.randint(0, vocab, (L,), generator=g).tolist() for L in resp_lens]
    mask = torch.zeros(n_traj, R)
    for i, L in enumerate(resp_lens):
        mask[i, :L] = 1
    return T.Trajectories(
        prompt_ids=prompts, response_ids=resps, group_ids=torch.arange(n_traj) // 2,
        rollout_logp=torch.zeros(n_traj, R), response_mask=mask, finish_reasons=["stop"] * n_traj,
        data_sources=["x"] * n_traj, acc=torch.zeros(n_traj), score=torch.zeros(n_traj),
        seq_reward=torch.zeros(n_traj), old_logp=torch.randn(n_traj, R, generator=g) * 0.1 - 3.0,
        adv=torch.randn(n_traj, generator=g))


# -----------------------------------------------------------------------------
# the trainer on the tiny model


TINY_RUN = dict(max_prompt_length=64, max_response_length=12, overlong_buffer_len=6, train_batch_size=2,
                gen_batch_size=3, n=4, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=2,
                filter_groups_metric="seq_reward", temperature=1.5, lr=1e-3, test_freq=2, save_freq=1,
                reward_num_workers=0, cpu_threads=1, val_max_samples=4, max_num_gen_batches=20,
                logger=["jsonl"])


def tiny_train_config(tiny_dir, out_dir, **over):
    """A train_dapo.Config for a short run on tiny_dir's model and data (TINY_RUN, resume='auto'),
    writing to out_dir; keyword arguments override any key."""
    base = dict(model_path=str(tiny_dir / "model"), train_files=[str(tiny_dir / "train.parquet")],
                val_files=[str(tiny_dir / "val.parquet")], out_dir=str(out_dir), **TINY_RUN, resume="auto")
    return T.Config(**{**base, **over})


def trainer_argv(tiny_dir, out, **over):
    """The command-line flags (--key=value) of a short run on tiny_dir's model and data (TINY_RUN),
    writing to out; keyword arguments override any key. For train_dapo.main(...) or the script."""
    kv = {"model_path": str(tiny_dir / "model"), "train_files": [str(tiny_dir / "train.parquet")],
          "val_files": [str(tiny_dir / "val.parquet")], "out_dir": str(out), **TINY_RUN, **over}
    return [f"--{k}={v!r}" if not isinstance(v, str) else f"--{k}={v}" for k, v in kv.items()]


def run_metrics(out):
    """The rows of out/metrics.jsonl without the timing_s/ and perf/ keys: what a resumed or repeated run
    must reproduce exactly."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


# -----------------------------------------------------------------------------
# processes


def torchrun_script(nproc, script, *args, timeout=300):
    """Run tests/helpers/{script} under `torchrun --standalone` (a free port) on nproc CPU processes (gloo), one
    thread each, the repository on PYTHONPATH; assert it exits 0, else fail with the tail of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(HELPERS_DIR, script), *map(str, args)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def torchrun_trainer(tiny_dir, out, nproc, fault=None, fake_vllm=False, **over):
    """`torchrun --nproc-per-node nproc train_dapo.py -- FLAGS` of a short run on tiny_dir's model and data
    (trainer_argv), a free port, CPU processes of one thread each -> the Popen, stdout and stderr in one pipe.
    fault: NANODAPO_FAULT (checkpoint.fault_point). fake_vllm: tests/helpers/fake_vllm.py stands in for vllm
    (tests/helpers/fake_vllm_launch.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("NANODAPO_FAULT", None)
    if fault:
        env["NANODAPO_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(HELPERS_DIR, "fake_vllm_launch.py") if fake_vllm else os.path.join(ROOT, "train_dapo.py"),
           "--", *trainer_argv(tiny_dir, out, **over)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def torchrun_dist_check(nproc, mode, *args):
    """tests/helpers/dist_check.py's `mode` (fsdp, tp, sp, ep2, save, load, ...) on nproc CPU processes; it
    writes its results to the .pt path among args."""
    torchrun_script(nproc, "dist_check.py", mode, *args)


# -----------------------------------------------------------------------------
# comparisons and environment probes


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute elementwise difference between two dicts of tensors with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].detach() - b[k].detach()).abs().max().item() for k in a)


def compile_unavailable() -> str | None:
    """None, or why torch.compile (inductor) cannot run here."""
    try:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    except Exception as e:  # no C++ compiler, unsupported platform, ...
        return f"{type(e).__name__}: {e}"
    return None


# -----------------------------------------------------------------------------
# the memory planner's tiny Qwen2-shaped model, every number by hand (tests/test_plan.py, test_sp.py)
#
# hidden 64, intermediate 128, 2 layers, 4 heads x 16 (q 64), 2 kv heads (kv 32), vocab 1000, untied,
# q/k/v biases.
# per block, TP-sharded: q 64*64 + k,v 2*64*32 + o 64*64 + biases 64+32+32 + gate/up/down 3*64*128 = 36,992
#            replicated: two norms 2*64 = 128                                    block = 37,120
# root (replicated over TP): embeddings + lm_head 2*1000*64 + final norm 64 = 128,064
# P = 2 * 37,120 + 128,064 = 202,304

GiB = 2**30


def planner_model():
    """The tiny Qwen2-shaped model.ModelConfig above (202,304 parameters)."""
    return M.ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=1000, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)


def planner_cfg(**kw):
    """The train_dapo.Config the hand-checked plans use (tp_size=2, checkpointing on, eager blocks: the
    activation bytes worked out in tests/test_plan.py, ...); keyword arguments override any key."""
    base = dict(max_prompt_length=16, max_response_length=48, ppo_micro_batch_size_per_gpu=2,
                use_dynamic_bsz=False, logprob_chunk=16, max_num_seqs=8, n=4, gradient_checkpointing=True,
                tp_size=2, compile=False)
    return T.Config(**{**base, **kw})


def plan_bytes(plan):
    """A plan.memory_plan result's per-item GiB as whole bytes."""
    return {k: round(v * GiB) for k, v in plan["gib"].items()}
