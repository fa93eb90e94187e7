# DAPO on Qwen2.5-7B (base), one node of 8 GPUs: the 32B recipe (configs/qwen32b.py) scaled down to a quarter of
# its batch and responses of 8192 tokens, so that a step takes hours, not a day, on 8 x 80 GB.
#
# Run:
#   torchrun --nproc-per-node 8 train_dapo.py configs/qwen2.5_7b_dapo.py
# Check it first, without GPUs or the model (batch arithmetic and per-GPU memory for 8 GPUs):
#   python train_dapo.py configs/qwen2.5_7b_dapo.py --dry_run
#
# Model and data (verl's DAPO files, unchanged):
#   huggingface-cli download Qwen/Qwen2.5-7B --local-dir ~/models/Qwen2.5-7B
#   wget -O ~/data/dapo-math-17k.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet?download=true"
#   wget -O ~/data/aime-2024.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024/resolve/main/data/aime-2024.parquet?download=true"
#   python tools/prepare_data.py inspect ~/data/dapo-math-17k.parquet --tokenizer ~/models/Qwen2.5-7B --max_prompt_length 2048
#
# Expected result: none published for this exact setup, and not measured yet. What to watch: train/acc and
# val/acc (AIME 2024, 30 problems) rising, response_length/mean growing, response_length/clip_ratio staying low.
#
# Differences from the 32B recipe, and why: train 128 / gen 384 groups (not 512 / 1536) and responses of 8192
# tokens (not 20480) with the overlong penalty over the last 2048 (not 4096), to keep a step within a few hours on
# one node; token budgets 2x / 3x a full sequence; no offload (a 7B model's states shard to 14 GiB per GPU).
# Rollout: the in-process vLLM engine, two engines of TP 4 per node, 0.6 of each GPU while awake (the trainer's
# fp32 states, ~15 GiB a GPU, stay beside it). rollout_engine='torch' runs the built-in engine instead (--dry_run
# shows its memory: a full weight copy per GPU and a static KV cache).
# The --dry_run planner: peak ~67 GiB per GPU on 80 GiB while vLLM is awake (~174 GiB of KV cache per engine:
# ~318 full-length sequences in flight); on 141 GiB GPUs ~113 GiB.

import os

# model and data
model_path = os.path.expanduser("~/models/Qwen2.5-7B")
train_files = [os.path.expanduser("~/data/dapo-math-17k.parquet")]
val_files = [os.path.expanduser("~/data/aime-2024.parquet")]
max_prompt_length = 2048
max_response_length = 8192
truncation = "left"

# batch: 128 groups of 16 per step from rounds of 384 prompts; 4 optimizer steps of 32 groups
train_batch_size = 128
gen_batch_size = 384
n = 16
ppo_mini_batch_size = 32
use_dynamic_bsz = True
ppo_max_token_len_per_gpu = 20480  # 2 x (prompt + response)
log_prob_max_token_len_per_gpu = 30720  # 3 x (prompt + response): no activations are kept

# DAPO
clip_ratio_low = 0.2
clip_ratio_high = 0.28
clip_ratio_c = 10.0
loss_agg_mode = "token-mean"
use_kl_loss = False
use_kl_in_reward = False
entropy_coeff = 0.0
filter_groups = True
filter_groups_metric = "acc"
max_num_gen_batches = 10
overlong_buffer = True
overlong_buffer_len = 2048
overlong_penalty_factor = 1.0

# optimizer
lr = 1e-6
lr_warmup_steps = 10
weight_decay = 0.1
grad_clip = 1.0

# sampling
temperature = 1.0
top_p = 1.0
top_k = -1
val_n = 1
val_temperature = 1.0
val_top_p = 0.7
val_do_sample = True

# rollout: in-process vLLM
rollout_engine = "vllm"
gen_tp = 4
gpu_memory_utilization = 0.6
enable_chunked_prefill = True
max_num_seqs = 256

# parallelism
nnodes = 1
n_gpus_per_node = 8

# schedule and run
total_epochs = 1
test_freq = 5
save_freq = 10
resume = "auto"
project_name = "DAPO"
experiment_name = "DAPO-Qwen2.5-7B"
out_dir = "out/DAPO-Qwen2.5-7B"
