# DAPO on Qwen2.5-32B (base): verl's DAPO recipe for Qwen2.5-32B, 16 nodes x 8 GPUs, translated key by key.
#
# Run, on every node (HOST:PORT = an address of node 0 that all nodes reach):
#   torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train_dapo.py configs/qwen32b.py
# Check it first, on any machine, without GPUs or the model (batch arithmetic and per-GPU memory for 128 GPUs):
#   python train_dapo.py configs/qwen32b.py --dry_run
#
# Model and data (the same files verl's recipe uses; they load unchanged, data_source "math_dapo"):
#   huggingface-cli download Qwen/Qwen2.5-32B --local-dir ~/models/Qwen2.5-32B
#   wget -O ~/data/dapo-math-17k.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet?download=true"
#   wget -O ~/data/aime-2024.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024/resolve/main/data/aime-2024.parquet?download=true"
#   python tools/prepare_data.py inspect ~/data/dapo-math-17k.parquet --tokenizer ~/models/Qwen2.5-32B --max_prompt_length 2048
# Every node needs the model and data at these paths, and out_dir on a filesystem all nodes share (checkpoints are
# written by every rank, like verl's trainer.default_local_dir).
#
# Expected result (published for this recipe, verl's DAPO reproduction): AIME 2024 accuracy 52, 50 without dynamic
# sampling (filter_groups=False). Here that is val/acc on aime-2024.parquet (30 problems; val_n=1 is noisy, pass
# --val_n=32 for an average over 32 samples). Not yet reproduced with nanodapo.
#
# Rollout: the in-process vLLM engine with the recipe's settings (TP 4: 32 engines of 4 GPUs, gpu_memory_utilization
# 0.8, chunked prefill, max_num_batched_tokens 22528). While it is awake it takes 0.8 of each GPU; the AdamW states
# wait on the host between optimizer steps, so what stays on the GPU next to it is small. The built-in
# engine cannot run this recipe: a full bf16 weight copy per GPU (61 GiB) plus a static KV cache of 5.5 GiB per
# row does not fit (python train_dapo.py configs/qwen32b.py --dry_run --rollout_engine=torch shows it).
# Ulysses sequence parallel size 8, as in the recipe: the 8 GPUs of a node split each micro-batch's tokens; the token
# budgets stay per GPU (verl's convention), so an SP group's micro-batch is 8 x 22528 tokens.
# Recipe settings nanodapo does not take:
# - actor.fsdp_config.param_offload: False here. It would run every AdamW step on the host CPUs, which the 8 ranks of
#   a node share; with only the AdamW states offloaded (optimizer_offload) the step runs on the GPU, and the dry run
#   plans 70.9 GiB a GPU on 80 GiB GPUs against 70.0 GiB with param_offload, the same checkpointing either way.
# - ref.fsdp_config.param_offload: no reference model is built (no KL term), so there is nothing to offload.
# - trainer.logger console + wandb: logger here is the default ["console", "jsonl"]; add "wandb" to log to wandb.
# Validation samples with top_p 0.7, as verl's recipe script does.

import os

# model and data
model_path = os.path.expanduser("~/models/Qwen2.5-32B")
train_files = [os.path.expanduser("~/data/dapo-math-17k.parquet")]
val_files = [os.path.expanduser("~/data/aime-2024.parquet")]
max_prompt_length = 2048
max_response_length = 20480
truncation = "left"

# batch: 512 groups of 16 per step, drawn from rounds of 1536 prompts; 16 optimizer steps of 32 groups
train_batch_size = 512
gen_batch_size = 1536
n = 16
ppo_mini_batch_size = 32
use_dynamic_bsz = True
ppo_max_token_len_per_gpu = 22528  # max_prompt_length + max_response_length
log_prob_max_token_len_per_gpu = 22528

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

# optimizer
lr = 1e-6
lr_warmup_steps = 10
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

# rollout: in-process vLLM
rollout_engine = "vllm"
gen_tp = 4
gpu_memory_utilization = 0.8
enable_chunked_prefill = True
max_num_batched_tokens = 22528
max_num_seqs = 256

# parallelism: FSDP over all 128 GPUs (dp 16 x sp 8), the AdamW states on the host between optimizer steps
sp_size = 8
optimizer_offload = True
nnodes = 16
n_gpus_per_node = 8

# schedule and run
total_epochs = 1
test_freq = 5
save_freq = 5
val_before_train = True
resume = "auto"
project_name = "DAPO"
experiment_name = "DAPO-Qwen2.5-32B"
out_dir = "out/DAPO-Qwen2.5-32B"
