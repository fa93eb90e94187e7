"""configs/*.py: every recipe parses and validates at its own world size; the 32B recipe's batch arithmetic;
each recipe's model is one the planner knows; hf.KNOWN_CONFIGS against the published parameter counts."""
import glob
import os

import pytest

import config
import hf
import model as M
import plan
import train_dapo as T
from conftest import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_parses_and_validates_at_its_world_size(path):
    cfg, flags = T.parse_args(T.Config, [path])
    assert not flags["dry_run"]
    config.check_config(cfg, world_size=cfg.nnodes * cfg.n_gpus_per_node, check_files=False)


def test_recipe_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"qwen32b.py", "qwen2.5_7b_dapo.py", "qwen3_8b_dapo.py", "qwen2_0.5b_gsm8k_grpo.py",
            "qwen3_235b_dapo.py", "qwen3_30b_a3b_dapo.py"} <= names


def test_qwen32b_batch_arithmetic_at_128_gpus():
    cfg, _ = T.parse_args(T.Config, [os.path.join(ROOT, "configs", "qwen32b.py")])
    assert cfg.nnodes * cfg.n_gpus_per_node == 128
    a = plan.batch_arithmetic(cfg, 128)
    assert a["prompts_per_gen_batch"] == 1536  # gen_batch_size = 3 x 512
    assert a["trajectories_per_step"] == 8192  # 512 groups x 16
    assert a["optimizer_steps_per_step"] == 16  # 512 / 32 groups per mini-batch, 1 epoch
    assert a["per_rank_mini_batch"] == 32  # 32 x 16 / dp 16 (128 GPUs = dp 16 x sp 8: an SP group shares data)


@pytest.mark.parametrize("path", [p for p in CONFIGS if os.path.basename(p) != "tiny.py"], ids=os.path.basename)
def test_recipe_model_is_known_to_the_planner(path):
    """--dry_run plans without the model present: the model directory's name is a KNOWN_CONFIGS key."""
    cfg, _ = T.parse_args(T.Config, [path])
    assert os.path.basename(cfg.model_path.rstrip("/")).lower() in hf.KNOWN_CONFIGS


# published parameter counts (Hugging Face model pages / safetensors totals), including embeddings
PUBLISHED = {"qwen2.5-32b": 32.76e9, "qwen2.5-7b": 7.62e9, "qwen3-8b": 8.19e9, "qwen2-0.5b-instruct": 0.494e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_known_configs_match_published_parameter_counts(name):
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS[name])
    assert mc.num_params() == pytest.approx(PUBLISHED[name], rel=0.01)


def test_known_configs_architecture_details():
    q3 = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen3-8b"])
    assert (q3.qk_norm, q3.attention_bias, q3.head_dim) == (True, False, 128)
    q2 = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen2.5-32b"])
    assert (q2.qk_norm, q2.attention_bias, q2.head_dim) == (False, True, 128)  # 5120 / 40
    assert M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen2-0.5b-instruct"]).tie_word_embeddings
