"""tools/from_verl.py: a verl launch script -> a config file whose --dry_run passes and whose fields equal the
direct translation of the same keys; bash's ${VAR:-default}, $((...)), quoting and continuations expanded as bash
does; unknown keys stop it."""
import os
import subprocess
import sys

import pytest

import train_dapo as T
from conftest import ROOT
from test_verl_keys import GUIDE_32B, GUIDE_DAPO_TUNING, GUIDE_GSM8K, launch_args

sys.path.insert(0, os.path.join(ROOT, "tools"))
import from_verl  # noqa: E402

# the Qwen2.5-32B guide's settings as a launch script of shell variables, the way verl's recipe scripts are written
SCRIPT_32B = r"""#!/usr/bin/env bash
set -xeuo pipefail
MODEL_PATH=${MODEL_PATH:-"/file_system/models/Qwen/Qwen2.5-32B"}
CKPTS_DIR=${CKPTS_DIR:-"/file_system/ckpt/DAPO/DAPO-Qwen2.5-32B"}
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 20))
overlong_buffer_len=$((1024 * 4))
train_prompt_bsz=512
gen_prompt_bsz=$((train_prompt_bsz * 3))   # 1536
NNODES=${NNODES:-16}
sp_size=8
offload=True
ray job submit --no-wait --runtime-env="${RUNTIME_ENV:-verl/trainer/runtime_env.yaml}" \
    -- python3 -m recipe.dapo.main_dapo \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.gen_batch_size=${gen_prompt_bsz} \
    data.train_batch_size=${train_prompt_bsz} \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=${sp_size} \
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=${sp_size} \
    actor_rollout_ref.actor.fsdp_config.param_offload=${offload} \
    reward_model.overlong_buffer.len=${overlong_buffer_len} \
    trainer.nnodes="${NNODES}" \
    trainer.default_local_dir="${CKPTS_DIR}" \
    trainer.logger='["console","wandb"]'
"""


def run_tool(script_text, tmp_path, *args, env=None):
    script = tmp_path / "run_verl.sh"
    script.write_text(script_text)
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "from_verl.py"), str(script), *args],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    out = tmp_path / "configs" / "run_verl.py"
    out.parent.mkdir(exist_ok=True)
    out.write_text(r.stdout)
    return r, str(out)


def fields(cfg):
    return {f: getattr(cfg, f) for f in T.Config.__dataclass_fields__}


def test_shell_expansion_as_bash_does():
    words, module = from_verl.launch_words(SCRIPT_32B, {"NNODES": "4"}, [])
    assert module == "recipe.dapo.main_dapo"
    got = dict(w.split("=", 1) for w in words)
    assert got["data.max_prompt_length"] == "2048" and got["data.max_response_length"] == "20480"
    assert got["data.gen_batch_size"] == "1536"  # $((train_prompt_bsz * 3)), a bare name inside $((...))
    assert got["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "22528"
    assert got["actor_rollout_ref.model.path"] == "/file_system/models/Qwen/Qwen2.5-32B"  # ${VAR:-"default"}
    assert got["trainer.nnodes"] == "4"  # the environment's NNODES wins over the :- default
    assert got["trainer.logger"] == '["console","wandb"]'  # single quotes keep the double ones
    assert from_verl.arithmetic("7 / 2 - -3 % 2", {}, []) == 4  # bash: integer division, truncated
    words, _ = from_verl.launch_words('X=${UNSET:=5}\npython -m verl.trainer.main_ppo a.b=$X c.d=${X:+on} "$@"',
                                      {}, ["e.f=1"])
    assert words == ["a.b=5", "c.d=on", "e.f=1"]
    with pytest.raises(from_verl.ScriptError, match="line 1: command substitution"):
        from_verl.launch_words("python -m verl.trainer.main_ppo a.b=$(date +%s)", {}, [])
    with pytest.raises(from_verl.ScriptError, match="no verl launch command"):
        from_verl.launch_words("echo hello", {}, [])


@pytest.mark.parametrize("command, refused", [(GUIDE_32B, ["trainer.logger"]), (GUIDE_GSM8K, [])],
                         ids=["dapo_qwen2.5_32b", "gsm8k_grpo"])
def test_guide_script_becomes_a_config_that_dry_runs_and_equals_the_direct_translation(command, refused, tmp_path):
    r, path = run_tool("#!/bin/bash\nset -x\n" + command + " $@\n", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.rstrip().endswith("dry run: config OK")
    for key in refused:
        assert f"# - {key}=" in r.stdout  # listed at the top with its reason
    from_file, _ = T.parse_args(T.Config, [path])
    direct, _ = T.parse_args(T.Config, [a for a in launch_args(command) if a.split("=")[0] not in refused])
    assert fields(from_file) == fields(direct)
    assert T.main([path, "--dry_run"]) == 0


def test_generated_config_says_where_each_line_came_from(tmp_path):
    r, path = run_tool(SCRIPT_32B, tmp_path, env={"MODEL_PATH": "/models/Qwen2.5-32B"})
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "torchrun --nnodes 16 --nproc-per-node 8" in text
    assert 'model_path = "/models/Qwen2.5-32B"' in text.replace("'", '"')  # the variable from the command line
    assert "clip_ratio_c = 3.0  # verl's default: actor_rollout_ref.actor.clip_ratio_c" in text
    assert "sp_size = 8  # actor_rollout_ref.actor.ulysses_sequence_parallel_size" in text
    cfg, _ = T.parse_args(T.Config, [path])
    assert (cfg.gen_batch_size, cfg.ppo_max_token_len_per_gpu, cfg.overlong_buffer_len) == (1536, 22528, 4096)


def test_tuning_guide_names_its_missing_model_then_dry_runs_with_one(tmp_path):
    r, path = run_tool(GUIDE_DAPO_TUNING + "\n", tmp_path)
    assert r.returncode == 1
    assert "dynamic_bsz_warmup_steps" in r.stdout  # refused, listed with its reason
    assert "dry run: FAILED" in r.stderr and "model_path" in r.stderr  # verl's default model is not here
    assert T.main([path, "--model_path=/models/Qwen2.5-7B", "--dry_run"]) == 0


def test_unknown_keys_stop_the_tool(tmp_path):
    r, _ = run_tool("python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.clip_ratio_hihg=0.28\n", tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert "did you mean 'actor_rollout_ref.actor.clip_ratio_high'" in r.stderr
