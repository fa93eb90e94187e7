"""hf.py: HF model directories that do not match their config.json or are damaged are named precisely (the tensor,
the file, both shapes) before anything loads; architectures nanodapo does not implement are refused."""
import json

import pytest
import safetensors.torch
import torch

import hf
from conftest import make_model_dir


# tiny dirs from conftest.make_model_dir: Qwen2, hidden 32, MLP 64, 2 layers, 4 heads / 2 kv heads, 512 positions

def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="MistralForCausalLM.*Qwen2ForCausalLM"):
        hf.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json in model directory"):
        hf.from_pretrained(str(tmp_path / "nope"))


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def test_context_limit_is_on_the_config(tmp_path):
    assert hf.load_config(str(make_model_dir(tmp_path))).max_position_embeddings == 512


def test_wrong_shape_names_tensor_file_and_both_shapes(tmp_path):
    path = make_model_dir(tmp_path)
    edit_config(path, intermediate_size=80)
    with pytest.raises(ValueError) as e:
        hf.from_pretrained(str(path), dtype=torch.float32)
    msg = str(e.value)
    assert "'model.layers.0.mlp.down_proj.weight'" in msg and "model.safetensors" in msg
    assert "the checkpoint has (32, 64), config.json implies (32, 80)" in msg


def test_missing_tensors_are_listed(tmp_path):
    path = make_model_dir(tmp_path)
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    for name in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        del tensors[name]
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        hf.from_pretrained(str(path), dtype=torch.float32)
    msg = str(e.value)
    assert "lacks 2 tensors" in msg and "'model.layers.1.mlp.up_proj.weight', 'model.norm.weight'" in msg


def test_truncated_safetensors_names_the_file(tmp_path):
    path = make_model_dir(tmp_path)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError) as e:
        hf.from_pretrained(str(path), dtype=torch.float32)
    assert str(f) in str(e.value) and "truncated or corrupt" in str(e.value)


def test_missing_shard_names_index_and_shard(tmp_path):
    path = make_model_dir(tmp_path)
    hf.save_pretrained(hf.from_pretrained(str(path), dtype=torch.float32), str(path), max_shard_bytes=20_000)
    (path / "model.safetensors").unlink()  # the single file from make_model_dir, superseded by the index
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=f"model.safetensors.index.json lists 1 shard.*{shards[-1].name}"):
        hf.from_pretrained(str(path), dtype=torch.float32)


def test_kv_heads_must_divide_heads(tmp_path):
    path = make_model_dir(tmp_path)
    edit_config(path, num_key_value_heads=3)
    with pytest.raises(ValueError) as e:
        hf.load_config(str(path))
    msg = str(e.value)
    assert "config.json" in msg and "num_key_value_heads=3 does not divide num_attention_heads=4" in msg


def test_unreadable_config_json(tmp_path):
    path = make_model_dir(tmp_path)
    (path / "config.json").write_text('{"architectures": ')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        hf.load_config(str(path))
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 32}))
    with pytest.raises(ValueError, match="config.json has no 'vocab_size'"):
        hf.load_config(str(path))
