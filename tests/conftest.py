"""Shared fixtures: a tiny random Qwen2 model directory with a byte-level tokenizer and a chat template,
and arithmetic parquet files in verl's schema. Everything is built in the test; nothing is downloaded."""
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import data
import model as M
import train_dapo as T
from tools import prepare_data

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
    M.save_pretrained(M.Transformer(cfg).init_weights(seed=seed), str(path))
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
