# DAPO on Qwen3-235B-A22B (MoE, 128 experts, top-8): verl's Megatron DAPO recipe for this model, translated key by
# key. The recipe runs 16 nodes x 16 accelerators = 256 devices; here 32 nodes x 8 GPUs = the same 256 devices.
#
# Run, on every node (HOST:PORT = an address of node 0 that all nodes reach):
#   torchrun --nnodes 32 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train_dapo.py configs/qwen3_235b_dapo.py
# Check it first, on any machine, without GPUs or the model (batch arithmetic and per-GPU memory for 256 GPUs):
#   python train_dapo.py configs/qwen3_235b_dapo.py --dry_run
# The plan: peak ~127 GiB per GPU on 141 GiB GPUs (H200), with ~78 full-length sequences of KV cache per engine.
# It also fits 80 GiB GPUs (peak ~76 GiB), but vLLM's bf16 weights (470 GB, 59 GB a GPU at gen_tp 8) leave each
# engine ~15 full-length sequences of KV cache there, fewer than a group of 16: rollouts would crawl. Plan on 141 GiB.
#
# Model and data (the recipe trains the Thinking-2507 release of the same shape; any Qwen3-235B-A22B checkpoint
# loads, data_source "math_dapo"):
#   huggingface-cli download Qwen/Qwen3-235B-A22B --local-dir ~/models/Qwen3-235B-A22B
#   wget -O ~/data/dapo-math-17k.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet?download=true"
#   wget -O ~/data/aime-2024.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024/resolve/main/data/aime-2024.parquet?download=true"
# Every node needs the model and data at these paths, and out_dir on a filesystem all nodes share.
#
# Expected result: none published with this recipe; not run with nanodapo. Watch val/acc on AIME 2024 from step 0
# (the model already solves part of it) and response_length / clip_ratio against the 34816-token limit.
#
# Parallelism: the recipe's Megatron layout (TP 4, PP 4, CP 8, EP 8 for training; offload of params, grads and
# optimizer) becomes EP + FSDP2 + Ulysses SP: the 8 GPUs of a node are one SP group (sp_size 8, for the recipe's
# context parallel 8) and one EP group (ep_size 8: 16 of the 128 experts of each layer per GPU, tokens exchanged
# by all-to-all within the node); every weight is FSDP-sharded (expert stacks over the 32 GPUs of the same EP
# rank) and offloaded to the host with the AdamW states. Token budgets: the recipe's per-GPU budget is
# (prompt + response) / CP = 4608; nanodapo's per-GPU budget must hold one whole sequence (verl's FSDP convention),
# so 36864, and an SP group's micro-batch holds up to 8 full-length sequences (the planner counts their activations).
# Rollout: the in-process vLLM engine at TP 8 (one engine per node) and gpu_memory_utilization 0.85: the recipe's
# vLLM-on-Ascend layout (TP 4 x data parallel 32 with experts spread over the engines) has no counterpart here, and
# TP 4 cannot hold the 470 GB of bf16 weights.
# Recipe settings nanodapo does not take:
# - Megatron pipeline_model_parallel_size 4, tensor_model_parallel_size 4, context_parallel_size 8,
#   num_layers_in_first/last_pipeline_stage 22, recompute_method uniform / granularity full / num_layers 1
#   (nanodapo checkpoints whole blocks, as many as the memory plan needs), use_flash_attn, dist_checkpointing_path
#   (an mcore copy of the weights: nanodapo reads the HF safetensors directly; no mbridge), grad_offload (offloaded with
#   the params here), the MoE token dispatcher (DeepEP, permute fusion: plain all-to-all here).
# - ref.*: no reference model (no KL term). rollout.dp_model_parallel_size / rollout_world_size, load_format,
#   max_model_len (derived here: prompt + response), device=npu, nccl_timeout, log_val_generations=-1.
# - ppo_micro_batch_size_per_gpu 32 / log_prob_micro_batch_size_per_gpu: unused with use_dynamic_bsz, as in verl.
# - the recipe's max_num_seqs 4096 and max_num_batched_tokens 6144 are for its 32 engines of TP 4; here 32
#   engines of TP 8 with vLLM's scheduler bounded by max_num_seqs 256 and chunked prefill on.

import os

# model and data
model_path = os.path.expanduser("~/models/Qwen3-235B-A22B")
train_files = [os.path.expanduser("~/data/dapo-math-17k.parquet")]
val_files = [os.path.expanduser("~/data/aime-2024.parquet")]
max_prompt_length = 2048
max_response_length = 34816
truncation = "left"

# batch: 256 groups of 16 per step from rounds of 256 prompts; 4 optimizer steps of 64 groups
train_batch_size = 256
gen_batch_size = 256
n = 16
ppo_mini_batch_size = 64
use_dynamic_bsz = True
ppo_max_token_len_per_gpu = 36864  # max_prompt_length + max_response_length (the recipe: / CP 8)
log_prob_max_token_len_per_gpu = 36864

# DAPO: clip-higher, dual clip, token-mean, no KL, dynamic sampling on accuracy, overlong shaping
clip_ratio_low = 0.2
clip_ratio_high = 0.28
clip_ratio_c = 10.0
loss_agg_mode = "token-mean"
use_kl_loss = False
kl_loss_coef = 0.0
use_kl_in_reward = False
kl_coef = 0.0
entropy_coeff = 0.0
filter_groups = True
filter_groups_metric = "acc"
max_num_gen_batches = 10
overlong_buffer = True
overlong_buffer_len = 4096
overlong_penalty_factor = 1.0

# optimizer (the recipe sets no warmup)
lr = 1e-6
lr_warmup_steps = 0
weight_decay = 0.1
grad_clip = 1.0

# sampling: train at T 1.0; validate with one sample at T 1.0, top_p 0.7
temperature = 1.0
top_p = 1.0
top_k = -1
val_n = 1
val_temperature = 1.0
val_top_p = 0.7
val_top_k = -1
val_do_sample = True

# rollout: in-process vLLM, one engine of TP 8 per node
rollout_engine = "vllm"
gen_tp = 8
gpu_memory_utilization = 0.85
enable_chunked_prefill = True
max_num_seqs = 256

# parallelism: EP 8 x SP 8 within each node, FSDP over all 256 GPUs, states offloaded to the host
sp_size = 8
ep_size = 8
param_offload = True
optimizer_offload = True
nnodes = 32
n_gpus_per_node = 8

# schedule and run: 100 steps, a checkpoint every 5, no validation during training
total_epochs = 1
total_training_steps = 100
test_freq = 0
save_freq = 5
val_before_train = False
resume = "auto"
logger = ["console", "jsonl"]
project_name = "DAPO"
experiment_name = "DAPO-Qwen3-235B-A22B"
out_dir = "out/DAPO-Qwen3-235B-A22B"
