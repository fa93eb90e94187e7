# GRPO on GSM8K with Qwen2-0.5B-Instruct, 2 nodes x 8 devices: verl's GSM8K GRPO example, translated key by key
# (written for Ascend NPUs; the device is auto-detected, so the same file runs on NPUs with torch_npu, or on GPUs).
#
# Run, on both nodes (HOST:PORT = an address of node 0 that both reach):
#   torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
#     train_dapo.py configs/qwen2_0.5b_gsm8k_grpo.py
# (on multi-node NPUs: export HCCL_SOCKET_IFNAME=<nic> GLOO_SOCKET_IFNAME=<nic>)
# One node works too (torchrun --nproc-per-node 8 train_dapo.py configs/qwen2_0.5b_gsm8k_grpo.py): each rank then
# takes 16 trajectories of a mini-batch instead of 8; the update is the same.
# Check it first, without devices or the model:
#   python train_dapo.py configs/qwen2_0.5b_gsm8k_grpo.py --dry_run
#
# Model and data (GSM8K in verl's rows: data_source "openai/gsm8k", the instruction "Let's think step by step and
# output the final answer after \"####\"", ground truth from "#### N"):
#   huggingface-cli download Qwen/Qwen2-0.5B-Instruct --local-dir ~/models/Qwen2-0.5B-Instruct
#   huggingface-cli download openai/gsm8k --repo-type dataset --local-dir ~/data/gsm8k_raw
#   python tools/prepare_data.py prepare-gsm8k ~/data/gsm8k_raw ~/data/gsm8k      # -> ~/data/gsm8k/{train,test}.parquet
#   python tools/prepare_data.py inspect ~/data/gsm8k/train.parquet --tokenizer ~/models/Qwen2-0.5B-Instruct --max_prompt_length 512
# (verl's examples/data_preprocess/gsm8k.py writes the same files; they load as they are.)
#
# Expected result: none published for this run, and not measured yet; val/acc (greedy, GSM8K test) should rise
# from the instruct model's starting accuracy, which val_before_train logs at step 0.
#
# The example's settings, and how nanodapo takes them:
# - rollout.name vllm with TP 2 and gpu_memory_utilization 0.6: set below; rollout_engine "auto" picks the vLLM engine
#   on CUDA when vllm is installed and the built-in engine otherwise (on an NPU pass --rollout_engine=vllm where
#   vllm-ascend is installed, with VLLM_ASCEND_ENABLE_NZ=0 for in-place weight reload; untested here).
# - ref.fsdp_config.param_offload=True while the actor is not offloaded: nanodapo's reference model follows the
#   actor's offload setting, so it stays on the device (0.5B parameters: 0.1 GiB per device in fp32 shards).
# - trainer.device=npu: device="auto" picks the NPU where torch_npu is installed (set device="npu" to insist).
# - use_torch_compile=False, use_remove_padding=True, critic_warmup=0: nanodapo compiles its decoder blocks on CUDA
#   (compile="auto"; set compile=False for verl's eager forward), is always packed (no padding), and has no critic.
# Values the example leaves to verl's defaults are spelled out below (clip 0.2 / 0.2, dual-clip c 3.0, token-mean,
# weight decay 0.01, no warmup, greedy validation, no dynamic sampling, no overlong shaping).

import os

# model and data
model_path = os.path.expanduser("~/models/Qwen2-0.5B-Instruct")
train_files = [os.path.expanduser("~/data/gsm8k/train.parquet")]
val_files = [os.path.expanduser("~/data/gsm8k/test.parquet")]
max_prompt_length = 512
max_response_length = 1024
filter_overlong_prompts = True
truncation = "error"

# batch: 128 prompts x 4 responses per step; 4 optimizer steps of 32 prompts; 4 trajectories per micro-batch
train_batch_size = 128
gen_batch_size = 128
n = 4
ppo_mini_batch_size = 32
ppo_micro_batch_size_per_gpu = 4
log_prob_micro_batch_size_per_gpu = 4
use_dynamic_bsz = False

# GRPO: symmetric clip, KL loss to the reference (k3), no dynamic sampling, no overlong shaping
clip_ratio_low = 0.2
clip_ratio_high = 0.2
clip_ratio_c = 3.0
loss_agg_mode = "token-mean"
norm_adv_by_std = True
use_kl_loss = True
kl_loss_coef = 0.001
kl_loss_type = "low_var_kl"
use_kl_in_reward = False
entropy_coeff = 0.0
filter_groups = False
overlong_buffer = False

# optimizer
lr = 1e-6
lr_warmup_steps = 0
weight_decay = 0.01
grad_clip = 1.0
param_offload = False
optimizer_offload = False

# sampling: train at T 1.0; greedy validation, one sample
temperature = 1.0
top_p = 1.0
top_k = -1
val_n = 1
val_do_sample = False

# rollout: vLLM (rollout_engine "auto" on CUDA with vllm installed), two GPUs per engine
gen_tp = 2
gpu_memory_utilization = 0.6

# parallelism and device
device = "auto"
nnodes = 2
n_gpus_per_node = 8

# schedule and run
total_epochs = 30
test_freq = 5
save_freq = 20
val_before_train = True
resume = "auto"
project_name = "verl_grpo_example_gsm8k"
experiment_name = "qwen2_0.5b_gsm8k_grpo"
out_dir = "out/qwen2_0.5b_gsm8k_grpo"
