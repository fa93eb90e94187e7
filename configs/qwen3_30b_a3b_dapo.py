# DAPO on Qwen3-30B-A3B (MoE, 128 experts, top-8) on one node of 8 GPUs: verl's Qwen3-30B-A3B DAPO Megatron recipe
# (the fp16 MoE test recipe), translated key by key to a single node.
#
# Run:
#   torchrun --nproc-per-node 8 train_dapo.py configs/qwen3_30b_a3b_dapo.py
# Check it first, without GPUs or the model (batch arithmetic and per-GPU memory for 8 GPUs):
#   python train_dapo.py configs/qwen3_30b_a3b_dapo.py --dry_run
# The plan fits on 80 GiB and on 141 GiB GPUs (the vLLM engine's KV cache is what grows with the GPU).
#
# Model and data (verl's DAPO files, unchanged):
#   huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir ~/models/Qwen3-30B-A3B
#   wget -O ~/data/dapo-math-17k.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet?download=true"
#   wget -O ~/data/aime-2024.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024/resolve/main/data/aime-2024.parquet?download=true"
#
# Expected result: none published with this recipe; not run with nanodapo. Qwen3-30B-A3B already solves part of
# AIME 2024 at step 0; watch val/acc against that, and response_length / clip_ratio against the 8192-token limit.
#
# Parallelism: the recipe's Megatron layout (TP 4, PP 4, EP 8, offload of params, grads and optimizer) becomes
# EP + FSDP2: ep_size 8 puts 16 of the 128 experts of each layer on each GPU (tokens exchanged by all-to-all),
# every weight is FSDP-sharded over the 8 GPUs, and params, gradients and AdamW states are offloaded to the host.
# Rollout: the in-process vLLM engine at the recipe's TP 8 and gpu_memory_utilization 0.7.
# Recipe settings nanodapo does not take:
# - dtype float16 (rollout and training, the recipe's subject): nanodapo trains in bfloat16 here; its float16
#   compute dtype has no loss scaling.
# - Megatron pipeline_model_parallel_size 4, tensor_model_parallel_size 4, grad_offload (offloaded with the params
#   here), use_fused_kernels, apply_rope_fusion; rollout mode async / return_raw_chat / calculate_log_probs (the
#   engine always returns its log-probs); ref.*: no reference model (no KL term).
# - trainer.logger wandb: add "wandb" to logger to log there; log_val_generations 10 is kept.

import os

# model and data
model_path = os.path.expanduser("~/models/Qwen3-30B-A3B")
train_files = [os.path.expanduser("~/data/dapo-math-17k.parquet")]
val_files = [os.path.expanduser("~/data/aime-2024.parquet")]
max_prompt_length = 2048
max_response_length = 8192
truncation = "left"

# batch: 32 groups of 16 per step, one optimizer step of 32 groups; 2 trajectories per micro-batch
train_batch_size = 32
gen_batch_size = 32
n = 16
ppo_mini_batch_size = 32
use_dynamic_bsz = False
ppo_micro_batch_size_per_gpu = 2
log_prob_micro_batch_size_per_gpu = 4

# DAPO: clip-higher, dual clip, token-mean, no KL, overlong shaping (the recipe does not filter groups)
clip_ratio_low = 0.2
clip_ratio_high = 0.28
clip_ratio_c = 10.0
loss_agg_mode = "token-mean"
use_kl_loss = False
kl_loss_coef = 0.0
use_kl_in_reward = False
kl_coef = 0.0
entropy_coeff = 0.0
filter_groups = False
overlong_buffer = True
overlong_buffer_len = 4096
overlong_penalty_factor = 1.0

# optimizer
lr = 1e-6
lr_warmup_steps = 10
weight_decay = 0.1
grad_clip = 1.0
dtype = "bfloat16"

# sampling: train at T 1.0; validate with one sample at T 1.0, top_p 0.7
temperature = 1.0
top_p = 1.0
top_k = -1
val_n = 1
val_temperature = 1.0
val_top_p = 0.7
val_top_k = -1
val_do_sample = True

# rollout: in-process vLLM, one engine of TP 8
rollout_engine = "vllm"
gen_tp = 8
gpu_memory_utilization = 0.7
enable_chunked_prefill = True
max_num_batched_tokens = 10240  # max_prompt_length + max_response_length

# parallelism: EP 8, FSDP over the 8 GPUs, states offloaded to the host. param_offload runs the AdamW step on the
# node's CPUs; on 141 GiB GPUs --param_offload=False moves it back to the GPU (the dry run's note plans 117.8 GiB),
# on 80 GiB GPUs it plans 75.5 GiB, too close to the edge to be this recipe's default.
ep_size = 8
param_offload = True
optimizer_offload = True
nnodes = 1
n_gpus_per_node = 8

# schedule and run
total_epochs = 10
test_freq = 5
save_freq = -1
val_before_train = False
log_val_generations = 10
resume = "auto"
project_name = "DAPO-moe"
experiment_name = "DAPO-Qwen3-30B-A3B"
out_dir = "out/DAPO-Qwen3-30B-A3B"
