"""config.py: config files and --key=value overrides, types and choices, the knobs' ranges and the rules between
them, and the file checks (model directory, data, reward function) that run before anything expensive."""
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import config
import train_dapo as T


def test_config_file_then_cli_overrides(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import os\n_scratch = 3\nlr = 3e-4\nn = 4\ntrain_files = 'a.parquet'\n")
    cfg, flags = T.parse_args(T.Config, [str(f), "--n=16", "--out_dir=runs/x", "--betas=(0.9, 0.95)", "--dry_run"])
    assert (cfg.lr, cfg.n, cfg.out_dir, cfg.train_files, cfg.betas) == (3e-4, 16, "runs/x", ["a.parquet"],
                                                                         (0.9, 0.95))
    assert flags["dry_run"]
    assert T.parse_args(T.Config, ["--lr=1"])[0].lr == 1.0 and isinstance(T.parse_args(T.Config, ["--lr=1"])[0].lr, float)


@pytest.mark.parametrize("args,msg", [
    (["--lrr=1e-6"], "unknown config key 'lrr'.*did you mean 'lr'"),
    (["--n=four"], "n='four'.*expected int"),
    (["--use_kl_loss=1"], "use_kl_loss=1.*expected bool"),
    (["--n"], "--key=value"),
    (["nope.py"], "config file 'nope.py' not found"),
])
def test_config_errors_name_the_key(args, msg):
    with pytest.raises(T.ConfigError, match=msg):
        T.parse_args(T.Config, args)


@pytest.mark.parametrize("over,msg", [
    (dict(ppo_mini_batch_size=3), "ppo_mini_batch_size=3 must divide train_batch_size=32"),
    (dict(ppo_micro_batch_size_per_gpu=48), "ppo_micro_batch_size_per_gpu=48 must divide"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c=1.0 must be > 1"),
    (dict(overlong_buffer_len=2048), "overlong_buffer_len=2048 must be in"),
    (dict(loss_agg_mode="sum"), "loss_agg_mode='sum'; choose one of token-mean"),
    (dict(kl_loss_type="k9"), "kl_loss_type='k9'; choose one of kl, abs, mse, low_var_kl"),
    (dict(filter_groups_metric="reward"), "filter_groups_metric='reward'; choose one of acc, score"),
    (dict(truncation="cut"), "truncation='cut'; choose one of error, left, right, middle"),
    (dict(gen_batch_size=8, filter_groups=False), "gen_batch_size=8 < train_batch_size=32"),
    (dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=100), "ppo_max_token_len_per_gpu=100 x sp_size=1 must be >="),
    (dict(logger=["console", "neptune"]), "logger 'neptune'; choose from console, jsonl"),
    (dict(n=0), "n=0 must be > 0"),
    (dict(sp_size=2), "sp_size=2 x tp_size=1 = 2 must divide the world size 1"),
    (dict(compile=True, device="cpu"), "compile=True compiles the sharded policy"),
    (dict(router_replay=True), "router_replay=True replays the routing vLLM records"),
])
def test_cross_field_validation(over, msg):
    with pytest.raises(T.ConfigError, match=msg):
        config.check_config(T.Config(**over), world_size=1, check_files=False)


def test_token_budget_is_per_gpu_and_an_sp_group_pools_it():
    """verl's convention: one sequence (512 + 1024 tokens) must fit the budget of an SP group, sp_size x per GPU."""
    cfg = dict(use_dynamic_bsz=True, sp_size=2, log_prob_max_token_len_per_gpu=800)
    config.check_config(T.Config(**cfg, ppo_max_token_len_per_gpu=800), world_size=2, check_files=False)  # 1600 >= 1536
    with pytest.raises(T.ConfigError, match="ppo_max_token_len_per_gpu=700 x sp_size=2 must be >= .* = 1536"):
        config.check_config(T.Config(**cfg, ppo_max_token_len_per_gpu=700), world_size=2, check_files=False)


def test_world_size_must_split_mini_batch():
    with pytest.raises(T.ConfigError, match="split evenly over 3 data-parallel ranks"):
        config.check_config(T.Config(), world_size=3, check_files=False)


def test_file_checks(tiny_dir, tmp_path):
    base = dict(model_path=str(tiny_dir / "model"), train_files=[str(tiny_dir / "train.parquet")],
                val_files=[str(tiny_dir / "val.parquet")], gen_batch_size=8, train_batch_size=8,
                ppo_mini_batch_size=8, max_prompt_length=256, max_response_length=256, overlong_buffer_len=64)
    config.check_config(T.Config(**base))
    with pytest.raises(T.ConfigError, match="= 513 exceeds the model's context, max_position_embeddings=512"):
        config.check_config(T.Config(**{**base, "max_response_length": 257}))
    with pytest.raises(T.ConfigError, match="no config.json"):
        config.check_config(T.Config(**{**base, "model_path": str(tmp_path)}))
    for knob in ("router_aux_loss", "router_replay"):  # MoE knobs on a dense model
        with pytest.raises(T.ConfigError, match=f"{knob}=True but .* is not a mixture-of-experts model"):
            config.check_config(T.Config(**{**base, knob: True, "rollout_engine": "vllm"}))
    import data
    with pytest.raises(data.DataError, match="data file not found: .*missing.parquet"):
        config.check_config(T.Config(**{**base, "train_files": [str(tmp_path / "missing.parquet")]}))
    pq.write_table(pa.table({"data_source": ["x"], "prompt": ["hi"]}), tmp_path / "bad.parquet")
    with pytest.raises(data.DataError, match="missing column 'reward_model' in .*bad.parquet"):
        config.check_config(T.Config(**{**base, "train_files": [str(tmp_path / "bad.parquet")]}))
    with pytest.raises(T.ConfigError, match="file '.*nofile.py' not found"):
        config.check_config(T.Config(**{**base, "reward_fn": str(tmp_path / "nofile.py") + ":f"}))


@pytest.mark.parametrize("source,message", [
    ("lr = 1e-3\nn = (4\n", r"bad.py line 2: syntax error"),
    ("lr = 1e-3\n\nn = undefined_name * 2\n", r"bad.py line 3: NameError: name 'undefined_name'"),
    ("import os\nn = int(os.environ['NO_SUCH_VARIABLE_X'])\n", r"bad.py line 2: KeyError"),
])
def test_config_file_errors_name_the_file_and_line(tmp_path, capsys, source, message):
    (tmp_path / "bad.py").write_text(source)
    assert T.main([str(tmp_path / "bad.py")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err


def test_main_reports_errors_without_traceback(capsys):
    assert T.main(["--lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'lrr'") and "Traceback" not in err
