"""verl's keys on nanodapo's command line (verl_keys.VERL_KEYS through config.parse_args): the full command lines of
the verl DAPO guide for Qwen2.5-32B, of a DAPO dynamic-batch tuning guide, and of the Ascend GSM8K GRPO guide
translate with no unknown key, and every Config field equals what the guide sets (tables written by hand from the
guides); validation keys never reach training knobs; refused keys say why; a mistyped key names the closest."""
import os
import re
import shlex

import pytest

import config
import train_dapo as T
import verl_keys
from conftest import ROOT

# The verl DAPO guide for Qwen2.5-32B: its Python f-string entrypoint with the guide's values substituted
# (dataset_path /file_system/datasets, model_path /file_system/models, checkpoint_path /file_system/ckpt, replicas
# 16; the guide writes gen_batch_size = train_prompt_bsz * 3, i.e. 3 x 512).
GUIDE_32B = """python3 -m verl.trainer.main_ppo \
    data.train_files="/file_system/datasets/BytedTsinghua-SIA/DAPO-Math-17k/verl/dapo-math-17k.parquet" \
    data.val_files="/file_system/datasets/BytedTsinghua-SIA/AIME-2024/verl/aime-2024.parquet" \
    data.prompt_key=prompt \
    data.truncation='left' \
    data.max_prompt_length=2048 \
    data.max_response_length=20480 \
    data.gen_batch_size=1536 \
    data.train_batch_size=512 \
    actor_rollout_ref.rollout.n=16 \
    algorithm.adv_estimator=grpo \
    algorithm.kl_ctrl.kl_coef=0.0 \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.max_num_gen_batches=10 \
    algorithm.filter_groups.metric=acc \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528 \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=22528 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=22528 \
    actor_rollout_ref.model.path="/file_system/models/Qwen/Qwen2.5-32B" \
    +actor_rollout_ref.model.override_config.attention_dropout=0. \
    +actor_rollout_ref.model.override_config.embd_pdrop=0. \
    +actor_rollout_ref.model.override_config.resid_pdrop=0. \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.use_token_level_loss=True \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=8 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.enable_chunked_prefill=True \
    actor_rollout_ref.rollout.max_num_batched_tokens=22528 \
    actor_rollout_ref.rollout.val_kwargs.top_k="-1" \
    actor_rollout_ref.rollout.val_kwargs.top_p=1.0 \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.n=1 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=8 \
    actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 \
    custom_reward_function.overlong_buffer.enable=True \
    custom_reward_function.overlong_buffer.len=4096 \
    custom_reward_function.overlong_buffer.penalty_factor=1.0 \
    trainer.logger=['console','vemlp_wandb'] \
    trainer.project_name="DAPO" \
    trainer.experiment_name="DAPO-Qwen2.5-32B" \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes="16" \
    +trainer.val_before_train=True \
    trainer.test_freq=5 \
    trainer.save_freq=5 \
    trainer.total_epochs=1 \
    trainer.default_local_dir="/file_system/ckpt/DAPO/DAPO-Qwen2.5-32B" \
    trainer.resume_mode=auto"""

# the guide's values, by hand (and verl's defaults where the guide leaves a knob to them)
EXPECTED_32B = dict(
    train_files=["/file_system/datasets/BytedTsinghua-SIA/DAPO-Math-17k/verl/dapo-math-17k.parquet"],
    val_files=["/file_system/datasets/BytedTsinghua-SIA/AIME-2024/verl/aime-2024.parquet"],
    prompt_key="prompt", truncation="left", max_prompt_length=2048, max_response_length=20480,
    gen_batch_size=1536, train_batch_size=512, n=16, kl_coef=0.0, kl_loss_coef=0.0, clip_ratio_low=0.2,
    clip_ratio_high=0.28, filter_groups=True, max_num_gen_batches=10, filter_groups_metric="acc",
    use_dynamic_bsz=True, ppo_max_token_len_per_gpu=22528, log_prob_max_token_len_per_gpu=22528,
    model_path="/file_system/models/Qwen/Qwen2.5-32B", gradient_checkpointing=True, lr=1e-6, lr_warmup_steps=10,
    weight_decay=0.1, ppo_mini_batch_size=32, param_offload=True, optimizer_offload=True, entropy_coeff=0.0,
    grad_clip=1.0, loss_agg_mode="token-mean", sp_size=8, gpu_memory_utilization=0.8, gen_tp=4,
    enable_chunked_prefill=True, max_num_batched_tokens=22528, val_top_k=-1, val_top_p=1.0, val_temperature=1.0,
    val_n=1, val_do_sample=True, ref_param_offload=True, overlong_buffer=True, overlong_buffer_len=4096,
    overlong_penalty_factor=1.0, project_name="DAPO", experiment_name="DAPO-Qwen2.5-32B", n_gpus_per_node=8,
    nnodes=16, val_before_train=True, test_freq=5, save_freq=5, total_epochs=1,
    out_dir="/file_system/ckpt/DAPO/DAPO-Qwen2.5-32B", resume="auto",
    # left to verl: its dual clip 3.0, no KL loss or in-reward KL, sampling at T 1
    clip_ratio_c=3.0, use_kl_loss=False, use_kl_in_reward=False, temperature=1.0, top_p=1.0, top_k=-1)

# a DAPO dynamic-batch tuning guide's "verified parameter combination", one line with the recipe scripts' variable
# names as flags (its `\ ` are the flattened line continuations)
GUIDE_DAPO_TUNING = (
    r"python3 -m verl.trainer.main_ppo \ --actor_rollout_ref.actor.use_dynamic_bsz=True \ "
    r"--algorithm.filter_groups.enable=True \ --algorithm.filter_groups.metric=seq_reward \ "
    r"--algorithm.filter_groups.max_num_gen_batches=20 \ --train_prompt_bsz=512 \ --n_resp_per_prompt=16 \ "
    r"--sp_size=4 \ --gen_tp=4 \ --actor_rollout_ref.model.use_remove_padding=True \ "
    r"--dynamic_bsz_warmup_steps=1000")
EXPECTED_DAPO_TUNING = dict(
    use_dynamic_bsz=True, filter_groups=True, filter_groups_metric="seq_reward", max_num_gen_batches=20,
    train_batch_size=512, n=16, sp_size=4, gen_tp=4,
    # left to verl: gen batches of train_batch_size prompts, 256-prompt mini-batches, clip 0.2 / 0.2 / 3.0
    gen_batch_size=512, ppo_mini_batch_size=256, clip_ratio_high=0.2, clip_ratio_c=3.0, weight_decay=0.01)

# the Ascend GSM8K GRPO guide's script (Qwen2-0.5B-Instruct, 2 nodes x 8 NPUs)
GUIDE_GSM8K = """python -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    +data.source=gsm8k \
    data.train_files=/data2/models/gsm8k/train.parquet \
    data.val_files=/data2/models/gsm8k/test.parquet \
    data.train_batch_size=128 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=/data2/models/Qwen2-0.5B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen0.5b_function_tmp_1124' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=2 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=30 \
    trainer.device=npu"""
EXPECTED_GSM8K = dict(
    train_files=["/data2/models/gsm8k/train.parquet"], val_files=["/data2/models/gsm8k/test.parquet"],
    train_batch_size=128, max_prompt_length=512, max_response_length=1024, filter_overlong_prompts=True,
    truncation="error", model_path="/data2/models/Qwen2-0.5B-Instruct", lr=1e-6, compile=False,
    ppo_mini_batch_size=32, ppo_micro_batch_size_per_gpu=4, use_kl_loss=True, kl_loss_coef=0.001,
    kl_loss_type="low_var_kl", entropy_coeff=0.0, gradient_checkpointing=True, param_offload=False,
    optimizer_offload=False, log_prob_micro_batch_size_per_gpu=4, gen_tp=2, rollout_engine="vllm",
    gpu_memory_utilization=0.6, n=4, ref_param_offload=True, use_kl_in_reward=False, logger=["console"],
    project_name="verl_grpo_example_gsm8k", experiment_name="qwen0.5b_function_tmp_1124", n_gpus_per_node=8,
    nnodes=2, save_freq=20, test_freq=5, total_epochs=30, device="npu",
    # left to verl: gen batch = train batch, clip 0.2 / 0.2 / 3.0, weight decay 0.01, greedy validation, no
    # dynamic sampling or overlong shaping, checkpoints under checkpoints/{project}/{experiment}
    gen_batch_size=128, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, weight_decay=0.01,
    val_do_sample=False, val_n=1, filter_groups=False, overlong_buffer=False,
    out_dir="checkpoints/verl_grpo_example_gsm8k/qwen0.5b_function_tmp_1124")

GUIDES = {"dapo_qwen2.5_32b": (GUIDE_32B, EXPECTED_32B, {"trainer.logger"}),
          "dapo_tuning": (GUIDE_DAPO_TUNING, EXPECTED_DAPO_TUNING, {"dynamic_bsz_warmup_steps"}),
          "gsm8k_grpo": (GUIDE_GSM8K, EXPECTED_GSM8K, set())}
FIELDS = [f for f in T.Config.__dataclass_fields__]


def launch_args(command: str) -> list[str]:
    """The words after the launcher's module, as the shell passes them."""
    words = shlex.split(command)
    return words[words.index("-m") + 2:]


def pairs(args: list[str]) -> list[tuple[str, str]]:
    return [tuple(a.split("=", 1)) for a in args if a.strip()]


@pytest.mark.parametrize("name", GUIDES)
def test_guide_command_line_has_no_unknown_key_and_refuses_only_what_it_must(name):
    command, _, refused = GUIDES[name]
    t = verl_keys.translate(pairs(launch_args(command)), FIELDS, verl_defaults=True)
    assert t.unknown == []
    assert {key for key, _, _ in t.refused} == refused
    n = len(pairs(launch_args(command)))
    assert len(t.translated) + len(t.noops) + len(t.refused) == n


@pytest.mark.parametrize("name", GUIDES)
def test_guide_command_line_sets_every_field_the_guide_sets(name):
    command, expected, refused = GUIDES[name]
    args = [a for a in launch_args(command) if not any(normalize_key(a) == r for r in refused)]
    cfg, flags = T.parse_args(T.Config, args)
    got = {k: getattr(cfg, k) for k in expected}
    assert got == expected
    assert not flags["dry_run"]


def normalize_key(arg: str) -> str:
    return verl_keys.normalize(arg.partition("=")[0])


def test_refused_guide_keys_stop_the_run_with_their_reasons():
    with pytest.raises(config.ConfigError) as e:
        T.parse_args(T.Config, launch_args(GUIDE_32B))
    assert "trainer.logger" in str(e.value) and "vemlp_wandb" in str(e.value) and "use wandb" in str(e.value)
    with pytest.raises(config.ConfigError) as e:
        T.parse_args(T.Config, launch_args(GUIDE_DAPO_TUNING))
    assert "dynamic_bsz_warmup_steps" in str(e.value) and "not a verl option" in str(e.value)


def test_validation_keys_never_touch_training_knobs():
    cfg, _ = T.parse_args(T.Config, ["actor_rollout_ref.rollout.n=16", "actor_rollout_ref.rollout.val_kwargs.n=1",
                                     "actor_rollout_ref.rollout.temperature=0.9",
                                     "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                                     "actor_rollout_ref.rollout.val_kwargs.top_p=0.95",
                                     "actor_rollout_ref.rollout.val_kwargs.top_k=20"])
    assert (cfg.n, cfg.temperature, cfg.top_p, cfg.top_k) == (16, 0.9, 1.0, -1)
    assert (cfg.val_n, cfg.val_temperature, cfg.val_top_p, cfg.val_top_k) == (1, 0.6, 0.95, 20)


@pytest.mark.parametrize("key, value, reason", [
    ("actor_rollout_ref.actor.strategy", "megatron", "no Megatron backend"),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", "2", "no Megatron backend"),
    ("actor_rollout_ref.rollout.name", "sglang", "nanodapo: rollout_engine"),
    ("reward_model.enable", "True", "no model-based reward"),
    ("actor_rollout_ref.model.lora_rank", "64", "no LoRA"),
    ("actor_rollout_ref.actor.fsdp_config.fsdp_size", "8", "all data-parallel ranks"),
    ("actor_rollout_ref.ref.ulysses_sequence_parallel_size", "2", "follows the actor's sp_size"),
    ("trainer.resume_mode", "resume_path", "needs trainer.resume_from_path"),
    ("actor_rollout_ref.actor.clip_ratio", "0.3", "clip_ratio_low / clip_ratio_high"),
])
def test_each_refused_key_gives_its_reason(key, value, reason):
    t = verl_keys.translate([(key, value)], FIELDS)
    assert [k for k, _, _ in t.refused] == [key]
    assert reason in t.refused[0][2]
    with pytest.raises(config.ConfigError, match=key.replace(".", r"\.")):
        T.parse_args(T.Config, [f"{key}={value}"])


def test_a_loss_mode_or_estimator_nanodapo_lacks_is_refused_with_the_ones_it_has():
    for key, value, choices in [("algorithm.adv_estimator", "gae", "choose one of grpo, rloo"),
                                ("actor_rollout_ref.actor.policy_loss.loss_mode", "gpg", "choose one of vanilla, gspo")]:
        with pytest.raises(config.ConfigError, match=f"{value}.*verl key {re.escape(key)}.*{choices}"):
            T.parse_args(T.Config, [f"{key}={value}"])
    cfg, _ = T.parse_args(T.Config, ["algorithm.adv_estimator=opo", "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"])
    assert (cfg.adv_estimator, cfg.loss_mode) == ("opo", "cispo")


def test_refused_values_of_accepted_keys_are_refused_and_off_values_are_no_ops():
    t = verl_keys.translate([("actor_rollout_ref.model.lora_rank", "0"), ("reward_model.enable", "False"),
                             ("critic.optim.lr", "1e-5"), ("actor_rollout_ref.actor.fsdp_config.fsdp_size", "-1")])
    assert t.refused == [] and len(t.noops) == 4


def test_a_mistyped_key_names_the_closest():
    with pytest.raises(config.ConfigError, match="did you mean 'actor_rollout_ref.actor.clip_ratio_high'"):
        T.parse_args(T.Config, ["actor_rollout_ref.actor.clip_ratio_hihg=0.28"])
    with pytest.raises(config.ConfigError, match="actor_rollout_ref.actor.use_token_level_loss.*loss_agg_mode"):
        T.parse_args(T.Config, ["--use_token_level_loss=True"])  # README's old a.b.c=v -> --c=v rule


def test_verl_conventions():
    cfg, _ = T.parse_args(T.Config, ["algorithm.filter_groups.max_num_gen_batches=-1",
                                     "trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/step_5",
                                     "custom_reward_function.path=my_reward.py", "trainer.test_freq=-1",
                                     "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
                                     "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
                                     "actor_rollout_ref.actor.use_token_level_loss=False",
                                     "actor_rollout_ref.actor.kl_loss_type=k3"])
    assert cfg.max_num_gen_batches == 0  # verl: non-positive = no limit
    assert cfg.resume == "/ckpt/step_5"
    assert cfg.reward_fn == "my_reward.py:compute_score"
    assert (cfg.test_freq, cfg.lr_warmup_steps) == (0, 0)
    assert cfg.vllm_kwargs == {"swap_space": 4}
    assert (cfg.loss_agg_mode, cfg.kl_loss_type) == ("seq-mean-token-mean", "low_var_kl")


def test_two_verl_keys_for_one_knob_must_agree():
    t = verl_keys.translate([("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "4"),
                             ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "8")])
    assert "different values" in t.refused[0][2]


def test_verl_keys_mix_with_config_files_and_nanodapo_overrides():
    tiny = os.path.join(ROOT, "configs", "tiny.py")
    base, _ = T.parse_args(T.Config, [tiny])
    cfg, flags = T.parse_args(T.Config, [tiny, "--actor_rollout_ref.actor.clip_ratio_high=0.25", "--lr=3e-4",
                                         "--dry_run=True"])
    assert (cfg.clip_ratio_high, cfg.lr, flags["dry_run"]) == (0.25, 3e-4, True)
    # with a config file the base is the file: verl's defaults do not apply
    assert (cfg.weight_decay, cfg.clip_ratio_c, cfg.n) == (base.weight_decay, base.clip_ratio_c, base.n)
    assert not T.parse_args(T.Config, ["--dry_run=False"])[1]["dry_run"]
    with pytest.raises(config.ConfigError, match="--dry_run=maybe"):
        T.parse_args(T.Config, ["--dry_run=maybe"])


def test_max_num_gen_batches_negative_means_unlimited_for_nanodapo_keys_too():
    cfg, _ = T.parse_args(T.Config, ["--max_num_gen_batches=-1"])
    config.check_knobs(cfg)  # no range error: <= 0 is no limit, as in verl


def test_every_rule_is_well_formed():
    for key, rule in verl_keys.VERL_KEYS.items():
        assert rule.kind in ("set", "no-op", "refused"), key
        assert all(f in FIELDS for f in rule.fields), key
        assert rule.note or rule.kind == "set", key
        assert (rule.convert is None) == (rule.kind == "refused"), key
        assert not rule.knob or rule.knob in FIELDS, key
    for field in verl_keys.VERL_DEFAULTS:
        assert field in FIELDS


def test_readme_table_is_the_code_table():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert verl_keys.markdown_table() in readme, "README's verl table: paste `python verl_keys.py`'s output"


def test_reference_offload_alone_reaches_the_memory_plan():
    """verl's GRPO examples offload the reference model while the actor stays on the GPU."""
    import hf
    import model as M
    import plan
    mc = M.ModelConfig.from_hf(hf.KNOWN_CONFIGS["qwen2-0.5b-instruct"])
    cfg, _ = T.parse_args(T.Config, ["actor_rollout_ref.actor.use_kl_loss=True",
                                     "actor_rollout_ref.ref.fsdp_config.param_offload=True"])
    assert (cfg.param_offload, cfg.ref_param_offload, config.ref_offload(cfg)) == (False, True, True)
    on_gpu = plan.memory_plan(T.Config(use_kl_loss=True), mc, world_size=8, gpu_gib=80)
    offloaded = plan.memory_plan(cfg, mc, world_size=8, gpu_gib=80)
    assert offloaded["gib"]["ref_params"] == 0 and offloaded["gib"]["params"] == on_gpu["gib"]["params"] > 0
    assert offloaded["host_gib"] == pytest.approx(on_gpu["gib"]["ref_params"])
    follows = T.Config(use_kl_loss=True, param_offload=True)  # None: as param_offload
    assert config.ref_offload(follows) and plan.memory_plan(follows, mc, 8, 80)["gib"]["ref_params"] == 0
    kept = T.Config(use_kl_loss=True, param_offload=True, ref_param_offload=False)
    assert plan.memory_plan(kept, mc, 8, 80)["gib"]["ref_params"] == pytest.approx(on_gpu["gib"]["ref_params"])
